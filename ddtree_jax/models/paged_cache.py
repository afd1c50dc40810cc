"""Paged caches on the device: per-layer page pools shared by all slots, one page table per cache.

A paged cache keeps, per layer, a pool ``[num_pages, P, ...]`` of pages of ``P`` positions (``P``
a power of two) and, for all its layers, ``page_table [B, pages_per_slot] int32`` and ``lengths
[B] int32``: position p of row b lives at ``pool[page_table[b, p // P], p % P]``, so a row holds
up to ``max_len = pages_per_slot * P`` positions. Page ``NULL_PAGE`` (0) is reserved: the host
allocator never hands it out and unused table entries point at it. Nothing here writes it
(``write_tokens`` drops writes that map to it or past the table), so it keeps its initial zeros
and reads through it give zeros, as the unwritten slots of a contiguous cache do.

The pure functions are the paged counterparts of the contiguous cache's operations:
``write_tokens`` (``_layers.write_rows``), ``commit_path`` (``tree_cache.commit_accepted``),
``gather_positions`` (the contiguous ``[B, length, ...]`` view: the reference path, which then
calls the contiguous code) and ``read_tokens``. Each equals the contiguous operation applied to
the gathered view and scattered back through the table (tests/test_paged_cache.py); ``PageLayout``
bundles them as the paged ``CacheLayout`` (``ddtree_jax.models.interface``), the ``layout`` of
both caches, through which the models read and write them. Rows must
not write to a page another row reads or writes in the same call: a page shared by several rows
(a common prompt prefix) lies wholly below each sharer's ``start``. Design:
docs/paged-caches.md, "Device layout and kernels".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = [
    "NULL_PAGE",
    "PageLayout",
    "PagedDraftCache",
    "PagedKVCache",
    "commit_path",
    "gather_positions",
    "read_tokens",
    "write_tokens",
]

NULL_PAGE = 0


def _check_layout(num_pages: int, page_size: int, pages_per_slot: int, batch: int) -> None:
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"paged cache: page_size must be a power of two, got {page_size}")
    if num_pages < 2 or pages_per_slot < 1 or batch < 1:
        raise ValueError(f"paged cache: need num_pages >= 2 (page {NULL_PAGE} is reserved), pages_per_slot >= 1 and "
                         f"batch >= 1, got {num_pages}, {pages_per_slot}, {batch}")


def _empty_rows(batch: int, pages_per_slot: int) -> tuple[jax.Array, jax.Array]:
    """``(page_table, lengths)`` of ``batch`` rows holding nothing: every entry ``NULL_PAGE``."""
    return jnp.full((batch, pages_per_slot), NULL_PAGE, jnp.int32), jnp.zeros((batch,), jnp.int32)


class _PageTableRows:
    """``take_rows`` / ``put_rows`` of a paged cache (a dataclass with ``page_table`` and
    ``lengths``): they act on the table and lengths, never on the shared pools."""

    def take_rows(self, rows: jax.Array):
        """The cache of batch rows ``rows [R]``: their table rows and lengths over the same pools
        (rows may repeat; repeated rows share their pages, so at most one of them may write)."""
        return dataclasses.replace(self, page_table=jnp.take(self.page_table, rows, axis=0),
                                   lengths=jnp.take(self.lengths, rows, axis=0))

    def put_rows(self, rows: jax.Array, src):
        """This cache with batch rows ``rows [R]`` replaced by ``src``'s R rows. ``src`` shares
        this cache's pools (a ``take_rows`` of it, written since): the result carries ``src``'s
        pools, which hold every row's pages."""
        return dataclasses.replace(src, page_table=self.page_table.at[rows].set(src.page_table),
                                   lengths=self.lengths.at[rows].set(src.lengths))

    @property
    def pages_per_slot(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_len(self) -> int:
        """Positions a row can hold: ``pages_per_slot * page_size``."""
        return self.pages_per_slot * self.page_size

    @property
    def layout(self) -> PageLayout:
        """Where the pools hold each row's positions: through ``page_table``."""
        return PageLayout(self.page_table)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(_PageTableRows):
    """The target's MLA latent cache in pages (the paged ``kimi.KVCache``).

    ``latent``: per layer, ``[num_pages, P, kv_lora_rank]``; ``k_rope``: per layer,
    ``[num_pages, P, qk_rope_head_dim]``; ``page_table [B, pages_per_slot] int32`` (shared by the
    layers); ``lengths [B] int32``: committed tokens per row. Positions at and past ``lengths``
    are scratch.
    """

    latent: tuple[jax.Array, ...]
    k_rope: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, num_pages: int, page_size: int, pages_per_slot: int, batch: int, *, num_layers: int,
             kv_lora_rank: int, qk_rope_head_dim: int, dtype) -> PagedKVCache:
        """Zero pools, every table entry ``NULL_PAGE``, lengths 0."""
        _check_layout(num_pages, page_size, pages_per_slot, batch)
        layers = range(num_layers)
        return cls(tuple(jnp.zeros((num_pages, page_size, kv_lora_rank), dtype) for _ in layers),
                   tuple(jnp.zeros((num_pages, page_size, qk_rope_head_dim), dtype) for _ in layers),
                   *_empty_rows(batch, pages_per_slot))

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedDraftCache(_PageTableRows):
    """The drafter's context keys and values in pages (the paged ``dflash.DraftCache``).

    ``k``, ``v``: per draft layer, ``[num_pages, P, kv_heads, head_dim]``; ``page_table [B,
    pages_per_slot] int32`` (shared by the layers); ``lengths [B] int32``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, num_pages: int, page_size: int, pages_per_slot: int, batch: int, *, num_layers: int,
             kv_heads: int, head_dim: int, dtype) -> PagedDraftCache:
        """Zero pools, every table entry ``NULL_PAGE``, lengths 0."""
        _check_layout(num_pages, page_size, pages_per_slot, batch)
        shape = (num_pages, page_size, kv_heads, head_dim)
        layers = range(num_layers)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers),
                   *_empty_rows(batch, pages_per_slot))

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def _locate(pool: jax.Array, page_table: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(page, slot)`` of ``positions [B, N]``; positions past the table or on ``NULL_PAGE`` get
    page ``num_pages`` (out of bounds: writes there are dropped, reads give zeros)."""
    num_pages, page_size = pool.shape[:2]
    index = positions // page_size
    covered = index < page_table.shape[1]
    page = jnp.take_along_axis(page_table, jnp.minimum(index, page_table.shape[1] - 1), axis=1)
    page = jnp.where(covered & (page != NULL_PAGE), page, num_pages)
    return page, positions % page_size


