"""``budget="auto"``: the per-round choice of DDTree's budget, and the statistics it keeps.

A round of ``budget="auto"`` (``ddtree_jax.auto_round``) chooses one budget ``b`` out of the
static set ``AutoPlan.budgets`` (``config.auto_budget_set``: 0, powers of two, the maximum):

* **expected tokens**: a best-first tree holds its nodes in creation order, parents first, so the
  tree of budget ``b`` is the first ``b + 1`` slots of the tree of the largest budget
  (``DraftTree.prefix``). Its expected committed tokens per row are the bonus plus the sum of its
  nodes' path probabilities (``exp(score)``, the draft marginals the builder ranks by):
  ``expected_tokens`` reads them off one prefix sum, for every budget at once;
* **calibration**: the draft's probabilities are not the acceptance probabilities under each
  row's own sampling law (a greedy row accepts the draft's argmax more often than its
  probability says; a hot row less often). The batch's realized drafted tokens over its expected
  ones, both as moving averages over drafted rounds, scale the expected drafted tokens
  (``calibration``, ``calibrated``); the objective only needs the batch's sum, so one factor for
  the batch is what it needs;
* **the choice**: ``choose_budget``: the budget of the largest (expected tokens of the batch) /
  (cost of a round at that budget); ties go to the smaller budget;
* **the gate** (before drafting: budget 0 skips the drafter): ``should_draft`` applies the same
  choice to the moving average of the per-row expected tokens of recent drafted rounds; it drafts
  when that choice is a positive budget, or after ``AutoStats.interval`` rounds in a row without
  the drafter (a probe: without it the averages would never change again). The interval starts
  at ``AutoPlan.probe_every``, doubles (up to ``MAX_BACKOFF`` times that) after each drafted round
  whose own choice was budget 0, and falls back to ``probe_every`` after one that verified a tree,
  so probing costs little where drafting does not pay.

``AutoStats`` (a pytree carried by the compiled rounds next to the ``DecodeState``) holds the
averages and the report: rounds, expected and realized tokens per budget. ``AutoReport`` is its
host copy. Design note and derivation: docs/auto-budget.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.tree import DraftTree

__all__ = ["DECAY", "MAX_BACKOFF", "AutoPlan", "AutoReport", "AutoStats", "calibrated", "calibration", "choose_budget",
           "expected_tokens", "should_draft"]

DECAY = 0.25
"""The moving averages' weight of the newest drafted round."""

MAX_BACKOFF = 32
"""The longest probe interval, in multiples of ``AutoPlan.probe_every``."""


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """Static settings of ``budget="auto"`` rounds (hashable: part of the compiled rounds' keys).

    Attributes:
      budgets: the budget set, ascending, starting at 0 (``config.auto_budget_set``).
      draft_len: L, the drafter's block depth (a path holds at most L drafted tokens).
      probe_every: rounds without the drafter after which one round drafts again, >= 1.
    """

    budgets: tuple[int, ...]
    draft_len: int
    probe_every: int

    def __post_init__(self):
        b = self.budgets
        if not (b and b[0] == 0 and all(x < y for x, y in zip(b, b[1:], strict=False))):
            raise ValueError(f"AutoPlan.budgets must be ascending and start at 0, got {b!r}")

    @property
    def caps(self) -> np.ndarray:
        """f32 ``[K]``: the most drafted tokens a round at each budget can commit, ``min(b, L)``."""
        return np.minimum(np.asarray(self.budgets, np.float32), self.draft_len)


def expected_tokens(tree: DraftTree, budgets: tuple[int, ...]) -> jax.Array:
    """f32 ``[B, K]``: each row's expected committed tokens (bonus included) of the tree's prefix
    of ``budgets[k]`` nodes: ``1 + sum_{i=1..b} exp(score_i)`` over valid nodes. ``tree`` is a
    best-first tree with at least ``max(budgets) + 1`` slots."""
    mass = jnp.where(tree.valid[:, 1:], jnp.exp(tree.score[:, 1:]), 0.0)
    prefix = jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=1)], axis=1)
    return 1.0 + prefix[:, jnp.asarray(budgets)]


def choose_budget(expected, costs) -> jax.Array:
    """Index ``k`` of the budget with the most expected tokens per unit cost: argmax of
    ``expected[k] / costs[k]`` (``expected``: the batch's expected committed tokens at each
    budget ``[K]``; ``costs``: a round's cost at each budget ``[K]``, > 0); the first on ties."""
    return jnp.argmax(jnp.asarray(expected, jnp.float32) / jnp.asarray(costs, jnp.float32)).astype(jnp.int32)


def calibration(stats: AutoStats) -> jax.Array:
    """The batch's realized drafted tokens per expected drafted token (moving averages); 1 before
    any drafted round committed."""
    return jnp.where(stats.predicted_ema > 0, stats.accepted_ema / jnp.maximum(stats.predicted_ema, 1e-30), 1.0)


def calibrated(expected, factor, caps) -> jax.Array:
    """Expected committed tokens with the drafted part scaled by ``factor`` and capped at
    ``caps`` drafted tokens: ``1 + min(factor * (expected - 1), caps)`` (broadcasting)."""
    return 1.0 + jnp.minimum(factor * (expected - 1.0), caps)


