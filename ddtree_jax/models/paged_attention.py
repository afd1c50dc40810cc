"""MLA attention in the absorbed form over a paged latent cache (``paged_cache.PagedKVCache``).

``paged_latent_attention`` dispatches on the ``Backend`` as ``latent_attention`` does: where
``hopper_runs`` says so and the pages hold whole 64-key tiles, the Hopper kernel
(``prefix_block_attention`` with the ``page_table``); else, where the family has the Triton MLA
kernel, ``pallas_kernels.triton.mla_attention`` with its ``page_table`` (each key tile loaded from
its page; the same fixed reduction segments as ``latent_attention``); elsewhere
``paged_latent_attention_reference``, the contiguous view (``gather_positions``) through
``latent_attention_reference``. ``layout_latent_attention``
is the models' entry: ``latent_attention`` or ``paged_latent_attention`` by the cache's
``CacheLayout``. Design: docs/paged-caches.md, "Device layout and kernels".
"""

from __future__ import annotations

import chex
import jax

from ddtree_jax.backend import Backend, has_kernel
from ddtree_jax.config import MIN_PAGE_SIZE, SEGMENT_GROUP, SEGMENT_KEYS, is_page_size
from ddtree_jax.models.interface import CacheLayout
from ddtree_jax.models.latent_attention import (
    AttentionMesh,
    hopper_runs,
    latent_attention,
    latent_attention_reference,
    prefix_block_attention,
    segmented_split,
)
from ddtree_jax.models.paged_cache import gather_positions
from ddtree_jax.models.tree_cache import BlockMask

__all__ = ["MIN_KERNEL_PAGE", "layout_latent_attention", "paged_latent_attention", "paged_latent_attention_reference"]

MIN_KERNEL_PAGE = MIN_PAGE_SIZE  # the smallest page the kernel takes: its smallest key tile


def paged_latent_attention_reference(q_latent: jax.Array, q_rope: jax.Array, pool_latent: jax.Array,
                                     pool_k_rope: jax.Array, page_table: jax.Array, mask: BlockMask, *,
                                     scale: float) -> jax.Array:
    """``q_latent [B,T,H,r]``, ``q_rope [B,T,H,dr]`` over the pools ``pool_latent [N,P,r]``,
    ``pool_k_rope [N,P,dr]`` through ``page_table [B, pages]`` -> ``[B,T,H,r]`` in ``q_latent``'s
    dtype: ``latent_attention_reference`` on the gathered ``[B, pages * P, ...]`` caches."""
    s = page_table.shape[1] * pool_latent.shape[1]
    return latent_attention_reference(q_latent, q_rope, gather_positions(pool_latent, page_table, s),
                                      gather_positions(pool_k_rope, page_table, s), mask, scale=scale)


def paged_latent_attention(q_latent: jax.Array, q_rope: jax.Array, pool_latent: jax.Array, pool_k_rope: jax.Array,
                           page_table: jax.Array, mask: BlockMask, *, scale: float, backend: Backend,
                           segment_keys: int | None = SEGMENT_KEYS, segment_group: int = SEGMENT_GROUP,
                           hopper: bool = True) -> jax.Array:
    """Absorbed MLA attention over a paged cache (shapes: ``paged_latent_attention_reference``).

    The block's own latents must already be in the pools at positions ``[start, start+T)`` of
    each row (``paged_cache.write_tokens``), with ``start + T <= pages * P``. With the Triton
    kernel: key tiles of ``min(default_tiles' block_k, P)`` keys (``P`` a power of two of at
    least ``MIN_KERNEL_PAGE``, else a ``ValueError``), the split chosen as ``latent_attention``
    chooses it, and fixed segments of ``segment_keys`` (``None``/0: none) in groups of
    ``segment_group``. With ``hopper``, where ``hopper_runs`` says so (``P`` a multiple of the
    Hopper kernel's 64-key tile among its conditions): ``prefix_block_attention`` through the table (the batch-invariant
    mode passes ``hopper=False``, as to ``latent_attention``). Runs on one device's arrays: on a
    mesh the caller runs it per shard with that shard's pool and table.
    """
    b, t, h, r = q_latent.shape
    n, page, _ = pool_latent.shape
    chex.assert_shape([q_latent, pool_latent, pool_k_rope, page_table, mask.start],
                      [(b, t, h, r), (n, page, r), (n, page, q_rope.shape[-1]), (b, None), (b,)])
    if not has_kernel(backend, "mla_attention"):
        return paged_latent_attention_reference(q_latent, q_rope, pool_latent, pool_k_rope, page_table, mask,
                                                scale=scale)
    from pallas_kernels.triton.mla_attention import auto_split_keys, default_tiles, mla_attention

    s = page_table.shape[1] * page
    if hopper and hopper_runs(backend, t, h, r, q_rope.shape[-1], pool_latent.dtype, s, page_size=page):
        return prefix_block_attention(q_latent, q_rope, pool_latent, pool_k_rope, mask.start, mask.within,
                                      scale=float(scale), page_table=page_table)
    if not is_page_size(page):
        raise ValueError(f"paged_latent_attention: the kernel needs pages of a power of two >= {MIN_KERNEL_PAGE} "
                         f"positions, got {page}")
    tiles = default_tiles(pool_latent.dtype)
    block_k = min(tiles["block_k"], page)
    split, segment_keys = segmented_split(auto_split_keys(b, t * h, s, block_m=tiles["block_m"], block_k=block_k),
                                          segment_keys or 0, segment_group, block_k)
    out = mla_attention(q_latent.astype(pool_latent.dtype), q_rope.astype(pool_k_rope.dtype), pool_latent,
                        pool_k_rope, mask.start, mask.within, scale=float(scale), causal=mask.causal, block_k=block_k,
                        split_keys=split, segment_keys=segment_keys, segment_group=segment_group,
                        interpret=backend.interpret, page_table=page_table)
    return out.astype(q_latent.dtype)


def layout_latent_attention(layout: CacheLayout, q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array,
                            k_rope: jax.Array, mask: BlockMask, *, scale: float, backend: Backend,
                            mesh: AttentionMesh | None, segment_keys: int | None, segment_group: int,
                            hopper: bool) -> jax.Array:
    """Absorbed MLA attention over one layer's cache buffers laid out as ``layout`` says:
    ``latent_attention`` (every argument as there) for contiguous buffers, else
    ``paged_latent_attention`` over the pools through ``layout.page_table`` (one device's arrays:
    a ``mesh`` is a ``ValueError``)."""
    if layout.page_table is None:
        return latent_attention(q_latent, q_rope, latent, k_rope, mask, scale=scale, backend=backend, mesh=mesh,
                                segment_keys=segment_keys, segment_group=segment_group, hopper=hopper)
    if mesh is not None:
        raise ValueError("paged latent attention runs on one device's arrays; this model is placed on a mesh")
    return paged_latent_attention(q_latent, q_rope, latent, k_rope, layout.page_table, mask, scale=scale,
                                  backend=backend, segment_keys=segment_keys, segment_group=segment_group,
                                  hopper=hopper)
