"""budget="auto": the chooser's rule on hand-made inputs, the tree prefix it verifies, the
statistics, the cost table's key and loading, the settings, and on tiny random models (CPU) the
sampling law, greedy equality with autoregressive decoding (generate and the Engine) and the
report. Costs are injected (``DecodeConfig.auto_costs``): no test depends on a timing.
"""

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax import _preflight, auto_budget, auto_costs, auto_round, generation
from ddtree_jax.accept import accept_path
from ddtree_jax.auto_budget import (
    DECAY,
    FIRST_DRAFT_TOKENS,
    MAX_PRIOR_ROUNDS,
    OWN_SAMPLES,
    PRIOR_ROUNDS,
    PROBE_SHARE,
    REFRESH_ROUNDS,
    STALL,
    WINDOW,
    AutoChooser,
    AutoPlan,
    AutoReport,
    RunCosts,
    batch_rounds,
    calibrated,
    choose_budget,
    expected_max,
    expected_tokens,
    finish_budget,
    finish_times,
    round_variance,
)
from ddtree_jax.auto_round import (
    plain_tally,
    round_plans,
    run_flush,
    run_probe_rounds,
    run_tallied_rounds,
    with_deferred,
)
from ddtree_jax.backend import resolve_backend
from ddtree_jax.config import ConfigError, DecodeConfig, auto_budget_set
from ddtree_jax.decode_round import DecodePlan, Models, prefill, realized_tokens, run_rounds
from ddtree_jax.generation import generate
from ddtree_jax.sampling import batch_sampling
from ddtree_jax.serving import Engine
from ddtree_jax.serving.server import metrics_text
from ddtree_jax.tree import build_draft_tree
from tests._model_fixtures import tiny_dflash, tiny_kimi
from tests._reference import chisquare_pvalue, filtered_probs

PLAN = AutoPlan(budgets=(0, 4, 8), draft_len=4, probe_every=3)

# --- the rule ---------------------------------------------------------------------------------


def test_budget_set():
    assert auto_budget_set(32) == (0, 4, 8, 16, 32)
    assert auto_budget_set(24) == (0, 4, 8, 16, 24)
    assert auto_budget_set(4) == (0, 4)
    assert auto_budget_set(1) == (0, 1)


def test_chooser_on_hand_made_inputs():
    rows = 16
    # a poor draft: a fraction of a token more per row does not pay a round twice as dear
    assert int(choose_budget([rows, rows * 1.1, rows * 1.2], [1.0, 2.0, 2.2])) == 0
    # flat costs, high acceptance: the largest tree
    assert int(choose_budget([rows, rows * 3.0, rows * 4.5], [1.0, 1.0, 1.0])) == 2
    # in between: 10/2 beats 4/1 and 11/3
    assert int(choose_budget([4.0, 10.0, 11.0], [1.0, 2.0, 3.0])) == 1
    # ties go to the smaller budget
    assert int(choose_budget([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])) == 0


def test_finish_rule_on_hand_made_inputs():
    """A static batch ends with its slowest row: the budget that ends it soonest, not the one with
    the most tokens per second."""
    costs = [1.0, 2.0]
    # every row the same: drafting triples each row's pace at twice the cost
    assert finish_budget([10, 10], [[1, 3], [1, 3]], costs) == 1
    # one row accepts little: the batch would wait for it (10 / 1.2 rounds at cost 2 > 10 at 1),
    # though the batch's tokens per second favour drafting (4.2 / 2 > 2 / 1)
    assert finish_budget([10, 10], [[1, 3], [1, 1.2]], costs) == 0
    assert int(choose_budget([2.0, 4.2], costs)) == 1
    # that row nearly done: the confident row decides (10 / 3 rounds at cost 2 < 10 at 1)
    assert finish_budget([10, 1], [[1, 3], [1, 1.2]], costs) == 1
    # ties go to the smaller budget
    assert finish_budget([6], [[1, 2]], costs) == 0


def test_round_variance_is_the_chain_laws():
    """Against the law written out: ``P(A = d) = a^d - a^(d+1)`` below the cap, ``a^cap`` at it,
    for fresh random ``a`` and caps; the variance of the committed tokens ``1 + A``."""
    rng = np.random.default_rng()
    caps = np.array([0, 1, 4, 9, 16])
    a = rng.uniform(0.02, 0.98, size=(20, 1))
    d = np.arange(17)
    pmf = np.where(d < caps[:, None, None], a[None] ** d - a[None] ** (d + 1), np.where(d == caps[:, None, None],
                                                                                          a[None] ** d, 0.0))
    mean = (pmf * d).sum(-1)  # [K, 20]
    var = (pmf * d**2).sum(-1) - mean**2
    np.testing.assert_allclose(round_variance(1.0 + mean.T, caps), var.T, rtol=2e-3, atol=2e-3)
    assert (round_variance(np.full((3, 5), 1.0), caps) == 0).all()  # nothing drafted accepted: one token
    np.testing.assert_allclose(round_variance(1.0 + caps[None].astype(float), caps), 0.0, atol=1e-9)  # all


def test_expected_max_against_sampling():
    """``E[max]`` of independent normals against 40,000 draws (fresh means and spreads, a column
    without spread among them): within 4 standard errors of the sample mean plus the grid's 0.2%;
    capped at a value per row, plus 0.4% (the integrand jumps at a cap)."""
    rng = np.random.default_rng()
    for R in (1, 3, 64):
        mean = rng.uniform(20.0, 60.0, size=(R, 3))
        sd = rng.uniform(0.0, 8.0, size=(R, 3)) * np.array([0.0, 1.0, 1.0])
        draws = rng.normal(mean, sd, size=(40_000, R, 3))
        err = 4 * draws.max(axis=1).std(axis=0) / np.sqrt(len(draws)) + 2e-3 * (mean + 8 * sd).max(axis=0)
        assert (np.abs(expected_max(mean, sd) - draws.max(axis=1).mean(axis=0)) <= err).all()
        np.testing.assert_allclose(expected_max(mean, sd)[0], mean[:, 0].max())
        cap = mean.max(axis=1) + rng.uniform(0.0, 6.0, size=R)  # (each row's at least its means)
        capped = np.minimum(draws, cap[:, None]).max(axis=1)
        err = 4 * capped.std(axis=0) / np.sqrt(len(draws)) + 4e-3 * cap.max()
        assert (np.abs(expected_max(mean, sd, cap) - capped.mean(axis=0)) <= err).all()
    # One row has a closed form (batch 1's host work): E[min(X, cap)] against a fine numerical
    # integral of min(x, cap) under the normal density
    mean, sd = rng.uniform(20.0, 60.0, size=(1, 4)), rng.uniform(0.5, 8.0, size=(1, 4))
    for cap in (None, mean.max() + rng.uniform(-6.0, 6.0)):
        x = mean + sd * np.linspace(-12.0, 12.0, 400_001)[:, None]  # [G, 4]
        density = np.exp(-0.5 * ((x - mean) / sd) ** 2) / (sd * np.sqrt(2 * np.pi))
        want = np.trapezoid(np.minimum(x, np.inf if cap is None else cap) * density, x, axis=0)
        np.testing.assert_allclose(expected_max(mean, sd, None if cap is None else np.array([cap])), want, rtol=1e-7)
    np.testing.assert_allclose(expected_max(mean, 0 * sd, np.array([40.0])), np.minimum(mean[0], 40.0))


def test_finish_rule_waits_for_the_unluckiest_row():
    """64 rows of 128 tokens, each round committing 1 + A tokens, ``P(A >= d) = 0.6^d`` up to 16
    (2.5 tokens a round), at 2.1 times a plain round's cost: by the rows' means drafting ends the
    batch sooner (51.2 rounds at 2.1 < 128 at 1), but the batch waits for its slowest row.
    Simulated (400 batches), the batch takes about 65 rounds: drafting is slower. The rule's
    estimate is within 3% of the simulated rounds and it keeps budget 0; one row alone (about 52
    rounds) drafts."""
    rng = np.random.default_rng()
    caps = np.array([0, 16])
    expected = np.array([1.0, 1.0 + sum(0.6**d for d in range(1, 17))])
    drafted = np.minimum(rng.geometric(0.4, size=(400, 64, 128)) - 1, 16)  # P(A >= d) = 0.6^d
    makespan = ((np.cumsum(1 + drafted, axis=2) < 128).sum(axis=2) + 1).max(axis=1)
    var = round_variance(expected[None], caps)
    costs = [1.0, 2.1]
    predicted = batch_rounds(np.full(64, 128), np.tile(expected, (64, 1)), np.tile(var, (64, 1)))
    assert abs(predicted[1] / makespan.mean() - 1) < 0.03, (predicted, makespan.mean())
    assert predicted[0] == 128
    assert finish_budget(np.full(64, 128), np.tile(expected, (64, 1)), costs) == 1  # (by the means)
    assert finish_budget(np.full(64, 128), np.tile(expected, (64, 1)), costs, np.tile(var, (64, 1))) == 0
    assert finish_budget([128], expected[None], costs, var) == 1


def test_finish_times_keeps_the_known_estimates_and_estimates_only_the_rest():
    """``finish_times(..., every=True, known=without every)`` equals estimating every budget, on
    fresh random batches, up to rounding (a column estimated among other columns or alone differs
    in the last bits)."""
    rng = np.random.default_rng()
    caps = np.array([0, 4, 8, 16])
    for _ in range(20):
        R = int(rng.integers(2, 65))
        remaining = rng.integers(1, 200, R)
        expected = np.concatenate([np.ones((R, 1)), 1.0 + rng.uniform(0.0, 1.0, (R, 3)) * caps[1:]], axis=1)
        var = round_variance(expected, caps)
        u = var * rng.uniform(0.0, 0.5, (R, 1))
        costs = np.array([1.0, *np.sort(rng.uniform(1.0, 3.0, 3))])
        partial = finish_times(remaining, expected, costs, var, u)
        full = finish_times(remaining, expected, costs, var, u, every=True)
        np.testing.assert_allclose(finish_times(remaining, expected, costs, var, u, every=True, known=partial),
                                   full, rtol=1e-12)
        assert np.isfinite(full).all()


def _uncached(c: AutoChooser) -> AutoChooser:
    """A chooser with ``c``'s statistics and none of its kept computations."""
    f = AutoChooser(c.plan)
    f.__dict__.update({k: v for k, v in c.__dict__.items() if k not in ("_rows_cache", "_stats_cache")})
    f._rows_cache = f._stats_cache = None
    return f


def test_chooser_keeps_the_rows_paces_until_a_drafted_record():
    """Between drafted dispatches the rows' paces are reused; a drafted dispatch's record (or
    other rows) recomputes them: the same values as a chooser that never kept any."""
    rows = np.arange(4)
    c = AutoChooser(PLAN)
    c.record(1, _tally([[2, 6, 2, 6, 7], [2, 2, 2, 5, 6], [2, 4, 2, 6, 8], [2, 5, 2, 4, 5]]), rows=rows)
    finish = (rows, np.array([30, 20, 25, 10]))

    def fresh():
        return _uncached(c)._paces(finish)

    first = c._paces(finish)
    assert c._paces(finish)[1] is first[1]  # (kept)
    c.record(0, plain_tally(np.full(4, 8), 3), rows=rows)
    assert c._paces(finish)[1] is first[1]  # (plain rounds change no pace)
    c.record(2, _tally([[1, 1, 1, 3, 4], [1, 5, 1, 3, 5], [1, 0, 1, 2, 2], [1, 3, 1, 3, 4]]), rows=rows)
    again = c._paces(finish)
    assert again[1] is not first[1]
    for got, want in zip(again, fresh(), strict=True):
        np.testing.assert_array_equal(got, want)
    other = (rows[:3], np.array([30, 20, 25]))
    np.testing.assert_array_equal(c._paces(other)[1], again[1][:3])


