"""The engine's compiled operations on a ``DecodeState`` of fixed slots.

Every function takes ``rows [R]``: the slots it touches, with ``R`` padded up to a power of two
by repeating the first entry *with identical data*, so that duplicate scatter writes agree and
each ``R`` compiles once. The state is donated: the engine holds the only reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.auto_round import flush_deferred, unrolled_tallied_rounds, with_deferred
from ddtree_jax.backend import Backend
from ddtree_jax.decode_round import (
    DecodePlan,
    Models,
    append_to_rows,
    first_tokens,
    round_with_logprobs,
    token_logprobs,
    unrolled_rounds,
    with_row_lengths,
)
from ddtree_jax.decode_state import FREE, NO_STOP, RUNNING, DecodeState
from ddtree_jax.paged_generate import without_pages
from ddtree_jax.rows import RowMesh
from ddtree_jax.sampling import SamplingBatch
from ddtree_jax.serving.shapes import ShapeCache

PREFILL_FIELDS = 3  # int32 columns of a prefill chunk's rows before its token ids


@functools.partial(jax.jit, static_argnames=("models", "plan"), donate_argnames=("state",))
def prefill_chunk(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, packed):
    """Append one prompt chunk to some slots, given as ONE int32 array ``packed [R, PREFILL_FIELDS
    + T]`` (one host-to-device transfer): per row its slot, the prompt tokens already in that
    slot's cache (``starts``: 0 for a prompt's first chunk, which discards whatever the slot held;
    -1 for a padding row, which keeps its length), the chunk's valid tokens (``counts``), then the
    chunk's ``T`` token ids, right-padded. Finish codes do not change: a slot being filled is not
    ``RUNNING`` and the rounds leave it alone. Where the target splits the slots over a row mesh,
    the rows must be laid out device by device (``prefill_layout``): each device then prefills its
    own slots in place, and no slot's cache leaves its device. Returns ``(state, the target's
    logits f32 [R, V] at each row's last chunk token)`` (a new request's first token is drawn
    from those of its prompt's last chunk: ``activate_first``; meaningless for padding rows)."""
    rows, starts, counts, ids = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, PREFILL_FIELDS:]
    target, drafter = models.merge(tparams, dparams)
    dcache = state.draft_cache if plan.hidden_layer_ids else None
    tcache, dcache, logits = append_to_rows(target, drafter, plan, state.target_cache, dcache, rows, ids, starts,
                                            counts, by_device=True, last=True)
    return dataclasses.replace(state, target_cache=tcache, draft_cache=dcache or state.draft_cache), logits


def prefill_rows(rows, starts, counts, ids) -> np.ndarray:
    """``prefill_chunk``'s ``packed`` array from its parts: ``rows``, ``starts``, ``counts`` ``[R]``
    and ``ids [R, T]``."""
    return np.concatenate([np.stack([rows, starts, counts], axis=1), ids], axis=1).astype(np.int32)


def row_blocks(target, slots: int) -> int:
    """The devices ``slots`` slots split over on the target's row mesh (1: one block)."""
    rows = getattr(target, "row_mesh", None)
    return 1 if rows is None else rows.blocks(slots)


