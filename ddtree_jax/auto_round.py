"""The compiled round of ``budget="auto"``: gate, draft, choose, verify the chosen prefix, commit.

    gate    ``auto_budget.should_draft`` on the recent rounds' statistics
    plain   (gate closed) an autoregressive step: root-only tree, no drafter; the verify's hidden
            states still extend the drafter's context, so a later round can draft
    drafted (gate open) the drafter's block, the best-first tree of the largest budget, every
            budget's expected tokens (``auto_budget.expected_tokens``), the choice
            (``auto_budget.choose_budget``), then verify, sample and commit the tree's prefix of
            the chosen budget, one ``lax.switch`` branch per budget (static verify shapes)

Both sides are ``lax.cond`` branches; ``force >= 0`` skips the gate and the choice and runs the
budget of that index (0: the plain step), which is how the round costs are timed
(``ddtree_jax.auto_costs``). The stages are ``decode_round``'s: which tree is verified is the only
difference from a fixed-budget round, so every committed token keeps the target's exact law.
Design note: docs/auto-budget.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.auto_budget import (
    AutoPlan,
    AutoStats,
    calibrated,
    calibration,
    choose_budget,
    expected_tokens,
    should_draft,
)
from ddtree_jax.decode_round import STAGES, DecodePlan, Models, _commit, _draft, _sample, _tree, _verify
from ddtree_jax.decode_state import DecodeState

__all__ = ["auto_round", "run_auto_rounds", "timed_auto_round", "unrolled_auto_rounds"]


def auto_round(models: Models, tparams, dparams, plan: DecodePlan, auto: AutoPlan, state: DecodeState,
               stats: AutoStats, base_key, costs, force) -> tuple[DecodeState, AutoStats]:
    """One round (module docstring). ``plan``: DDTree at the largest budget of ``auto.budgets``;
    ``costs`` f32 ``[K]``: a round's cost at each budget; ``force`` i32: -1 to choose, else the
    index of the budget to run. Returns the next state and statistics."""
    target, drafter = models.merge(tparams, dparams)
    active = ~state.done
    caps = jnp.asarray(auto.caps)
    B, K = state.batch_size, len(auto.budgets)
    plain_plan = dataclasses.replace(plan, method="ar", budget=0)

    def plain(state):
        work = {}
        for _, stage in STAGES:
            work = stage(target, drafter, plain_plan, state, base_key, work)
        return work["state"], jnp.int32(0), jnp.ones((B, K), jnp.float32)

    def drafted(state):
        work = _tree(target, drafter, plan, state, base_key, _draft(target, drafter, plan, state, base_key, {}))
        tree = work["tree"]
        expected = expected_tokens(tree, auto.budgets)
        batch = jnp.sum(jnp.where(active[:, None], calibrated(expected, calibration(stats), caps), 0.0), axis=0)
        k = jnp.where(force >= 0, force, choose_budget(batch, costs)).astype(jnp.int32)

        def verify(budget):
            def run(state):
                work = dict(tree=tree.prefix(budget + 1))
                for stage in (_verify, _sample, _commit):
                    work = stage(target, drafter, plan, state, base_key, work)
                return work["state"]
            return run

        return jax.lax.switch(k, [verify(b) for b in auto.budgets], state), k, expected

    draft = jnp.where(force >= 0, force > 0, should_draft(stats, jnp.sum(active), costs, auto))
    new, k, expected = jax.lax.cond(draft, drafted, plain, state)
    accepted = jnp.take_along_axis(new.accept_lengths, jnp.minimum(state.rounds, state.capacity - 1)[:, None],
                                   axis=1)[:, 0]
    return new, stats.update(draft, k, expected, accepted, active, auto)


@functools.partial(jax.jit, static_argnames=("models", "plan", "auto", "max_rounds"),
                   donate_argnames=("state", "stats"))
def run_auto_rounds(models: Models, tparams, dparams, plan: DecodePlan, auto: AutoPlan, state: DecodeState,
                    stats: AutoStats, base_key, costs, max_rounds: int) -> tuple[DecodeState, AutoStats]:
    """Up to ``max_rounds`` rounds on the device, stopping early once every row is done
    (``decode_round.run_rounds`` with the chooser's statistics carried along)."""

    def cond(carry):
        i, st, _ = carry
        return (i < max_rounds) & ~jnp.all(st.done)

    def body(carry):
        i, st, sts = carry
        return (i + 1, *auto_round(models, tparams, dparams, plan, auto, st, sts, base_key, costs, jnp.int32(-1)))

    _, state, stats = jax.lax.while_loop(cond, body, (jnp.int32(0), state, stats))
    return state, stats


def unrolled_auto_rounds(models: Models, tparams, dparams, plan: DecodePlan, auto: AutoPlan, state: DecodeState,
                         stats: AutoStats, base_key, costs, force, rounds: int) -> tuple[DecodeState, AutoStats]:
    """``rounds`` rounds one after the other, inside a compiled function
    (``decode_round.unrolled_rounds``'s counterpart)."""
    for _ in range(rounds):
        state, stats = auto_round(models, tparams, dparams, plan, auto, state, stats, base_key, costs, force)
    return state, stats


timed_auto_round = jax.jit(auto_round, static_argnames=("models", "plan", "auto"),
                           donate_argnames=("state", "stats"))
"""``auto_round`` compiled alone (one round whatever the rows' state): what ``generate`` times."""