def test_chooser_keeps_the_batch_statistics_until_they_change():
    """The batch's factor, pace and pace error are computed once per state of its averages: kept
    across plain records, recomputed after a drafted one or any change of the averages (a test
    that sets them by hand included), equal to a chooser that never kept any."""
    c = AutoChooser(PLAN)
    c.record(1, _tally([[2, 6, 2, 6, 7], [2, 2, 2, 5, 6]]))

    def fresh():
        return _uncached(c)._batch_stats()

    first = c._batch_stats()
    c.record(0, plain_tally(np.full(2, 8), 3))
    assert c._batch_stats()[0] is first[0]  # (plain rounds change none)
    c.record(2, _tally([[1, 1, 1, 3, 4], [1, 5, 1, 3, 5]]))
    for got, want in zip(c._batch_stats(), fresh(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(c._batch_stats()[0], first[0])
    c.accepted_ema = c.accepted_ema * 0.5  # (by hand, no record)
    for got, want in zip(c._batch_stats(), fresh(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(c.factor(), fresh()[0])
    c.factor()[:] = 0.0  # (a copy: the kept one is untouched)
    np.testing.assert_array_equal(c.factor(), fresh()[0])


def test_chooser_finish_rule_weighs_the_rows_by_their_measured_spread():
    """64 rows that each expect 3 tokens a round at budget 4 (cap 4), 40 tokens left, a drafted
    round 1.9 times a plain one; by the means drafting ends the batch sooner (40 / 3 rounds at 1.9).
    After one drafted round: where the rows' tokens spread no more than a round's own luck does
    (half accepted 2, half 4: variance 1.0, the law's about 2), they are taken alike and the rule
    drafts; where they spread more (half 1, half 5: variance 4.1), the rows differ, the slow half
    may be slow, and the batch would wait for them: budget 0. With fewer than SPREAD_ROWS rows,
    the fixed prior (PRIOR_ROUNDS)."""
    costs = (1.0, 1.9, 2.0)
    rows = np.arange(64)
    finish = (rows, np.full(64, 40))
    expected = calibrated(np.tile([1.0, 3.0, 3.0], (64, 1)), 1.0, PLAN.caps)
    assert finish_budget(finish[1], expected, costs, round_variance(expected, PLAN.caps)) == 1
    for low, high, choice in [(2, 4, 1), (1, 5, 0)]:
        c = AutoChooser(PLAN)
        c.record(1, _tally([[1, low if r % 2 else high, 1, 3, 3] for r in rows]), rows=rows)
        prior = c.prior_rounds(rows)
        assert prior[1] == (MAX_PRIOR_ROUNDS if choice else 1.0), prior
        assert c._rule(64, costs, finish) == choice, (low, high)
    c = AutoChooser(PLAN)
    c.record(1, _tally([[1, 3, 1, 3, 3]] * 4), rows=np.arange(4))
    assert c.prior_rounds(np.arange(4))[1] == PRIOR_ROUNDS


def test_prior_rounds_measure_the_spread_of_the_rows_paces():
    """Rows whose true paces spread with variance tau^2 = 0.25 around 3 tokens a round, each
    round's tokens with variance v = 1 around its row's pace, four dispatches of 4 rounds per
    row: prior_rounds estimates v / tau^2 = 4 from the within-row and between-row variances (2,000
    rows: within 10%). Rows of one pace: the bound, MAX_PRIOR_ROUNDS. The budgets a dispatch did
    not verify keep PRIOR_ROUNDS."""
    rng = np.random.default_rng(0)
    R, n = 2000, 4
    rows = np.arange(R)
    for tau2, want in [(0.25, 4.0), (0.0, MAX_PRIOR_ROUNDS)]:
        pace = 3.0 + np.sqrt(tau2) * rng.standard_normal(R)
        c = AutoChooser(PLAN)
        for _ in range(4):
            tokens = n * pace + np.sqrt(n * 1.0) * rng.standard_normal(R)
            c.record(1, _tally(np.stack([np.full(R, n), tokens, np.full(R, n), np.full(R, 3.0 * n),
                                         np.full(R, 3.0 * n)], axis=1)), rows=rows)
        prior = c.prior_rounds(rows)
        assert abs(prior[1] / want - 1) < 0.1, (tau2, prior)
        assert prior[2] == PRIOR_ROUNDS, prior


def test_chooser_finish_rule_uses_each_rows_own_averages():
    costs = (1.0, 1.5, 2.0)
    rows = np.array([7, 3, -1])
    c = AutoChooser(PLAN)
    # rows 7 and 3 (slots 0, 1) ran 12 drafted rounds: row 7 expects 3 tokens at budget 4, row 3
    # 1.2, and each accepted what it expected; slot 2 is free. The batch's averages: 2.1 and 2.4
    c.record(1, _tally([[12, 36, 12, 36, 42], [12, 14.4, 12, 14.4, 15.6], [0, 0, 0, 0, 0]]), rows=rows)
    np.testing.assert_allclose(c.row_expected[7], [1.0, 3.0, 3.5])
    np.testing.assert_allclose(c.row_expected[3], [1.0, 1.2, 1.3])
    assert (c.row_rounds[:3] == 0).all() and c.row_rounds[[3, 7]].tolist() == [12, 12]  # (rows 0-2: none)
    c.accepted_ema = c.predicted_ema.copy()  # (calibration factor 1)
    c.verified_at[:] = c.drafted  # (as if budget 8 were verified too: no refresh due)
    assert c.choose(2, costs) == 1  # the batch's mean (2.1 at budget 4, for 1.5): draft
    # row 3, at 0.75 its own average (12 rounds against PRIOR_ROUNDS = 4) and 0.25 the batch's
    # (1.425 at budget 4), would set the pace: 20 / 1.425 * 1.5 > 20 (the rule; `choose` probes:
    # a tree is within the error of 24 row-rounds)
    assert c._rule(2, costs, finish=([7, 3], [20, 20])) == 0
    assert c.choose(2, costs, finish=([7, 3], [20, 2])) == 1  # row 3 nearly done: row 7 decides
    # a row not drafted yet takes the batch's averages: 20 / 2.1 * 1.5 < 20
    assert c.choose(1, costs, finish=([11], [20])) == 1
    # a second dispatch moves row 7's average by the weight of its rounds
    c.record(1, _tally([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]), rows=rows)
    np.testing.assert_allclose(c.row_expected[7], (1 - DECAY) * np.array([1.0, 3.0, 3.5]) + DECAY * 1.0)
    np.testing.assert_allclose(c.row_expected[3], [1.0, 1.2, 1.3])
    assert c.row_rounds[[3, 7]].tolist() == [12, 13]
    # after 2 rounds the same averages weigh 1/3: row 3 (1.8 at budget 4) no longer stops drafting
    c = AutoChooser(PLAN)
    c.record(1, _tally([[2, 6, 2, 6, 7], [2, 2.4, 2, 2.4, 2.6], [0, 0, 0, 0, 0]]), rows=rows)
    c.accepted_ema = c.predicted_ema.copy()
    c.verified_at[:] = c.drafted  # (as if budget 8 were verified too: no refresh due)
    assert c.choose(2, costs, finish=([7, 3], [20, 20])) == 1


def test_chooser_finish_rule_calibrates_each_row_by_its_own_acceptance():
    """Two rows that expect the same (3 tokens a round at budget 4, 3.5 at 8), one accepting what
    it expects, the other a twentieth of its drafted tokens: the batch's factor (0.525) says
    drafting ends the batch soonest (20 / 2.05 * 1.5 < 20), the slow row's own factor (0.05,
    shrunk toward 0.525 by PRIOR_ROUNDS to 0.17) says it does not: 20 / 1.34 * 1.5 > 20. With both
    rows accepting what they expect, drafting."""
    costs = (1.0, 1.5, 2.0)
    rows = np.array([0, 1])
    c = AutoChooser(PLAN)
    c.record(1, _tally([[12, 36, 12, 36, 42], [12, 13.2, 12, 36, 42]]), rows=rows)
    # 0.525, shrunk toward 1 by the 24 row-rounds behind it (PRIOR_ROUNDS); budget 8: budget 4's
    np.testing.assert_allclose(c.factor()[1:], 24 / 28 * 0.525 + 4 / 28, rtol=1e-6)
    np.testing.assert_allclose(c.row_drafted[:, 1], [[2.0, 2.0], [0.1, 2.0]], rtol=1e-6)
    assert c._rule(2, costs) == 1  # (the batch's tokens per second: 2.05 a row at budget 4 for 1.5)
    assert c._rule(2, costs, finish=([0, 1], [20, 20])) == 0
    c = AutoChooser(PLAN)
    c.record(1, _tally([[12, 36, 12, 36, 42], [12, 36, 12, 36, 42]]), rows=rows)
    c.verified_at[:] = c.drafted  # (as if budget 8 were verified too: no refresh due)
    assert c.choose(2, costs, finish=([0, 1], [20, 20])) == 1


def test_calibration_scales_the_drafted_part_and_caps_it():
    e = jnp.asarray([1.0, 2.0, 3.0])
    np.testing.assert_allclose(calibrated(e, 0.5, PLAN.caps), [1.0, 1.5, 2.0])
    np.testing.assert_allclose(calibrated(e, 10.0, PLAN.caps), [1.0, 5.0, 5.0])  # at most L = 4 drafted tokens


def _chooser(expected_ema, accepted=1.0, predicted=1.0, skipped=0, interval=3):
    c = AutoChooser(PLAN)
    c.expected_ema = np.asarray(expected_ema, float)
    c.accepted_ema, c.predicted_ema = np.full(3, float(accepted)), np.full(3, float(predicted))
    c.calibrated_by = np.full(3, 1e12)  # (the ratios as they are)
    c.skipped, c.interval, c.drafted = skipped, interval, 1
    c.verified_at = np.ones(3)  # (every budget verified just now: no refresh due)
    return c


def test_choice_before_a_dispatch_from_the_recent_curve():
    costs = (1.0, 1.5, 2.0)
    assert _chooser([1.0, 2.5, 3.0]).choose(8, costs) == 1  # 2.5 / 1.5 beats 3 / 2 and 1 / 1
    assert _chooser([1.0, 2.5, 4.5]).choose(8, costs) == 2
    assert _chooser([1.0, 1.2, 1.3]).choose(8, costs) == 0  # the draft is poor
    # well predicted, but the rows accepted a tenth of it: calibrated, it does not pay
    assert _chooser([1.0, 2.5, 3.0], accepted=0.1, predicted=1.0).choose(8, costs) == 0
    # after `interval` rounds at budget 0, a probe at the best positive budget
    assert _chooser([1.0, 1.2, 1.3], skipped=3).choose(8, costs) == 1
    assert _chooser([1.0, 1.2, 1.6], skipped=3).choose(8, costs) == 2  # 0.6 / 2 beats 0.2 / 1.5
    assert _chooser([1.0, 1.2, 1.3], skipped=3, interval=6).choose(8, costs) == 0


def test_rounds_keep_larger_budgets_estimates_until_verified_and_refresh_them():
    """Expected tokens past a round's budget are lower bounds (a tree held to its depth): they set
    a larger budget's averages (the batch's and each row's) only until a round verifies that
    budget. Where the rule chooses a budget below the largest, the next one up runs once its last
    verification is ``REFRESH_ROUNDS`` drafted rounds old or never happened, counted from the
    choice (a pipelined caller chooses again before recording)."""
    costs, rows = (1.0, 1.5, 2.0), np.arange(4)
    c = AutoChooser(PLAN)
    c.record(1, _tally([[1, 2, 1, 2.5, 2.7]] * 4), rows)  # budget 8 never verified: its lower bound
    np.testing.assert_allclose(c.expected_ema, [1.0, 2.5, 2.7])
    np.testing.assert_allclose(c.row_expected[:, 2], 2.7)
    assert c.choose(4, costs) == 2  # the rule's 4, refreshed: 8 was never verified
    assert c.choose(4, costs) == 1  # (that refresh is on its way)
    c.record(2, _tally([[1, 2, 1, 2.5, 3.0]] * 4), rows)
    ema8, row8 = c.expected_ema[2], c.row_expected[:, 2].copy()
    assert ema8 > 2.7 and (row8 > 2.7).all()
    c.record(1, _tally([[1, 2, 1, 2.4, 2.5]] * 4), rows)  # a lower bound for 8 no longer counts
    assert c.expected_ema[2] == ema8 and c.expected_ema[1] < 2.5
    np.testing.assert_array_equal(c.row_expected[:, 2], row8)
    for _ in range(REFRESH_ROUNDS - 2):
        c.record(1, _tally([[1, 2, 1, 2.5, 2.5]] * 4), rows)
    assert c.choose(4, costs) == 1  # 8 verified REFRESH_ROUNDS - 1 drafted rounds ago
    c.record(1, _tally([[1, 2, 1, 2.5, 2.5]] * 4), rows)
    assert c.choose(4, costs) == 2
    assert c.expected_ema[2] == ema8
    # the largest budget verifies every budget: nothing to refresh above it, nor after it
    c = AutoChooser(PLAN)
    c.record(2, _tally([[1, 2, 1, 2.5, 2.7]] * 4), rows)
    assert c.choose(4, costs) == 1


def test_probes_take_at_most_their_share_of_the_time():
    """Where a probe's price is measured (4 plain rounds here), a probe is due only once the plain
    rounds since the last drafted dispatch cost 1 / PROBE_SHARE times it (80 rounds), however
    short the interval (3); unmeasured, the interval alone decides."""
    costs = (1.0, 1.5, 2.0)
    due = lambda skipped, **kw: _chooser([1.0, 1.2, 1.3], skipped=skipped).choose(8, costs, **kw)  # noqa: E731
    assert due(2) == 0 and due(3) == 1
    floor = 4.0 / PROBE_SHARE
    assert due(3, probe_price=4.0) == 0 and due(floor - 1, probe_price=4.0) == 0
    assert due(floor, probe_price=4.0) == 1
    assert due(3, probe_price=0.0) == 1


def test_run_costs_price_probes_from_their_timed_dispatches():
    """A timed probing dispatch's price is its time beyond as many rounds at budget 0's current
    cost (the median of the latest, at least 0, at most STALL times those rounds); None before
    one is timed."""
    rc = RunCosts((1.0, 1.5, 2.0))
    assert rc.probe_price() is None
    rc.observe(0, 2.0)  # (budget 0 now paid at twice its table cost)
    rc.observe_probe(8, 20.0)
    assert rc.probe_price() == 4.0
    rc.observe_probe(8, 1e9)  # (a stall: capped)
    rc.observe_probe(8, 10.0)  # (cheaper than 8 plain rounds: the median, not below 0)
    assert rc.probe_price() == 4.0
    rc.observe_probe(8, 1e9)
    assert rc.probe_price() == (4.0 + STALL * 16) / 2 and max(rc.probes) == STALL * 16
    c = AutoChooser(PLAN)  # (the chooser's: per batch shape, reported)
    c.costs(8, (1.0, 1.5, 2.0))
    c.costs(2, (1.0, 1.5, 2.0))
    c.observe_probe(8, 4, 6.0)
    assert c.probe_price(8) == 2.0 and c.probe_price(2) is None
    assert AutoReport.of(c, {}).probe_prices == {8: 2.0, 2: None}
    frozen = AutoChooser(PLAN, learn_costs=False)  # (costs given: no probe is priced)
    frozen.costs(8, (1.0, 1.5, 2.0))
    frozen.observe_probe(8, 4, 6.0)
    assert frozen.probe_price(8) is None


def test_first_choices_follow_the_prior_until_a_drafted_round_is_recorded():
    """Before any drafted round is recorded, a drafted round at the largest budget is taken to
    commit FIRST_DRAFT_TOKENS tokens: where that pays at the costs every choice is the largest
    budget (not a probe); where it does not, the first choice probes at the largest budget (its
    round tells every budget's expected tokens exactly) and the next (a pipelined caller's, before
    the probe is read back) runs budget 0."""
    top = len(PLAN.budgets) - 1
    pays = (1.0, 0.75 * FIRST_DRAFT_TOKENS, FIRST_DRAFT_TOKENS)  # (the largest budget's cost at the prior's break-even)
    c = AutoChooser(PLAN)
    assert [c.choose(8, pays, finish=([0], [30])) for _ in range(3)] == [top] * 3 and not c.probing
    c.record(top, _tally([[2, 4, 2, 4.0, 4.8]] * 8))  # (2 tokens a round expected at budget 4, 2.4 at 8; 2 accepted)
    assert c.choose(8, pays) == 1 and not c.probing
    loses = (1.0, 0.75 * FIRST_DRAFT_TOKENS, FIRST_DRAFT_TOKENS * 1.01)
    c = AutoChooser(PLAN)
    assert c.choose(8, loses) == top and c.probing
    assert c.choose(8, loses) == 0 and not c.probing


def _tally(rows, realized=None):
    """Rows of (rounds, accepted, expected at each budget), and the realized tokens at each budget
    appended (``realized``, one row for all; default: one a round at budget 0, what the rounds
    accepted at the others)."""
    rows = np.asarray(rows, np.float32)
    if realized is None:
        return np.concatenate([rows, rows[:, :1], rows[:, 1:2], rows[:, 1:2]], axis=1)
    return np.concatenate([rows, np.tile(np.asarray(realized, np.float32), (len(rows), 1))], axis=1)


def test_statistics_of_drafted_and_plain_dispatches():
    costs = (1.0, 1.5, 2.0)
    c = AutoChooser(PLAN)
    # two rows ran 2 rounds at budget 4 (index 1), one row did not run
    report = c.record(1, _tally([[2, 4, 2, 4, 5], [2, 8, 2, 6, 8], [0, 0, 0, 0, 0]]))
    np.testing.assert_allclose(c.expected_ema, [1.0, 2.5, 3.25])  # the first drafted dispatch, as it is
    assert (c.accepted_ema[1], c.predicted_ema[1]) == (2.0, 1.5)  # drafted tokens per row-round: 8 / 4 vs 6 / 4
    assert c.calibrated_by.tolist() == [4, 4, 0]  # (2 rows' 2 rounds; budget 8: not verified)
    np.testing.assert_allclose(report, [[0, 2, 0], [0, 10, 0], [0, 12, 0]])
    assert c.rounds.tolist() == [0, 2, 0] and c.expected.tolist() == [0, 10, 0] and c.realized.tolist() == [0, 12, 0]
    assert c.choose(1, costs) > 0  # (the next choice updates the probe interval)
    assert (c.skipped, c.drafted, c.interval) == (0, 2, 3)  # the tree pays: probe often
    report = c.record(0, _tally([[3, 3, 3, 3, 3], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]))
    np.testing.assert_allclose(c.expected_ema, [1.0, 2.5, 3.25])  # plain rounds teach the averages nothing
    np.testing.assert_allclose(report, [[3, 0, 0], [4, 0, 0], [4, 0, 0]])
    assert (c.skipped, c.drafted) == (3, 2)
    # a drafted dispatch of 1 round (weight DECAY) whose statistics say drafting does not pay at
    # these costs: back off
    dear = (1.0, 5.0, 5.0)
    c.record(2, _tally([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]))
    np.testing.assert_allclose(c.expected_ema, np.array([1.0, 2.5, 3.25]) * (1 - DECAY) + DECAY * 1.0)
    np.testing.assert_allclose(c.predicted_ema[1], 1.5 * (1 - DECAY))
    assert c.interval == 3  # (until the next choice)
    assert c.choose(1, dear) == 0 and (c.skipped, c.interval) == (0, 6)
    assert c.choose(1, dear) == 0 and c.interval == 6  # no drafted dispatch since: no second back-off
    c.record(2, _tally([[4, 4, 4, 4, 4]]))  # 4 rounds: weight 1 - (1 - DECAY)^4
    np.testing.assert_allclose(c.expected_ema[1], 2.125 * (1 - DECAY) ** 4 + (1 - (1 - DECAY) ** 4))
    assert c.choose(1, dear) == 0 and c.interval == 12
    c.record(1, _tally([[1, 5, 1, 5, 5]] * 2))
    assert c.choose(1, (1.0, 1.0, 1.0)) > 0 and c.interval == 3  # a tree pays again: probe often
    assert not c.record(1, _tally([[0, 0, 0, 0, 0]])).any()  # nothing ran: nothing learned


def test_run_costs_scale_the_table_by_the_medians_of_the_timed_ratios():
    c = RunCosts((1.0, 2.0, 3.0))
    np.testing.assert_allclose(c.current(), [1.0, 2.0, 3.0])  # nothing timed: the table
    c.observe(0, 0.5)  # fewer than OWN_SAMPLES of its own: every budget takes the pooled median
    np.testing.assert_allclose(c.current(), [0.5, 1.0, 1.5])
    c.observe(1, 3.0)  # ratios 0.5, 1.5
    np.testing.assert_allclose(c.current(), [1.0, 2.0, 3.0])
    for _ in range(OWN_SAMPLES - 1):
        c.observe(1, 3.0)
    np.testing.assert_allclose(c.current(), [1.5, 3.0, 4.5])  # budget 1 on its own ratios; pooled 1.5
    assert c.timed.tolist() == [1, OWN_SAMPLES, 0]

    # A lone slow dispatch does not price its budget: the pooled median holds it until the
    # budget has OWN_SAMPLES timings, then its own median (the latest WINDOW) does.
    c = RunCosts((1.0, 2.0))
    for _ in range(OWN_SAMPLES):
        c.observe(1, 2.2)
    c.observe(0, 1.7)
    np.testing.assert_allclose(c.current(), [1.1, 2.2])
    for _ in range(OWN_SAMPLES - 1):
        c.observe(0, 1.1)
    np.testing.assert_allclose(c.current()[0], 1.1)
    for _ in range(WINDOW):
        c.observe(0, 0.9)
    np.testing.assert_allclose(c.current()[0], 0.9)
    c.observe(1, 1000.0)  # a stall counts as STALL times the budget's ratio at most
    assert c.own[1][-1] == STALL * 1.1
    # the report keeps what was observed, stall included
    assert c.summary() == ((OWN_SAMPLES + WINDOW, 0.9, 0.9, 1.7), (OWN_SAMPLES + 1, 2.2, 2.2, 1000.0))

    before = c.current()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        c.observe(0, bad)
    np.testing.assert_allclose(c.current(), before)
    for table in ((1.0, 0.0), (1.0, float("nan")), ((1.0,),)):
        with pytest.raises(ValueError, match="cost table"):
            RunCosts(table)


def test_one_slow_dispatch_does_not_keep_the_choice_off_a_budget():
    """The H200 run at batch 64, T=1 (2026-12-03), simulated: the table says 0.668 / 1.021 / 1.078
    ms per round at budgets 0 / 4 / 8, the dispatches pay 0.739 / 1.21 / 1.30, a tree commits 1.5
    / 1.6 tokens per round (as expected), so plain rounds are best; the first budget-0 dispatch
    stalls (1.124 ms per round). Over 60 dispatches (one-round probes untimed, as ``generate``
    does) budget 0 runs at least 80% of the last 50 (46 here; the rest are probes). Costs that
    take a budget's latest timing as it is never run budget 0 again after the stall (0 of 50)."""
    table, paid, tokens = (0.668, 1.021, 1.078), (0.739, 1.21, 1.30), (1.0, 1.5, 1.6)
    c, stalled, picks = AutoChooser(PLAN), False, []
    for _ in range(60):
        k = c.choose(64, c.costs(64, table))
        rounds = 1 if c.probing else 8
        if not c.probing:
            c.observe(64, k, paid[k] if k or stalled else 1.124)
            stalled |= k == 0
        realized = [(t if j <= k else tokens[k]) * rounds for j, t in enumerate(tokens)]  # (as expected)
        c.record(k, _tally([[rounds, tokens[k] * rounds, *(t * rounds for t in tokens)]] * 64, realized))
        picks.append(k)
    assert picks[10:].count(0) >= 40, picks


def test_the_chooser_decides_on_the_costs_the_run_pays():
    """The table says a tree pays; the timed dispatches say its rounds cost three plain ones, and
    the budget not timed yet is priced by the timed ratios' median: the choice goes to budget 0.
    With costs given (``learn_costs=False``) the table stands."""
    table = (1.0, 1.5, 2.0)
    for learn in (True, False):
        c = _chooser([1.0, 2.5, 3.0])
        c.learn_costs = learn
        assert c.choose(8, c.costs(8, table)) == 1
        for _ in range(OWN_SAMPLES):
            c.observe(8, 0, 0.8)
            c.observe(8, 1, 2.4)
        # budget 8 untimed: the latest WINDOW ratios (1.6, 0.8, 1.6, 0.8, 1.6) give 1.6
        np.testing.assert_allclose(c.costs(8, table), (0.8, 2.4, 3.2) if learn else table)
        assert c.choose(8, c.costs(8, table)) == (0 if learn else 1)
        np.testing.assert_allclose(c.costs(16, (2.0, 3.0, 4.0)), (2.0, 3.0, 4.0))  # per batch shape
        report = AutoReport.of(c, {8: table})
        assert report.costs == {8: table}
        np.testing.assert_allclose(report.run_costs[8], c.costs(8, table))


def test_tree_prefix_is_the_smaller_build_and_expected_tokens_its_prefix_sums():
    """Best-first order adds parents (and earlier siblings) first, so the first b + 1 slots of a
    tree are the tree of budget b, links included."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 7)) * 2, jnp.float32)
    big = build_draft_tree(logits, 12, impl="reference")
    for b in (1, 5):
        small, cut = build_draft_tree(logits, b, impl="reference"), big.prefix(b + 1)
        for field in ("tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"):
            np.testing.assert_array_equal(getattr(cut, field), getattr(small, field), err_msg=f"{field} at {b}")
    e = np.asarray(expected_tokens(big, (0, 1, 3, 6, 12)))
    p = np.where(np.asarray(big.valid), np.exp(np.asarray(big.score, np.float64)), 0.0)
    want = np.stack([1 + p[:, 1 : b + 1].sum(axis=1) for b in (0, 1, 3, 6, 12)], axis=1)
    np.testing.assert_allclose(e, want, rtol=1e-5)
    assert (np.diff(e, axis=1) >= 0).all()


def test_realized_tokens_are_the_walk_on_each_prefix():
    """What a round would have committed at a smaller budget, read off its accepted path, is what
    the walk on the tree's prefix commits with the same per-node draws (fresh random trees and
    draws; 3 tokens, so that the draws often match a child)."""
    rng = np.random.default_rng()
    budgets = (0, 1, 3, 6, 12)
    for _ in range(3):
        logits = jnp.asarray(rng.standard_normal((32, 5, 3)) * 2, jnp.float32)
        tree = build_draft_tree(logits, 12, impl="reference")
        draws = jnp.asarray(rng.integers(0, 3, size=tree.tokens.shape), jnp.int32)
        realized = np.asarray(realized_tokens(accept_path(tree, draws, impl="reference").path, budgets))
        for k, b in enumerate(budgets):
            walk = accept_path(tree.prefix(b + 1), draws[:, : b + 1], impl="reference")
            np.testing.assert_array_equal(realized[:, k], np.asarray(walk.num_accepted) + 1, err_msg=f"budget {b}")
        assert (realized[:, -1] > realized[:, 1]).any()  # (the draws reach past the smallest trees)


def test_calibration_is_known_by_the_row_rounds_behind_it():
    """One row, one drafted round that accepted nothing of the 2 tokens it expected: its factor
    is 0, but one round of one row says little (at T=0.6 a row accepts 0 or 4 tokens a round), so
    the batch's factor is 0 shrunk toward 1 by PRIOR_ROUNDS row-rounds: 0.8, and drafting still
    pays at a cost ratio of 1.3 (1 + 0.8 * 2 tokens for 1.3); the same round in each of 64 rows
    is known: 4 / 68, and it does not."""
    costs = (1.0, 1.3, 2.0)
    for rows, factor, k in [(1, 0.8, 1), (64, 4 / 68, 0)]:
        c = AutoChooser(PLAN)
        c.record(1, _tally([[1, 1, 1, 3, 3]] * rows))
        np.testing.assert_allclose(c.factor()[1], factor)
        assert c._rule(rows, costs) == k


def test_chooser_drafts_where_what_drafted_rounds_teach_pays_for_them():
    """One drafted round at budget 4 that committed 2 tokens where 2.5 were expected: at a cost of
    2.4 plain rounds drafting does not pay on that estimate (2.4 tokens, calibrated), but one
    round of one row knows the pace to about +-0.6 tokens (``pace_error``), and a dispatch of
    drafted rounds would tell whether the 40 tokens left are better drafted: the next dispatch
    drafts at budget 4 (not a probe) and the interval stays. The same round in each of 64 rows
    knows the pace to +-0.15 tokens: budget 0, backed off. Where the tree loses by more than the
    error (a cost of 5), or too few tokens are left to gain what the lesson costs, budget 0."""
    costs = (1.0, 2.4, 3.0)
    errors = {}
    for rows, k, interval in [(1, 1, 3), (64, 0, 6)]:
        for finish in (None, (np.arange(rows), np.full(rows, 40))):
            c = AutoChooser(PLAN)
            c.record(1, _tally([[1, 2, 1, 2.5, 2.8]] * rows), rows=np.arange(rows))
            assert c._rule(rows, costs, finish) == 0
            assert (c.choose(rows, costs, finish), c.probing, c.interval) == (k, False, interval)
        errors[rows] = c.pace_error()
    assert errors[1][0] == errors[64][0] == 0.0  # (budget 0 commits one token: nothing to know)
    np.testing.assert_allclose(errors[1][1], 0.644, atol=0.01)
    np.testing.assert_allclose(errors[64][1], 0.152, atol=0.01)
    for costs, left in [((1.0, 5.0, 6.0), 40), ((1.0, 2.5, 3.0), 3)]:
        c = AutoChooser(PLAN)
        c.record(1, _tally([[1, 2, 1, 2.5, 2.8]]), rows=np.arange(1))
        assert (c.explore_value(1, costs, ([0], [left])) < 0).all()
        assert (c.choose(1, costs, ([0], [left])), c.interval) == (0, 6)


def test_static_batch_probes_at_the_budget_its_slowest_rows_favour():
    """Two rows known over 40 drafted rounds: one fast (3 tokens a round at budget 4, 5 at 8),
    one slow (1.4 and 1.45). The batch waits for the slow row, for which no tree pays (budget 4:
    40 / 1.4 rounds at 1.5 > 40 plain ones), so a due probe runs; at budget 4, the cheaper tree
    for that row, though the rows' mean (2.2 at 4 for 1.5, 3.2 at 8 for 2) favours budget 8."""
    costs = (1.0, 1.5, 2.0)
    c = AutoChooser(PLAN)
    fast, slow = [40, 200, 40, 120, 200], [40, 58, 40, 56, 58]
    c.record(2, np.asarray([fast + fast[2:], slow + slow[2:]], np.float32), rows=np.array([0, 1]))
    c.skipped = 10**6  # (a probe due, whatever the interval)
    assert c.choose(2, costs, finish=([0, 1], [40, 40])) == 1 and c.probing
    c.skipped = 10**6
    assert c.choose(2, costs) == 2 and not c.probing  # (the throughput rule: the mean row, drafting)


def test_chooser_calibrates_each_budget_by_what_its_prefix_realized():
    """Drafted rounds at budget 8 whose draft is well calibrated on its first 4 nodes (2 tokens
    expected, 2 realized) and overconfident past them (4 expected at budget 8, 2.2 realized):
    budget 4 pays (2 tokens for 1.5), budget 8 does not (2.2 for 2). One factor for every budget
    (realized over expected at the verified budget, 0.4) would make budget 4 look as poor (1.4
    for 1.5) and keep budget 0. A budget larger than any verified takes the largest verified one's
    factor."""
    costs = (1.0, 1.5, 2.0)
    c = AutoChooser(PLAN)
    c.record(2, _tally([[4, 8.8, 4, 8, 16]] * 8, realized=[4, 8, 8.8]))
    np.testing.assert_allclose(c.factor(), [1.0, 1.0, 32 / 36 * 0.4 + 4 / 36])  # (32 row-rounds: PRIOR_ROUNDS)
    assert c.choose(8, costs) == 1
    c = AutoChooser(PLAN)
    c.record(1, _tally([[4, 6, 4, 8, 16]] * 8, realized=[4, 6, 6]))
    np.testing.assert_allclose(c.factor(), [1.0, 0.5, 0.5] * np.array([1, 8 / 9, 8 / 9]) + [0, 1 / 9, 1 / 9])


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="dflash", budget="auto"), "budget"),
    (dict(method="ar", budget="auto"), "budget"),
    (dict(budget="many"), "budget"),
    (dict(budget="auto", auto_max_budget=0), "auto_max_budget"),
    (dict(budget="auto", auto_probe_every=0), "auto_probe_every"),
    (dict(budget="auto", auto_costs=(1.0, 2.0)), "auto_costs"),
    (dict(budget="auto", auto_max_budget=8, auto_costs=(1.0, 0.0, 2.0)), "auto_costs"),
    (dict(budget="auto", auto_costs="fast"), "auto_costs"),
    (dict(budget="auto", auto_max_budget=8, auto_costs=(1.0, 2.0, 3.0), auto_restart=-1.0), "auto_restart"),
    (dict(budget="auto", auto_restart=1.0), "auto_restart"),  # (without auto_costs: measured)
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        DecodeConfig(**kwargs)
    assert e.value.field == field


def test_auto_settings_and_the_option():
    d = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=[1, 2, 3])
    assert d.is_auto and d.max_budget == 8 and d.auto_costs == (1.0, 2.0, 3.0) and d.auto_restart is None
    assert DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=[1, 2, 3], auto_restart=2).auto_restart == 2.0
    assert not DecodeConfig(budget=5).is_auto and DecodeConfig(budget=5).max_budget == 5
    assert _preflight.budget("auto") == "auto" and _preflight.budget("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        _preflight.budget("0")


# --- the cost table ------------------------------------------------------------------------------


def test_cost_key_names_device_models_shapes_and_versions():
    target = tiny_kimi(0)
    drafter = tiny_dflash(target, 1)
    key = auto_costs.cost_key(auto_costs.models_digest(target, drafter), backend="ref", rows=16, cache_len=80,
                              per_call=4, budgets=(0, 4, 8))
    assert key["device"] == jax.devices()[0].device_kind and key["jax"] == jax.__version__
    assert key["timing"] == auto_costs.TIMING
    assert (key["rows"], key["cache_len"], key["per_call"], key["budgets"]) == (16, 80, 4, [0, 4, 8])
    other = tiny_kimi(0, num_hidden_layers=2)
    assert auto_costs.models_digest(target, drafter) == auto_costs.models_digest(tiny_kimi(5), drafter)  # weights: no
    assert auto_costs.models_digest(other, drafter) != key["models"]  # shapes: yes
    _, tparams, dparams = Models.split(target, drafter)  # (generate's form: from the split parameters)
    assert auto_costs.models_digest(target, drafter, (tparams, dparams)) == key["models"]
    assert auto_costs.models_digest(other, drafter, Models.split(other, drafter)[1:]) != key["models"]
    json.dumps(key)


def test_cost_table_saves_loads_and_refuses_what_does_not_match(tmp_path):
    key = dict(device="d", models="m", rows=4, budgets=[0, 4, 8], jax="x")
    table = auto_costs.CostTable(str(tmp_path))
    assert table.get(key) is None
    table.put(key, [1.0, 2.0, 3.5], restart=0.002)
    fresh = auto_costs.CostTable(str(tmp_path))  # another process: from the file
    assert fresh.get(key) == (1.0, 2.0, 3.5)
    assert fresh.get({**key, "rows": 8}) is None
    calls = []
    assert fresh.get_or_measure(key, calls.append) == (1.0, 2.0, 3.5) and not calls  # stored: not timed again
    with open(table.path(key)) as f:
        stored = json.load(f)
    with open(table.path(key), "w") as f:  # a file for another key under this name
        json.dump({**stored, "key": {**key, "rows": 2}}, f)
    assert auto_costs.CostTable(str(tmp_path)).get(key) is None
    with open(table.path(key), "w") as f:
        f.write("{not json")
    assert auto_costs.CostTable(str(tmp_path)).get(key) is None
    measured = auto_costs.CostTable(None).get_or_measure(key, calls.append, reps=2, per_call=4,
                                                         before=lambda: calls.append("before"), restart=True)
    # one warm-up call each, then two repetitions of a burst of BURST calls each
    bursts = [x for k in range(3) for x in ["before", k] * auto_costs.BURST]
    # then the restart's price: one untimed call of budget 0 and two timed, each alone
    assert calls == ["before", 0, "before", 1, "before", 2] + bursts * 2 + ["before", 0] * 3
    assert len(measured) == 3 and all(c > 0 for c in measured)


def test_cost_table_keeps_the_restart_price_and_measures_it_where_a_table_has_none(tmp_path):
    key = dict(device="d", models="m", rows=4, budgets=[0, 4], jax="x")
    old = auto_costs.CostTable(str(tmp_path))
    old.put(key, [1.0, 2.0])  # (a table stored before restarts were priced)
    calls = []
    table = auto_costs.CostTable(str(tmp_path))
    assert table.get(key) == (1.0, 2.0) and table.restart(key) is None
    assert table.get_or_measure(key, calls.append, reps=3) == (1.0, 2.0) and not calls  # (no restart asked)
    assert table.get_or_measure(key, calls.append, reps=3, restart=True) == (1.0, 2.0)  # the costs kept
    assert calls == [0] * 4 and table.restart(key) == 0.0  # (these calls cost nothing: below a round)
    fresh = auto_costs.CostTable(str(tmp_path))
    assert fresh.restart(key) == 0.0 and fresh.get_or_measure(key, calls.append, restart=True) == (1.0, 2.0)
    assert calls == [0] * 4  # both stored: nothing timed again
    fresh.put(key, [1.0, 2.0], restart=0.003)
    assert auto_costs.CostTable(str(tmp_path)).restart(key) == 0.003
    assert auto_costs.CostTable(str(tmp_path)).restart({**key, "rows": 8}) is None

    def slow(k):
        time.sleep(0.02)

    assert 0.015 < auto_costs.measure_restart(slow, cost=0.001, reps=3, per_call=4) < 0.2


def test_default_table_lives_under_the_compilation_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(auto_costs, "_default", None)
    monkeypatch.setenv("DDTREE_JAX_COMPILATION_CACHE", str(tmp_path))
    assert auto_costs.default_table().folder == str(tmp_path / auto_costs.FOLDER)
    monkeypatch.setattr(auto_costs, "_default", None)
    monkeypatch.setenv("DDTREE_JAX_COMPILATION_CACHE", "off")
    assert auto_costs.default_table().folder is None


# --- decoding --------------------------------------------------------------------------------------

V = 12
GREEDY_PROMPTS, GREEDY_TOKENS = [[1, 2, 3, 4, 5], [7], [9, 10, 11]], 8
LAW_PROMPT, LAW_N = [1, 5, 2], 3000
LAW_SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.1)]
AUTO = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=(1.0, 1.7, 5.0), auto_probe_every=2, seed=11,
                    sync_every=2)  # several choices within the few rounds of the test