def prefill_layout(slots: list[int], blocks: int, per_block: int, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, pick)`` for a prefill of ``slots`` on ``blocks`` devices of ``per_block`` slots
    each: ``blocks * block_rows`` entries, device ``j``'s block listing its own slots (``rows``)
    and their positions in ``slots`` (``pick``), padded by repeating its first (identical data).
    A block with none holds padding rows: the block's first slot, ``pick`` -1 (count 0, start -1)."""
    rows = np.zeros((blocks * block_rows,), np.int32)
    pick = np.full((blocks * block_rows,), -1, np.int32)
    for j in range(blocks):
        mine = [i for i, s in enumerate(slots) if s // per_block == j]
        if len(mine) > block_rows:
            raise ValueError(f"prefill_layout: {len(mine)} slots on device {j}, more than {block_rows} rows")
        block = slice(j * block_rows, (j + 1) * block_rows)
        if mine:
            pick[block] = mine + [mine[0]] * (block_rows - len(mine))
            rows[block] = np.asarray(slots, np.int32)[pick[block]]
        else:
            rows[block] = j * per_block
    return rows, pick


_PREFILL_SHAPES: dict = {}


def prefill_shapes(models: Models, plan: DecodePlan, tparams, dparams, state: DecodeState) -> ShapeCache:
    """The ``ShapeCache`` of ``prefill_chunk`` executables for these models, plan and state layout
    (avals and shardings of ``tparams``, ``dparams`` and ``state``), shared by every engine with the
    same ones, as the compiled function's own cache would be. Its executables take
    ``(tparams, dparams, state, packed)`` (``prefill_chunk``'s ``packed [rows, PREFILL_FIELDS +
    tokens]``).

    On one device, executables are compiled ahead (in the background for new shapes). On a mesh the
    state's placement is the compiler's choice and may change after the first round, and with
    several processes all must run the same executables in the same order: there each shape is the
    compiled function itself, compiled at its first call, in the caller."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    specs = jax.tree.map(spec, (tparams, dparams, state))
    leaves, treedef = jax.tree.flatten(specs)
    one_device = jax.process_count() == 1 and len({d for x in leaves for d in x.sharding.device_set}) == 1
    key = (models, plan, treedef, tuple(leaves))
    cache = _PREFILL_SHAPES.get(key)
    if cache is None:
        def compile_shape(rows: int, tokens: int):
            if not one_device:
                return lambda tparams, dparams, state, packed: prefill_chunk(models, tparams, dparams, plan, state,
                                                                             packed)
            packed = jax.ShapeDtypeStruct((rows, PREFILL_FIELDS + tokens), jnp.int32)
            return prefill_chunk.lower(models, *specs[:2], plan, specs[2], packed).compile()

        cache = _PREFILL_SHAPES.setdefault(key, ShapeCache(compile_shape, background=one_device))
    return cache


ACTIVATION_FIELDS = 12  # int32 columns of ``activation_rows`` before the stop ids


def activation_rows(rows, roots, cache_lengths, max_new_tokens, stop_ids, sampling: SamplingBatch, request_ids,
                    rounds) -> np.ndarray:
    """``activate``'s inputs as ONE int32 array ``[R, ACTIVATION_FIELDS + S]`` (an activation then
    costs one host-to-device transfer, not twelve): per row its slot, root, cache length, token
    limit, request id, rounds, temperature, top-k, top-p, min-p, seed, has-seed (float32 and
    uint32 fields as their bits), then its ``S`` stop ids."""
    def bits(x, dtype):
        return np.ascontiguousarray(np.asarray(x, dtype)).view(np.int32)

    cols = [bits(rows, np.int32), bits(roots, np.int32), bits(cache_lengths, np.int32), bits(max_new_tokens, np.int32),
            bits(request_ids, np.uint32), bits(rounds, np.int32), bits(sampling.temperature, np.float32),
            bits(sampling.top_k, np.int32), bits(sampling.top_p, np.float32), bits(sampling.min_p, np.float32),
            bits(sampling.seed, np.uint32), bits(sampling.has_seed, np.int32)]
    return np.concatenate([np.stack(cols, axis=1), np.asarray(stop_ids, np.int32)], axis=1)


@functools.partial(jax.jit, donate_argnames=("state",))
def activate(state: DecodeState, packed) -> DecodeState:
    """Start decoding in the slots of ``packed`` (``activation_rows``: i32 ``[R, ACTIVATION_FIELDS
    + S]``), whose caches hold their cache length of prompt tokens (all but the last, the root):
    per-row limits, stop ids, sampling, request ids and round counts (0 for a new request; a
    resumed one's rounds so far, so that its random stream continues: ``ddtree_jax/rng.py``)."""
    def f32(i):
        return jax.lax.bitcast_convert_type(packed[:, i], jnp.float32)

    def u32(i):
        return jax.lax.bitcast_convert_type(packed[:, i], jnp.uint32)

    rows, roots, cache_lengths, max_new_tokens, rounds = (packed[:, i] for i in (0, 1, 2, 3, 5))
    sampling = SamplingBatch(temperature=f32(6), top_k=packed[:, 7], top_p=f32(8), min_p=f32(9), seed=u32(10),
                             has_seed=packed[:, 11] != 0)
    R = rows.shape[0]
    zeros = jnp.zeros((R,), jnp.int32)
    tcache = with_row_lengths(state.target_cache, rows, cache_lengths)
    dcache = None if state.draft_cache is None else with_row_lengths(state.draft_cache, rows, cache_lengths)

    def put(x, y):
        return x.at[rows].set(jnp.asarray(y).astype(x.dtype))

    return DecodeState(
        target_cache=tcache, draft_cache=dcache, root=put(state.root, roots),
        out=put(state.out, jnp.zeros((R, state.capacity), jnp.int32)), generated=put(state.generated, zeros),
        finish=put(state.finish, jnp.full((R,), RUNNING, jnp.int32)),
        accept_lengths=put(state.accept_lengths, jnp.zeros((R, state.capacity), jnp.int32)),
        rounds=put(state.rounds, rounds), max_new_tokens=put(state.max_new_tokens, max_new_tokens),
        stop_ids=put(state.stop_ids, packed[:, ACTIVATION_FIELDS:]),
        sampling=jax.tree.map(put, state.sampling, sampling), request_ids=put(state.request_ids, u32(4)),
        deferred=None if state.deferred is None else dataclasses.replace(state.deferred,
                                                                         count=put(state.deferred.count, zeros)),
    )


@functools.partial(jax.jit, static_argnames=("backend", "rows", "k"), donate_argnames=("state", "first_logprobs"))
def activate_first(state: DecodeState, packed, chunk, logits, base_key, first_logprobs=None, *, backend: Backend,
                   rows: RowMesh | None = None, k: int = 0):
    """``activate``, where a row whose root is -1 is a new request whose caches hold its whole
    prompt, which ends in the prefill chunk ``chunk`` (the first ``PREFILL_FIELDS`` columns of
    ``prefill_chunk``'s ``packed``, ``[Rc, PREFILL_FIELDS]``, or all of it: its token ids are not
    read, so that one activation program serves every chunk width), whose outputs ``logits [Rc,
    V]`` are the target's at each chunk row's last token): its first token is drawn there by its
    own law (``decode_round.first_tokens``), on the chunk's rows, which ``prefill_layout`` laid
    out device by device over the row mesh ``rows`` (each device draws for its own slots, from
    logits that never leave it), and committed (``DecodeState.with_first_tokens``: root, first
    output, stop tokens and limits).

    Returns ``(state, first_logprobs)``: with ``k > 0``, ``first_logprobs [slots, 1 + 2 k]`` with
    the new slots' rows set to their first token's ``token_logprobs`` entries (``None`` in, ``None``
    out, with ``k`` 0)."""
    slots, new = packed[:, 0], packed[:, 1] < 0
    state = activate(state, packed.at[:, 1].set(jnp.maximum(packed[:, 1], 0)))
    B = state.batch_size
    is_new = jnp.zeros((B,), bool).at[slots].set(new)
    at = chunk[:, 0]
    # chunk rows that end a new request's prompt (a padding row of an empty block counts 0 tokens;
    # one repeating a block's first row repeats its data, so its draw and writes agree)
    to = jnp.where(is_new[at] & (chunk[:, 2] > 0), at, B)
    sampling = jax.tree.map(lambda x: x[at], state.sampling)
    first = first_tokens(logits, sampling, state.request_ids[at], base_key, backend, rows)
    state = state.with_first_tokens(jnp.zeros((B,), jnp.int32).at[to].set(first, mode="drop"), where=is_new)
    if k:
        entries = token_logprobs(logits[:, None], first[:, None], sampling, k)[:, 0]
        first_logprobs = first_logprobs.at[to].set(entries, mode="drop")
    return state, first_logprobs


@jax.jit
def first_column(state: DecodeState) -> jax.Array:
    """i32 ``[slots]``: each slot's first output token (what ``activate_first`` drew for a new
    request). One shape whatever the number of newcomers, so reading it back compiles once."""
    return state.out[:, 0]


@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: DecodeState, rows) -> DecodeState:
    """Mark slots ``rows`` ``FREE``: they commit nothing more (a cancelled or stop-string request)."""
    return dataclasses.replace(state, finish=state.finish.at[rows].set(FREE))


