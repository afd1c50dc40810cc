"""The state of a batch of requests between decoding rounds, as one typed pytree.

A ``DecodeState`` has one row ("slot") per request. Everything a round needs is data in it —
both caches, each row's last committed token, its output buffer, its own token limit, stop ids,
sampling settings and random-stream id — so the compiled round never recompiles for new
requests, and a serving loop can move requests in and out of slots between rounds with
``take_rows`` / ``put_rows`` without knowing how a model lays out its cache.

With ``budget="auto"`` a state can also hold a ``DeferredContext``: the drafter-context features of
the autoregressive rounds (budget 0), kept back so that those rounds run no drafter code; the
next drafted round's program first adds them to the drafter's context (``auto_round``).

Finish codes (``finish [B]``): ``RUNNING`` while decoding; ``STOP``, ``LENGTH`` or ``ERROR`` once
finished; ``FREE`` for a slot that holds no request (it rides along in the fixed-shape round and
commits nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax.models.interface import RowCache
from ddtree_jax.sampling import SamplingBatch

__all__ = ["ERROR", "FINISH_REASONS", "FREE", "LENGTH", "NO_STOP", "RUNNING", "STOP", "DecodeState",
           "DeferredContext"]

RUNNING, STOP, LENGTH, ERROR, FREE = 0, 1, 2, 3, 4
FINISH_REASONS = {STOP: "stop", LENGTH: "length", ERROR: "error: the target produced non-finite logits", FREE: "free"}
NO_STOP = -2  # pads a row's stop ids; matches no token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeferredContext:
    """Drafter-context features held back from the drafter's cache, ``P`` positions per row.

    Attributes:
      feats: ``[B, P, F]`` the target's features (``DecodePlan.hidden_layer_ids``' outputs,
        concatenated) of each row's next committed positions after its drafter context: entry
        ``j`` is position ``draft_cache.lengths[b] + j``; the first ``count[b]`` are valid.
      count: i32 ``[B]``.
    """

    feats: jax.Array
    count: jax.Array

    @classmethod
    def empty(cls, batch: int, length: int, features: int, dtype) -> DeferredContext:
        return cls(jnp.zeros((batch, length, features), dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def length(self) -> int:
        """P: the most positions a row can hold back."""
        return self.feats.shape[1]

    def push(self, feats: jax.Array, counts: jax.Array) -> DeferredContext:
        """The first ``counts [B]`` of ``feats [B, A, F]`` appended after each row's held positions
        (a row's positions past ``P`` are dropped: the caller keeps ``count + counts <= P``)."""
        idx = jnp.arange(feats.shape[1])[None]
        at = jnp.where(idx < counts[:, None], self.count[:, None] + idx, self.length)
        put = jax.vmap(lambda row, pos, values: row.at[pos].set(values.astype(row.dtype), mode="drop"))
        return DeferredContext(put(self.feats, at, feats), self.count + counts.astype(jnp.int32))

    def cleared(self) -> DeferredContext:
        """Nothing held back (the features stay: past ``count`` they are never read)."""
        return DeferredContext(self.feats, jnp.zeros_like(self.count))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["target_cache", "draft_cache", "root", "out", "generated", "finish", "accept_lengths", "rounds",
                 "max_new_tokens", "stop_ids", "sampling", "request_ids", "deferred"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot decoding state; ``B`` slots, output capacity ``C``, ``S`` stop ids per slot.

    Attributes:
      target_cache: the target's cache (``RowCache``) holding each row's committed tokens but the last.
      draft_cache: the drafter's context (``RowCache``), or ``None`` for autoregressive decoding.
      root: i32 ``[B]`` each row's last committed token (the next tree's root).
      out: i32 ``[B, C]`` generated tokens; the first ``generated[b]`` are valid.
      generated: i32 ``[B]``.
      finish: i32 ``[B]`` finish code (module doc).
      accept_lengths: i32 ``[B, C]`` tokens accepted per round (bonus included); the first
        ``rounds[b]`` are valid.
      rounds: i32 ``[B]`` rounds each row has run while running.
      max_new_tokens: i32 ``[B]`` each row's own limit (``<= C``).
      stop_ids: i32 ``[B, S]`` each row's stop tokens, padded with ``NO_STOP``.
      sampling: ``SamplingBatch`` with ``[B]`` fields.
      request_ids: u32 ``[B]`` stable ids that key unseeded rows' random streams (``ddtree_jax.rng``).
      deferred: the drafter context held back by autoregressive rounds (``DeferredContext``), or
        ``None``: those rounds then add it to ``draft_cache`` as they commit. A drafted round
        needs none held back (``auto_round.flush_deferred`` first).
    """

    target_cache: RowCache
    draft_cache: RowCache | None
    root: jax.Array
    out: jax.Array
    generated: jax.Array
    finish: jax.Array
    accept_lengths: jax.Array
    rounds: jax.Array
    max_new_tokens: jax.Array
    stop_ids: jax.Array
    sampling: SamplingBatch
    request_ids: jax.Array
    deferred: DeferredContext | None = None

    @classmethod
    def start(cls, target_cache: RowCache, draft_cache: RowCache | None, roots: jax.Array, *, capacity: int,
              max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingBatch, request_ids: jax.Array,
              finish: int = RUNNING) -> DecodeState:
        """A state of ``B = len(roots)`` slots with nothing generated yet: empty outputs and
        statistics, every slot's finish code ``finish`` (``RUNNING`` to decode, ``FREE`` for empty
        slots), the given per-slot limits, stop ids, sampling and request ids."""
        B = roots.shape[0]
        zeros = jnp.zeros((B,), jnp.int32)
        return cls(
            target_cache=target_cache, draft_cache=draft_cache, root=roots.astype(jnp.int32),
            out=jnp.zeros((B, capacity), jnp.int32), generated=zeros, finish=jnp.full((B,), finish, jnp.int32),
            accept_lengths=jnp.zeros((B, capacity), jnp.int32), rounds=zeros,
            max_new_tokens=max_new_tokens.astype(jnp.int32), stop_ids=stop_ids.astype(jnp.int32), sampling=sampling,
            request_ids=request_ids.astype(jnp.uint32),
        )

    def with_first_tokens(self, first: jax.Array, where: jax.Array | None = None) -> DecodeState:
        """The state after each running row (of those ``where [B]`` marks; default all) commits
        ``first [B]``, its first new token (drawn from the prompt's last position by the prefill;
        ``INVALID_TOKEN``, -1: the row's law was invalid there), by ``with_committed``: the token
        becomes the row's root and its first output, with stop tokens and ``max_new_tokens``
        applied. No round ran: the acceptance lengths and round counts stay empty."""
        active = ~self.done if where is None else ~self.done & where
        first = first.astype(jnp.int32)
        return self.with_committed(first[:, None], jnp.ones_like(first), active, first < 0)[0]

    def with_committed(self, tokens: jax.Array, n: jax.Array, active: jax.Array, invalid: jax.Array):
        """``(state, count)``: the state after each ``active [B]`` row commits the first ``n [B]``
        of ``tokens [B, A]``, truncated after its first stop token (kept) and at its
        ``max_new_tokens``; a row marked ``invalid [B]`` commits nothing and finishes ``ERROR``.
        The committed tokens go to ``out``, the last one becomes the root; ``count [B]`` is how
        many each row committed. Finish codes: ``STOP`` at a stop token, ``LENGTH`` at the limit."""
        A = tokens.shape[1]
        idx = jnp.arange(A)[None]
        is_stop = jnp.any(tokens[:, :, None] == self.stop_ids[:, None, :], axis=-1) & (idx < n[:, None])
        stop_at = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, A + 1)
        count = jnp.minimum(jnp.minimum(n, stop_at), self.max_new_tokens - self.generated)
        count = jnp.where(active & ~invalid, count, 0).astype(jnp.int32)
        # Row-wise writes (a vmapped scatter keeps its rows as a batch dim, which a mesh splitting
        # the rows partitions without gathering them)
        pos = jnp.where(idx < count[:, None], self.generated[:, None] + idx, self.capacity)
        out = jax.vmap(lambda row, at, values: row.at[at].set(values, mode="drop"))(self.out, pos, tokens)
        generated = self.generated + count
        last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        finish = jnp.where(active & invalid, ERROR, self.finish)
        finish = jnp.where(active & ~invalid & (stop_at <= count), STOP, finish)
        finish = jnp.where(active & (finish == RUNNING) & (generated >= self.max_new_tokens), LENGTH, finish)
        return dataclasses.replace(self, out=out, generated=generated, finish=finish,
                                   root=jnp.where(count > 0, last, self.root)), count

    @property
    def batch_size(self) -> int:
        return self.root.shape[0]

    @property
    def capacity(self) -> int:
        """C: the longest output any row can hold."""
        return self.out.shape[1]

    @property
    def done(self) -> jax.Array:
        """bool ``[B]``: the row commits nothing more (finished, or a free slot)."""
        return self.finish != RUNNING

    def take_rows(self, rows: jax.Array) -> DecodeState:
        """The state of slots ``rows [R]`` (rows may repeat), caches included."""

        def take(x):
            return jnp.take(x, rows, axis=0)

        return DecodeState(
            target_cache=self.target_cache.take_rows(rows),
            draft_cache=None if self.draft_cache is None else self.draft_cache.take_rows(rows),
            sampling=jax.tree.map(take, self.sampling), deferred=jax.tree.map(take, self.deferred),
            **{f: take(getattr(self, f)) for f in _ROW_FIELDS},
        )

    def put_rows(self, rows: jax.Array, src: DecodeState) -> DecodeState:
        """This state with slots ``rows [R]`` replaced by the R rows of ``src`` (same capacity and
        stop-id width)."""

        def put(x, y):
            return x.at[rows].set(y.astype(x.dtype))

        return DecodeState(
            target_cache=self.target_cache.put_rows(rows, src.target_cache),
            draft_cache=None if self.draft_cache is None else self.draft_cache.put_rows(rows, src.draft_cache),
            sampling=jax.tree.map(put, self.sampling, src.sampling),
            deferred=jax.tree.map(put, self.deferred, src.deferred),
            **{f: put(getattr(self, f), getattr(src, f)) for f in _ROW_FIELDS},
        )


_ROW_FIELDS = ("root", "out", "generated", "finish", "accept_lengths", "rounds", "max_new_tokens", "stop_ids",
               "request_ids")