def read_tokens(pool: jax.Array, page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """``pool [N, P, ...]`` entries at ``positions [B, K]`` (non-negative) of each row ->
    ``[B, K, ...]``; positions on ``NULL_PAGE`` or past the table read zeros."""
    page, slot = _locate(pool, page_table, positions)
    return pool.at[page, slot].get(mode="fill", fill_value=0)


def write_tokens(pool: jax.Array, page_table: jax.Array, start: jax.Array, values: jax.Array) -> jax.Array:
    """The paged ``write_rows``: ``values [B, T, ...]`` into ``pool [N, P, ...]`` at positions
    ``start[b] + t`` of each row (cast to the pool's dtype). Positions past the table
    (``>= pages_per_slot * P``) or whose entry is ``NULL_PAGE`` are dropped: page 0 is never
    written. Rows write disjoint pages (see the module's docstring); with the pool donated the
    update is in place."""
    positions = start[:, None] + jnp.arange(values.shape[1], dtype=start.dtype)[None, :]
    page, slot = _locate(pool, page_table, positions)
    return pool.at[page, slot].set(values.astype(pool.dtype), mode="drop")


def gather_positions(pool: jax.Array, page_table: jax.Array, length: int) -> jax.Array:
    """The contiguous view ``[B, length, ...]`` of positions ``[0, length)`` of every row
    (``length <= pages_per_slot * P``, static), whole pages at a time; entries on ``NULL_PAGE``
    read its zeros."""
    page_size = pool.shape[1]
    if not 0 <= length <= page_table.shape[1] * page_size:
        raise ValueError(f"gather_positions: length {length} outside [0, {page_table.shape[1] * page_size}]")
    pages = -(-length // page_size)
    view = jnp.take(pool, page_table[:, :pages], axis=0)  # [B, pages, P, ...]
    return view.reshape(view.shape[0], pages * page_size, *pool.shape[2:])[:, :length]


def commit_path(pool: jax.Array, page_table: jax.Array, start: jax.Array, accepted: jax.Array) -> jax.Array:
    """The paged ``commit_accepted``: move the accepted nodes of the last block into place.

    The pool holds row b's block of ``T`` nodes at positions ``[start[b], start[b] + T)``;
    ``accepted [B, A]`` lists node indices in path order (root first), ``-1`` padded. Node
    ``accepted[b, i]`` moves to position ``start[b] + i``; padded entries copy node 0 onto
    positions past the accepted ones (scratch). Only ``A`` positions per row are read and written
    (``write_tokens``' rules: nothing lands on ``NULL_PAGE`` or past the table).
    """
    source = start[:, None] + jnp.maximum(accepted, 0)
    return write_tokens(pool, page_table, start, read_tokens(pool, page_table, source))


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The paged ``CacheLayout``: a pool ``[N, P, ...]`` holds position p of row b at
    ``[page_table[b, p // P], p % P]``; the operations are this module's functions (their rules:
    nothing lands on ``NULL_PAGE`` or past the table)."""

    page_table: jax.Array

    def write(self, pool: jax.Array, start: jax.Array, values: jax.Array) -> jax.Array:
        """``write_tokens``."""
        return write_tokens(pool, self.page_table, start, values)

    def commit(self, pool: jax.Array, start: jax.Array, accepted: jax.Array) -> jax.Array:
        """``commit_path``."""
        return commit_path(pool, self.page_table, start, accepted)

    def view(self, pool: jax.Array, length: int) -> jax.Array:
        """``gather_positions``: positions ``[0, length)`` of every row, ``[B, length, ...]``."""
        return gather_positions(pool, self.page_table, length)