@pytest.fixture(scope="module")
def law_models():
    target = tiny_kimi(3, vocab_size=V)
    return target, tiny_dflash(target, 4, mask_token_id=V - 1)


@pytest.fixture(scope="module")
def mixed_run(law_models):
    """One batch (one compilation): LAW_N sampled rows per setting (2 tokens each) and three greedy
    rows (GREEDY_TOKENS each)."""
    sampling = [dt.SamplingParams(**s) for s in LAW_SETTINGS for _ in range(LAW_N)]
    sampling += [dt.SamplingParams(temperature=0.0)] * len(GREEDY_PROMPTS)
    prompts = [LAW_PROMPT] * (len(LAW_SETTINGS) * LAW_N) + GREEDY_PROMPTS
    limits = [2] * (len(LAW_SETTINGS) * LAW_N) + [GREEDY_TOKENS] * len(GREEDY_PROMPTS)
    return generate(*law_models, prompts, sampling=sampling, max_new_tokens=limits, compact=False, config=AUTO)


def _two_token_law(target, params):
    logits = np.asarray(target(jnp.asarray([LAW_PROMPT + [t] for t in range(V)])))  # one forward pass
    first, seconds = logits[0, -2], logits[:, -1]
    return (filtered_probs(first, **params)[:, None]
            * np.stack([filtered_probs(seconds[t], **params) for t in range(V)])).ravel()


