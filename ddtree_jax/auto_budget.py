"""``budget="auto"``: the host's choice of DDTree's budget per dispatch, and the statistics it keeps.

Each dispatch of compiled rounds (``generate``: a chunk of ``sync_every`` rounds; the ``Engine``:
one step's rounds) runs the fixed-budget round of one budget ``b`` out of the static set
``AutoPlan.budgets`` (``config.auto_budget_set``: 0, powers of two, the maximum), chosen on the
host before the dispatch from the statistics of the dispatches already read back:

* **expected tokens**: a best-first tree holds its nodes in creation order, parents first, so the
  tree of budget ``b`` is the first ``b + 1`` slots of the tree of the largest budget
  (``DraftTree.prefix``). Its expected committed tokens per row are the bonus plus the sum of its
  nodes' path probabilities (``exp(score)``, the draft marginals the builder ranks by):
  ``expected_tokens`` reads them off one prefix sum, for every budget at once. A drafted round of
  ``budget="auto"`` at budget ``b`` drafts the ``b`` depths its tree can reach (the drafter's LM
  head dominates its cost at a large vocabulary), builds the largest tree on them, verifies the
  prefix of its budget and reports these sums (``auto_round``): exact up to ``b``, past it those
  of a tree held to depth ``b``, lower bounds. A larger budget's average therefore moves only with
  the rounds that verified it or a larger one (before any did, with the lower bounds), and
  **refreshes** keep it current: where the choice is a budget below the largest and the next one
  up was last verified ``REFRESH_ROUNDS`` drafted rounds ago (or never), that dispatch runs the
  next budget instead, so the choice climbs one budget per dispatch where larger trees pay;
* **calibration**: the draft's probabilities are not the acceptance probabilities under each
  row's own sampling law (a greedy row accepts the draft's argmax more often than its
  probability says; a hot row less often; deep nodes are further off). Per budget, the realized
  drafted tokens over the expected ones, both as moving averages over drafted rounds, scale the
  expected drafted tokens (``AutoChooser.factor``, ``calibrated``). A round verified at one
  budget says exactly what it would have committed at every smaller one
  (``decode_round.realized_tokens``), so each drafted round calibrates every budget up to its
  own; a larger budget takes the largest calibrated one's factor;
* **the choice**: ``choose_budget``: the budget of the largest (calibrated expected tokens of the
  running rows) / (cost of a round at that budget); ties go to the smaller budget. Budget 0 runs
  the plain autoregressive round (no drafter), so its rounds teach the averages nothing. That is
  the rule for a batch whose finished rows make room for new ones (the engine). A static batch
  (``generate``) ends with its slowest row, so there the rule is ``finish_budget``: the budget
  that ends the batch soonest if every later round used it, ``cost * E[max over running rows of
  the rounds the row needs for the tokens it may still commit]`` (``batch_rounds``), from
  per-row moving averages of the expected tokens, each calibrated by the row's own factor
  (realized over expected drafted tokens), both shrunk toward the batch's by the rounds behind
  them against the rounds of the batch's average that the rows' measured spread is worth
  (``AutoChooser.prior_rounds``: an empirical-Bayes weight, ``PRIOR_ROUNDS`` before it is
  measured; rows not drafted yet take the batch's). A drafted round commits a
  random number of tokens (``round_variance``: a path accepted depth by depth with one
  probability per depth, set by the mean), so the batch waits for its unluckiest row: at batch
  64 a round expecting 2.5 tokens ends 128 tokens in about 65 rounds, not 51. A row's mean is
  itself an estimate, known as well as the mean of its ``n`` rounds and the prior's, and that
  uncertainty adds to the spread: where the rows' paces differ, a row seen in few drafted rounds
  may be the slow one; where they do not (their spread is the rounds' own), it may not;
* **the first dispatches**: before any drafted round is read back there are no statistics; the
  prior is that a drafted round at the largest budget commits ``FIRST_DRAFT_TOKENS`` tokens.
  Where that pays at the costs (the largest budget's cost at most that many times budget 0's),
  every choice is the largest budget until the first drafted round is read back (a pipelined
  caller's first two dispatches); elsewhere the first dispatch probes, at the largest budget (its
  round tells every budget's expected tokens exactly). A pipelined caller
  chooses its second dispatch before that probe is read back, knowing nothing, so the rounds
  of both may be plain where drafting pays; ``probe_alone`` says when the probe should rather
  run as a dispatch of its one round at the largest budget, read back before the next choice (a
  pipeline restart: worth it where rounds are dear against the restart);
* **probes**: after ``AutoChooser.interval`` rounds in a row at budget 0 one dispatch drafts
  anyway, at the best positive budget (without it the averages would never change again;
  ``generate`` runs it as the first round of a full dispatch, ``auto_round.run_probe_rounds``;
  the engine's dispatches are single rounds). The
  interval starts at ``AutoPlan.probe_every``, doubles (up to ``MAX_BACKOFF`` times that) after
  each drafted dispatch whose statistics still choose budget 0 at the next choice, and falls back
  to ``probe_every`` after one whose statistics choose a tree, so probing costs little where
  drafting does not pay. ``generate`` also times its probing dispatches (``RunCosts.probe_price``:
  what one costs beyond as many plain rounds, the host's work for it included); once one is
  timed, a probe is due only once the plain rounds since the last drafted dispatch cost
  ``1 / PROBE_SHARE`` times that price, so probes take at most about ``PROBE_SHARE`` of the time
  whatever they cost;
* **drafting to learn**: where the rule chooses budget 0 on an estimate that few drafted rounds
  stand behind (batch 1), a dispatch of drafted rounds runs instead where what it would teach is
  worth more than it costs (``AutoChooser.explore_value``: the expected saving of the better
  choice after it, over the rounds left, against its rounds' loss to plain ones).

* **costs as the run pays them**: the cost table (timed once per device, models and shapes) is
  the prior; each timed dispatch gives its budget's ratio of paid to table cost (host work
  between dispatches included), and a budget's cost is its table cost times the median of its own
  latest ratios once it has ``OWN_SAMPLES`` of them, else the median of the latest ratios of all
  budgets (``RunCosts``), so that one slow dispatch neither prices a budget out for good nor
  leaves an untimed budget looking cheaper than the host's share allows.

``AutoChooser`` holds the averages, the run's costs and the report (rounds, expected and realized
tokens per budget) on the host; ``AutoReport`` is its summary. Design note: docs/auto-budget.md.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import ndtr

from ddtree_jax.tree import DraftTree

__all__ = ["DECAY", "FIRST_DRAFT_TOKENS", "MAX_BACKOFF", "OWN_SAMPLES", "REFRESH_ROUNDS", "SEQUENCE", "STALL",
           "WINDOW", "AutoChooser", "AutoPlan", "AutoReport", "MAX_PRIOR_ROUNDS", "MEASURED_RESTART", "PRIOR_ROUNDS",
           "PROBE_SHARE", "RESTART_SHARE", "RunCosts", "SPREAD_ROWS", "batch_rounds", "calibrated", "carried_up",
           "choose_budget", "expected_max", "expected_tokens", "finish_budget", "finish_times", "probe_alone",
           "restart_price", "round_variance"]

DECAY = 0.25
"""The moving averages' weight of the newest drafted round."""

