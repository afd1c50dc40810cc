"""The compiled rounds of ``budget="auto"``: one fixed-budget program per budget of the set, each
also tallying what the host's choice needs.

``round_plans`` gives the ``DecodePlan`` of each budget: budget 0 is the autoregressive round
(a root-only tree, no drafter; the verify's hidden states still extend the drafter's context,
so a later round can draft); a positive budget ``b`` is DDTree's round that builds the tree of
the largest budget, verifies its prefix of ``b + 1`` slots (the tree a build of ``b`` gives) and
reports every budget's expected tokens (``DecodePlan.expected_budgets``). No program holds a
conditional: the host picks the program (``auto_budget.AutoChooser``). The stages are
``decode_round``'s, so every committed token keeps the target's exact law.

The tally of a run of rounds is f32 ``[B, 2 + K]`` per row, summed over the rounds in which the
row was running: rounds, tokens accepted (bonus included: the acceptance lengths), then the
expected committed tokens at each of the ``K`` budgets (ones at budget 0).
Design note: docs/auto-budget.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.auto_budget import AutoPlan
from ddtree_jax.decode_round import DecodePlan, Models, round_with_expected
from ddtree_jax.decode_state import DecodeState

__all__ = ["round_plans", "run_tallied_rounds", "tallied_round", "unrolled_tallied_rounds"]


def round_plans(plan: DecodePlan, auto: AutoPlan) -> tuple[DecodePlan, ...]:
    """The plan of each budget of ``auto.budgets`` (module docstring); ``plan``: the DDTree plan
    (its models' settings, backend and drafter layers)."""
    return tuple(dataclasses.replace(plan, method="ddtree" if b else "ar", budget=b, logprobs=0,
                                     expected_budgets=auto.budgets) for b in auto.budgets)


def tallied_round(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                  tally) -> tuple[DecodeState, jax.Array]:
    """One round (inside a compiled function) and ``tally`` with its running rows added."""
    active = ~state.done
    new, expected = round_with_expected(models, tparams, dparams, plan, state, base_key)
    accepted = jnp.take_along_axis(new.accept_lengths, jnp.minimum(state.rounds, state.capacity - 1)[:, None],
                                   axis=1)
    row = jnp.concatenate([jnp.ones_like(accepted, jnp.float32), accepted.astype(jnp.float32), expected], axis=1)
    return new, tally + jnp.where(active[:, None], row, 0.0)


def _zeros(plan: DecodePlan, state: DecodeState) -> jax.Array:
    return jnp.zeros((state.batch_size, 2 + len(plan.expected_budgets)), jnp.float32)


@functools.partial(jax.jit, static_argnames=("models", "plan", "max_rounds"), donate_argnames=("state",))
def run_tallied_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                       max_rounds: int) -> tuple[DecodeState, jax.Array]:
    """``decode_round.run_rounds`` at one of ``round_plans``: up to ``max_rounds`` rounds,
    stopping early once every row is done; returns ``(state, tally)``."""

    def cond(carry):
        i, st, _ = carry
        return (i < max_rounds) & ~jnp.all(st.done)

    def body(carry):
        i, st, tally = carry
        return (i + 1, *tallied_round(models, tparams, dparams, plan, st, base_key, tally))

    _, state, tally = jax.lax.while_loop(cond, body, (jnp.int32(0), state, _zeros(plan, state)))
    return state, tally


def unrolled_tallied_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                            rounds: int) -> tuple[DecodeState, jax.Array]:
    """``rounds`` rounds one after the other inside a compiled function
    (``decode_round.unrolled_rounds``'s counterpart); returns ``(state, tally)``."""
    tally = _zeros(plan, state)
    for _ in range(rounds):
        state, tally = tallied_round(models, tparams, dparams, plan, state, base_key, tally)
    return state, tally
