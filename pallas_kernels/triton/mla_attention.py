"""MLA attention in the absorbed form straight from the latent cache (Pallas Triton): decode,
tree verify and prefill blocks.

``mla_attention(q_latent [B,T,H,r], q_rope [B,T,H,dr], latent [B,S,r], k_rope [B,S,dr], start [B],
block_mask [B,T,T] or causal)`` -> ``[B,T,H,r]`` in the query dtype: ``softmax(scale *
(q_latent.latent + q_rope.k_rope)) @ latent`` (``W_UV`` and ``o_proj`` are applied outside),
float32 accumulators. Block token i of row b sees ``[0, start[b])`` and the block positions its
mask allows; every token sees at least one key; ``start + T <= S``. Reference:
``ddtree_jax.models.latent_attention.latent_attention(impl="reference")``; tests/test_mla_kernel.py.
FlashAttention-2 online softmax over key tiles; the ``T*H`` query rows are flattened (all heads
share the keys) and each row's key loop stops at its length. Optional key splits (``split_keys``,
merged by a second kernel) and fixed segments (``segment_keys``): with segments a row's bits
depend only on its data and the tiles, not on ``B``, ``T`` or the split. With ``page_table`` the
cache is a page pool (``latent [N,P,r]``, ``k_rope [N,P,dr]``, position p of row b at page
``page_table[b, p // P]``, slot ``p % P``; ``P`` a multiple of ``block_k``, so each key tile lies
in one page): the same kernel, each key tile loaded from its page, the same bits as over the
gathered contiguous cache. Design and measurements: docs/kernels.md, "MLA attention";
the paged layout: docs/paged-caches.md, "Device layout and kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.triton._online_softmax import _LOG2E, _NEG, _contiguous_tile, _dot, _fresh, _merge, _paged

__all__ = ["auto_split_keys", "default_tiles", "merge_block", "mla_attention"]

# Value columns per merge program: a [64, 64] float32 tile is 32 registers a thread at 4 warps
# (the whole [64, 512] accumulator would be 256 and spill).
_MERGE_COLS = 64
# Streaming multiprocessors the split-keys heuristic sizes for (a 132-SM GPU).
_NUM_SMS = 132


def _row_span(rt, *, H, T, S, BM, causal, start):
    """Rows of row tile ``rt``, their tokens, the tile's first token and the end of its keys
    (clamped to the cache: a caller breaking ``start + T <= S`` gets wrong values, not stray reads)."""
    row0 = rt * BM
    rows = row0 + jnp.arange(BM, dtype=jnp.int32)
    tok = rows // H
    tok_lo = row0 // H
    if causal:
        kv_end = start + jnp.minimum((row0 + BM - 1) // H, T - 1) + 1
    else:
        kv_end = start + T
    return rows, tok, tok_lo, jnp.minimum(kv_end, S)


def _attn_kernel(start_ref, qn_ref, qr_ref, lat_ref, kr_ref, bm_ref, *out_refs, H, T, S, R, r, dr, RP, DRP, BM, BK,
                 TMP, causal, chunk, seg, grp, scale_log2, tile_at=_contiguous_tile):
    b, rt, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = start_ref[b]
    rows, tok, tok_lo, kv_end = _row_span(rt, H=H, T=T, S=S, BM=BM, causal=causal, start=start)
    row0 = rt * BM
    row_ok = rows < R
    if chunk:
        lo = sp * chunk
        hi = jnp.minimum(lo + chunk, kv_end)
    else:
        lo = sp * 0
        hi = kv_end
    cols, dcols = jnp.arange(RP, dtype=jnp.int32), jnp.arange(DRP, dtype=jnp.int32)
    col_ok = None if RP == r else (cols < r)[None, :]
    dcol_ok = None if DRP == dr else (dcols < dr)[None, :]

    def both(a, c):
        if a is None:
            return c
        return a if c is None else a & c

    def load(ref, mask):
        # Triton takes ``other`` only with a mask: the lean tiles load unmasked.
        return plgpu.load(ref, mask=mask, other=None if mask is None else 0)

    @pl.when(lo < hi)
    def _():
        qn = plgpu.load(qn_ref.at[b, pl.ds(row0, BM), pl.ds(0, RP)], mask=both(row_ok[:, None], col_ok), other=0)
        qr = plgpu.load(qr_ref.at[b, pl.ds(row0, BM), pl.ds(0, DRP)], mask=both(row_ok[:, None], dcol_ok), other=0)
        tmp_tok = tok_lo + jnp.arange(TMP, dtype=jnp.int32)
        onehot = None if causal else jnp.where(tok[:, None] == tmp_tok[None, :], 1.0, 0.0).astype(jnp.bfloat16)

        def step(i, carry, s_lo, s_hi, masked):
            """Key tile i of the key range ``[s_lo, s_hi)``; ``masked`` for tiles that reach the block."""
            o, m, den = carry
            k0 = s_lo + i * BK
            kpos = k0 + jnp.arange(BK, dtype=jnp.int32)
            kin = (kpos < s_hi)[:, None] if masked else None
            row, slot = tile_at(b, k0)
            lat = load(lat_ref.at[row, pl.ds(slot, BK), pl.ds(0, RP)], both(kin, col_ok))
            kr = load(kr_ref.at[row, pl.ds(slot, BK), pl.ds(0, DRP)], both(kin, dcol_ok))
            s = (_dot(qn, lat, trans_b=True) + _dot(qr, kr, trans_b=True)) * scale_log2
            if masked:
                rel = kpos - start
                if causal:
                    in_block = rel[None, :] <= tok[:, None]
                else:
                    mt = plgpu.load(bm_ref.at[b, pl.ds(tok_lo, TMP), pl.ds(k0 - start + BK, BK)],
                                    mask=(tmp_tok < T)[:, None], other=0)
                    in_block = _dot(onehot, mt) > 0.5
                vis = (kpos < s_hi)[None, :] & ((kpos < start)[None, :] | ((rel >= 0)[None, :] & in_block))
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            corr = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            den = den * corr + p.sum(axis=-1)
            o = o * corr[:, None] + _dot(p.astype(lat.dtype), lat)
            return o, m_new, den

        def segment(s_lo, s_hi):
            """Keys ``[s_lo, s_hi)`` from a fresh state. Tiles wholly inside the committed prefix
            see every key (no mask), then the rest."""
            n_lean = jnp.maximum(jnp.minimum(s_hi, start) - s_lo, 0) // BK
            n_all = pl.cdiv(s_hi - s_lo, BK)
            part = jax.lax.fori_loop(0, n_lean, functools.partial(step, s_lo=s_lo, s_hi=s_hi, masked=False),
                                     _fresh(BM, RP))
            return jax.lax.fori_loop(n_lean, n_all, functools.partial(step, s_lo=s_lo, s_hi=s_hi, masked=True), part)

        if seg:
            # Fixed two-level segmentation: segments of ``seg`` keys folded in order into their
            # group of ``grp`` keys, groups folded in order into the total (a program's range
            # starts on a segment or group boundary: folding into a fresh state is exact).
            def group(gi, total):
                g_lo = lo + gi * grp
                g_hi = jnp.minimum(g_lo + grp, hi)

                def one(si, gtot):
                    s_lo = g_lo + si * seg
                    return _merge(gtot, segment(s_lo, jnp.minimum(s_lo + seg, g_hi)))

                return _merge(total, jax.lax.fori_loop(0, pl.cdiv(g_hi - g_lo, seg), one, _fresh(BM, RP)))

            o, m, den = jax.lax.fori_loop(0, pl.cdiv(hi - lo, grp), group, _fresh(BM, RP))
        else:
            o, m, den = _merge(_fresh(BM, RP), segment(lo, hi))
        out_mask = both(row_ok[:, None], col_ok)
        if chunk:
            o_ref, m_ref, den_ref = out_refs
            plgpu.store(o_ref.at[b, sp, pl.ds(row0, BM), pl.ds(0, RP)], o, mask=out_mask)
            plgpu.store(m_ref.at[b, sp, pl.ds(row0, BM)], m, mask=row_ok)
            plgpu.store(den_ref.at[b, sp, pl.ds(row0, BM)], den, mask=row_ok)
        else:
            (out_ref,) = out_refs
            out = o / jnp.where(den > 0, den, 1.0)[:, None]
            plgpu.store(out_ref.at[b, pl.ds(row0, BM), pl.ds(0, RP)], out.astype(out_ref.dtype), mask=out_mask)


def _merge_kernel(start_ref, o_ref, m_ref, den_ref, out_ref, *, H, T, S, R, r, MR, MC, BM, causal, chunk, seg,
                  grp):
    """Merge the splits a row tile's length reached, in split order (the same order for any
    batch); splits of one segment each are first folded into their groups (``grp`` keys), as the
    attention kernel folds them when it runs the segments itself. Each program merges ``MR`` of
    the attention tile's ``BM`` rows and ``MC`` of the value columns (every element's fold is its
    own, and a row's maxima and denominators fold alike in every program: the same bits whatever
    ``MR`` and ``MC``), so a program holds a ``[MR, MC]`` float32 tile."""
    b, rt, ct = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0, col0 = rt * MR, ct * MC
    # the parts the enclosing attention tile wrote: its length, not the sub-block's
    _, _, _, kv_end = _row_span(row0 // BM, H=H, T=T, S=S, BM=BM, causal=causal, start=start_ref[b])
    rows = row0 + jnp.arange(MR, dtype=jnp.int32)
    row_ok = rows < R
    col_ok = None if r % MC == 0 else (col0 + jnp.arange(MC, dtype=jnp.int32) < r)[None, :]
    mask2 = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok
    n_parts = pl.cdiv(kv_end, chunk)
    per_group = max(1, grp // chunk) if seg else 1

    def fold(s, carry):
        o_s = plgpu.load(o_ref.at[b, s, pl.ds(row0, MR), pl.ds(col0, MC)], mask=mask2, other=0)
        m_s = plgpu.load(m_ref.at[b, s, pl.ds(row0, MR)], mask=row_ok, other=_NEG)
        den_s = plgpu.load(den_ref.at[b, s, pl.ds(row0, MR)], mask=row_ok, other=0)
        return _merge(carry, (o_s, m_s, den_s))

    def group(gi, total):
        first = gi * per_group
        n = jnp.minimum(per_group, n_parts - first)
        return _merge(total, jax.lax.fori_loop(first, first + n, fold, _fresh(MR, MC)))

    o, _, den = jax.lax.fori_loop(0, pl.cdiv(n_parts, per_group), group, _fresh(MR, MC))
    out = o / jnp.where(den > 0, den, 1.0)[:, None]
    plgpu.store(out_ref.at[b, pl.ds(row0, MR), pl.ds(col0, MC)], out.astype(out_ref.dtype), mask=mask2)


def merge_block(batch: int, rows: int, r: int, block_m: int, *, num_sms: int = _NUM_SMS) -> tuple[int, int]:
    """``(rows, value columns)`` per program of the merge launch: ``(block_m, 64)`` unless that
    leaves fewer than two programs per SM (a decode step at small batch: 8 programs at B=1 with K2
    shapes), then halved, columns first, down to 16 x 16. The bits do not depend on it."""
    mr, mc = block_m, min(max(16, pl.next_power_of_2(r)), _MERGE_COLS)
    while batch * pl.cdiv(rows, mr) * pl.cdiv(r, mc) < 2 * num_sms and (mc > 16 or mr > 16):
        if mc > 16:
            mc //= 2
        else:
            mr //= 2
    return mr, mc


def default_tiles(dtype) -> dict:
    """``block_m, block_k, num_warps, num_stages`` for caches of ``dtype``: bf16 64 query rows (one
    token's 64 heads at K2 shapes), 64 keys, 8 warps, 2 stages; float32 (tests) 32 x 32, 4 warps,
    1 stage. Decode and verify share one tile shape (their rounding must agree)."""
    if jnp.dtype(dtype).itemsize >= 4:
        return dict(block_m=32, block_k=32, num_warps=4, num_stages=1)
    return dict(block_m=64, block_k=64, num_warps=8, num_stages=2)


def auto_split_keys(batch: int, rows: int, max_len: int, *, block_m: int = 64, block_k: int = 64,
                    num_sms: int = _NUM_SMS) -> int:
    """A ``split_keys`` for ``batch`` rows of ``rows = T*H`` query rows over a ``max_len`` cache.

    0 (no split) once ``batch * row tiles`` fills the SMs; otherwise enough splits of a full
    cache to give about two programs per SM, but never fewer than 512 keys per split: each split
    writes ``block_m * r`` float32 partials, about half the bytes of the 512 keys it reads.
    """
    programs = batch * pl.cdiv(rows, block_m)
    if programs >= num_sms:
        return 0
    want = pl.cdiv(2 * num_sms, programs)
    keys = max(512, pl.next_power_of_2(pl.cdiv(max_len, want)))
    keys = pl.cdiv(keys, block_k) * block_k
    return 0 if keys >= max_len else keys


@functools.partial(
    jax.jit,
    static_argnames=("scale", "causal", "block_m", "block_k", "split_keys", "segment_keys", "segment_group",
                     "num_warps", "num_stages", "interpret", "merge_tiles"),
)
def mla_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, start: jax.Array,
                  block_mask: jax.Array | None = None, *, scale: float, causal: bool = False,
                  block_m: int | None = None, block_k: int | None = None, split_keys: int = 0,
                  segment_keys: int = 0, segment_group: int = 1, num_warps: int | None = None,
                  num_stages: int | None = None, interpret: bool = False,
                  merge_tiles: tuple[int, int] | None = None, page_table: jax.Array | None = None) -> jax.Array:
    """Absorbed MLA attention of a block of ``T`` tokens per row over the latent cache.

    Args:
      q_latent: ``[B,T,H,r]``; q_rope: ``[B,T,H,dr]`` (bf16 or float32).
      latent: ``[B,S,r]``; k_rope: ``[B,S,dr]``; the block's own keys at ``[start, start+T)``.
        With ``page_table``: page pools ``[N,P,r]``, ``[N,P,dr]``.
      start: int32 ``[B]``, committed prefix length per row (``start + T <= S``).
      block_mask: bool ``[B,T,T]`` (which block tokens see which), or ``None`` with ``causal``.
      scale: the softmax scale. causal: the block is causal (prefill, decode).
      block_m / block_k: query rows (of the flattened ``T*H``) and keys per tile (powers of 2,
        >= 16). split_keys: 0, or keys per split (a multiple of ``block_k``; see
        ``auto_split_keys``). segment_keys: 0, or reduce each row's keys in fixed segments of
        this many positions (a multiple of ``block_k``), each from a fresh softmax state, folded
        in order into fixed groups of ``segment_group`` segments, the groups folded in order: a
        row's result then depends only on its data, ``block_k``, ``segment_keys`` and
        ``segment_group``, not on ``B``, ``T`` or ``split_keys``, which must then be 0 (all in
        one program), ``segment_keys`` (one program per segment) or ``segment_keys *
        segment_group`` (one program per group); the merge kernel repeats the same folds.
        num_warps / num_stages: Triton launch parameters. ``None``: ``default_tiles(latent.dtype)``.
      merge_tiles: ``(rows, value columns)`` per program of the split merge (powers of two, rows
        dividing ``block_m``); ``None``: ``merge_block``. Any choice gives the same bits.
      page_table: ``None`` (contiguous caches), or int32 ``[B, pages]``: position p of row b is
        slot ``p % P`` of pool page ``page_table[b, p // P]`` (``S = pages * P``; ``P`` a
        multiple of ``block_k``; every entry a page of the pool). The result has the same bits as
        the contiguous kernel over the gathered ``[B,S,...]`` caches.

    Returns:
      ``[B,T,H,r]`` in ``q_latent``'s dtype.
    """
    B, T, H, r = q_latent.shape
    n, slots = latent.shape[:2]  # batch rows and slots, or pages and the page size
    dr = k_rope.shape[-1]
    S = slots if page_table is None else page_table.shape[-1] * slots
    rows_ok = n == B if page_table is None else page_table.ndim == 2 and page_table.shape[0] == B
    if (q_rope.shape != (B, T, H, dr) or latent.shape != (n, slots, r) or k_rope.shape != (n, slots, dr)
            or not rows_ok):
        raise ValueError(f"mla_attention: shapes q_latent {q_latent.shape}, q_rope {q_rope.shape}, "
                         f"latent {latent.shape}, k_rope {k_rope.shape}"
                         + ("" if page_table is None else f", page_table {page_table.shape}") + " do not agree")
    tiles = default_tiles(latent.dtype)
    block_m, block_k = block_m or tiles["block_m"], block_k or tiles["block_k"]
    if page_table is not None and slots % block_k:
        raise ValueError(f"mla_attention: the page size {slots} must be a multiple of block_k {block_k}")
    num_warps, num_stages = num_warps or tiles["num_warps"], num_stages or tiles["num_stages"]
    if (block_mask is None) != causal:
        raise ValueError("mla_attention: pass exactly one of block_mask and causal=True")
    if split_keys and split_keys % block_k:
        raise ValueError(f"mla_attention: split_keys {split_keys} must be a multiple of block_k {block_k}")
    if segment_keys and (segment_keys % block_k or segment_group < 1
                         or split_keys not in (0, segment_keys, segment_keys * segment_group)):
        raise ValueError(f"mla_attention: segment_keys {segment_keys} must be a multiple of block_k {block_k}, "
                         f"segment_group ({segment_group}) >= 1 and split_keys ({split_keys}) 0, segment_keys or "
                         "segment_keys * segment_group")
    R, BM, BK = T * H, block_m, block_k
    RP, DRP = max(16, pl.next_power_of_2(r)), max(16, pl.next_power_of_2(dr))
    TMP = max(16, pl.next_power_of_2(pl.cdiv(BM, H) + 1))
    if causal:
        bm = jnp.zeros((B, 1, 1), jnp.bfloat16)  # unused
    else:
        # bf16 0/1 (an operand of the one-hot product), padded so every tile's slice is in bounds.
        bm = jnp.pad(block_mask.astype(jnp.bfloat16), ((0, 0), (0, 0), (BK, BK)))
    chunk = split_keys if split_keys and split_keys < S else 0
    n_split = pl.cdiv(S, chunk) if chunk else 1
    grid = (B, pl.cdiv(R, BM), n_split)
    sd, f32 = jax.ShapeDtypeStruct, jnp.float32
    if chunk:
        out_shape = [sd((B, n_split, R, r), f32), sd((B, n_split, R), f32), sd((B, n_split, R), f32)]
    else:
        out_shape = [sd((B, R, r), q_latent.dtype)]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    seg = segment_keys if segment_keys and segment_keys < S else 0  # one segment: same as none
    static = dict(H=H, T=T, S=S, R=R, r=r, BM=BM, causal=causal, chunk=chunk, seg=seg, grp=seg * segment_group)
    tile = dict(dr=dr, RP=RP, DRP=DRP, BK=BK, TMP=TMP, scale_log2=float(scale) * _LOG2E, **static)
    args = (start.astype(jnp.int32), q_latent.reshape(B, R, r), q_rope.reshape(B, R, dr), latent, k_rope, bm)
    if page_table is None:
        kernel = functools.partial(_attn_kernel, **tile)
    else:
        kernel = functools.partial(_paged(_attn_kernel), page_size=slots, **tile)
        args = (page_table.astype(jnp.int32),) + args
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[any_spec] * len(args),
        out_specs=[any_spec] * len(out_shape),
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="mla_attention",
    )(*args)
    if chunk:
        mr, mc = merge_tiles or merge_block(B, R, r, BM)
        if BM % mr or mr & (mr - 1) or mc & (mc - 1):
            raise ValueError(f"mla_attention: merge_tiles {(mr, mc)} must be powers of two, rows dividing {BM}")
        (out,) = pl.pallas_call(
            functools.partial(_merge_kernel, MR=mr, MC=mc, **static),
            grid=(B, pl.cdiv(R, mr), pl.cdiv(r, mc)),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec],
            out_shape=[sd((B, R, r), q_latent.dtype)],
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret,
            name="mla_attention_merge",
        )(start.astype(jnp.int32), *outs)
    else:
        (out,) = outs
    return out.reshape(B, T, H, r)
