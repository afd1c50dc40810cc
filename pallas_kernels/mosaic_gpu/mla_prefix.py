"""MLA attention of a block's queries over the committed prefix of the latent cache (Hopper).

Contract (the plain references are in tests/test_mla_prefix_kernel.py; the caller,
``ddtree_jax.models.latent_attention.prefix_block_attention``, is checked against
``latent_attention_reference``):

* ``q_latent [B,R,r]`` and ``q_rope [B,R,dr]`` (bf16): a block's ``R = T*H`` query rows,
  token-major (``q_nope`` already multiplied by ``W_UK``); the cache ``latent [B,S,r]``,
  ``k_rope [B,S,dr]``; ``end [B] int32``: every query row of batch row b sees the cache
  positions ``[0, end[b])`` (keys every token of the block sees alike).
* Split ``s`` covers positions ``[s * split, (s + 1) * split)`` (``split``: int32 ``[1]``, chosen
  at run time from the longest row by ``split_size``; ``n_split`` static). Returns ``o [B,n,R,r]``
  float32, each split's softmax-weighted mean of its latents, and ``lse [B,n,R]`` float32, its
  base-2 log-sum-exp of the scaled scores ``scale * log2(e) * (q_latent.latent + q_rope.k_rope)``.
  Only the splits a row's ``end`` reaches are written; the caller merges those.

Why a second attention kernel. The Triton kernel (``pallas_kernels/triton/mla_attention.py``)
holds a ``[64, 512]`` float32 accumulator per program and runs Triton's products on it: on the
H200 at 32k context it stayed 13x from the cache-read floor at decode B=1 and 5x from the FLOP
floor at verify B=16, slower than XLA's dense einsums. This kernel is laid out for Hopper, in
the pattern of FlashAttention-3 and DeepSeek's FlashMLA:

* one CTA per (64 query rows, key split, batch row) with three warpgroups. A memory warpgroup
  streams ``[64 keys, 576]`` tiles into two shared-memory slots with TMA and refills a slot once
  both compute warpgroups have arrived on its "consumed" barrier; the queries stay in shared
  memory for the whole split.
* Warpgroup 0 computes the ``[64, 64]`` score tile once (``wgmma``; the contraction over ``r +
  dr`` as three products into one accumulator), the online softmax, and hands the bf16
  probabilities and the rows' rescale factors to warpgroup 1 through shared memory
  (``p_ready``/``p_free`` barriers); each warpgroup then multiplies them with its half of the
  tile's 512 value columns, so each holds a ``[64, 256]`` float32 accumulator (128 registers a
  thread) where one warpgroup would need 256. A last message carries ``1 / den``.
* Measured against computing the scores in both warpgroups (no hand-off, 1.5x the flops; H200,
  32k context, bench/results/attention_nvidia_h200_20261130_hopper_one_score.md): kernel time
  decode B=16 179 -> 149 us, verify B=16 T=16 2.49 -> 1.92 ms, verify B=1 T=65 617 -> 475 us.
  Shared memory: queries 72 KiB + two key slots 144 KiB + probabilities 8 KiB, so no reduction
  scratch (a row's scores live in one warp: no cross-warp reduction needs it).

The block's own keys (positions ``[start, start+T)`` under the tree's ancestor mask or causal)
are not read here for blocks of several tokens: ``prefix_block_attention`` folds them in with
plain JAX (a decode step's one key is read here: ``end = start + 1``). The key splits are a
speed choice, and unlike the Triton kernel's fixed segments a row's bits depend on them, so the
batch-invariant mode keeps the Triton kernel.

Backend: Pallas Mosaic GPU (``plgpu.kernel``, sm_90: ``wgmma``, TMA), lane-level lowering
semantics set explicitly (the default changed between jax 0.10 and 0.11). The cache must have a
multiple of 8 slots (the TMA copies' tiling) and at least 64. Imports only JAX. Off the GPU the
kernel runs in the Mosaic GPU interpreter (``interpret=InterpretGPUParams()``), which has no rules
for ``wgmma``, layout hints or register reallocation: there the products are plain dots
(``_scores``, ``_accumulate``) and the hints are skipped; everything else is the same code.
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

__all__ = ["MIN_SPLIT_KEYS", "auto_splits", "prefix_attention", "split_size", "supports"]

_NEG = -1e30
_LOG2E = math.log2(math.e)
# Query rows per CTA: one wgmma M tile (64 rows: one token's heads at K2 shapes).
_BM = 64
# Shared memory a CTA may take on an H200 (227 KiB), less room for barriers and alignment.
_SMEM_BYTES = 227 * 1024 - 1024
# Streaming multiprocessors of an H200 (sizes the split heuristic).
_NUM_SMS = 132
# The shortest key split: at decode B=1 over 32k keys, 256-key splits (128 CTAs) took 56 us
# against 60 for 512 and 78 for 1024 (H200, prefix kernel + block part + merge).
MIN_SPLIT_KEYS = 256


def supports(q_rows: int, r: int, dr: int, dtype, *, block_k: int = 64, stages: int = 2) -> bool:
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


def _kernel(end_ref, split_ref, qn_ref, qr_ref, lat_ref, kr_ref, o_ref, lse_ref, scoped, *, S, BK, stages, half,
            scale_log2, interpreted):
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
        # copy); the keys it repeats from the previous tile are masked like those past ``hi``
        return jnp.minimum(lo + t * BK, S - BK)

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
            keys = pl.ds(tile_start(t), BK)
            for h in range(2):
                plgpu.copy_gmem_to_smem(lat_ref.at[b, keys, pl.ds(h * half, half)], lat_smem.at[h, slot],
                                        k_bars.at[slot])
            plgpu.copy_gmem_to_smem(kr_ref.at[b, keys], kr_smem.at[slot], k_bars.at[slot])

        stream_tiles(fetch, n_tiles, stages, consumed)


def split_size(end: jax.Array, n_split: int, *, block_k: int = 64, min_keys: int = MIN_SPLIT_KEYS) -> jax.Array:
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
                     split: jax.Array, *, scale: float, n_split: int, block_k: int = 64, stages: int = 2,
                     interpret=False) -> tuple[jax.Array, jax.Array]:
    """Per-split attention of ``q_latent``/``q_rope`` ``[B,R,*]`` over the cache positions
    ``[0, end[b])`` of ``latent``/``k_rope`` ``[B,S,*]`` (see the module notes): ``(o [B,n,R,r]
    float32, lse [B,n,R] float32)``. Split ``s`` covers ``[s * split, (s + 1) * split)`` (``split``:
    int32 ``[1]``, a multiple of ``block_k``, see ``split_size``); only the splits a row's
    ``end`` reaches are written (the rest of ``o`` and ``lse`` is left unwritten: read a row's
    first ``ceil(end / split)`` splits only). ``stages``: key tiles in flight. ``interpret``:
    ``False``, or Mosaic GPU interpreter params (tests)."""
    B, R, r = q_latent.shape
    S, dr = latent.shape[1], k_rope.shape[-1]
    if q_rope.shape != (B, R, dr) or latent.shape != (B, S, r) or k_rope.shape != (B, S, dr) or end.shape != (B,):
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
                             interpreted=bool(interpret))

    def entry(*refs):
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
    return kernel(end.astype(jnp.int32), split.astype(jnp.int32), q_latent, q_rope.astype(dt), latent, k_rope)