def should_draft(stats: AutoStats, active: jax.Array, costs, plan: AutoPlan) -> jax.Array:
    """bool: whether this round runs the drafter (module docstring: the gate). ``active``: the
    number of running rows."""
    expected = active * calibrated(stats.expected_ema, calibration(stats), plan.caps)
    return (choose_budget(expected, costs) > 0) | (stats.skipped >= stats.interval)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["expected_ema", "accepted_ema", "predicted_ema", "skipped", "interval", "drafted", "rounds",
                 "expected", "realized"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class AutoStats:
    """The chooser's memory and report, for ``K`` budgets.

    Attributes:
      expected_ema: f32 ``[K]`` moving average over drafted rounds of the running rows' mean
        expected tokens at each budget (uncalibrated).
      accepted_ema, predicted_ema: f32 moving averages over drafted rounds of the batch's
        realized and expected drafted tokens at the chosen budget (``calibration``).
      skipped: i32 rounds in a row without the drafter (starts at ``probe_every``: the first
        round drafts).
      interval: i32 the rounds without the drafter after which a round probes (module docstring).
      drafted: i32 rounds that ran the drafter (with a running row); those at budget 0 wasted it.
      rounds: i32 ``[K]`` rounds run at each budget (rounds with a running row).
      expected: f32 ``[K]`` the running rows' expected tokens summed over those rounds
        (uncalibrated; a round at budget 0 expects exactly one token per row).
      realized: f32 ``[K]`` the running rows' accepted tokens (bonus included) over those rounds.
    """

    expected_ema: jax.Array
    accepted_ema: jax.Array
    predicted_ema: jax.Array
    skipped: jax.Array
    interval: jax.Array
    drafted: jax.Array
    rounds: jax.Array
    expected: jax.Array
    realized: jax.Array

    @classmethod
    def start(cls, plan: AutoPlan) -> AutoStats:
        """Fresh statistics (every leaf its own buffer: the statistics are donated leaf by leaf)."""
        return _start(len(plan.budgets), plan.probe_every)

    def update(self, drafted, k, expected_rows, accepted_rows, active, plan: AutoPlan) -> AutoStats:
        """The statistics after a round: ``drafted`` (bool: the drafter ran), ``k`` (the index
        of the budget verified), ``expected_rows`` f32 ``[B, K]`` (uncalibrated; any value when
        not drafted), ``accepted_rows`` i32 ``[B]`` (tokens accepted, bonus included) and
        ``active`` bool ``[B]`` (the rows that ran)."""
        n = jnp.sum(active)
        live = n > 0
        weight = active.astype(jnp.float32)[:, None]
        total = jnp.sum(jnp.where(drafted, expected_rows, 1.0) * weight, axis=0)  # [K]
        accepted = jnp.sum(jnp.where(active, accepted_rows, 0)).astype(jnp.float32)
        learn = drafted & live
        first = self.drafted == 0  # no drafted round yet: take this one as it is
        mix = lambda old, new: jnp.where(learn, jnp.where(first, new, (1 - DECAY) * old + DECAY * new), old)
        one_hot = (jnp.arange(len(plan.budgets)) == k) & live
        return AutoStats(
            expected_ema=mix(self.expected_ema, total / jnp.maximum(n, 1)),
            accepted_ema=mix(self.accepted_ema, accepted - n),
            predicted_ema=mix(self.predicted_ema, total[k] - n),
            skipped=jnp.where(drafted, 0, self.skipped + 1).astype(jnp.int32),
            interval=jnp.where(learn, jnp.where(k > 0, plan.probe_every,
                                                jnp.minimum(2 * self.interval, MAX_BACKOFF * plan.probe_every)),
                               self.interval).astype(jnp.int32),
            drafted=self.drafted + learn,
            rounds=self.rounds + one_hot,
            expected=self.expected + jnp.where(one_hot, total[k], 0.0),
            realized=self.realized + jnp.where(one_hot, accepted, 0.0),
        )


@functools.partial(jax.jit, static_argnames=("K", "probe_every"))
def _start(K: int, probe_every: int) -> AutoStats:
    zeros = jnp.zeros((K,), jnp.float32)
    return AutoStats(expected_ema=jnp.ones((K,), jnp.float32), accepted_ema=jnp.float32(0),
                     predicted_ema=jnp.float32(0), skipped=jnp.int32(probe_every), interval=jnp.int32(probe_every),
                     drafted=jnp.int32(0), rounds=jnp.zeros((K,), jnp.int32), expected=zeros,
                     realized=jnp.zeros((K,), jnp.float32))


@dataclasses.dataclass(frozen=True)
class AutoReport:
    """What ``budget="auto"`` chose, on the host.

    Attributes:
      budgets: the budget set.
      rounds: rounds run at each budget (the per-round budget histogram).
      expected: the running rows' expected committed tokens at each budget, summed over those
        rounds (the draft's path probabilities, uncalibrated; exactly one per row at budget 0).
      realized: the tokens the running rows accepted in those rounds (bonus included).
      drafted_rounds: rounds that ran the drafter (the rounds at positive budgets, and those at
        budget 0 that drafted and then found the tree not worth verifying).
      costs: the round costs the choice used, one per budget, per batch size the rounds ran at.
    """

    budgets: tuple[int, ...]
    rounds: tuple[int, ...]
    drafted_rounds: int
    expected: tuple[float, ...]
    realized: tuple[float, ...]
    costs: dict[int, tuple[float, ...]]

    @classmethod
    def of(cls, stats: AutoStats, plan: AutoPlan, costs: dict[int, tuple[float, ...]]) -> AutoReport:
        got = jax.device_get(stats)
        return cls(budgets=plan.budgets, rounds=tuple(int(x) for x in got.rounds), drafted_rounds=int(got.drafted),
                   expected=tuple(float(x) for x in got.expected), realized=tuple(float(x) for x in got.realized),
                   costs=dict(costs))

    @property
    def histogram(self) -> dict[int, int]:
        """``{budget: rounds}``."""
        return dict(zip(self.budgets, self.rounds, strict=True))