@functools.partial(jax.jit, donate_argnames=("state",))
def set_page_rows(state: DecodeState, rows, table_rows) -> DecodeState:
    """Paged caches: the page-table rows of slots ``rows [R]`` replaced by ``table_rows [R, pages
    per slot]`` in both caches (one table serves both: their pools share page ids)."""
    def put(cache):
        return None if cache is None else dataclasses.replace(
            cache, page_table=cache.page_table.at[rows].set(table_rows.astype(cache.page_table.dtype)))

    return dataclasses.replace(state, target_cache=put(state.target_cache), draft_cache=put(state.draft_cache))


@functools.partial(jax.jit, static_argnames=("models",), donate_argnames=("state",))
def flush(models: Models, tparams, dparams, state: DecodeState) -> DecodeState:
    """``auto_round.flush_deferred``: every slot's held-back drafter context added to its context.
    Paged, a slot holding none back writes through the null page: its length may be stale (a slot
    between requests) while its table already maps pages it shares."""
    drafter = models.merge(tparams, dparams)[1]
    if _paged(state):
        tables = _tables(state)
        return _with_tables(flush_deferred(drafter, without_pages(state, state.deferred.count == 0)), tables)
    return flush_deferred(drafter, state)


def _paged(state: DecodeState) -> bool:
    return hasattr(state.target_cache, "page_table")


