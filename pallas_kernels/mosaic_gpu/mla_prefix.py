"""MLA attention of a block's queries over the committed prefix of the latent cache (Pallas Mosaic
GPU on Hopper: ``wgmma``, TMA, warp-specialised warpgroups): the fast path of
``ddtree_jax.models.latent_attention.prefix_block_attention``.

``prefix_attention(q_latent [B,R,r], q_rope [B,R,dr] bf16 (R = T*H rows, token-major), latent
[B,S,r], k_rope [B,S,dr], end [B])``: every query row of batch row b sees cache positions ``[0,
end[b])`` (paged: ``latent [N,P,r]``, ``k_rope [N,P,dr]`` pools and a ``page_table [B, pages]``;
each key tile is copied from its page); split s covers ``[s * split, (s + 1) * split)``
(``split_size``). Returns per split ``o [B,n,R,r]`` (softmax-weighted mean of its latents) and
``lse [B,n,R]`` (base-2 log-sum-exp of ``scale * log2(e) * scores``), float32; only the splits a
row reaches are written, and the caller merges them. ``supports``: the shapes it takes (at least 64
cache slots, a multiple of 8). One CTA per (64 query rows, split, batch row): a memory warpgroup
streams key tiles, warpgroup 0 computes scores and softmax and hands the probabilities to warpgroup
1, each multiplies its half of the value columns. A row's bits depend on the splits (not
batch-invariant).
Plain references: tests/test_mla_prefix_kernel.py. Design: docs/kernels.md, "The Hopper kernel".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu._stream import stream_tiles

__all__ = ["KEY_TILE", "MIN_SPLIT_KEYS", "auto_splits", "prefix_attention", "split_size", "supports"]

_NEG = -1e30
_LOG2E = math.log2(math.e)
# Query rows per CTA: one wgmma M tile (64 rows: one token's heads at K2 shapes).
_BM = 64
# Shared memory a CTA may take on Hopper (227 KiB), less room for barriers and alignment.
_SMEM_BYTES = 227 * 1024 - 1024
# Streaming multiprocessors the split heuristic fills (a 132-SM Hopper GPU).
_NUM_SMS = 132
# Keys per tile (``block_k``'s default): a paged cache takes the kernel with pages of whole tiles.
KEY_TILE = 64
# The shortest key split (the measured choice: docs/kernels.md, "The Hopper kernel").
MIN_SPLIT_KEYS = 256


def supports(q_rows: int, r: int, dr: int, dtype, *, block_k: int = KEY_TILE, stages: int = 2) -> bool:
    """Whether the kernel takes these shapes: bf16, whole 64-row query tiles, value halves and
    the rope part in whole 64-column (128-byte swizzle) tiles, and the slots in shared memory."""
    if jnp.dtype(dtype) != jnp.bfloat16 or q_rows % _BM or r % 128 or dr % 64 or block_k % 64:
        return False
    return _smem_bytes(r, dr, block_k, stages) <= _SMEM_BYTES


def _smem_bytes(r, dr, block_k, stages):
    # queries, key slots, the probabilities handed between warpgroups, three row vectors
    return 2 * (_BM * (r + dr) + stages * block_k * (r + dr) + _BM * block_k) + 3 * 4 * _BM


def _scores(q_smem, qr_smem, lat_smem, kr_smem, slot, BK, *, interpreted):
    """``q . latent + q_rope . k_rope`` for the key tile in ``slot``: three ``wgmma`` into one
    accumulator (compiled), or plain products of the loaded tiles (the Mosaic GPU interpreter has
    no ``wgmma`` on transposed operands)."""
    if interpreted:
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
        return (dot(q_smem[0], lat_smem[0, slot].T) + dot(q_smem[1], lat_smem[1, slot].T)
                + dot(qr_smem[...], kr_smem[slot].T))

    def product(s_ref):
        plgpu.wgmma(s_ref, q_smem.at[0], lat_smem.at[0, slot].transpose((1, 0)))
        plgpu.wgmma(s_ref, q_smem.at[1], lat_smem.at[1, slot].transpose((1, 0)))
        plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].transpose((1, 0)))
        return s_ref[...]

    return pl.run_scoped(product, plgpu.ACC((_BM, BK), jnp.float32))


def _accumulate(acc, p, v_ref, *, interpreted):
    """``acc + p @ v_ref`` (``p``: an array, or a shared-memory ref): ``wgmma`` into ``acc``'s
    registers in place (compiled), or a plain product (interpreted: no rule for ``run_state``)."""
    if interpreted:
        p = p if isinstance(p, jax.Array) else p[...]
        return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, p, v_ref)

    return pl.run_state(product)(plgpu.ACC.init(acc))


def _kernel(end_ref, split_ref, table_ref, qn_ref, qr_ref, lat_ref, kr_ref, o_ref, lse_ref, scoped, *, S, BK, stages,
            half, scale_log2, interpreted, page):
    (q_smem, qr_smem, lat_smem, kr_smem, p_smem, lse_smem, alpha_smem), (q_bar, k_bars), consumed, (p_ready,
                                                                                                 p_free) = scoped
    rt, sp, b = lax.axis_index("rt"), lax.axis_index("sp"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    row0 = rt * _BM
    # Layout hints for the compiler; the Mosaic GPU interpreter has no rules for them.
    cast = (lambda x, _: x) if interpreted else plgpu.layout_cast
    iota = ((lambda shape, dim, _: lax.broadcasted_iota(jnp.int32, shape, dim)) if interpreted else
            (lambda shape, dim, layout: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)))
    split = split_ref[0]
    lo = sp * split
    hi = jnp.minimum(lo + split, end_ref[b])
    n_tiles = lax.div(jnp.maximum(hi - lo, 0) + (BK - 1), BK)

    def tile_start(t):
        # a tile that would cross the cache's end is moved back to end there (no out-of-bounds
        # copy); the keys it repeats from the previous tile are masked like those past ``hi``.
        # Paged, tiles never cross a page and a row's positions end inside its last page.
        return lo + t * BK if page else jnp.minimum(lo + t * BK, S - BK)

    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def fresh():
        m = cast(jnp.full((_BM,), _NEG, jnp.float32), rows_layout)
        den = cast(jnp.zeros((_BM,), jnp.float32), rows_layout)
        return cast(jnp.zeros((_BM, half), jnp.float32), plgpu.Layout.WGMMA), m, den

    def softmax_step(t, slot, m, den):
        """The tile's scores and online-softmax update: ``(p, alpha, m_new, den_new)``."""
        s = _scores(q_smem, qr_smem, lat_smem, kr_smem, slot, BK, interpreted=interpreted) * scale_log2
        first = lo + t * BK
        kpos = tile_start(t) + iota((_BM, BK), 1, plgpu.Layout.WGMMA)
        s = jnp.where((kpos >= first) & (kpos < hi), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        return p, alpha, m_new, den * alpha + p.sum(axis=1)

    def scale_rows(acc, v):
        return acc * lax.broadcast_in_dim(v, acc.shape, [0])

    def store_out(acc, inv, col):
        # every row saw at least one key: den >= 1
        o_ref.at[b, sp, pl.ds(row0, _BM), pl.ds(col * half, half)][...] = scale_rows(acc, inv)

    def store_lse(m, den):
        lse_smem[...] = m + jnp.log2(den)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, sp, pl.ds(row0, _BM)])
        plgpu.wait_smem_to_gmem(0)

    def rows_from(ref):
        return ref[...] if interpreted else plgpu.load(ref, (), layout=rows_layout)

    # Warpgroup 0 computes the scores once and hands the probabilities and the rescale factor
    # to warpgroup 1 through shared memory (``p_ready``; ``p_free`` when read); a last message
    # carries 1 / den.
    @pl.when((wg == 0) & (n_tiles > 0))
    def _scores_wg():
        if not interpreted:
            plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(q_bar)

        def step(t, carry):
            acc, m, den = carry
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(k_bars.at[slot])
            p, alpha, m, den = softmax_step(t, slot, m, den)
            p16 = p.astype(lat_smem.dtype)
            pl.when(t > 0)(lambda: plgpu.barrier_wait(p_free))
            p_smem[...] = p16
            alpha_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            acc = _accumulate(scale_rows(acc, alpha), p16, lat_smem.at[0, slot], interpreted=interpreted)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m, den

        acc, m, den = lax.fori_loop(0, n_tiles, step, fresh())
        inv = 1.0 / den
        plgpu.barrier_wait(p_free)
        alpha_smem[...] = inv
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        store_out(acc, inv, 0)
        store_lse(m, den)

    @pl.when((wg == 1) & (n_tiles > 0))
    def _values_wg():
        if not interpreted:
            plgpu.set_max_registers(232, action="increase")

        def step(t, acc):
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(k_bars.at[slot])
            plgpu.barrier_wait(p_ready)
            acc = _accumulate(scale_rows(acc, rows_from(alpha_smem)), p_smem, lat_smem.at[1, slot],
                              interpreted=interpreted)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, n_tiles, step, fresh()[0])
        plgpu.barrier_wait(p_ready)
        store_out(acc, rows_from(alpha_smem), 1)

    @pl.when((wg == 2) & (n_tiles > 0))
    def _memory():
        if not interpreted:
            plgpu.set_max_registers(40, action="decrease")
        for h in range(2):
            plgpu.copy_gmem_to_smem(qn_ref.at[b, pl.ds(row0, _BM), pl.ds(h * half, half)], q_smem.at[h], q_bar)
        plgpu.copy_gmem_to_smem(qr_ref.at[b, pl.ds(row0, _BM)], qr_smem, q_bar)

        def fetch(t, slot):
            start = tile_start(t)
            row, keys = b, pl.ds(start, BK)
            if page:  # the tile's page, and the tile inside it
                row, keys = table_ref[b, lax.div(start, page)], pl.ds(lax.rem(start, page), BK)
            for h in range(2):
                plgpu.copy_gmem_to_smem(lat_ref.at[row, keys, pl.ds(h * half, half)], lat_smem.at[h, slot],
                                        k_bars.at[slot])
            plgpu.copy_gmem_to_smem(kr_ref.at[row, keys], kr_smem.at[slot], k_bars.at[slot])

        stream_tiles(fetch, n_tiles, stages, consumed)