def test_sampling_law_with_auto_budget(law_models, mixed_run):
    """Through ``generate``: the first two tokens of each sampled setting follow the target's law
    (``_check_two_token_law``) where the first dispatch probes (its first round drafted at the
    largest budget, then plain rounds holding the drafter's context back)."""
    out = mixed_run
    assert out.dispatches[0].form == "probe" and out.auto.drafted_rounds >= 1
    law_rows = out.requests[: len(LAW_SETTINGS) * LAW_N]
    assert np.mean([r.acceptance_lengths[0] for r in law_rows]) > 1.1, "drafts must be accepted to mean something"
    _check_two_token_law(law_models[0], np.array([r.tokens for r in law_rows]))


def test_sampling_law_verifying_a_prefix_of_the_largest_tree(law_models):
    """Rounds at ``round_plans(...)[1]`` (budget 4 of the set (0, 4, 8): the drafter drafts the 4
    depths the budget-4 prefix of the budget-8 tree can reach, the round verifies that prefix)
    keep each sampled setting's law of the first two tokens (``_check_two_token_law``)."""
    target, drafter = law_models
    models, tparams, dparams = Models.split(target, drafter)
    base = DecodePlan(method="ddtree", budget=8, hidden_layer_ids=tuple(drafter.config.target_layer_ids),
                      backend=resolve_backend(DecodeConfig().impl))
    plans = round_plans(base, AutoPlan(budgets=(0, 4, 8), draft_len=4, probe_every=2))
    B = len(LAW_SETTINGS) * LAW_N
    sampling = batch_sampling([dt.SamplingParams(**s) for s in LAW_SETTINGS for _ in range(LAW_N)], B)
    state = prefill(models, tparams, dparams, plans[1], jnp.tile(jnp.asarray([LAW_PROMPT[:-1]]), (B, 1)),
                    jnp.full((B,), len(LAW_PROMPT) - 1), jnp.full((B,), LAW_PROMPT[-1]), max_len=16, capacity=8,
                    max_new_tokens=jnp.full((B,), 2), stop_ids=jnp.full((B, 1), -2), sampling=sampling,
                    request_ids=jnp.arange(B, dtype=jnp.uint32))
    state, tally = run_tallied_rounds(models, tparams, dparams, plans[1], state, jax.random.key(11), 2)
    assert (np.asarray(state.generated) == 2).all()
    rounds = np.asarray(tally)[:, 0]
    assert rounds.min() >= 1 and (rounds == 1).mean() > 0.1, "drafts must be accepted to mean something"
    _check_two_token_law(target, np.asarray(state.out)[:, :2])


