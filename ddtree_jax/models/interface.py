"""What the decode loop needs from a target and a drafter (structural ``Protocol`` types).

Any model with these methods runs under ``generate`` and the serving loop: the Kimi/DeepSeek-V3
target and the DFlash drafter implement them, and so do the hand-built test models in
``ddtree_jax.testing``. Shapes: ``B`` batch rows, ``T`` block tokens, ``V`` vocabulary, ``H``
hidden size, ``L`` draft depth (``block_size - 1``).
"""

from __future__ import annotations

from typing import Any, Protocol, Self, runtime_checkable

import jax

__all__ = ["CacheLayout", "DraftModel", "RowCache", "TargetModel"]


@runtime_checkable
class RowCache(Protocol):
    """A per-request cache: ``lengths [B]`` committed positions per row, batch rows that can be
    gathered and replaced without the caller knowing the layout of the arrays."""

    lengths: jax.Array

    def take_rows(self, rows: jax.Array) -> Self:
        """The cache of rows ``rows [R]`` (rows may repeat)."""
        ...

    def put_rows(self, rows: jax.Array, src: Self) -> Self:
        """This cache with rows ``rows [R]`` replaced by the R rows of ``src``."""
        ...


class CacheLayout(Protocol):
    """Where a cache's buffers hold each row's positions: the one place the models' forward passes
    learn whether a cache is contiguous (``tree_cache.ROWS``: buffers ``[B, S, ...]``) or paged
    (``paged_cache.PageLayout``: pools ``[N, P, ...]`` through a page table). The Kimi target and
    the DFlash drafter read and write their caches only through their cache's ``layout``."""

    page_table: jax.Array | None  # None: contiguous

    def write(self, buffer: jax.Array, start: jax.Array, values: jax.Array) -> jax.Array:
        """``buffer`` with ``values [B, T, ...]`` at positions ``start[b] + t`` of each row."""
        ...

    def commit(self, buffer: jax.Array, start: jax.Array, accepted: jax.Array) -> jax.Array:
        """``buffer`` with the accepted nodes ``accepted [B, A]`` (``-1`` padded) of the block at
        ``[start, start + T)`` moved to ``start + i`` (``tree_cache.commit_accepted``)."""
        ...

    def view(self, buffer: jax.Array, length: int) -> jax.Array:
        """The contiguous ``[B, length, ...]`` view of positions ``[0, length)``."""
        ...


@runtime_checkable
class TargetModel(Protocol):
    """The model whose sampling law the output follows.

    ``config`` has at least ``vocab_size``, ``hidden_size``, ``num_hidden_layers`` and
    ``max_position_embeddings``. ``hidden_layer_ids`` names layers whose outputs are returned as
    features for the drafter (a tuple of ``[B, T, H]``).
    """

    config: Any

    def init_cache(self, batch: int, max_len: int) -> RowCache: ...

    def prefill(self, input_ids: jax.Array, lengths: jax.Array, cache: RowCache, *,
                hidden_layer_ids: tuple[int, ...] = (), valid: jax.Array | None = None,
                logits_at: jax.Array | None = None,
                ) -> tuple[jax.Array, tuple[jax.Array, ...], RowCache]:
        """Append a causal chunk ``input_ids [B, T]`` (``lengths [B]`` valid) after each row's prefix.
        ``valid [B, T]`` bool (None: all) marks the tokens before each row's length; a model may
        skip work for the others (their outputs are meaningless anyway). Logits ``[B, T, V]``, or
        with ``logits_at [B]`` (positions in the chunk) ``[B, 1, V]`` at those positions."""
        ...

    def verify(self, tokens: jax.Array, depths: jax.Array, ancestor_mask: jax.Array, cache: RowCache, *,
               hidden_layer_ids: tuple[int, ...] = (), valid: jax.Array | None = None,
               ) -> tuple[jax.Array, tuple[jax.Array, ...], RowCache]:
        """Logits ``[B, T, V]`` at every node of a tree block; the cache's lengths do not move.
        ``valid [B, T]`` bool (None: all) marks the used node slots; outputs at the others are
        meaningless (a model may skip work for them)."""
        ...

    def commit(self, cache: RowCache, accepted: jax.Array, counts: jax.Array) -> RowCache:
        """Keep the accepted path ``accepted [B, A]`` (``counts [B]`` valid) of the last block."""
        ...

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embedding ``[...] -> [..., H]`` (the drafter shares it)."""
        ...

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """LM head ``[..., H] -> float32 [..., V]`` (the drafter shares it)."""
        ...


@runtime_checkable
class DraftModel(Protocol):
    """A block drafter: ``config`` has ``block_size`` and ``target_layer_ids``."""

    config: Any

    def init_cache(self, batch: int, max_len: int) -> RowCache: ...

    def append_context(self, cache: RowCache, target_hidden: jax.Array, counts: jax.Array) -> RowCache:
        """Add the target's features ``[B, A, n*H]`` of newly committed tokens (``counts [B]`` valid)."""
        ...

    def propose(self, target: TargetModel, cache: RowCache, last_token: jax.Array, *,
                depths: int | None = None) -> jax.Array:
        """Draft logits ``float32 [B, L, V]`` for depths ``1..L`` after ``last_token [B]``; with
        ``depths``, only the first ``depths`` of them (the same values: a tree of budget ``b``
        never goes deeper than ``b``)."""
        ...