def split_size(end: jax.Array, n_split: int, *, block_k: int = KEY_TILE, min_keys: int = MIN_SPLIT_KEYS) -> jax.Array:
    """Keys per split (int32 ``[1]``) so that ``n_split`` splits cover the longest row's ``end``:
    a multiple of ``block_k``, at least ``min_keys`` (shorter splits cost more in partials and
    fixed work than they save; rows shorter than ``n_split * min_keys`` use fewer splits)."""
    longest = jnp.max(end).astype(jnp.int32)
    keys = (longest + n_split - 1) // n_split
    keys = (keys + block_k - 1) // block_k * block_k
    return jnp.maximum(keys, min_keys).reshape(1)


def auto_splits(batch: int, q_rows: int, cache_len: int, *, num_sms: int = _NUM_SMS) -> int:
    """How many key splits a call gets: enough CTAs (one per SM: a CTA takes most of an SM's
    shared memory) to fill the SMs once, ``batch * q_rows / 64 * n <= num_sms``, at least 1, and
    no more than ``cache_len`` holds splits of ``MIN_SPLIT_KEYS`` (more could never be reached:
    they would only cost empty CTAs and partials the merge reads)."""
    return max(1, min(num_sms // (batch * pl.cdiv(q_rows, _BM)), pl.cdiv(cache_len, MIN_SPLIT_KEYS)))


@functools.partial(jax.jit, static_argnames=("scale", "n_split", "block_k", "stages", "interpret"))
def prefix_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, end: jax.Array,
                     split: jax.Array, page_table: jax.Array | None = None, *, scale: float, n_split: int,
                     block_k: int = KEY_TILE, stages: int = 2, interpret=False) -> tuple[jax.Array, jax.Array]:
    """Per-split attention of ``q_latent``/``q_rope`` ``[B,R,*]`` over the cache positions
    ``[0, end[b])`` of ``latent``/``k_rope`` ``[B,S,*]`` (see ``split_size``): ``(o [B,n,R,r]
    float32, lse [B,n,R] float32)``. Split ``s`` covers ``[s * split, (s + 1) * split)`` (``split``:
    int32 ``[1]``, a multiple of ``block_k``, see ``split_size``); only the splits a row's
    ``end`` reaches are written (the rest of ``o`` and ``lse`` is left unwritten: read a row's
    first ``ceil(end / split)`` splits only). ``stages``: key tiles in flight. ``interpret``:
    ``False``, or Mosaic GPU interpreter params (tests). ``page_table [B, pages]`` (int32): the
    caches are pools ``[N, P, *]`` and row ``b``'s position ``i`` is at ``[page_table[b, i // P],
    i % P]`` (``P`` a multiple of ``block_k``); ``end <= pages * P``."""
    B, R, r = q_latent.shape
    dr, page = k_rope.shape[-1], None
    if page_table is None:
        S, rows = latent.shape[1], B
    else:
        rows, page = latent.shape[:2]
        S = page_table.shape[1] * page
        if page_table.shape[0] != B or page % block_k:
            raise ValueError(f"prefix_attention: a page table {page_table.shape} for {B} rows over pages of {page} "
                             f"positions (a multiple of block_k={block_k})")
    if (q_rope.shape != (B, R, dr) or (latent.shape[0], latent.shape[2]) != (rows, r) or
            k_rope.shape != (*latent.shape[:2], dr) or end.shape != (B,)):
        raise ValueError(f"prefix_attention: shapes q_latent {q_latent.shape}, q_rope {q_rope.shape}, latent "
                         f"{latent.shape}, k_rope {k_rope.shape}, end {end.shape} do not agree")
    if S < block_k or S % 8 or not supports(R, r, dr, latent.dtype, block_k=block_k, stages=stages):
        raise ValueError(f"prefix_attention: no kernel for {R} query rows, r={r}, dr={dr}, {latent.dtype}, "
                         f"block_k={block_k}, stages={stages}, a cache of {S} slots (at least block_k, a multiple "
                         "of 8: the TMA copies' tiling; see supports())")
    half = r // 2
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    dt = latent.dtype
    scratch = (  # the swizzled buffers first (1 KiB aligned), the row vectors last: no padding between
        plgpu.SMEM((2, _BM, half), dt, transforms=swz),
        plgpu.SMEM((_BM, dr), dt, transforms=swz),
        plgpu.SMEM((2, stages, block_k, half), dt, transforms=swz),
        plgpu.SMEM((stages, block_k, dr), dt, transforms=swz),
        plgpu.SMEM((_BM, block_k), dt, transforms=swz),
        plgpu.SMEM((_BM,), jnp.float32),
        plgpu.SMEM((_BM,), jnp.float32),
    )
    body = functools.partial(_kernel, S=S, BK=block_k, stages=stages, half=half, scale_log2=float(scale) * _LOG2E,
                             interpreted=bool(interpret), page=page)

    def entry(*refs):
        if page is None:  # no table
            refs = (*refs[:2], None, *refs[2:])
        pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            scratch,
            (plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=3, num_barriers=stages)),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            (plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)),
            collective_axes="wg",
        )

    f32 = jnp.float32
    kernel = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((B, n_split, R, r), f32), jax.ShapeDtypeStruct((B, n_split, R), f32)),
        grid=(R // _BM, n_split, B),
        grid_names=("rt", "sp", "b"),
        num_threads=3,
        thread_name="wg",
        # no cross-warp reductions here (a row's scores live in one warp): no reduction scratch
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             reduction_scratch_bytes=0),
        interpret=interpret,
    )
    table = () if page is None else (page_table.astype(jnp.int32),)
    return kernel(end.astype(jnp.int32), split.astype(jnp.int32), *table, q_latent, q_rope.astype(dt), latent, k_rope)
