"""A draft block's attention over its context and itself (Pallas Triton): the DFlash drafter's
attention, reading only each row's real context length.

``block_attention(q [B,T,N,D], k_ctx, v_ctx [B,S,K,D], k_blk, v_blk [B,T,K,D], lengths [B], *,
causal, window, scale)`` -> ``[B,T,N,D]`` in the query dtype, float32 accumulators. Block token
``t`` of row ``b`` sits at position ``lengths[b] + t``; it sees the context positions
``p < lengths[b]`` (with ``window``: only ``lengths[b] + t - p < window``) and the block tokens
``t'`` (``t' <= t`` if ``causal``; ``|t - t'| < window`` with ``window``). Query head ``n`` uses
key-value head ``n // (N // K)``. Reference: ``ddtree_jax.models.block_attention.block_attention
(impl="reference")``; tests/test_block_attention.py.

With ``page_table [B, pages]`` the context is a page pool (``k_ctx, v_ctx [N,P,K,D]``, position
``p`` of row ``b`` at page ``page_table[b, p // P]``, slot ``p % P``; ``lengths <= pages * P``):
the same kernel, each key tile loaded from its page (the tile divides ``P``).

FlashAttention-2 online softmax. One program per (row, key-value head, context chunk): its ``G *
T`` query rows (``G = N // K`` heads share the keys) loop over the chunk's key tiles up to the
row's length, so a round's cost follows the context the rows hold, not the cache's ``S``. Chunks
of ``CHUNK`` positions start at fixed positions and are merged in order, with the block's own
keys folded into chunk 0: a row's result depends only on its own data (not on ``B`` or ``S``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.triton._online_softmax import _LOG2E, _contiguous_tile, _dot, _fresh, _merge, _paged

__all__ = ["CHUNK", "block_attention"]

CHUNK = 1024  # context positions per program


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _fold(carry, s, v):
    """One key tile's scores ``s [BM, BK]`` (log2 units, -inf where hidden) and values into the
    running ``(o, m, den)``."""
    o, m, den = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    return o * corr[:, None] + _dot(p.astype(v.dtype), v), m_new, den * corr + p.sum(axis=-1)


def _kernel(len_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, o_ref, m_ref, den_ref, *, T, G, BM, BT, BK, DP,
            causal, window, scale_log2, tile_at=_contiguous_tile):
    b, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n = len_ref[b]
    tok = jnp.arange(BM, dtype=jnp.int32) // G
    q = q_ref[b, kh, :, :]
    lo = sp * CHUNK
    hi = jnp.minimum(lo + CHUNK, n)

    def ctx_tile(i, carry):
        k0 = pl.multiple_of(lo + i * BK, BK)
        kpos = k0 + jnp.arange(BK, dtype=jnp.int32)
        kin = kpos < hi
        row, slot = tile_at(b, k0)
        k = plgpu.load(kc_ref.at[row, pl.ds(slot, BK), kh, :], mask=kin[:, None], other=0)
        v = plgpu.load(vc_ref.at[row, pl.ds(slot, BK), kh, :], mask=kin[:, None], other=0)
        vis = kin[None, :]
        if window is not None:
            vis = vis & (n + tok[:, None] - kpos[None, :] < window)
        s = jnp.where(vis, _dot(q, k, trans_b=True) * scale_log2, -jnp.inf)
        return _fold(carry, s, v)

    carry = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), BK), ctx_tile, _fresh(BM, DP))
    # the block's own keys, folded in chunk 0 only (elsewhere every score is hidden: no change)
    t2 = jnp.arange(BT, dtype=jnp.int32)
    vis = (t2 < T)[None, :] & (sp == 0)
    if causal:
        vis = vis & (t2[None, :] <= tok[:, None])
    if window is not None:
        vis = vis & (jnp.abs(tok[:, None] - t2[None, :]) < window)
    k, v = kb_ref[b, :, kh, :], vb_ref[b, :, kh, :]
    o, m, den = _fold(carry, jnp.where(vis, _dot(q, k, trans_b=True) * scale_log2, -jnp.inf), v)
    o_ref[b, kh, sp, :, :] = o
    m_ref[b, kh, sp, :] = m
    den_ref[b, kh, sp, :] = den


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "interpret"))
def block_attention(q, k_ctx, v_ctx, k_blk, v_blk, lengths, page_table=None, *, causal: bool = False,
                    window: int | None = None, scale: float, interpret: bool = False):
    """The module docstring's attention; ``lengths <= S`` (paged: ``<= pages * P``). The context
    is read in place when ``S`` (paged: ``P``) is a multiple of 16 and ``D`` a power of two from 16
    (else it is padded first: a copy)."""
    B, T, N, D = q.shape
    _, S, K, _ = k_ctx.shape  # paged: S is the page size P
    G = N // K
    R = T * G
    BM, BT, DP = _pow2(R), _pow2(T), _pow2(D)
    BK = next((bk for bk in (64, 32, 16) if S % bk == 0), 64)
    SP = -(-S // BK) * BK
    if (SP, DP) != (S, D):
        if page_table is not None and SP != S:
            raise ValueError(f"block_attention: pages of {S} positions; the kernel needs a multiple of 16")
        pad = ((0, 0), (0, SP - S), (0, 0), (0, DP - D))
        k_ctx, v_ctx = jnp.pad(k_ctx, pad), jnp.pad(v_ctx, pad)
    chunks = pl.cdiv(S if page_table is None else page_table.shape[1] * S, CHUNK)
    # [B, K, BM, DP]: a key-value head's query rows token-major (row t*G + g), zero padded
    rows = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, R, D)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, BM - R), (0, DP - D)))
    blk = ((0, 0), (0, BT - T), (0, 0), (0, DP - D))
    k_blk, v_blk = jnp.pad(k_blk, blk).astype(k_ctx.dtype), jnp.pad(v_blk, blk).astype(k_ctx.dtype)
    static = dict(T=T, G=G, BM=BM, BT=BT, BK=BK, DP=DP, causal=causal, window=window, scale_log2=scale * _LOG2E)
    args = (lengths.astype(jnp.int32), rows.astype(k_ctx.dtype), k_ctx, v_ctx, k_blk, v_blk)
    if page_table is None:
        kernel = functools.partial(_kernel, **static)
    else:
        kernel = functools.partial(_paged(_kernel), page_size=S, **static)
        args = (page_table.astype(jnp.int32),) + args
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    o, m, den = pl.pallas_call(
        kernel,
        grid=(B, K, chunks),
        in_specs=[any_spec] * len(args),
        out_specs=[any_spec] * 3,
        out_shape=[sd((B, K, chunks, BM, DP), f32), sd((B, K, chunks, BM), f32), sd((B, K, chunks, BM), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="block_attention",
    )(*args)
    # the chunks in order (a chunk past a row's length holds m = _NEG, den = 0: folding it changes nothing)
    acc, m_acc, den_acc = o[:, :, 0], m[:, :, 0], den[:, :, 0]
    for c in range(1, chunks):
        acc, m_acc, den_acc = _merge((acc, m_acc, den_acc), (o[:, :, c], m[:, :, c], den[:, :, c]))
    out = acc[:, :, :R, :D] / den_acc[:, :, :R, None]  # every token sees itself: den > 0
    return out.reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, N, D).astype(q.dtype)
