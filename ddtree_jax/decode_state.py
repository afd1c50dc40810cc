"""The state of a batch of requests between decoding rounds, as one typed pytree.

A ``DecodeState`` has one row ("slot") per request. Everything a round needs is data in it —
both caches, each row's last committed token, its output buffer, its own token limit, stop ids,
sampling settings and random-stream id — so the compiled round never recompiles for new
requests, and a serving loop can move requests in and out of slots between rounds with
``take_rows`` / ``put_rows`` without knowing how a model lays out its cache.

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

__all__ = ["ERROR", "FINISH_REASONS", "FREE", "LENGTH", "NO_STOP", "RUNNING", "STOP", "DecodeState"]

RUNNING, STOP, LENGTH, ERROR, FREE = 0, 1, 2, 3, 4
FINISH_REASONS = {STOP: "stop", LENGTH: "length", ERROR: "error: the target produced non-finite logits", FREE: "free"}
NO_STOP = -2  # pads a row's stop ids; matches no token


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["target_cache", "draft_cache", "root", "out", "generated", "finish", "accept_lengths", "rounds",
                 "max_new_tokens", "stop_ids", "sampling", "request_ids"],
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
            sampling=jax.tree.map(take, self.sampling),
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
            **{f: put(getattr(self, f), getattr(src, f)) for f in _ROW_FIELDS},
        )


_ROW_FIELDS = ("root", "out", "generated", "finish", "accept_lengths", "rounds", "max_new_tokens", "stop_ids",
               "request_ids")