def _check_two_token_law(target, tokens):
    """``tokens [len(LAW_SETTINGS) * LAW_N, 2]``, rows by setting: each setting's pairs follow the
    target's law (chi-square, p > 1e-4; fixed seed); the control (the same counts against the
    other setting's law) is rejected (p < 1e-6, or a token outside its support)."""
    laws = [_two_token_law(target, s) for s in LAW_SETTINGS]
    for i, s in enumerate(LAW_SETTINGS):
        codes = tokens[i * LAW_N : (i + 1) * LAW_N, 0] * V + tokens[i * LAW_N : (i + 1) * LAW_N, 1]
        counts = np.bincount(codes, minlength=V * V)
        law, wrong = laws[i], laws[1 - i]
        assert (law[codes] > 0).all(), f"a token outside the filtered support was emitted ({s})"
        p = chisquare_pvalue(counts[law > 0], law[law > 0] * LAW_N)
        assert p > 1e-4, f"chi-square p = {p:.3g} for {s}"
        rejected = (wrong[codes] == 0).any() or chisquare_pvalue(counts[wrong > 0], wrong[wrong > 0] * LAW_N) < 1e-6
        assert rejected, f"the control was not rejected for {s}"


@pytest.fixture(scope="module")
def greedy_ar(law_models):
    return generate(law_models[0], None, GREEDY_PROMPTS, method="ar", max_new_tokens=GREEDY_TOKENS)


def test_greedy_auto_equals_autoregressive_and_reports_its_rounds(mixed_run, greedy_ar):
    ar = greedy_ar
    greedy = mixed_run.requests[-len(GREEDY_PROMPTS):]
    assert [r.tokens for r in greedy] == ar.tokens
    report = mixed_run.auto
    assert report.budgets == (0, 4, 8) and report.costs == {len(mixed_run.requests): AUTO.auto_costs}
    assert sum(report.rounds) == mixed_run.rounds and report.rounds[0] >= 1  # plain rounds and drafted ones
    assert report.drafted_rounds == report.rounds[1] + report.rounds[2]
    # the dispatches in order add up to the histogram
    by_budget = dict.fromkeys(report.budgets, 0)
    for b, n in report.sequence:
        by_budget[b] += n
    assert tuple(by_budget.values()) == report.rounds and all(n > 0 for _, n in report.sequence)
    assert report.realized[0] == report.expected[0]  # a plain round expects and commits one token per row
    assert sum(report.realized) == sum(sum(r.acceptance_lengths) for r in mixed_run.requests)


def test_generate_compacts_only_where_the_cost_table_says_it_pays(law_models, greedy_ar, tmp_path, monkeypatch):
    """With costs from the table, a compaction is observed (its host time, stored for the larger
    batch's key once no program compiles during it), and later runs compact only where the rounds
    left times the smaller batch's saving per round beat that price: never at a huge price, again
    where the smaller batch is cheap and the price nil; the tokens the same every time."""
    table = auto_costs.CostTable(str(tmp_path))
    monkeypatch.setattr(auto_costs, "_default", table)
    config = DecodeConfig(budget="auto", auto_max_budget=4, sync_every=1)
    run = lambda: generate(*law_models, GREEDY_PROMPTS, max_new_tokens=[GREEDY_TOKENS, 2, 2], config=config)  # noqa: E731
    want = [greedy_ar.tokens[0], greedy_ar.tokens[1][:2], greedy_ar.tokens[2][:2]]

    def entries():
        out = {}
        for name in os.listdir(table.folder):
            with open(os.path.join(table.folder, name)) as f:
                entry = json.load(f)
            out[entry["key"]["rows"]] = entry
        return out

    outs = [run(), run()]  # (the first compiles the smaller batch's programs: its compaction is not priced)
    assert all(o.tokens == want and o.batch_sizes == [3, 1] and len(o.compaction_seconds) == 1 for o in outs)
    big, small = entries()[3], entries()[1]
    assert "observed_compaction" not in small and 0 <= big["observed_compaction"] <= outs[1].seconds
    table.observe_compaction(big["key"], 1e9)
    kept = run()
    assert kept.tokens == want and kept.batch_sizes == [3] and kept.compaction_seconds == ()
    table.observe_compaction(big["key"], 0.0)
    table.put(small["key"], [c / 1e6 for c in big["costs"]], 0.0)  # (no restart either)
    again = run()
    assert again.tokens == want and again.batch_sizes == [3, 1]


