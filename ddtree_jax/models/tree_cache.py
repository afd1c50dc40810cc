"""Cache bookkeeping that every target needs for tree verification, whatever its attention.

A target's cache holds, per batch row, ``lengths[b]`` committed positions and scratch after
them. ``verify`` writes a tree block of ``T`` nodes at ``[lengths, lengths + T)`` without moving
the lengths; ``commit`` then moves the accepted nodes (a root-to-leaf path) into place and
advances the lengths. These helpers do both for caches stored as ``[layers, B, S, ...]`` arrays;
``ROWS`` bundles them as the contiguous ``CacheLayout`` (``ddtree_jax.models.interface``; the paged
one is ``paged_cache.PageLayout``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.models._layers import write_rows

__all__ = ["ROWS", "BlockMask", "RowLayout", "block_attention_mask", "causal_block_mask", "commit_accepted",
           "tree_block_mask"]


def causal_block_mask(batch: int, size: int) -> jax.Array:
    """``[B, T, T]``: block token i sees block tokens ``j <= i`` (a prompt chunk, a decode step)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((size, size), bool)), (batch, size, size))


def tree_block_mask(ancestor_mask: jax.Array) -> jax.Array:
    """``[B, T, T]``: a tree node sees its ancestors and itself (the diagonal is added)."""
    return ancestor_mask | jnp.eye(ancestor_mask.shape[-1], dtype=bool)[None]


def block_attention_mask(block_mask: jax.Array, start: jax.Array, max_len: int) -> jax.Array:
    """Where a block written at ``start [B]`` may attend over the whole cache: ``[B, T, max_len]``.

    Every committed position (``< start``) is visible; within the block, ``block_mask [B, T, T]``
    decides; positions after the block are not visible.
    """
    b, t, _ = block_mask.shape
    rel = jnp.arange(max_len)[None, :] - start[:, None]  # [B, S]
    in_block = (rel >= 0) & (rel < t)
    block_part = jnp.take_along_axis(block_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None], (b, t, max_len)),
                                     axis=2)
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & block_part)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Where a block of ``T`` tokens written at ``start`` may attend, without a ``[B,T,S]`` array.

    ``start [B] int32``: the committed prefix of each row (all of it is visible);
    ``within [B,T,T] bool`` (which block tokens see which, e.g. ``tree_block_mask``), or ``None``
    for a causal block (a prompt chunk, a decode step). Keys after the block are not visible.
    Attention kernels read this description; ``dense`` is the plain mask the references use.
    """

    start: jax.Array
    within: jax.Array | None = None

    @property
    def causal(self) -> bool:
        return self.within is None

    def dense(self, size: int, max_len: int) -> jax.Array:
        """``[B, size, max_len]`` bool for a block of ``size`` tokens over a ``max_len`` cache."""
        within = causal_block_mask(self.start.shape[0], size) if self.within is None else self.within
        return block_attention_mask(within, self.start, max_len)


def commit_accepted(buffer: jax.Array, start: jax.Array, accepted: jax.Array) -> jax.Array:
    """Move the accepted nodes of the last block into place in one layer's cache array.

    ``buffer [B, S, ...]`` holds the block at ``[start, start + T)``; ``accepted [B, A]`` lists
    node indices in path order (root first), ``-1`` padded. Node ``accepted[b, i]`` moves to
    ``start[b] + i``; padded entries copy node 0 onto positions past the accepted ones (scratch).
    Only ``A`` rows per batch row are read and written: with the buffer donated (the decode loop's
    carry), the update happens in place.
    """
    src = start[:, None] + jnp.maximum(accepted, 0)
    index = src.reshape(src.shape + (1,) * (buffer.ndim - 2))
    picked = jnp.take_along_axis(buffer, index, axis=1)
    return write_rows(buffer, picked, start)


class RowLayout:
    """The contiguous ``CacheLayout``: a buffer ``[B, S, ...]`` holds position p of row b at
    ``[b, p]``. Stateless: use ``ROWS``."""

    page_table = None

    def write(self, buffer: jax.Array, start: jax.Array, values: jax.Array) -> jax.Array:
        """``write_rows``: ``values [B, T, ...]`` at positions ``start[b] + t`` (``start + T <= S``)."""
        return write_rows(buffer, values, start)

    def commit(self, buffer: jax.Array, start: jax.Array, accepted: jax.Array) -> jax.Array:
        """``commit_accepted``."""
        return commit_accepted(buffer, start, accepted)

    def view(self, buffer: jax.Array, length: int) -> jax.Array:
        """Positions ``[0, length)`` of every row: ``[B, length, ...]``."""
        return buffer[:, :length]


ROWS = RowLayout()
