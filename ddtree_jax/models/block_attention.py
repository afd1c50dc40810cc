"""A draft block's attention over its context and itself: the DFlash drafter's attention.

Block token ``t`` of row ``b`` sits at position ``lengths[b] + t`` after its context (positions
``0 .. lengths[b] - 1`` of the cache, which holds ``S >= lengths`` positions). It sees every
context position before ``lengths[b]`` and the block's tokens; a causal layer hides the block's
later tokens and a sliding layer of half-width ``window`` every key ``|offset| >= window`` away.

Two implementations, the same contract: ``impl="reference"`` concatenates the context and the
block and runs a masked softmax over all ``S + T`` keys (plain JAX, what the tests check against);
the Triton kernel (``pallas_kernels/triton/block_attention.py``) reads each row's context only up
to its length, so a draft costs what the rows hold, not what the cache could hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.backend import Backend, has_kernel, kernel_module
from ddtree_jax.models._layers import masked_softmax
from ddtree_jax.models.paged_cache import gather_positions

__all__ = ["block_attention", "block_attention_reference", "block_mask"]


def block_mask(lengths: jax.Array, s: int, t: int, *, causal: bool, window: int | None) -> jax.Array:
    """bool ``[B, T, S + T]``: which keys (the ``S`` context positions, then the block's ``T``
    tokens) each block token sees (module doc)."""
    key_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(s)[None], (lengths.shape[0], s)),
                               lengths[:, None] + jnp.arange(t)[None]], axis=1)
    query_pos = lengths[:, None] + jnp.arange(t)[None]
    valid = jnp.concatenate([key_pos[:, :s] < lengths[:, None], jnp.ones((lengths.shape[0], t), bool)], axis=1)
    offset = query_pos[:, :, None] - key_pos[:, None, :]
    mask = valid[:, None, :]
    if causal:
        mask = mask & (offset >= 0)
    if window is not None:
        mask = mask & (jnp.abs(offset) < window)
    return mask


def block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, lengths, *, causal: bool, window: int | None,
                              scale: float) -> jax.Array:
    """``q [B,T,N,D]``, ``k_ctx, v_ctx [B,S,K,D]``, ``k_blk, v_blk [B,T,K,D]``, ``lengths [B]`` ->
    ``[B,T,N,D]`` in ``q``'s dtype (query head ``n`` reads key-value head ``n // (N // K)``)."""
    b, t, n, d = q.shape
    s, kh = k_ctx.shape[1], k_ctx.shape[2]
    q = q.reshape(b, t, kh, n // kh, d)
    k = jnp.concatenate([k_ctx.astype(q.dtype), k_blk.astype(q.dtype)], axis=1)
    v = jnp.concatenate([v_ctx.astype(q.dtype), v_blk.astype(q.dtype)], axis=1)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
    mask = block_mask(lengths, s, t, causal=causal, window=window)
    probs = masked_softmax(scores * scale, mask[:, None, None]).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, n, d)


def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, lengths, *, causal: bool, window: int | None, scale: float,
                    backend: Backend, page_table: jax.Array | None = None) -> jax.Array:
    """``block_attention_reference``'s result, through the Triton kernel where ``backend`` runs it
    (each row's result then depends only on its own data, whatever the batch). With ``page_table
    [B, pages]`` the context is a page pool ``[N, P, K, D]`` (``paged_cache.PagedDraftCache``):
    the kernel reads each row's pages in place; the reference gathers them first."""
    if has_kernel(backend, "block_attention"):
        return kernel_module(backend, "block_attention").block_attention(
            q, k_ctx, v_ctx, k_blk, v_blk, lengths, page_table, causal=causal, window=window, scale=scale,
            interpret=backend.interpret)
    if page_table is not None:
        length = page_table.shape[1] * k_ctx.shape[1]
        k_ctx, v_ctx = (gather_positions(x, page_table, length) for x in (k_ctx, v_ctx))
    return block_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, lengths, causal=causal, window=window,
                                     scale=scale)