def _stored(table: auto_costs.CostTable) -> dict:
    """The one file of ``table``'s folder."""
    (name,) = os.listdir(table.folder)
    with open(os.path.join(table.folder, name)) as f:
        return json.load(f)


def test_generate_times_its_costs_on_running_rows_and_puts_them_back(law_models, greedy_ar, tmp_path, monkeypatch):
    """Without injected costs, generate times each budget's compiled rounds on its own rows, then
    decodes them from where they were: greedy equality with autoregressive decoding; a second
    call reads the stored costs and touches no row to do so."""
    table = auto_costs.CostTable(str(tmp_path))
    monkeypatch.setattr(auto_costs, "_default", table)
    config = DecodeConfig(budget="auto", auto_max_budget=4, auto_probe_every=2)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert out.tokens == greedy_ar.tokens
    stored = _stored(table)
    assert (stored["key"]["rows"], stored["key"]["per_call"], stored["key"]["budgets"]) == (3, 8, [0, 4])
    assert out.auto.costs == {3: tuple(stored["costs"])} and all(c > 0 for c in stored["costs"])
    # A second call finds the costs in the table: it neither times nor copies the rows' fields.
    monkeypatch.setattr(auto_costs, "measure", lambda *a, **k: pytest.fail("timed costs the table holds"))
    monkeypatch.setattr(generation, "_row_fields", lambda *a, **k: pytest.fail("copied the rows for a table hit"))
    again = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert again.tokens == greedy_ar.tokens and again.auto.costs == out.auto.costs


@pytest.mark.parametrize("read_lag", [1, 2])
def test_engine_greedy_auto_equals_autoregressive(law_models, greedy_ar, tmp_path, monkeypatch, read_lag):
    """The engine times its costs at start-up on a scratch state (into the cost table), then
    decodes: greedy equality with autoregressive decoding, and the per-budget metrics; read back
    one or two steps after each dispatch."""
    table = auto_costs.CostTable(str(tmp_path))
    monkeypatch.setattr(auto_costs, "_default", table)
    config = dt.EngineConfig(decode=DecodeConfig(budget="auto", auto_max_budget=4, auto_probe_every=2),
                             slots=2, max_model_len=32, prefill_chunk=16, read_lag=read_lag)
    engine = Engine(*law_models, config)
    assert engine.budget == "auto" and len(engine.auto_costs) == 2
    stored = _stored(table)
    assert stored["key"] == auto_costs.cost_key(auto_costs.models_digest(*law_models), backend=engine.plan.backend,
                                                rows=2, cache_len=engine.cache_len, per_call=1, budgets=(0, 4))
    assert list(engine.auto_costs) == stored["costs"] and all(c > 0 for c in engine.auto_costs)
    results = engine.generate(GREEDY_PROMPTS, max_tokens=GREEDY_TOKENS)
    assert [r.tokens for r in results] == greedy_ar.tokens
    snap = engine.metrics.snapshot()["auto_budget"]
    assert snap["budgets"] == [0, 4] and sum(snap["rounds"]) > 0
    assert sum(snap["realized_tokens"]) == sum(sum(r.acceptance_lengths) for r in results)
    assert 'ddtree_auto_budget_rounds_total{budget="4"}' in metrics_text(engine)[0].decode()


def _auto_state(law_models, plan, held: int | None):
    """A prefilled state of four rows (greedy and seeded), with ``held`` positions of drafter
    context held back by its plain rounds (``None``: added round by round)."""
    target, drafter = law_models
    models, tparams, dparams = Models.split(target, drafter)
    prompts = GREEDY_PROMPTS + [[3, 1, 4, 1, 5, 9]]
    lengths = np.array([len(p) for p in prompts], np.int32)
    padded = np.zeros((len(prompts), lengths.max() - 1), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p) - 1] = p[:-1]
    sampling = batch_sampling([dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=1.0, seed=5),
                               dt.SamplingParams(temperature=0.7, top_p=0.9, seed=6),
                               dt.SamplingParams(temperature=1.0, top_k=4)], len(prompts))
    state = prefill(models, tparams, dparams, plan, jnp.asarray(padded), jnp.asarray(lengths - 1),
                    jnp.asarray([p[-1] for p in prompts]), max_len=64, capacity=24,
                    max_new_tokens=jnp.full((len(prompts),), 24), stop_ids=jnp.full((len(prompts), 1), -2),
                    sampling=sampling, request_ids=jnp.arange(len(prompts), dtype=jnp.uint32))
    return state if held is None else with_deferred(state, drafter, held)


def test_auto_rounds_draft_their_own_depths_and_report_exactly_up_to_their_budget(law_models, monkeypatch):
    """A drafted round of ``budget="auto"`` at budget ``b`` drafts ``b`` depths only (the block's
    whole depth at the largest), commits what the fixed budget's round commits, and reports the
    expected tokens of the largest round exactly up to ``b`` and never more past it (the same
    rows and keys; seeded and greedy rows)."""
    from ddtree_jax.models import DFlashDrafter

    depths = []
    propose = DFlashDrafter.propose

    def spy(self, target, cache, last_token, **kw):
        depths.append(kw.get("depths"))
        return propose(self, target, cache, last_token, **kw)

    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    target, drafter = law_models
    models, tparams, dparams = Models.split(target, drafter)
    base = DecodePlan(method="ddtree", budget=4, hidden_layer_ids=tuple(drafter.config.target_layer_ids),
                      backend=resolve_backend(DecodeConfig().impl))
    plans = round_plans(base, AutoPlan(budgets=(0, 2, 4), draft_len=4, probe_every=2))
    key = jax.random.key(5)
    out, tallies = {}, {}
    for name, plan in [("auto 2", plans[1]), ("auto 4", plans[2]), ("fixed 2", dataclasses.replace(base, budget=2))]:
        depths.clear()
        state = _auto_state(law_models, base, None)
        if name.startswith("auto"):
            state, tallies[name] = run_tallied_rounds(models, tparams, dparams, plan, state, key, 1)
        else:
            state = run_rounds(models, tparams, dparams, plan, state, key, 1, False)
        assert depths == [2 if name.endswith("2") else None], (name, depths)  # (block 5: depth 4 is the whole)
        out[name] = np.asarray(state.out)
    np.testing.assert_array_equal(out["auto 2"], out["fixed 2"])
    K = 3
    e2, e4 = (np.asarray(tallies[n])[:, 2 : 2 + K] for n in ("auto 2", "auto 4"))
    np.testing.assert_allclose(e2[:, :2], e4[:, :2], rtol=1e-5)
    assert (e2[:, 2] <= e4[:, 2] + 1e-5).all()


def test_held_back_context_is_the_context_added_round_by_round(law_models):
    """Plain rounds that hold the drafter's context back (``DecodeState.deferred``, the rounds
    ``generate`` runs at budget 0: ``run_rounds`` at ``round_plans(...)[0]``, their tally
    ``plain_tally``), flushed only before a drafted dispatch, and a probing dispatch
    (``run_probe_rounds``: the held context added, one drafted round, then plain ones) give the
    same tokens, statistics and drafter context as rounds that add it as they commit (float32: the
    K/V within 1e-5); and the context is really held back in between (its lengths lag, over two
    dispatches)."""
    target, drafter = law_models
    models, tparams, dparams = Models.split(target, drafter)
    plan = DecodePlan(method="ddtree", budget=4, hidden_layer_ids=tuple(drafter.config.target_layer_ids),
                      backend=resolve_backend(DecodeConfig().impl))
    plans = round_plans(plan, AutoPlan(budgets=(0, 4), draft_len=4, probe_every=2))
    every, held = _auto_state(law_models, plan, None), _auto_state(law_models, plan, 4)
    key = jax.random.key(3)
    lags = []
    for k, rounds, probe in [(0, 2, False), (0, 2, False), (1, 2, False), (0, 1, False), (1, 3, True), (0, 1, False)]:
        if probe:  # the same rounds one program each: the drafted round, then the plain ones
            every, tally_every = run_tallied_rounds(models, tparams, dparams, plans[k], every, key, 1)
            every, rest = run_tallied_rounds(models, tparams, dparams, plans[0], every, key, rounds - 1)
        else:
            every, tally_every = run_tallied_rounds(models, tparams, dparams, plans[k], every, key, rounds)
        before = np.asarray(held.rounds)
        if k and not probe:  # (a probing dispatch adds the held context in its own program)
            held = run_flush(models, tparams, dparams, held)
            assert not np.asarray(held.deferred.count).any()
        if probe:
            assert np.asarray(held.deferred.count).any()
            held, tally_held = run_probe_rounds(models, tparams, dparams, plans[k], plans[0], held, key, rounds,
                                                fixed=False)
            ran = np.asarray(held.rounds) - before
            np.testing.assert_array_equal(plain_tally(ran - np.asarray(tally_held)[:, 0], 2), rest)
        elif k:
            held, tally_held = run_tallied_rounds(models, tparams, dparams, plans[k], held, key, rounds)
        else:
            held = run_rounds(models, tparams, dparams, plans[0], held, key, rounds)
            tally_held = plain_tally(np.asarray(held.rounds) - before, 2)
        np.testing.assert_array_equal(tally_held, tally_every)
        for f in ("out", "generated", "accept_lengths", "finish", "root"):
            np.testing.assert_array_equal(getattr(held, f), getattr(every, f), err_msg=f)
        np.testing.assert_array_equal(held.target_cache.lengths, every.target_cache.lengths)
        lag = np.asarray(every.draft_cache.lengths - held.draft_cache.lengths)
        np.testing.assert_array_equal(lag, np.asarray(held.deferred.count))
        lags.append(int(lag.max()))
    assert lags == [2, 4, 0, 1, 2, 3], lags  # (the rows run throughout)
    held = run_flush(models, tparams, dparams, held)
    assert not np.asarray(held.deferred.count).any()
    lengths = np.asarray(every.draft_cache.lengths)
    np.testing.assert_array_equal(held.draft_cache.lengths, lengths)
    for a, b in zip(held.draft_cache.k + held.draft_cache.v, every.draft_cache.k + every.draft_cache.v, strict=True):
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(a[row, :n]), np.asarray(b[row, :n]), atol=1e-5)