def _tables(state: DecodeState):
    """A paged state's page tables, ``(target's, drafter's or None)``: what ``_with_tables`` puts back."""
    return state.target_cache.page_table, None if state.draft_cache is None else state.draft_cache.page_table


def _with_tables(state: DecodeState, tables) -> DecodeState:
    t, d = tables
    return dataclasses.replace(
        state, target_cache=dataclasses.replace(state.target_cache, page_table=t),
        draft_cache=None if state.draft_cache is None else dataclasses.replace(state.draft_cache, page_table=d))


HARVEST_FIELDS = 3  # columns before the tokens in ``rounds_and_harvest``'s packed rows


@functools.partial(jax.jit, static_argnames=("models", "plan", "rounds", "tokens"), donate_argnames=("state",))
def rounds_and_harvest(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key, *,
                       rounds: int, tokens: int, first_logprobs=None):
    """``rounds`` rounds (``unrolled_rounds``: the call returns before they finish), and what the
    host needs of them in ONE int32 array ``[B, HARVEST_FIELDS + tokens + rounds]``; per slot:
    tokens committed by these rounds, rounds run, finish code, then the committed tokens
    (``tokens`` columns, the first ``n`` valid) and the rounds' acceptance lengths (``rounds``
    columns). With ``plan.logprobs = K > 0``, ``tokens * (1 + 2 K)`` more columns follow: for
    each token column, ``decode_round.token_logprobs``'s ``1 + 2 K`` entries (float32 bits as
    int32; a slot with no round yet starts with its first token's, ``first_logprobs [B, 1 + 2 K]``:
    ``activate_first``). With ``plan.expected_budgets`` at a positive budget (``budget="auto"``'s drafted
    rounds, ``auto_round.round_plans``; no log-probabilities), ``auto_round.tally_width(K)``
    more columns follow instead: the rounds' tally (``auto_round``, float32 bits as int32); budget 0's
    rounds are plain ones, their tally ``auto_round.plain_tally`` of the rounds column. Returns
    ``(state, packed)``."""
    if _paged(state):
        # A row not running (a slot between requests, or admitted but not yet prefilled) holds a
        # stale length; its round's writes past it could reach pages the slot now shares, so the
        # rounds see its table as the null page, where writes land nowhere.
        tables = _tables(state)
        state, packed = _rounds_and_harvest(models, tparams, dparams, plan,
                                            without_pages(state, state.finish != RUNNING), base_key, rounds, tokens,
                                            first_logprobs)
        return _with_tables(state, tables), packed
    return _rounds_and_harvest(models, tparams, dparams, plan, state, base_key, rounds, tokens, first_logprobs)


def _rounds_and_harvest(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                        rounds: int, tokens: int, first_logprobs=None):
    gen0, rnd0 = state.generated, state.rounds
    if plan.expected_budgets:
        if plan.logprobs:
            raise ValueError("rounds_and_harvest: no log-probabilities with expected_budgets")
        if plan.budget:  # (budget 0's tally is its rounds column's: auto_round.plain_tally)
            state, tally = unrolled_tallied_rounds(models, tparams, dparams, plan, state, base_key, rounds)
            bits = jax.lax.bitcast_convert_type(tally, jnp.int32)
            return state, jnp.concatenate([_harvest(state, gen0, rnd0, rounds, tokens), bits], axis=1)
    if plan.logprobs:
        state, logprobs = _rounds_with_logprobs(models, tparams, dparams, plan, state, base_key, rounds, tokens,
                                                first_logprobs)
        packed = _harvest(state, gen0, rnd0, rounds, tokens)
        return state, jnp.concatenate([packed, logprobs.reshape(logprobs.shape[0], -1)], axis=1)
    state = unrolled_rounds(models, tparams, dparams, plan, state, base_key, rounds)
    return state, _harvest(state, gen0, rnd0, rounds, tokens)


