"""The compiled rounds of ``budget="auto"``: one fixed-budget program per budget of the set, each
also tallying what the host's choice needs.

``round_plans`` gives the ``DecodePlan`` of each budget: budget 0 is the autoregressive round
(a root-only tree, no drafter; the verify's hidden states still extend the drafter's context,
so a later round can draft); a positive budget ``b`` is DDTree's round that drafts the ``b``
depths its tree can reach (as the fixed budget's round does), builds the tree of the largest
budget on them, verifies its prefix of ``b + 1`` slots (the tree a build of ``b`` gives) and
reports every budget's expected tokens (``DecodePlan.expected_budgets``: exact up to ``b``, lower
bounds past it). No program holds a conditional: the host picks the program
(``auto_budget.AutoChooser``). The stages are ``decode_round``'s, so every committed token keeps
the target's exact law.

Budget 0 can also hold back the drafter's context (``with_deferred``): its rounds then keep the
features of the tokens they commit in ``DecodeState.deferred`` and run no drafter code at all, so
a run of budget-0 rounds is ``decode_round.run_rounds`` at ``round_plans(...)[0]`` and costs what
plain autoregressive rounds cost. The caller adds what is held back to the drafter's context
(``run_flush``, one pass over up to ``P`` positions per row) only when needed: before a drafted
dispatch (a drafted round always drafts from the whole context) and before budget-0 rounds that
would hold more than ``P``. ``generate`` holds ``HELD_DISPATCHES`` dispatches' rounds; the
``Engine``, whose dispatches are single rounds, ``DEFER_ROUNDS`` (``serving._device.flush``).

A probe (a drafted round the statistics did not choose, to refresh them) runs inside a full
dispatch (``run_probe_rounds``: one drafted round, then budget-0 rounds), so it neither breaks the
caller's pipeline of dispatches nor pays a dispatch of its own.

The tally of a run of rounds is f32 ``[B, 2 + 2K]`` per row (``tally_width``), summed over the
rounds in which the row was running: rounds, tokens accepted (bonus included: the acceptance
lengths), the expected committed tokens at each of the ``K`` budgets (ones at budget 0), then the
tokens the rounds would have committed at each budget (``decode_round.realized_tokens``: exact up
to the verified budget; past it, what they committed).
Design note: docs/auto-budget.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.auto_budget import AutoPlan
from ddtree_jax.decode_round import DecodePlan, Models, round_with_expected, run_rounds
from ddtree_jax.decode_state import DecodeState, DeferredContext

__all__ = ["DEFER_ROUNDS", "HELD_DISPATCHES", "engine_deferred", "flush_deferred", "plain_tally", "round_plans",
           "run_fixed_tallied_rounds", "run_flush", "run_probe_rounds", "run_tallied_rounds", "tallied_round",
           "tally_width", "unrolled_tallied_rounds", "with_deferred"]


def round_plans(plan: DecodePlan, auto: AutoPlan) -> tuple[DecodePlan, ...]:
    """The plan of each budget of ``auto.budgets`` (module docstring); ``plan``: the DDTree plan
    (its models' settings, backend and drafter layers)."""
    return tuple(dataclasses.replace(plan, method="ddtree" if b else "ar", budget=b, logprobs=0,
                                     expected_budgets=auto.budgets) for b in auto.budgets)


DEFER_ROUNDS = 16
"""The positions of drafter context a slot of the ``Engine`` holds back at most (its flush then
runs once per that many budget-0 rounds, and before each drafted dispatch)."""

HELD_DISPATCHES = 4
"""The dispatches of budget-0 rounds whose drafter context ``generate`` holds back at most (its
flush then runs once per that many, and before each drafted dispatch)."""


def engine_deferred(config, depth: int) -> int:
    """Positions of drafter context an ``Engine`` slot holds back (0: none) under ``config`` (an
    ``EngineConfig``; ``depth``: the drafter's block size - 1): with ``budget="auto"``,
    ``DEFER_ROUNDS``, at most one more than the cache's scratch past ``max_model_len`` (the flush
    writes that many positions past a slot's context), and none where that is fewer than a
    dispatch's rounds."""
    decode = config.decode
    if not decode.is_auto:
        return 0
    length = min(DEFER_ROUNDS, config.cache_len(0, depth) + 1)
    return length if length >= (decode.sync_every or 1) else 0


def with_deferred(state: DecodeState, drafter, length: int) -> DecodeState:
    """``state`` whose autoregressive rounds hold back up to ``length`` positions of drafter
    context per row (nothing held yet), features in the target cache's floating dtype (its
    activations')."""
    if length < 1:
        raise ValueError(f"with_deferred: length must be >= 1, got {length}")
    dtype = next(x.dtype for x in jax.tree.leaves(state.target_cache) if jnp.issubdtype(x.dtype, jnp.floating))
    features = drafter.fc.kernel.shape[0]
    return dataclasses.replace(state, deferred=DeferredContext.empty(state.batch_size, length, features, dtype))


def flush_deferred(drafter, state: DecodeState) -> DecodeState:
    """``state`` with its held-back context (if any) added to the drafter's context, for use
    inside a compiled function. Needs room for ``P`` positions past each row's drafter context
    (its cache's scratch)."""
    held = state.deferred
    if held is None or state.draft_cache is None:
        return state
    cache = drafter.append_context(state.draft_cache, held.feats, held.count)
    return dataclasses.replace(state, draft_cache=cache, deferred=held.cleared())


def _flushed(models: Models, tparams, dparams, state: DecodeState) -> DecodeState:
    return flush_deferred(models.merge(tparams, dparams)[1], state)


@functools.partial(jax.jit, static_argnames=("models",), donate_argnames=("state",))
def run_flush(models: Models, tparams, dparams, state: DecodeState) -> DecodeState:
    """``flush_deferred`` as a compiled call of its own."""
    return _flushed(models, tparams, dparams, state)


def tallied_round(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                  tally) -> tuple[DecodeState, jax.Array]:
    """One round (inside a compiled function) and ``tally`` with its running rows added."""
    active = ~state.done
    new, expected, realized = round_with_expected(models, tparams, dparams, plan, state, base_key)
    accepted = jnp.take_along_axis(new.accept_lengths, jnp.minimum(state.rounds, state.capacity - 1)[:, None],
                                   axis=1)
    row = jnp.concatenate([jnp.ones_like(accepted, jnp.float32), accepted.astype(jnp.float32), expected, realized],
                          axis=1)
    return new, tally + jnp.where(active[:, None], row, 0.0)


def tally_width(budgets: int) -> int:
    """The columns of a tally over a set of ``budgets`` budgets (module docstring)."""
    return 2 + 2 * budgets


def _zeros(plan: DecodePlan, state: DecodeState) -> jax.Array:
    return jnp.zeros((state.batch_size, tally_width(len(plan.expected_budgets))), jnp.float32)


@functools.partial(jax.jit, static_argnames=("models", "plan"), donate_argnames=("state",))
def run_tallied_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                       max_rounds) -> tuple[DecodeState, jax.Array]:
    """``decode_round.run_rounds`` at one of ``round_plans`` with its tally: up to ``max_rounds``
    rounds (an int, traced: one program for any count), stopping early once every row is done;
    returns ``(state, tally)``. A drafted plan needs nothing held back (``run_flush`` first)."""

    def cond(carry):
        i, st, _ = carry
        return (i < max_rounds) & ~jnp.all(st.done)

    def body(carry):
        i, st, tally = carry
        return (i + 1, *tallied_round(models, tparams, dparams, plan, st, base_key, tally))

    _, state, tally = jax.lax.while_loop(cond, body, (jnp.int32(0), state, _zeros(plan, state)))
    return state, tally