WINDOW = 5
"""``RunCosts``: the latest timed dispatches a median is taken over (per budget, and over all)."""

OWN_SAMPLES = 3
"""``RunCosts``: the timed dispatches after which a budget's cost follows its own ratios alone."""

STALL = 4.0
"""``RunCosts``: a timed dispatch's ratio counts as at most this many times the budget's current
ratio, so that one stall (a compile, another process) cannot dominate the medians."""

PAID_WINDOW = 256
"""``RunCosts.summary``: the latest timed dispatches per budget its median is taken over."""

FIRST_DRAFT_TOKENS = 1.5
"""The prior: the tokens a drafted round at the largest budget is taken to commit before any
drafted round is read back. Where that pays against a plain round at the costs given (the
largest budget's cost at most this many times budget 0's), the choice is the largest budget
until the first drafted round is read back; elsewhere the first dispatch probes (at the largest
budget). Set where blind drafting loses little where drafting pays and where it does not: a
static batch's slowest row at T=1 commits about 1.4 tokens a round at budget 16 on the shipped
pair (docs/auto-budget.md, "Probes")."""

RESTART_SHARE = 0.5
"""``probe_alone``: the share of a dispatch's plain rounds a pipeline restart's price
(``restart_price``) may be at most for the first probe to run alone."""

MEASURED_RESTART = 2.0
"""``restart_price``: what a measured restart counts for until one is observed. The measurement
(``auto_costs.measure_restart``: a call's launch and read-back) leaves out the host's choice and
launch of the dispatch after the probe, which the device waits for too (the shipped pair at batch
64 on an H100: 0.70 ms measured, 2.9-3.9 ms from a probe's launch to the next dispatch's launch
end beyond its round)."""

REFRESH_ROUNDS = 64
"""Drafted rounds after which a choice of a budget below the largest runs the next budget up
instead, once, to renew that budget's statistics (a round at ``b`` tells nothing exact past
``b``): every verified budget's estimate is then at most this many drafted rounds old."""

MAX_BACKOFF = 32
"""The longest probe interval, in multiples of ``AutoPlan.probe_every``."""

PROBE_SHARE = 0.05
"""The share of the time probes may take at most where their price is measured: a probe is then
due only once the plain rounds since the last drafted dispatch cost ``1 / PROBE_SHARE`` times it
(``AutoChooser.choose``'s ``probe_price``)."""

SEQUENCE = 4096
"""``AutoChooser.sequence``: the recorded dispatches it keeps (bounded: an engine's chooser lives
as long as the engine)."""

PRIOR_ROUNDS = 4.0
"""``finish_budget``'s per-row estimates: the drafted rounds after which a row's own average weighs
as much as the batch's (a row's average over ``n`` drafted rounds gets weight
``n / (n + PRIOR_ROUNDS)``), so that one round's noise in one row does not set the batch's pace;
where the rows' spread is measured (``AutoChooser.prior_rounds``), that measure instead."""

SPREAD_ROWS = 32
"""``AutoChooser.prior_rounds``: the rows with drafted rounds at a budget (and the degrees of
freedom within rows) it takes to measure how much the rows' paces differ (16 rows' two dispatches
measured it anywhere from 1.5 to 30 rounds in one run)."""

MAX_PRIOR_ROUNDS = 256.0
"""``AutoChooser.prior_rounds``'s bound where the rows' paces look alike."""


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """Static settings of ``budget="auto"`` (hashable).

    Attributes:
      budgets: the budget set, ascending, starting at 0 (``config.auto_budget_set``).
      draft_len: L, the drafter's block depth (a path holds at most L drafted tokens).
      probe_every: rounds at budget 0 after which one dispatch drafts again, >= 1.
    """

    budgets: tuple[int, ...]
    draft_len: int
    probe_every: int

    def __post_init__(self):
        b = self.budgets
        if not (b and b[0] == 0 and all(x < y for x, y in zip(b, b[1:], strict=False))):
            raise ValueError(f"AutoPlan.budgets must be ascending and start at 0, got {b!r}")

    @functools.cached_property
    def caps(self) -> np.ndarray:
        """f64 ``[K]``: the most drafted tokens a round at each budget can commit, ``min(b, L)``
        (read-only)."""
        caps = np.minimum(np.asarray(self.budgets, np.float64), self.draft_len)
        caps.setflags(write=False)
        return caps


def expected_tokens(tree: DraftTree, budgets: tuple[int, ...]) -> jax.Array:
    """f32 ``[B, K]``: each row's expected committed tokens (bonus included) of the tree's prefix
    of ``budgets[k]`` nodes: ``1 + sum_{i=1..b} exp(score_i)`` over valid nodes. ``tree`` is a
    best-first tree with at least ``max(budgets) + 1`` slots."""
    mass = jnp.where(tree.valid[:, 1:], jnp.exp(tree.score[:, 1:]), 0.0)
    prefix = jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=1)], axis=1)
    return 1.0 + prefix[:, jnp.asarray(budgets)]


def restart_price(measured: float | None, observed: float | None) -> float | None:
    """The price of a pipeline restart that ``probe_alone`` compares: ``observed`` (seconds from
    an earlier first probe alone's launch to the launch end of the dispatch after it, less the
    probe round's table cost: what running alone cost, the host's choice and launch of the next
    dispatch included) where known, else ``MEASURED_RESTART`` times ``measured``
    (``auto_costs.measure_restart``); ``None`` where neither is known."""
    if observed is not None:
        return observed
    return None if measured is None else MEASURED_RESTART * measured


def probe_alone(restart: float | None, plain: float, rounds: int) -> bool:
    """Whether a pipelined caller runs its first probe (no drafted round read back yet) as a
    dispatch of its one round, read back before the next choice, rather than as the first round
    of a full dispatch of ``rounds`` followed by one chosen before it is read (alone, the probe
    verifies the largest budget at the drafter's whole depth: its round says what every smaller
    budget would have committed, so the choice after it knows every budget's tokens, where a
    probe at a smaller budget leaves the larger ones that budget's calibration): where the
    restart's price (``restart``: ``restart_price``; ``None``: unknown, never) is at most
    ``RESTART_SHARE`` of the dispatch's rounds at budget 0 (``plain`` each). Alone, the probe saves
    up to ``2 rounds - 1`` plain rounds where drafting pays and costs the restart where it does
    not."""
    return restart is not None and restart <= RESTART_SHARE * rounds * plain


def choose_budget(expected, costs) -> int:
    """Index ``k`` of the budget with the most expected tokens per unit cost: argmax of
    ``expected[k] / costs[k]`` (``expected``: the batch's expected committed tokens at each
    budget ``[K]``; ``costs``: a round's cost at each budget ``[K]``, > 0); the first on ties."""
    return int(np.argmax(np.asarray(expected, np.float64) / np.asarray(costs, np.float64)))