def test_engine_held_back_context_changes_no_token(law_models, monkeypatch):
    """The engine's budget-0 rounds hold the drafter's context back (flushed before drafted
    dispatches, every ``DEFER_ROUNDS`` rounds and before a request's pages are published): the
    same tokens and acceptance lengths, greedy and seeded, as an engine that adds it every round,
    with slots reused and a second turn that finds the first turn's generated tokens in the
    prefix cache (pages of 16); the drafter's context in those pages within 1e-5; and flushes did run.
    Costs injected: both engines choose alike. Paged only (the scheduling of the flushes is the
    same without pages; the contiguous flush is the one generate's rounds test): it fails without
    the flush before a drafted dispatch and without the one before publishing."""
    config = dt.EngineConfig(decode=DecodeConfig(budget="auto", auto_max_budget=4, auto_probe_every=2,
                                                 auto_costs=(1.0, 1.6), seed=5),
                             slots=2, max_model_len=64, prefill_chunk=16, page_size=16)
    first = [list(range(1, 12)) + list(range(1, 11)), [7, 3, 5, 8, 2], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6]]
    sampling = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=1.0, seed=5),
                dt.SamplingParams(temperature=0.7, top_p=0.9, seed=6), dt.SamplingParams(temperature=0.0)]

    def serve(defer: bool):
        with monkeypatch.context() as m:
            if not defer:
                m.setattr(auto_round, "DEFER_ROUNDS", 0)
            eng = Engine(*law_models, config)
        assert bool(eng._defer) == defer
        flushes, flush = [0], eng._flush

        def counted(state):
            flushes[0] += 1
            return flush(state)

        eng._flush = counted
        eng.warmup()  # compiles the flush (held back: runs it at least once, on free slots)
        assert (flushes[0] >= 1) if defer else flushes[0] == 0
        flushes[0] = 0
        one = eng.generate(first, sampling, max_tokens=24)
        eng.drain()
        cache = []  # the drafter's keys and values in each first-turn context's cached pages
        for p, r in zip(first, one, strict=True):
            pages = jnp.asarray(eng._pool.match_prefix(p + r.tokens)[0], jnp.int32)
            cache.append([np.asarray(a[pages]) for a in eng._state.draft_cache.k + eng._state.draft_cache.v])
        two = eng.generate([p + r.tokens + [5] for p, r in zip(first, one, strict=True)], sampling, max_tokens=8)
        return [(r.tokens, r.acceptance_lengths) for r in one + two], flushes[0], eng.metrics.snapshot(), cache

    held, flushed, snap, held_pages = serve(True)
    every, none, _, every_pages = serve(False)
    assert held == every
    assert flushed > 0 and none == 0
    assert len(held_pages) == len(every_pages) and any(len(x[0]) for x in held_pages)
    for a, b in zip(held_pages, every_pages, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
    assert snap["auto_budget"]["rounds"][0] > 0 and snap["auto_budget"]["rounds"][1] > 0


@pytest.mark.parametrize("fixed", [False, True])
def test_timing_the_costs_keeps_the_held_back_context(law_models, tmp_path, monkeypatch, fixed):
    """generate's cost timing (``_round_costs``) on rows that hold context back runs every budget
    on them, then puts them back: the same rows, the same drafter context once flushed (the timed
    rounds reuse the held-back buffer, so it is flushed first; without that this test fails)."""
    monkeypatch.setattr(auto_costs, "_default", auto_costs.CostTable(str(tmp_path)))
    target, drafter = law_models
    models, tparams, dparams = Models.split(target, drafter)
    plan = DecodePlan(method="ddtree", budget=4, hidden_layer_ids=tuple(drafter.config.target_layer_ids),
                      backend=resolve_backend(DecodeConfig().impl))
    plans = round_plans(plan, AutoPlan(budgets=(0, 4), draft_len=4, probe_every=2))
    key = jax.random.key(3)
    state, _ = run_tallied_rounds(models, tparams, dparams, plans[0], _auto_state(law_models, plan, 2), key, 2)
    assert np.asarray(state.deferred.count).min() == 2
    before = run_flush(models, tparams, dparams, jax.tree.map(jnp.copy, state))
    after, costs, restart, observe = generation._round_costs(DecodeConfig(budget="auto", auto_max_budget=4), "digest",
                                                             models, tparams, dparams, plans, state, key, 64, 5, 2,
                                                             fixed)
    assert len(costs) == 2 and all(c > 0 for c in costs) and restart >= 0 and callable(observe)
    after = run_flush(models, tparams, dparams, after)
    for f in ("out", "generated", "accept_lengths", "finish", "root", "rounds"):
        np.testing.assert_array_equal(getattr(after, f), getattr(before, f), err_msg=f)
    np.testing.assert_array_equal(after.target_cache.lengths, before.target_cache.lengths)
    lengths = np.asarray(before.draft_cache.lengths)
    np.testing.assert_array_equal(after.draft_cache.lengths, lengths)
    kv = lambda s: s.draft_cache.k + s.draft_cache.v  # noqa: E731
    for a, b in zip(kv(after), kv(before), strict=True):
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(a[row, :n]), np.asarray(b[row, :n]), atol=1e-6)



def test_generate_prices_each_probe_with_the_dispatch_launched_before_it(law_models, monkeypatch):
    """One dispatch ahead, a probing dispatch is launched (its choice and launch: host work) while
    the dispatch before it runs, so that one's time holds it: generate prices the probes from the
    two together (their rounds and the time from the read-back before the first to the probe's),
    and times the one before a probe at no budget. Costs from the table (drafting never pays,
    probes every round, their share lifted), timings recorded only."""
    S, calls, timed, priced = 2, [], [], []
    plain, probe = generation.run_rounds, generation.ar.run_probe_rounds
    monkeypatch.setattr(generation, "run_rounds", lambda *a, **k: calls.append("plain") or plain(*a, **k))
    monkeypatch.setattr(generation.ar, "run_probe_rounds", lambda *a, **k: calls.append("probe") or probe(*a, **k))
    monkeypatch.setattr(generation, "_round_costs", lambda decode, digest, models, tparams, dparams, plans, state,
                        *rest: (state, (1.0, 50.0, 50.0), None, None))
    monkeypatch.setattr(AutoChooser, "observe", lambda self, shape, k, seconds: timed.append(k))
    monkeypatch.setattr(AutoChooser, "observe_probe", lambda self, shape, n, seconds: priced.append((n, seconds)))
    monkeypatch.setattr(auto_budget, "PROBE_SHARE", 1e9)
    config = DecodeConfig(budget="auto", auto_max_budget=8, auto_probe_every=1, sync_every=S)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=24, compact=False, config=config)
    assert [d.form for d in out.dispatches][:2] == ["probe", "loop"] and calls[0] == "probe"
    got = out.dispatches
    probes = {i for i, d in enumerate(got) if d.form == "probe"}
    # priced: the probes after the first whose dispatch and the one before it (not a probe: two
    # probes' rounds would count one twice) ran all their rounds
    spans = [i for i in probes if i > 1 and got[i - 1].form != "probe" and got[i].rounds == got[i - 1].rounds == S]
    assert spans and len(priced) == len(spans), (priced, got)
    assert all(n == 2 * S and seconds > 0 for n, seconds in priced)
    # timed: every dispatch but the first, the probes and the ones launched just before a probe
    # (and the last, if it ran fewer rounds)
    excluded = {0} | probes | {i - 1 for i in probes if i > 0}
    assert len(got) - len(excluded) - 1 <= len(timed) <= len(got) - len(excluded), (timed, got)

@pytest.mark.parametrize("restart, alone", [(0.0, True), (1.0, True), (1.01, False), (None, False)])
def test_generate_runs_its_first_probe_alone_where_a_restart_is_cheap(law_models, greedy_ar, restart, alone):
    """Where the prior does not pay, generate's first dispatch probes. Where a pipeline restart's
    price (a measured restart counts MEASURED_RESTART times) is at most RESTART_SHARE of a
    dispatch's plain rounds (here 2 x restart against 0.5 x 4 rounds x 1.0 = 2.0),
    the probe is a call of its one round, read back before the next call is launched (so the
    next is chosen on its statistics); else (an unknown restart too) it is the first round of a
    full dispatch. Either way it verifies the largest budget (its round calibrates every budget
    for the choice after it). Greedy tokens stay autoregressive decoding's."""
    S = 4
    config = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=(1.0, 50.0, 50.0), auto_restart=restart,
                          sync_every=S)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert out.tokens == greedy_ar.tokens
    price = None if restart is None else auto_budget.MEASURED_RESTART * restart
    assert out.auto.restarts == {len(GREEDY_PROMPTS): price}  # (reported: the price the choice took)
    assert out.auto.probe_prices == {len(GREEDY_PROMPTS): None}  # (costs given: nothing timed)
    first, second = out.dispatches[:2]
    assert (first.form, first.budget, first.rounds) == (("alone", 8, 1) if alone else ("probe", 8, S))
    assert second.form != "probe" and second.rounds == S
    if alone:  # (launched once the probe was read back; else launched ahead of that read)
        assert second.start >= first.start + first.choose + first.launch + first.wait


def test_restart_price_takes_an_observed_restart_over_the_measured_one():
    """The price probe_alone compares: what a run observed where known; else the measured restart
    (a launch and read-back alone) MEASURED_RESTART times (it leaves out the host's next choice
    and launch); unknown where neither is."""
    assert auto_budget.restart_price(None, None) is None
    assert auto_budget.restart_price(0.5, None) == auto_budget.MEASURED_RESTART * 0.5
    assert auto_budget.restart_price(0.5, 3.0) == auto_budget.restart_price(None, 3.0) == 3.0
    assert auto_budget.restart_price(0.5, 0.0) == 0.0
    share = auto_budget.RESTART_SHARE * 8 * 0.5  # 8 plain rounds of 0.5
    assert auto_budget.probe_alone(share, 0.5, 8) and not auto_budget.probe_alone(share * 1.01, 0.5, 8)
    assert not auto_budget.probe_alone(None, 0.5, 8)


def test_compaction_pays_where_the_rounds_left_save_more_than_it_costs():
    """``_compaction_pays`` on a hand-made table: the rounds left times the smaller batch's saving
    at the chosen budget against the observed compaction plus the smaller batch's restart; True
    where the table lacks the price or the smaller batch's costs."""
    table = auto_costs.CostTable()
    big, small = (dict(device="d", models="m", rows=r, budgets=[0, 4], jax="x") for r in (16, 8))
    table.put(big, [1.0, 2.0])
    assert generation._compaction_pays(table, big, small, 0, 10.0)  # (nothing known of the smaller batch)
    table.put(small, [0.9, 1.5], restart=0.5)
    assert generation._compaction_pays(table, big, small, 0, 10.0)  # (no compaction observed yet)
    table.observe_compaction(big, 0.4)
    # budget 0: 10 rounds x 0.1 saved = 1.0 > 0.4 + 0.5; 8 rounds: 0.8 < 0.9
    assert generation._compaction_pays(table, big, small, 0, 10.0)
    assert not generation._compaction_pays(table, big, small, 0, 8.0)
    assert generation._compaction_pays(table, big, small, 1, 2.0)  # budget 4: 2 x 0.5 = 1.0 > 0.9
    assert not generation._compaction_pays(table, big, small, 1, 0.0)


@pytest.mark.parametrize("name,other", [("restart", "compaction"), ("compaction", "restart")])
def test_cost_table_keeps_an_observed_restart_and_compaction(tmp_path, name, other):
    """``observe_restart`` (a run's observed restart, beside the measured one) and
    ``observe_compaction`` (what a run's compaction from the key's rows cost) store in memory and
    on disk, each beside the other; the latest replaces the one before; negative observations
    count as 0; a key without costs stores none; storing the costs again keeps it."""
    observe = lambda t, *a: getattr(t, f"observe_{name}")(*a)  # noqa: E731
    observed = lambda t, k: getattr(t, f"observed_{name}")(k)  # noqa: E731
    key = dict(device="d", models="m", rows=4, budgets=[0, 4], jax="x")
    table = auto_costs.CostTable(str(tmp_path))
    observe(table, key, 1.0)
    assert observed(table, key) is None and not os.listdir(tmp_path)  # (no costs: nothing stored)
    table.put(key, [1.0, 2.0], restart=0.002)
    assert observed(table, key) is None
    observe(table, key, 0.004)
    getattr(table, f"observe_{other}")(key, 0.007)
    fresh = auto_costs.CostTable(str(tmp_path))  # another process: from the file
    assert observed(fresh, key) == 0.004 and fresh.restart(key) == 0.002 and fresh.get(key) == (1.0, 2.0)
    assert getattr(fresh, f"observed_{other}")(key) == 0.007
    observe(fresh, key, 0.003)
    fresh.put(key, [1.5, 2.5], restart=0.001)
    again = auto_costs.CostTable(str(tmp_path))
    assert (again.get(key), again.restart(key), observed(again, key)) == ((1.5, 2.5), 0.001, 0.003)
    observe(again, key, -0.5)
    assert observed(auto_costs.CostTable(str(tmp_path)), key) == 0.0
    assert observed(again, {**key, "rows": 8}) is None