@functools.partial(jax.jit, static_argnames=("models", "plan", "rounds"), donate_argnames=("state",))
def run_fixed_tallied_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                             rounds: int) -> tuple[DecodeState, jax.Array]:
    """``run_tallied_rounds`` with exactly ``rounds`` rounds (static: a loop of known trip count,
    ``decode_round.run_rounds``'s ``fixed`` form); rows that are not running add nothing."""

    def body(i, carry):
        st, tally = carry
        return tallied_round(models, tparams, dparams, plan, st, base_key, tally)

    return jax.lax.fori_loop(0, rounds, body, (state, _zeros(plan, state)))


@functools.partial(jax.jit, static_argnames=("models", "probe", "plain", "rounds", "fixed"),
                   donate_argnames=("state",))
def run_probe_rounds(models: Models, tparams, dparams, probe: DecodePlan, plain: DecodePlan, state: DecodeState,
                     base_key, rounds: int, fixed: bool) -> tuple[DecodeState, jax.Array]:
    """A probing dispatch: the held-back context added (``flush_deferred``: a probe follows plain
    rounds, so its flush is part of its program rather than a launch of its own), one round at the
    drafted plan ``probe``, then up to ``rounds - 1`` at ``plain`` (``round_plans(...)[0]``,
    holding their context back); ``fixed``: exactly that many, else stopping once every row is
    done. Returns ``(state, the probe round's tally)``; the plain rounds' tally is ``plain_tally``
    of the rows' rounds past the probe's."""
    state = _flushed(models, tparams, dparams, state)
    state, tally = tallied_round(models, tparams, dparams, probe, state, base_key, _zeros(probe, state))
    return run_rounds(models, tparams, dparams, plain, state, base_key, rounds - 1, fixed), tally


def plain_tally(rounds: np.ndarray, budgets: int) -> np.ndarray:
    """The tally of budget-0 rounds, from each row's count of them (``rounds`` ``[B]``): every such
    round accepts one token, and expects and realizes one at every budget (no drafter ran). f64
    ``[B, tally_width(budgets)]``."""
    d = np.asarray(rounds, np.float64)[:, None]
    return np.repeat(d, tally_width(budgets), axis=1)


def unrolled_tallied_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                            rounds: int) -> tuple[DecodeState, jax.Array]:
    """``rounds`` rounds one after the other inside a compiled function
    (``decode_round.unrolled_rounds``'s counterpart); returns ``(state, tally)``. Unlike
    ``run_tallied_rounds`` it adds no held-back context first: a caller holding context back
    flushes before a drafted dispatch (the ``Engine``: only when something is held, since its
    dispatches are single rounds)."""
    tally = _zeros(plan, state)
    for _ in range(rounds):
        state, tally = tallied_round(models, tparams, dparams, plan, state, base_key, tally)
    return state, tally