def finish_budget(remaining, expected, costs, variance=None, uncertainty=None) -> int:
    """Index ``k`` of the budget that ends a static batch soonest if every later round used it:
    argmin of ``finish_times`` (same arguments); the first on ties."""
    return int(np.argmin(finish_times(remaining, expected, costs, variance, uncertainty)))


def finish_times(remaining, expected, costs, variance=None, uncertainty=None, every: bool = False,
                 known=None) -> np.ndarray:
    """f64 ``[K]``: the time until a static batch ends if every later round used each budget,
    ``costs[k] * batch_rounds(...)[k]`` (``remaining``: ``[R]`` tokens each running row may still
    commit, > 0; ``expected``: ``[R, K]`` each row's expected committed tokens per round at each
    budget, >= 1; ``variance``: ``[R, K]`` the variance of a round's committed tokens, None for
    none; ``uncertainty``: ``[R, K]`` the variance of the estimate ``expected`` itself, None for
    none; ``costs``: ``[K]``, > 0). Without variance (budget 0 commits exactly one token a round)
    a budget's rounds are ``max_i remaining[i] / expected[i, k]``, a lower bound with it (Wald: a
    row's expected rounds times its mean tokens is at least what it commits), and no estimate is
    taken below it. A budget whose bound is no better than a budget without variance cannot win
    and is not estimated further (``inf``) unless ``every``. ``known``: ``[K]`` this function's
    result for the same arguments without ``every``, whose finite entries are kept (only the
    others are estimated)."""
    costs = np.asarray(costs, np.float64)
    bound = costs * (np.asarray(remaining, np.float64)[:, None] / np.asarray(expected, np.float64)).max(axis=0)
    if variance is None:
        return bound
    random = (np.asarray(variance) > 0).any(axis=0)
    todo = random & ((bound < bound[~random].min(initial=np.inf)) | every)
    times = np.where(random, np.inf, bound)
    if known is not None:
        done = np.isfinite(known)
        todo &= ~done
        times[done] = np.asarray(known)[done]
    if todo.any():
        times[todo] = np.maximum(bound[todo], costs[todo] * batch_rounds(
            remaining, np.asarray(expected)[:, todo], np.asarray(variance)[:, todo],
            None if uncertainty is None else np.asarray(uncertainty)[:, todo]))
    return times


def batch_rounds(remaining, expected, variance, uncertainty=None) -> np.ndarray:
    """f64 ``[K]``: the expected rounds until the last of ``R`` rows has committed its
    ``remaining`` ``[R]`` tokens, each round committing a random number of tokens of mean
    ``expected`` and variance ``variance`` (``[R, K]``; independent rounds and rows). A row's
    rounds are taken normal with the renewal moments: mean ``(r + o) / m`` (``o = (v + m^2 - m) /
    2m``, the last round's expected overshoot, for whole tokens) and variance ``r v / m^3``, plus
    ``(r / m^2)^2 u`` where the mean itself is an estimate of variance ``uncertainty`` ``u``
    (``[R, K]``, None: exact; to first order in ``u``); the batch's is the expected max over its
    rows (``expected_max``): the batch waits for the unluckiest of its rows, and at the same mean
    a budget with more variance, or whose rows' paces are known less well, ends it later. No row
    needs more than ``r`` rounds (a round commits at least one token)."""
    r = np.asarray(remaining, np.float64)[:, None]
    m = np.asarray(expected, np.float64)
    v = np.maximum(np.asarray(variance, np.float64), 0.0)
    spread = r * v / m**3
    if uncertainty is not None:
        spread = spread + (r / m**2) ** 2 * np.maximum(np.asarray(uncertainty, np.float64), 0.0)
    return expected_max((r + (v + m * m - m) / (2 * m)) / m, np.sqrt(spread), cap=r[:, 0])


GRID = 65
"""``expected_max``: points of the integration grid (its error is under a hundredth of the spread)."""


def expected_max(mean, sd, cap=None) -> np.ndarray:
    """f64 ``[K]``: ``E[max_i min(X_ik, cap[i])]`` of independent normals ``X_ik ~ N(mean[i, k],
    sd[i, k]^2)`` (``[R, K]``, R >= 1; ``sd`` >= 0, 0: the value itself; ``cap`` ``[R]`` >= the
    means, None: none), per column: the integral of ``P(max > x) = 1 - prod_i P(min(X_i, cap_i) <=
    x)`` over ``x`` from a point below which the max is almost surely above (the largest ``mean -
    8 sd``) to one above which it is almost surely below (the largest ``mean + 8 sd``, or cap), by
    the trapezoid rule on ``GRID`` points; for one row (batch 1), ``E[min(X, cap)]`` in closed
    form."""
    mean, sd = np.asarray(mean, np.float64), np.asarray(sd, np.float64)
    if mean.shape[0] == 1:
        return _expected_min(mean[0], sd[0], np.inf if cap is None else float(np.asarray(cap).reshape(-1)[0]))
    lo, hi = (mean - 8 * sd).max(axis=0), (mean + 8 * sd).max(axis=0)
    if cap is not None:
        cap = np.asarray(cap, np.float64)[:, None]
        lo, hi = np.minimum(lo, cap.max()), np.minimum(hi, cap.max())
    # A row almost surely below every column's range (P(X <= lo) >= Phi(8)) changes no product
    near = ((mean + 8 * sd) >= lo).any(axis=1)
    mean, sd = mean[near], sd[near]
    if cap is not None:
        cap = cap[near]
    t = np.linspace(0.0, 1.0, GRID)
    x = lo + (hi - lo) * t[:, None]  # [G, K]
    z = (x[:, None, :] - mean) / np.where(sd > 0, sd, 1.0)  # [G, R, K]
    # P(X_i <= x), multiplied over the rows (a product that underflows is a max almost surely above x)
    below = np.where(sd > 0, ndtr(z), np.where(z >= 0, 1.0, 0.0))
    if cap is not None:
        below = np.where(x[:, None, :] >= cap, 1.0, below)
    return lo + (hi - lo) * np.trapezoid(1.0 - below.prod(axis=1), t, axis=0)


def _expected_min(mean: np.ndarray, sd: np.ndarray, cap: float) -> np.ndarray:
    """f64 ``[K]``: ``E[min(X_k, cap)]``, ``X_k ~ N(mean[k], sd[k]^2)`` (``sd`` >= 0): ``m Phi(z) -
    s phi(z) + cap (1 - Phi(z))`` with ``z = (cap - m) / s``; ``m`` without a cap, ``min(m, cap)``
    without spread."""
    if not np.isfinite(cap):
        return mean.copy()
    spread = sd > 0
    z = (cap - mean) / np.where(spread, sd, 1.0)
    below = ndtr(z)
    value = mean * below - sd * np.exp(-0.5 * z * z) / np.sqrt(2.0 * np.pi) + cap * (1.0 - below)
    return np.where(spread, value, np.minimum(mean, cap))


