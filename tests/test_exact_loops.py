"""Dispatches of a known number of rounds (``run_rounds(exact=True)``,
``run_exact_tallied_rounds``): what ``generate`` runs on a GPU, where a loop that stops once every
row is done makes the host read each round's predicate. Extra rounds on finished rows change
nothing, and ``generate`` gives the same tokens with them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ddtree_jax as dt
from ddtree_jax import generation
from ddtree_jax.auto_budget import AutoPlan
from ddtree_jax.auto_round import round_plans, run_exact_tallied_rounds, run_tallied_rounds, with_deferred
from ddtree_jax.backend import REFERENCE
from ddtree_jax.config import DecodeConfig, auto_budget_set
from ddtree_jax.decode_round import DecodePlan, Models, prefill, run_rounds
from ddtree_jax.decode_state import NO_STOP

SAMPLING = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.9, top_p=0.9, seed=3),
            dt.SamplingParams(temperature=1.0, top_k=5, seed=4)]


def _state(models, plan, limits):
    target, drafter = models
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    B = len(prompts)
    lengths = np.array([len(p) - 1 for p in prompts], np.int32)
    padded = np.zeros((B, max(lengths)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p) - 1] = p[:-1]
    (tg, tp), (dg, dp) = nnx.split(target), nnx.split(drafter)
    state = prefill(Models(tg, dg), tp, dp, plan, jnp.asarray(padded), jnp.asarray(lengths),
                    jnp.asarray([p[-1] for p in prompts]), max_len=48, capacity=max(limits),
                    max_new_tokens=jnp.asarray(limits, jnp.int32), stop_ids=jnp.full((B, 1), NO_STOP),
                    sampling=dt.batch_sampling(SAMPLING, B), request_ids=jnp.arange(B, dtype=jnp.uint32))
    return Models(tg, dg), tp, dp, state


def _rows(state):
    """Everything a round changes but the caches' contents (their lengths included)."""
    fields = dataclasses.replace(state, target_cache=None, draft_cache=None, deferred=None)
    return fields, state.target_cache.lengths, None if state.draft_cache is None else state.draft_cache.lengths


def test_rounds_past_every_rows_end_change_nothing(models):
    # Rows of 3, 7 and 5 new tokens finish within 7 rounds; the loop that stops stops there, the
    # loop of known count runs 12: the same rows, finish codes, acceptance lengths and caches.
    # (The autoregressive round: test_tallied_rounds_past_every_rows_end_tally_nothing.)
    plan = DecodePlan(method="ddtree", budget=4, backend=REFERENCE, hidden_layer_ids=models[1].config.target_layer_ids)
    graphs, tp, dp, state = _state(models, plan, [3, 7, 5])
    key = jax.random.key(1)
    stops = run_rounds(graphs, tp, dp, plan, jax.tree.map(jnp.copy, state), key, 12)
    counted = run_rounds(graphs, tp, dp, plan, state, key, 12, exact=True)
    assert bool(jnp.all(stops.done)) and int(stops.rounds.max()) <= 7
    jax.tree.map(np.testing.assert_array_equal, _rows(counted), _rows(stops))


def test_tallied_rounds_past_every_rows_end_tally_nothing(models):
    target, drafter = models
    auto = AutoPlan(budgets=auto_budget_set(8), draft_len=drafter.config.block_size - 1, probe_every=8)
    base = DecodePlan(method="ddtree", budget=8, backend=REFERENCE, hidden_layer_ids=drafter.config.target_layer_ids)
    for plan in (round_plans(base, auto)[0], round_plans(base, auto)[1]):  # budget 0 (holding context back) and 4
        graphs, tp, dp, state = _state(models, plan, [3, 7, 5])
        state = with_deferred(state, drafter, 12)
        key = jax.random.key(2)
        stops, tally_stops = run_tallied_rounds(graphs, tp, dp, plan, jax.tree.map(jnp.copy, state), key, 12)
        counted, tally_counted = run_exact_tallied_rounds(graphs, tp, dp, plan, state, key, 12)
        assert bool(jnp.all(stops.done))
        jax.tree.map(np.testing.assert_array_equal, _rows(counted), _rows(stops))
        np.testing.assert_array_equal(tally_counted, tally_stops)
        np.testing.assert_array_equal(counted.deferred.count, stops.deferred.count)


@pytest.mark.parametrize("config", [DecodeConfig(budget=6),
                                    DecodeConfig(budget="auto", auto_max_budget=8, auto_costs=(1.0, 1.2, 1.3))],
                         ids=["ddtree", "auto"])
def test_generate_with_loops_of_known_count_gives_the_same_tokens(models, monkeypatch, config):
    # On a CPU generate loops until every row is done; told that loops wait on the host (a GPU),
    # it runs loops of known count where the rows surely need them: greedy and seeded rows keep
    # every token and acceptance length.
    target, drafter = models
    drafter = drafter if config.uses_drafter else None
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    kw = dict(sampling=SAMPLING, max_new_tokens=[40, 12, 25], config=config)
    want = dt.generate(target, drafter, prompts, **kw)
    loops = []
    for name in ("run_rounds", "run_exact_tallied_rounds", "run_tallied_rounds"):
        inner = getattr(generation, name)

        def spy(*a, inner=inner, name=name, **k):
            loops.append(name == "run_exact_tallied_rounds" or k.get("exact", False))
            return inner(*a, **k)

        monkeypatch.setattr(generation, name, spy)
    monkeypatch.setattr(generation, "_loops_wait_on_the_host", lambda state: True)
    got = dt.generate(target, drafter, prompts, **kw)
    assert got.tokens == want.tokens
    assert [r.acceptance_lengths for r in got.requests] == [r.acceptance_lengths for r in want.requests]
    assert any(loops) and not all(loops), loops  # (the first drafted dispatch has no pace yet)


def test_which_dispatches_run_a_known_count():
    surely = generation._rounds_surely_needed
    assert surely(8, np.zeros(2), drafted=False, rounds=8) and not surely(7, np.zeros(2), drafted=False, rounds=8)
    # drafted: twice the average pace must remain; no pace yet, no known count
    assert not surely(100, np.array([0, 0]), drafted=True, rounds=8)
    assert surely(48, np.array([30, 10]), drafted=True, rounds=8)  # 3 tokens a round: 48 >= 2 * 8 * 3
    assert not surely(47, np.array([30, 10]), drafted=True, rounds=8)