def test_generate_observes_what_its_first_probe_alone_cost(law_models, greedy_ar, monkeypatch):
    """After a first probe alone, generate hands what it cost to the cost table's key: from the
    probe's launch (after its choice) to the end of the next dispatch's launch (its choice
    included), less the probe round's table cost; nothing where the probe ran inside a dispatch,
    nor where a program was traced or compiled in that time (the first call of a process would
    store a compilation as the restart's price)."""
    S, costs = 4, (1.0, 50.0, 50.0)
    for price, alone, compiled in ((0.0, True, False), (0.0, True, True), (None, False, False)):
        seen = []

        def round_costs(decode, digest, models, tparams, dparams, plans, state, *args, price=price, seen=seen):
            return state, costs, price, seen.append

        monkeypatch.setattr(generation, "_round_costs", round_costs)
        monkeypatch.setattr(generation.CompileWatch, "seconds", property(lambda self, c=compiled: 0.5 if c else 0.0))
        config = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=costs, sync_every=S)
        out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
        assert out.tokens == greedy_ar.tokens
        first, second = out.dispatches[:2]
        assert (first.form == "alone") == alone
        if alone and not compiled:
            (observed,) = seen
            expected = (second.start + second.choose + second.launch) - (first.start + first.choose) - costs[2]
            assert observed == pytest.approx(expected, abs=1e-6)
        else:
            assert seen == []


def test_generate_watches_compilations_only_through_its_first_probe_alone(law_models, monkeypatch):
    """The compile watch a first probe alone opens is closed when generate returns, and when it
    raises."""
    opened = []

    class Watch(generation.CompileWatch):
        def __enter__(self):
            opened.append(self)
            self.open = True
            return super().__enter__()

        def __exit__(self, *exc):
            self.open = False
            return super().__exit__(*exc)

    monkeypatch.setattr(generation, "CompileWatch", Watch)
    config = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=(1.0, 50.0, 50.0), auto_restart=0.0,
                          sync_every=4)
    generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert len(opened) == 1 and not opened[0].open

    def fails(*args, **kwargs):
        raise RuntimeError("a read-back failed")

    monkeypatch.setattr(generation, "_read_progress", fails)
    with pytest.raises(RuntimeError, match="read-back failed"):
        generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert len(opened) == 2 and not opened[1].open


def test_generate_decides_its_first_probe_with_the_restart_a_run_observed(law_models, greedy_ar, tmp_path,
                                                                          monkeypatch):
    """With the cost table's costs (no injected costs), a restart observed by an earlier run
    decides whether the first probe runs alone: an observed restart above RESTART_SHARE of a
    dispatch's plain rounds keeps it inside its dispatch, whatever the measured restart; one of 0
    lets it run alone. The table's costs are set so that the prior does not pay."""
    table = auto_costs.CostTable(str(tmp_path))
    monkeypatch.setattr(auto_costs, "_default", table)
    config = DecodeConfig(budget="auto", auto_max_budget=4, sync_every=4)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    assert out.tokens == greedy_ar.tokens
    key = _stored(table)["key"]
    table.put(key, [1.0, 50.0], restart=0.0)  # (a drafted round dear: the first dispatch probes)
    round_costs = generation._round_costs
    for observed, alone in ((0.0, True), (auto_budget.RESTART_SHARE * 4 * 1.0 * 1.01, False)):
        table.observe_restart(key, observed)
        monkeypatch.setattr(generation, "_round_costs", _keeping(round_costs, table, key, observed))
        out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
        assert out.tokens == greedy_ar.tokens
        assert out.auto.restarts == {len(GREEDY_PROMPTS): observed}
        assert (out.dispatches[0].form == "alone") == alone


def _keeping(round_costs, table, key, observed):
    """``round_costs`` whose observer leaves ``table``'s observed restart for ``key`` as it is (a
    run on this CPU would replace it with what the CPU's rounds cost)."""

    def wrapped(*args):
        state, costs, price, _ = round_costs(*args)
        assert table.observed_restart(key) == observed
        return state, costs, price, lambda seconds: None

    return wrapped


@pytest.mark.parametrize("costs, pays", [((1.0, 50.0, 50.0), False), ((1.0, 1.0, 1.0), True)])
def test_generate_probes_inside_full_dispatches(law_models, greedy_ar, monkeypatch, costs, pays):
    """generate runs every dispatch as ``sync_every`` rounds: a probe (a drafted round the
    statistics did not choose: the first dispatch's where the prior does not pay, and one after
    ``interval`` plain rounds) as the first round of a dispatch whose others are plain
    (``run_probe_rounds``), budget 0 as plain rounds (``run_rounds``), a chosen budget as its
    tallied rounds. Where drafting never pays every drafted round is a probe's; where it pays, none
    is: the first two dispatches (the second launched before the first is read back) run the
    largest budget. Greedy tokens stay autoregressive decoding's.
    Full dispatches at one budget time their budget, a probing one and the one before it (launched
    ahead, it holds the probe's launch) the probes' price: the costs come
    from the table (patched, and the timings only recorded, so no timing changes a choice; the
    probes' share of the time lifted, so the interval alone decides when they run), and each
    choice is given the probes' price (here none: no probe's time was recorded)."""
    calls, timed, priced = [], [], []
    S = 2  # (rounds per dispatch, and probes every round: a second comes before the rows' GREEDY_TOKENS are done)

    def recorded(kind, run, budget_of):
        def call(models, tparams, dparams, *args, **kw):
            at = 2 if kind == "probe" else 1  # (the state's position; the rounds' two after it)
            before, n = np.asarray(args[at].rounds), args[at + 2]
            out = run(models, tparams, dparams, *args, **kw)
            state = out[0] if isinstance(out, tuple) else out
            calls.append((kind, budget_of(args), int(n), int((np.asarray(state.rounds) - before).max())))
            return out
        return call

    monkeypatch.setattr(generation, "run_tallied_rounds", recorded("tallied", generation.run_tallied_rounds,
                                                                   lambda a: a[0].budget))
    monkeypatch.setattr(generation, "run_rounds", recorded("plain", generation.run_rounds, lambda a: a[0].budget))
    monkeypatch.setattr(generation.ar, "run_probe_rounds", recorded("probe", generation.ar.run_probe_rounds,
                                                                    lambda a: a[0].budget))
    monkeypatch.setattr(generation, "_round_costs", lambda decode, digest, models, tparams, dparams, plans, state,
                        *rest: (state, costs, None, None))
    monkeypatch.setattr(AutoChooser, "observe", lambda self, shape, k, seconds: timed.append(self.plan.budgets[k]))
    monkeypatch.setattr(AutoChooser, "observe_probe", lambda self, shape, n, seconds: priced.append(n))
    monkeypatch.setattr(auto_budget, "PROBE_SHARE", 1e9)
    finishes, prices, choose = [], [], AutoChooser.choose

    def choosing(self, active, costs, finish=None, probe_price=None):
        finishes.append(finish)
        prices.append(probe_price)
        return choose(self, active, costs, finish, probe_price)

    monkeypatch.setattr(AutoChooser, "choose", choosing)
    config = DecodeConfig(budget="auto", auto_max_budget=8, auto_probe_every=1, sync_every=S)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=GREEDY_TOKENS, compact=False, config=config)
    # A static batch: each choice sees its running rows and what they may still commit, as of the
    # last read (the first: every row, its limit but the first token, drawn by the prefill)
    ids, left = finishes[0]
    assert list(ids) == [0, 1, 2] and list(left) == [GREEDY_TOKENS - 1] * 3
    assert all(0 < min(f[1]) and max(f[1]) < GREEDY_TOKENS and len(f[0]) == len(f[1]) for f in finishes)
    assert sum(finishes[-1][1]) < sum(left)
    assert out.tokens == greedy_ar.tokens
    # The first dispatch: the largest budget where the prior pays, else a probe at the largest budget
    assert calls[0] == (("tallied", 8) if pays else ("probe", 8)) + (S, S), calls
    if pays:
        assert calls[1][:2] == ("tallied", 8), calls
    else:
        assert calls[1][:2] == ("plain", 0), calls
    assert all(n == S for _, _, n, _ in calls), calls
    assert all((kind == "plain") == (b == 0) for kind, b, _, _ in calls), calls
    # The output lists the calls read back (all but one launched ahead after every row finished),
    # in order, each with its form and where its time went
    got = out.dispatches
    assert len(calls) - 1 <= len(got) <= len(calls), (got, calls)
    assert [(d.budget, d.rounds) for d in got] == [(b, n) for _, b, n, _ in calls[:len(got)]]
    forms = ["probe" if kind == "probe" else "loop" for kind, *_ in calls[: len(got)]]
    assert [d.form for d in got] == forms
    assert all(min(d.start, d.choose, d.launch, d.wait) >= 0 for d in got)
    assert all(a.start < b.start for a, b in zip(got, got[1:], strict=False))
    assert sum(d.choose + d.launch + d.wait for d in got) == pytest.approx(out.round_seconds)
    # One dispatch ahead, a call launched after every row finished runs no round: the calls that ran
    ran = [c for c in calls if c[3] > 0]
    assert len(ran) >= len(calls) - 1
    probes = [c for c in ran if c[0] == "probe"]
    # Timed: the full calls at one budget but the first (launched after no read) and those a probe
    # was launched behind (their time holds its launch); such a call and the probe together price
    # the probes (their rounds and time).
    full = [i > 0 and r == S for i, (_, _, _, r) in enumerate(calls)]
    behind = [i + 1 < len(calls) and calls[i + 1][0] == "probe" for i in range(len(calls))]
    assert timed == [b for i, (kind, b, _, _) in enumerate(calls) if kind != "probe" and full[i] and not behind[i]]
    assert priced == [2 * S for i, (kind, *_) in enumerate(calls) if kind == "probe" and full[i] and full[i - 1]]
    assert prices == [None] * len(finishes)
    if pays:
        assert not probes and any(kind == "tallied" for kind, *_ in ran[1:]), calls
    else:
        assert len(probes) > 1 and all(kind != "tallied" for kind, *_ in ran[1:]), calls
        assert out.auto.drafted_rounds == len(probes)


def test_generate_times_no_dispatch_beside_a_synchronous_launch(law_models, monkeypatch):
    """On GPUs a loop whose end the device decides returns to the host only once it ran (and the
    rounds before it): one dispatch ahead, the time between two read-backs that hold such a launch
    is not one dispatch's, so neither the loop nor the dispatch read back just before it is timed
    (the GPU's forms here: ``FIXED_CALLS``). A 64-row K2-shaped run once priced every budget at a
    fiftieth of its cost that way."""
    monkeypatch.setattr(generation, "FIXED_CALLS", True)
    made, timed = [], []
    made_as = generation.Dispatch
    monkeypatch.setattr(generation, "Dispatch", lambda *a, **k: made.append(made_as(*a, **k)) or made[-1])
    monkeypatch.setattr(AutoChooser, "observe", lambda self, shape, k, seconds: timed.append(len(made) - 1))
    config = DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=(1.0, 1.0, 1.0), sync_every=2)
    out = generate(*law_models, GREEDY_PROMPTS, max_new_tokens=25, compact=False, config=config)
    forms = [d.form for d in out.dispatches]
    assert "loop" in forms and timed, forms  # (the rows' last rounds: a loop)
    assert all(forms[i] == "fixed" and forms[i + 1:i + 2] != ["loop"] for i in timed), (forms, timed)