@functools.cache
def _chain_moments(cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean and variance of ``A``, ``P(A >= d) = a^d`` for ``d = 1..cap``, over a grid of ``a``
    in [0, 1] (both increasing from 0 at ``a = 0``; the mean to ``cap``, the variance back to 0)."""
    a = np.linspace(0.0, 1.0, 1025)[:, None]
    d = np.arange(1, cap + 1)
    tail = a**d  # [G, cap]
    mean = tail.sum(axis=1)
    return mean, (tail * (2 * d - 1)).sum(axis=1) - mean**2  # E[A^2] = sum_d (2d - 1) P(A >= d)


def round_variance(expected, caps) -> np.ndarray:
    """f64, ``expected``'s shape ``[..., K]``: the variance of a round's committed tokens for
    expected committed tokens ``expected`` (>= 1) at budgets whose rounds commit at most ``caps``
    ``[K]`` drafted tokens: that of a path accepted depth by depth with one probability per depth,
    ``P(A >= d) = a^d`` up to the cap, ``a`` set by the mean (the draft's acceptance falls with
    depth about geometrically; the tree's siblings only raise each depth's probability). 0 at a
    cap of 0 (budget 0: exactly one token)."""
    drafted = np.asarray(expected, np.float64) - 1.0
    out = np.zeros(drafted.shape)
    for k, cap in enumerate(np.asarray(caps).astype(int).tolist()):
        if cap > 0:
            mean, var = _chain_moments(cap)
            out[..., k] = np.interp(np.clip(drafted[..., k], 0.0, cap), mean, var)
    return out


def calibrated(expected, factor, caps) -> np.ndarray:
    """Expected committed tokens with the drafted part scaled by ``factor`` and capped at
    ``caps`` drafted tokens: ``1 + min(factor * (expected - 1), caps)`` (broadcasting)."""
    return 1.0 + np.minimum(factor * (np.asarray(expected, np.float64) - 1.0), caps)


class RunCosts:
    """Seconds per round at each budget as a run pays them, for one compiled batch shape.

    ``table``: the cost table's seconds per round (the prior, > 0). ``observe`` adds a timed
    dispatch (its wall time per round, from its launch to its results on the host, and for the
    engine the host's work between dispatches) as the ratio of that time to the budget's table
    cost (capped at ``STALL`` times the budget's current ratio). A budget's cost is its table cost
    times a ratio: the median of its own latest ``WINDOW`` ratios once it has ``OWN_SAMPLES``
    of them; before that (an untimed budget too) the median of the latest ``WINDOW`` ratios of
    all budgets; 1 before any dispatch is timed. Timing noise only adds time, so a lone slow
    dispatch must not set a budget's cost: the choice would never run that budget again to correct
    it (on the H200 one budget-0 dispatch at 1.7 times its table cost kept a run off budget 0).
    The pooled ratio carries the host's share of a round, which the table leaves out, to the
    budgets not timed yet. For the report (``summary``) it also keeps, per budget, the timed
    dispatches' count, least and most seconds per round and the latest ``PAID_WINDOW`` of them
    (bounded: the engine's chooser lives as long as the engine)."""

    def __init__(self, table):
        self.table = np.asarray(table, np.float64)
        if self.table.ndim != 1 or not (np.isfinite(self.table) & (self.table > 0)).all():
            raise ValueError(f"RunCosts: the cost table must be positive seconds per round, got {table!r}")
        self.own = [collections.deque(maxlen=WINDOW) for _ in self.table]
        self.recent = collections.deque(maxlen=WINDOW)
        self.timed = np.zeros(self.table.shape, np.int64)
        self.low = np.full(self.table.shape, np.inf)
        self.high = np.zeros(self.table.shape)
        self.paid = [collections.deque(maxlen=PAID_WINDOW) for _ in self.table]
        self.probes: collections.deque = collections.deque(maxlen=WINDOW)  # (observe_probe's prices)
        self._current: np.ndarray | None = None  # (current(), until the next observe)

    def ratio(self, k: int) -> float:
        """Budget index ``k``'s paid / table cost ratio (class docstring)."""
        # (statistics.median: the same value as numpy's, at a fraction of its cost on a few samples)
        if len(self.own[k]) >= OWN_SAMPLES:
            return statistics.median(self.own[k])
        return statistics.median(self.recent) if self.recent else 1.0

    def observe(self, k: int, seconds_per_round: float) -> None:
        """Adds a timed dispatch at budget index ``k``; non-positive or non-finite times are ignored."""
        s = float(seconds_per_round)
        if not (np.isfinite(s) and s > 0):
            return
        r = min(s / self.table[k], STALL * self.ratio(k))
        self.own[k].append(r)
        self.recent.append(r)
        self.timed[k] += 1
        self.low[k], self.high[k] = min(self.low[k], s), max(self.high[k], s)
        self.paid[k].append(s)
        self._current = None

    def observe_probe(self, rounds: int, seconds: float) -> None:
        """Adds a timed probing dispatch of ``rounds`` rounds (one drafted, the rest at budget 0;
        its wall time as ``observe``'s) as its price: the seconds beyond as many rounds at budget
        0's current cost, at most ``STALL`` times those (one stall must not stop probing for
        good); non-positive or non-finite times are ignored."""
        s, plain = float(seconds), rounds * float(self.current()[0])
        if np.isfinite(s) and s > 0:
            self.probes.append(min(s - plain, STALL * plain))

    def probe_price(self) -> float | None:
        """Seconds a probing dispatch costs beyond as many plain rounds: the median of the latest
        ``WINDOW`` timed ones' prices (``observe_probe``; at least 0); None before one is timed."""
        return max(statistics.median(self.probes), 0.0) if self.probes else None

    def current(self) -> np.ndarray:
        """f64 ``[K]``: the seconds per round the choice uses now (a copy)."""
        if self._current is None:
            self._current = self.table * np.array([self.ratio(k) for k in range(len(self.table))])
        return self._current.copy()

    def summary(self) -> tuple[tuple[int, float, float, float], ...]:
        """Per budget: ``(timed dispatches, min, median, max seconds per round)`` as observed, the
        median over the latest ``PAID_WINDOW`` (zeros where none was timed)."""
        return tuple((int(n), float(lo), float(np.median(p)), float(hi)) if n else (0, 0.0, 0.0, 0.0)
                     for n, lo, hi, p in zip(self.timed, self.low, self.high, self.paid, strict=True))


class AutoChooser:
    """The host's statistics of ``budget="auto"`` and its choice (module docstring).

    Attributes:
      expected_ema: f64 ``[K]`` moving average over drafted rounds of the running rows' mean
        expected tokens at each budget (uncalibrated), over the rounds that verified it or a
        larger one (before any did, over all: their lower bounds); ones before any drafted round.
      verified_at: f64 ``[K]`` the drafted rounds counted when a dispatch verifying each budget (or
        a larger one) was last chosen or recorded (``-inf``: never), for refreshes.
      accepted_ema, predicted_ema: f64 ``[K]`` moving averages, per budget, of the running rows'
        mean realized and expected drafted tokens at that budget, over the drafted rounds that
        verified it or a larger one (a round's tokens at a smaller budget are known exactly,
        ``decode_round.realized_tokens``); ``calibrated_by``: ``[K]`` those rounds' running rows'
        rounds (``factor``'s weight; 0: the budget is not calibrated yet).
      skipped: rounds at budget 0 since the last drafted dispatch or probe chosen (starts at
        ``probe_every``: the first dispatch probes).
      interval: the rounds at budget 0 after which a dispatch probes.
      drafted: drafted rounds so far.
      rounds: ``[K]`` rounds run at each budget (rounds with a running row).
      expected: f64 ``[K]`` the running rows' expected tokens summed over those rounds
        (uncalibrated; exactly one per row at budget 0).
      realized: f64 ``[K]`` the running rows' accepted tokens (bonus included) over those rounds.
      probing: whether the last ``choose`` gave a probe (``generate`` runs one drafted round, then
        plain ones: ``auto_round.run_probe_rounds``).
      run_costs: ``{batch shape: RunCosts}``, the costs the run has paid (``costs``, ``observe``).
      row_expected: f64 ``[rows, K]``, by row id, each row's moving average over its drafted
        rounds of its expected tokens at each budget (uncalibrated; meaningless while the row's
        ``row_rounds`` is 0), for ``finish_budget`` (``record``'s ``rows``); row_rounds: f64
        ``[rows]`` those rounds; row_drafted: f64 ``[rows, K, 2]``, the same rows' moving averages
        of their realized and of their expected drafted tokens per round at each budget, over
        ``row_calibrated_by`` ``[rows, K]`` rounds (each row's own calibration factors, shrunk
        toward the batch's by ``PRIOR_ROUNDS``).
      learn_costs: whether ``observe`` corrects the cost table (False: the table's costs are
        used as given, as with ``DecodeConfig.auto_costs``).
      sequence: the latest ``SEQUENCE`` recorded dispatches with a running row, oldest first, as
        ``(budget, rounds)`` (a probing dispatch of ``generate``: its drafted round, then its plain
        ones).
    """

    def __init__(self, plan: AutoPlan, learn_costs: bool = True):
        K = len(plan.budgets)
        self.plan = plan
        self.expected_ema = np.ones(K)
        self.accepted_ema, self.predicted_ema, self.calibrated_by = np.zeros(K), np.zeros(K), np.zeros(K)
        self.skipped = self.interval = plan.probe_every
        self.drafted = 0
        self.verified_at = np.full(K, -np.inf)
        self.probing = False
        self.rounds = np.zeros(K, np.int64)
        self.expected = np.zeros(K)
        self.realized = np.zeros(K)
        self.run_costs: dict[int, RunCosts] = {}
        self.row_expected = np.zeros((0, K))
        self.row_rounds = np.zeros(0)
        self.row_drafted = np.zeros((0, K, 2))
        self.row_calibrated_by = np.zeros((0, K))
        self.row_sums = np.zeros((0, K, 3))
        self.learn_costs = learn_costs
        self.sequence: collections.deque = collections.deque(maxlen=SEQUENCE)
        self._finish = None  # the last choice's `finish`
        self._backoff_due = False  # a drafted dispatch recorded since the last choice
        self._rows_cache = None  # `_paces`' rows' part: ((drafted, row ids), expected, variance, uncertainty)
        self._stats_cache = None  # `_batch_stats`: (the averages' key, factor, pace, pace error, known by)

    def costs(self, shape: int, table) -> np.ndarray:
        """The seconds per round at each budget for the compiled batch shape ``shape`` (its rows):
        ``table`` (the cost table's) corrected by the dispatches timed at that shape
        (``RunCosts``). What ``choose`` and ``record`` take as ``costs``."""
        if shape not in self.run_costs:
            self.run_costs[shape] = RunCosts(table)
        return self.run_costs[shape].current()

    def observe(self, shape: int, k: int, seconds_per_round: float) -> None:
        """Adds the wall time per round of a dispatch at budget index ``k`` and batch shape
        ``shape`` (after ``costs`` gave that shape's costs); nothing without ``learn_costs``."""
        if self.learn_costs:
            self.run_costs[shape].observe(k, seconds_per_round)

    def observe_probe(self, shape: int, rounds: int, seconds: float) -> None:
        """Adds the wall time of a probing dispatch of ``rounds`` rounds at batch shape ``shape``
        (``RunCosts.observe_probe``); nothing without ``learn_costs``."""
        if self.learn_costs:
            self.run_costs[shape].observe_probe(rounds, seconds)

    def probe_price(self, shape: int) -> float | None:
        """The seconds a probing dispatch at batch shape ``shape`` costs beyond as many plain rounds
        (``RunCosts.probe_price``; None: not timed yet), for ``choose``."""
        return self.run_costs[shape].probe_price()

    def factor(self) -> np.ndarray:
        """f64 ``[K]``: per budget, the realized drafted tokens per expected drafted token (moving
        averages), shrunk toward 1 (the draft's own probabilities) by the row-rounds behind it:
        weight ``n / (n + PRIOR_ROUNDS)`` after ``n`` (``calibrated_by``; one round of one row is
        0 or a few tokens, a round of 64 rows is known); a budget no drafted round verified (nor a
        larger one) takes the factor of the largest budget below it that one did, 1 before any
        (``carried_up``)."""
        return self._batch_stats()[0].copy()

    def _batch_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(factor, pace, pace error, known by)``, each f64 ``[K]`` (``factor``, the batch's
        calibrated expected tokens ``calibrated(expected_ema, factor, caps)``, ``pace_error`` at
        that pace, ``_known_by``), computed once per state of the batch's averages: between two
        drafted dispatches' records every choice reads the same ones (a choice at 64 rows costs
        about a millisecond of the host's time where it starts on cold caches)."""
        key = (self.drafted, self.expected_ema.tobytes(), self.accepted_ema.tobytes(),
               self.predicted_ema.tobytes(), self.calibrated_by.tobytes())
        if self._stats_cache is None or self._stats_cache[0] != key:
            seen = (self.calibrated_by > 0) & (self.predicted_ema > 0)
            ratio = np.divide(self.accepted_ema, self.predicted_ema, out=np.ones_like(self.accepted_ema), where=seen)
            w = self.calibrated_by / (self.calibrated_by + PRIOR_ROUNDS)
            factor = carried_up(w * ratio + (1.0 - w), seen)
            caps = self.plan.caps
            pace = calibrated(self.expected_ema, factor, caps)
            known = carried_up(self.calibrated_by, self.calibrated_by > 0) * (self.calibrated_by.max() > 0)
            error = np.sqrt(round_variance(pace, caps) / (known + PRIOR_ROUNDS))
            self._stats_cache = (key, factor, pace, error, known)
        return self._stats_cache[1:]

    def _row_factors(self, ids, known, prior=PRIOR_ROUNDS) -> np.ndarray:
        """f64 ``[R, K]``: rows ``ids``' own calibration factors per budget (``known [R]``: rows
        with drafted rounds), each with ``prior`` rounds (a scalar or ``[K]``) of the batch's."""
        K = len(self.plan.budgets)
        n, drafted = np.zeros((len(ids), K)), np.zeros((len(ids), K, 2))
        n[known], drafted[known] = self.row_calibrated_by[ids[known]], self.row_drafted[ids[known]]
        batch = self.factor()
        prior = prior * self.predicted_ema
        with np.errstate(invalid="ignore", divide="ignore"):
            own = (n * drafted[..., 0] + prior * batch) / (n * drafted[..., 1] + prior)
        return carried_up(np.where(np.isfinite(own) & (prior > 0), own, batch), self.calibrated_by > 0)

    def pace_error(self, pace=None) -> np.ndarray:
        """f64 ``[K]``: the standard error of a round's calibrated tokens at each budget as the
        batch's drafted rounds know them, ``sqrt(v / n)``: ``v`` the variance of a round's tokens
        at the batch's calibrated pace (``round_variance``), ``n`` the row-rounds behind the
        budget's factor (``calibrated_by``, carried up to budgets no round verified) and
        ``PRIOR_ROUNDS``; 0 at budget 0. ``pace``: that pace, computed if None."""
        if pace is None:
            return self._batch_stats()[2].copy()
        return np.sqrt(round_variance(pace, self.plan.caps) / (self._known_by() + PRIOR_ROUNDS))

    def _known_by(self) -> np.ndarray:
        """f64 ``[K]``: the row-rounds behind each budget's factor, carried up (0 before any)."""
        return self._batch_stats()[3]

    def explore_value(self, active: int, costs, finish=None, scores=None, paces=None) -> np.ndarray:
        """f64 ``[K]``: per budget, what a dispatch of drafted rounds there is worth now, in plain
        rounds, where the rule would run plain ones: the expected saving what its rounds teach
        buys (the knowledge gradient), less what they lose to plain rounds.

        The rule's time ratio ``r`` of budget ``b`` to budget 0 (the time to the batch's end, or
        per token without ``finish``; ``scores``: ``_scores``' for these arguments, ``paces``:
        ``_paces(finish)``, computed if None) is known to about ``s``, its change when the rows'
        paces rise by one ``pace_error`` (with ``finish``: the relative change of the rows'
        rounds-by-means bound, ``finish_times``, which scales as the estimate does). The
        dispatch's ``R = min(probe_every, H)`` rounds add ``m = active * R`` row-rounds to the
        ``n`` behind the estimate, which moves the ratio by about ``s_m = s sqrt(m / (n + m))``;
        the better choice after it saves ``max(0, 1 - ratio)`` of the ``H`` plain rounds left
        (``finish``: the most tokens a row may still commit; else the rounds until the next probe
        after a back-off, ``2 * interval``), in expectation ``H (s_m phi(d) - (r - 1) Q(d))``, ``d =
        (r - 1) / s_m``. Its rounds cost ``R (costs[b] / costs[0]) (1 - 1 / r)`` plain rounds (a
        round at ``b`` does the work of ``costs[b] / (r costs[0])`` plain ones: without
        ``finish``, its calibrated tokens). A budget the rule did not estimate (``inf``: its bound
        cannot beat budget 0) is valued at its bound first, the most it can be worth, and
        estimated only where that is positive. ``-inf`` at budget 0."""
        costs = np.asarray(costs, np.float64)
        caps = self.plan.caps
        _, pace, error, known_by = self._batch_stats()
        if finish is None:
            times, lifted = costs / pace, costs / np.minimum(pace + error, 1.0 + caps)  # (per token)
            horizon = 2.0 * self.interval
        else:
            paces = self._paces(finish) if paces is None else paces
            if scores is None:
                scores = self._scores(active, costs, finish, every=True, paces=paces)
            remaining, expected = paces[:2]
            r = np.asarray(remaining, np.float64)[:, None]
            slowest = (r / expected).max(axis=0)  # (the rounds-by-means bound, over the costs)
            times = np.where(np.isfinite(scores), scores, costs * slowest)
            lifted = times * (r / np.minimum(expected + error, 1.0 + caps)).max(axis=0) / slowest
            horizon = float(r.max())
        ratio, s = times / times[0], np.maximum((times - lifted) / times[0], 1e-12)
        rounds = min(float(self.plan.probe_every), horizon)
        m = active * rounds
        sm = s * np.sqrt(m / (known_by + PRIOR_ROUNDS + m))
        d = (ratio - 1.0) / sm
        saved = sm * np.exp(-0.5 * d * d) / np.sqrt(2.0 * np.pi) - (ratio - 1.0) * ndtr(-d)
        loss = costs / costs[0] * (1.0 - 1.0 / ratio)  # (a round's share of the batch's work: ratio / costs[b])
        value = horizon * saved - rounds * np.maximum(loss, 0.0)
        value[0] = -np.inf
        if finish is not None and (~np.isfinite(scores[1:]) & (value[1:] > 0)).any():
            every = self._scores(active, costs, finish, True, paces, known=scores)
            return self.explore_value(active, costs, finish, every, paces)
        return value

    def _paces(self, finish) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For a static batch's running rows ``finish`` (``choose``): ``(remaining [R], expected
        [R, K], variance [R, K], uncertainty [R, K])``, the tokens each may still commit, its
        calibrated expected tokens per round at each budget, the variance of a round's tokens
        there (``round_variance``) and that of the estimate ``expected`` (the variance over the
        rounds it is known as well as; module docstring)."""
        ids, remaining = (np.asarray(x) for x in finish)
        # (the rows' part changes only with a drafted dispatch's record: a choice between plain
        # dispatches reuses it)
        key = (self.drafted, ids.tobytes())
        if self._rows_cache is None or self._rows_cache[0] != key:
            expected, behind = self._row_paces(ids)
            variance = round_variance(expected, self.plan.caps)
            self._rows_cache = (key, expected, variance, variance / behind)
        return (remaining, *self._rows_cache[1:])

    def _row_paces(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """``_paces``' ``(expected [R, K], behind [R, 1])`` for the rows ``ids``."""
        own = np.zeros((len(ids), len(self.plan.budgets)))
        n = np.zeros((len(ids), 1))
        known = ids < len(self.row_expected)
        own[known], n[known, 0] = self.row_expected[ids[known]], self.row_rounds[ids[known]]
        prior = self.prior_rounds(ids)
        w = n / (n + prior)  # (0 for a row not drafted yet)
        rows = w * own + (1.0 - w) * self.expected_ema
        # Each row's own realized / expected drafted tokens, with `prior` rounds of the batch's
        # (the rows the batch waits for are those whose drafts are accepted least, not predicted least)
        expected = calibrated(rows, self._row_factors(ids, known, prior), self.plan.caps)
        # A row's mean is its own n rounds' with `prior` rounds of the batch's: known as well as
        # n + prior rounds' mean (the batch's rows may differ: a row seen in few drafted rounds may
        # be the slow one)
        return expected, n + prior

    def _scores(self, active: int, costs, finish=None, every: bool = False, paces=None, known=None) -> np.ndarray:
        """f64 ``[K]``, lower is better: the rule's score of each budget (module docstring): minus
        the batch's calibrated expected tokens per second, or with ``finish`` the time until the
        static batch ends (``finish_times``; ``every``: every budget estimated, for a probe's
        choice among the positive ones; else those that cannot beat budget 0 are ``inf``;
        ``paces``: ``_paces(finish)``, computed if None; ``known``: the scores without ``every``,
        whose finite entries are kept)."""
        if finish is None:
            return -(active * self._batch_stats()[1]) / costs
        remaining, expected, variance, uncertainty = self._paces(finish) if paces is None else paces
        return finish_times(remaining, expected, costs, variance, uncertainty, every, known)

    def prior_rounds(self, ids) -> np.ndarray:
        """f64 ``[K]``: per budget, the rounds of the batch's average a row's own average is mixed
        with (``_scores``): the spread of the paces of the running rows ``ids``, measured, as the
        empirical-Bayes prior's weight ``v / tau^2`` (``v``: the variance of a round's committed
        tokens within a row, pooled over the rows' drafted dispatches at that budget; ``tau^2``:
        the variance of the rows' true paces, their observed paces' variance less what ``v``
        explains; bounded to [1, ``MAX_PRIOR_ROUNDS``]) once ``SPREAD_ROWS`` rows have drafted
        rounds there, else ``PRIOR_ROUNDS``. Until their dispatches there give ``SPREAD_ROWS``
        degrees of freedom within rows (a second dispatch per row), ``v`` is the law the rule takes
        for a round's tokens (``round_variance`` at each row's pace), so the first probe's round
        already tells rows that differ from rows that only drew differently."""
        K = len(self.plan.budgets)
        out = np.full(K, PRIOR_ROUNDS)
        ids = np.asarray(ids)
        ids = ids[(ids >= 0) & (ids < len(self.row_sums))]
        if len(ids) < SPREAD_ROWS:  # (every choice runs this: nothing to measure, nothing computed)
            return out
        n, sums = self.row_calibrated_by[ids], self.row_sums[ids]
        for k in range(1, K):
            seen = n[:, k] > 0
            if seen.sum() < SPREAD_ROWS:
                continue
            m, (y, q, d) = n[seen, k], sums[seen, k].T
            df = float((d - 1).sum())
            # (before a second dispatch per row: the law round_variance takes for the rows' paces)
            within = (float((q - y * y / m).sum()) / df if df >= SPREAD_ROWS
                      else round_variance((y / m)[:, None], self.plan.caps[k : k + 1])[:, 0])
            v = max(float(np.mean(within)), 0.0)  # (0: rounds without luck, a row's own average is its pace)
            between = float(np.var(y / m, ddof=1) - np.mean(within / m))
            out[k] = np.clip(v / max(between, v / MAX_PRIOR_ROUNDS, 1e-12), 1.0, MAX_PRIOR_ROUNDS)
        return out

    def _rule(self, active: int, costs, finish=None) -> int:
        """The rule's budget index (module docstring): the argmin of ``_scores``, as ``choose``
        takes it."""
        return int(np.argmin(self._scores(active, np.asarray(costs, np.float64), finish)))

    def choose(self, active: int, costs, finish=None, probe_price: float | None = None) -> int:
        """The index of the budget of the next dispatch for ``active`` running rows and ``costs``
        (a round's cost at each budget): the prior's largest budget before any drafted round is
        recorded where it pays (``FIRST_DRAFT_TOKENS``), else the rule on the averages (where it
        chooses a budget below the largest whose next budget up was last verified
        ``REFRESH_ROUNDS`` drafted rounds ago or never, that next budget: a refresh); where the
        rule chooses budget 0, a drafted dispatch where its rounds would teach more than they cost
        (``explore_value``), else a probe at the best positive budget by the same rule once
        ``interval`` rounds in a row ran at budget 0 (the first dispatch where the prior does not
        pay) and, where ``probe_price`` is given (seconds a probing dispatch costs beyond as many
        plain rounds, as measured), once the plain rounds since the last drafted dispatch cost
        ``1 / PROBE_SHARE`` times it. ``finish``: for
        a static batch, ``(row ids, tokens each may still commit)`` of its running rows (``[R]``
        each, R >= 1): the rule is then ``finish_budget`` on the rows' own averages (module
        docstring). The rule's scores are computed once: where a probe may be due, for every
        budget (the probe's choice among the positive ones)."""
        costs = np.asarray(costs, np.float64)
        self._finish = finish
        top = len(self.plan.budgets) - 1
        if self.drafted == 0 and costs[top] <= FIRST_DRAFT_TOKENS * costs[0]:
            self.probing = False  # (the prior: drafting pays until a drafted round is read back)
            return top
        # (the back-off below only lengthens the interval where the choice is budget 0)
        paces = None if finish is None else self._paces(finish)
        scores = self._scores(active, costs, finish, every=self._probe_due(costs, probe_price), paces=paces)
        k = int(np.argmin(scores))
        if 0 < k < top and self.drafted - self.verified_at[k + 1] >= REFRESH_ROUNDS:
            k += 1  # a refresh of the next budget up
        if k == 0 and self.drafted > 0:  # would drafted rounds teach enough to pay for themselves?
            value = self.explore_value(active, costs, finish, scores, paces)
            if value.max() > 0:
                k = int(np.argmax(value))
        if self._backoff_due:  # a drafted dispatch was recorded: do its statistics choose a tree?
            self._backoff_due = False
            self.interval = self.plan.probe_every if k > 0 else min(2 * self.interval,
                                                                    MAX_BACKOFF * self.plan.probe_every)
        self.probing = k == 0 and self._probe_due(costs, probe_price)
        if self.probing:  # (counted from here: a pipelined caller chooses again before recording it)
            self.skipped = 0
            # the first probe verifies the largest budget: its round tells every budget's expected
            # tokens exactly (a smaller tree's only bounds the larger ones from below)
            k = top if self.drafted == 0 else 1 + int(np.argmin(scores[1:]))
        if k > 0:  # (counted from here, as the probe's)
            self.verified_at[: k + 1] = self.drafted
        return k

    def _probe_due(self, costs, probe_price) -> bool:
        """Whether a probe is due (``choose``): ``interval`` rounds at budget 0 and, with a measured
        ``probe_price``, plain rounds that cost ``1 / PROBE_SHARE`` times it."""
        return self.skipped >= self.interval and (
            probe_price is None or PROBE_SHARE * self.skipped * costs[0] >= probe_price)

    def record(self, k: int, tally, rows=None) -> np.ndarray:
        """Adds a dispatch at budget index ``k`` from its rows' ``tally`` ``[B, 2 + 2K]``
        (``auto_round.tally``: rounds run, tokens accepted, expected tokens at each budget, tokens
        realized at each budget; zero rows for rows that did not run); ``rows``: ``[B]`` the
        slots' row ids (negative: a free slot), to keep per-row averages (``row_expected``).
        Returns the dispatch's report increments f64 ``[3, K]``: rounds, expected and realized
        tokens per budget."""
        K = len(self.plan.budgets)
        tally = np.asarray(tally, np.float64)
        row_rounds, accepted = tally[:, 0].sum(), tally[:, 1].sum()
        curve, realized = tally[:, 2 : 2 + K].sum(axis=0), tally[:, 2 + K : 2 + 2 * K].sum(axis=0)
        rounds = int(tally[:, 0].max(initial=0))
        report = np.zeros((3, K))
        if rounds == 0:
            return report
        expected = curve[k] if k > 0 else row_rounds
        report[:, k] = rounds, expected, accepted
        self.sequence.append((self.plan.budgets[k], rounds))
        self.rounds[k] += rounds
        self.expected[k] += expected
        self.realized[k] += accepted
        if k == 0:
            self.skipped += rounds
            return report
        weight = 1.0 if self.drafted == 0 else 1.0 - (1.0 - DECAY) ** rounds
        mix = lambda old, new, w=weight: (1.0 - w) * old + w * new  # noqa: E731
        upto = np.arange(K) <= k
        # Expected tokens: exact up to the verified budget; past it lower bounds, kept only where
        # no round verified the budget yet
        exact = upto | (self.calibrated_by == 0)
        self.expected_ema = np.where(exact, mix(self.expected_ema, curve / row_rounds), self.expected_ema)
        # Every budget up to the verified one: what its rounds would have committed there
        fresh = np.where(self.calibrated_by > 0, 1.0 - (1.0 - DECAY) ** rounds, 1.0)[upto]
        self.accepted_ema[upto] = mix(self.accepted_ema[upto], (realized[upto] - row_rounds) / row_rounds, fresh)
        self.predicted_ema[upto] = mix(self.predicted_ema[upto], (curve[upto] - row_rounds) / row_rounds, fresh)
        self.calibrated_by[upto] += row_rounds
        self.drafted += rounds
        self.verified_at[upto] = self.drafted
        self.skipped = 0
        if rows is not None:
            self._record_rows(np.asarray(rows), tally, upto)
        self._backoff_due = True  # (the next choice's rule says whether the updated statistics pay)
        return report

    def _record_rows(self, rows, tally, upto) -> None:
        """``record``'s per-row averages for the slots' row ids ``rows``, budgets ``upto`` verified."""
        K = len(self.plan.budgets)
        slots = np.flatnonzero((rows >= 0) & (tally[:, 0] > 0))
        ids, n = rows[slots], tally[slots, :1]
        if ids.size and ids.max() >= len(self.row_expected):
            more = int(ids.max()) + 1 - len(self.row_expected)
            self.row_expected = np.concatenate([self.row_expected, np.zeros((more, K))])
            self.row_rounds = np.concatenate([self.row_rounds, np.zeros(more)])
            self.row_drafted = np.concatenate([self.row_drafted, np.zeros((more, K, 2))])
            self.row_calibrated_by = np.concatenate([self.row_calibrated_by, np.zeros((more, K))])
            self.row_sums = np.concatenate([self.row_sums, np.zeros((more, K, 3))])
        fresh = 1.0 - (1.0 - DECAY) ** n
        w = np.where(self.row_rounds[ids, None] > 0, fresh, 1.0)  # (1: its first)
        w = w * (upto[None, :] | (self.row_calibrated_by[ids] == 0))  # (past the verified budget: lower bounds)
        self.row_expected[ids] = (1.0 - w) * self.row_expected[ids] + w * tally[slots, 2 : 2 + K] / n
        self.row_rounds[ids] += n[:, 0]
        # realized and expected drafted tokens at each budget verified
        drafted = np.stack([tally[slots, 2 + K : 2 + 2 * K], tally[slots, 2 : 2 + K]], axis=-1) / n[..., None] - 1.0
        w = np.where(self.row_calibrated_by[ids] > 0, fresh, 1.0)[..., None] * upto[None, :, None]
        self.row_drafted[ids] = (1.0 - w) * self.row_drafted[ids] + w * drafted
        self.row_calibrated_by[ids] += n * upto
        realized = tally[slots, 2 + K : 2 + 2 * K]
        sums = np.stack([realized, realized**2 / n, np.ones_like(realized)], axis=-1)
        self.row_sums[ids] += sums * upto[None, :, None]


def carried_up(values, seen) -> np.ndarray:
    """``values`` ``[..., K]`` where ``seen [K]``, and elsewhere the value of the largest seen
    index below (1 where there is none)."""
    values = np.asarray(values, np.float64)
    at = np.maximum.accumulate(np.where(seen, np.arange(len(seen)), -1))
    return np.where(at >= 0, np.take(values, np.maximum(at, 0), axis=-1), 1.0)


@dataclasses.dataclass(frozen=True)
class AutoReport:
    """What ``budget="auto"`` chose.

    Attributes:
      budgets: the budget set.
      rounds: rounds run at each budget (the per-round budget histogram).
      expected: the running rows' expected committed tokens at each budget, summed over those
        rounds (the draft's path probabilities, uncalibrated; exactly one per row at budget 0).
      realized: the tokens the running rows accepted in those rounds (bonus included).
      drafted_rounds: rounds that ran the drafter (the rounds at positive budgets).
      costs: the cost table's round costs, one per budget, per batch size the rounds ran at.
      restarts: per batch size, the pipeline restart's price in seconds the run decided with
        (``restart_price``: observed by an earlier run, else from ``auto_costs.measure_restart``
        or ``DecodeConfig.auto_restart``; None: unknown); empty for the engine (its dispatches
        are read back one by one).
      run_costs: the costs the run paid and chose with at the end (``RunCosts.current``), per
        batch size.
      paid: per batch size, per budget, the timed dispatches' ``(count, min, median, max)``
        seconds per round as observed (``RunCosts.summary``).
      sequence: the dispatches in the order they ran, ``(budget, rounds)`` each (the latest
        ``SEQUENCE``; ``AutoChooser.sequence``).
      probe_prices: per batch size, the seconds a probing dispatch cost beyond as many plain
        rounds as the run measured them (``RunCosts.probe_price``; None: none timed).
    """

    budgets: tuple[int, ...]
    rounds: tuple[int, ...]
    drafted_rounds: int
    expected: tuple[float, ...]
    realized: tuple[float, ...]
    costs: dict[int, tuple[float, ...]]
    run_costs: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    paid: dict[int, tuple[tuple[int, float, float, float], ...]] = dataclasses.field(default_factory=dict)
    sequence: tuple[tuple[int, int], ...] = ()
    restarts: dict[int, float | None] = dataclasses.field(default_factory=dict)
    probe_prices: dict[int, float | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, chooser: AutoChooser, costs: dict[int, tuple[float, ...]],
           restarts: dict[int, float | None] | None = None) -> AutoReport:
        return cls(budgets=chooser.plan.budgets, rounds=tuple(int(x) for x in chooser.rounds),
                   drafted_rounds=int(chooser.drafted), expected=tuple(float(x) for x in chooser.expected),
                   realized=tuple(float(x) for x in chooser.realized), costs=dict(costs),
                   run_costs={n: tuple(float(x) for x in c.current()) for n, c in chooser.run_costs.items()},
                   paid={n: c.summary() for n, c in chooser.run_costs.items()},
                   sequence=tuple(chooser.sequence), restarts=dict(restarts or {}),
                   probe_prices={n: c.probe_price() for n, c in chooser.run_costs.items()})

    @property
    def histogram(self) -> dict[int, int]:
        """``{budget: rounds}``."""
        return dict(zip(self.budgets, self.rounds, strict=True))