def _harvest(state: DecodeState, gen0, rnd0, rounds: int, tokens: int):
    """The packed rows of ``rounds_and_harvest`` for rounds run from ``gen0``/``rnd0``; a slot
    that had run no round (``rnd0`` 0) from its first output on (a new request's first token,
    committed by its activation: ``activate_first``)."""
    gen0 = jnp.where(rnd0 == 0, 0, gen0)
    C = state.capacity
    tok_idx = jnp.clip(gen0[:, None] + jnp.arange(tokens)[None], 0, C - 1)
    rnd_idx = jnp.clip(rnd0[:, None] + jnp.arange(rounds)[None], 0, C - 1)
    return jnp.concatenate([
        (state.generated - gen0)[:, None], (state.rounds - rnd0)[:, None], state.finish[:, None],
        jnp.take_along_axis(state.out, tok_idx, axis=1), jnp.take_along_axis(state.accept_lengths, rnd_idx, axis=1),
    ], axis=1).astype(jnp.int32)


def _rounds_with_logprobs(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                          rounds: int, tokens: int, first_logprobs=None):
    """``unrolled_rounds`` that also gathers each committed token's ``token_logprobs`` entries:
    ``(state, i32 [B, tokens, 1 + 2 K])``, row ``b``'s first ``generated - generated before`` valid;
    a slot that had run no round (a new request) starts with its first token's entries,
    ``first_logprobs [B, 1 + 2 K]`` (``activate_first``)."""
    B = state.batch_size
    new = state.rounds == 0
    gen0 = jnp.where(new, 0, state.generated)
    rows = jnp.arange(B)[:, None]
    gathered = jnp.zeros((B, tokens, 1 + 2 * plan.logprobs), jnp.int32)
    for _ in range(rounds):
        before = state.generated
        state, logprobs = round_with_logprobs(models, tparams, dparams, plan, state, base_key)
        idx = jnp.arange(logprobs.shape[1])[None]
        pos = jnp.where(idx < (state.generated - before)[:, None], (before - gen0)[:, None] + idx, tokens)
        gathered = gathered.at[rows, pos].set(logprobs, mode="drop")
    if first_logprobs is not None:
        gathered = gathered.at[:, 0].set(jnp.where(new[:, None], first_logprobs, gathered[:, 0]))
    return state, gathered


def page_bytes(target, drafter, page_size: int) -> int:
    """Device bytes of one page of ``page_size`` positions: the target's latents and, with a
    ``drafter`` (``None`` for ``ar``), its context keys and values at those positions."""
    def one(model):
        cache = jax.eval_shape(lambda: model.init_paged_cache(2, page_size, 1, 1))  # two pages
        nbytes = lambda x: x.size * x.dtype.itemsize  # noqa: E731
        return (sum(map(nbytes, jax.tree.leaves(cache))) - nbytes(cache.page_table) - nbytes(cache.lengths)) // 2

    return one(target) + (0 if drafter is None else one(drafter))


def empty_state(target, drafter, plan: DecodePlan, slots: int, max_len: int, capacity: int, stop_width: int,
                shard=None, pages: tuple[int, int] | None = None, deferred: int = 0) -> DecodeState:
    """A state of ``slots`` free slots (finish ``FREE``); ``shard`` optionally places it.
    ``pages``: ``(num_pages, page_size)`` for paged caches (pools of ``num_pages`` pages, the null
    page included; every table row of ``max_len`` positions' pages null), else contiguous ones of
    ``max_len`` positions per slot. ``deferred > 0``: autoregressive rounds hold back up to that
    many positions of drafter context per slot (``auto_round.with_deferred``)."""

    def caches(model):
        if pages is None:
            return model.init_cache(slots, max_len)
        num_pages, page_size = pages
        return model.init_paged_cache(num_pages, page_size, -(-max_len // page_size), slots)

    def build():
        zeros = jnp.zeros((slots,), jnp.int32)
        state = DecodeState.start(
            caches(target), caches(drafter) if plan.hidden_layer_ids else None,
            zeros, capacity=capacity, max_new_tokens=jnp.ones((slots,), jnp.int32),
            stop_ids=jnp.full((slots, stop_width), NO_STOP, jnp.int32),
            sampling=SamplingBatch(temperature=jnp.zeros((slots,), jnp.float32), top_k=zeros,
                                   top_p=jnp.ones((slots,), jnp.float32), min_p=jnp.zeros((slots,), jnp.float32),
                                   seed=jnp.zeros((slots,), jnp.uint32), has_seed=jnp.zeros((slots,), bool)),
            request_ids=jnp.zeros((slots,), jnp.uint32), finish=FREE,
        )
        return with_deferred(state, drafter, deferred) if deferred else state

    state = jax.jit(build)()  # compiled: every leaf its own buffer (the state is donated leaf by leaf)
    if shard is not None:
        return shard(state)
    # Committed to its device, as every program's output is: a program first called on this state
    # and later on a round's output would otherwise compile twice (JAX keys compiled programs on
    # whether their arguments are committed), the second time while serving.
    return jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
