"""Exact top-K of each row's log-softmax over a large vocabulary for TPUs, sort-free: the per-depth
tables of the DDTree builder (``ddtree_jax.tree``) straight from the draft logits.

Contract (as the Triton version, ``pallas_kernels.triton.vocab_top_k``; the plain-JAX reference is
``jax.lax.top_k(jax.nn.log_softmax(x.astype(f32)), k)``, and tests/test_tpu_kernels.py compares):
for each row of ``logits [..., V]`` (bf16 or f32) the ``k`` largest log-probabilities
``z = (x - m) - lse`` in descending order, ties by lower index, and their column indices. Rows
with a NaN, a +inf or only -inf have an all-NaN log-softmax: their values are NaN and their
indices ``0 .. k-1``. Requires ``1 <= k <= V``.

``lse`` (where the normaliser comes from), both modes ported, as they cost the same here as there:

* ``"xla"`` (the tree's mode): ``log(sum(exp(x - m)))`` by XLA between the launches with the
  kernel's exact row max, ``jax.nn.log_softmax``'s operations (``pallas_kernels._shared``), so the
  values are the reference's bit for bit wherever XLA reduces that sum in the same order as inside
  ``log_softmax`` (it does on the CPU, which the tests check; on a TPU it is unchecked). One more
  read of the logits.
* ``"kernel"`` (fused): the stats pass also sums ``exp2((x - chunk max) * log2 e)`` per chunk, so
  XLA does not read the row. The value agrees with XLA's to about an ulp, not bit for bit; the
  top-K is exact for the kernel's own ``lse`` (``vocab_top_k_debug`` returns it).

Backend: Pallas' Mosaic TPU lowering; checked in TPU interpret mode on a CPU and lowered for a TPU
with ``jax.export`` (block shapes, and that every operation has a Mosaic lowering). Never compiled
by the Mosaic compiler or run on a TPU: no TPU timing exists.

Layout. Rows on sublanes, vocabulary on lanes, as the sampler (``fused_sample``): rows padded to
``block_rows`` (16: one bf16 (16, 128) tile), the vocabulary to ``nt`` tiles of ``tile = G * 128``
columns (G = ``CHUNK`` = 32 unless the vocabulary is smaller), padding -inf. A tile of a row block
is G lane-dense ``(block_rows, 128)`` vreg columns. A *chunk* is one lane of one tile: column
``t * tile + j * 128 + l`` for ``j < G`` (tile t, lane l), G values strided by 128. Per-tile and
per-chunk arrays are ``(tiles, rows, 128)``: the tile on the leading axis, so a kernel indexes it
dynamically (a leading index) and never slices lanes at a dynamic offset.

Algorithm (three launches; the first and the third stream the row):

1. stats, grid ``(row blocks, tiles)``: the maximum of every chunk (G - 1 elementwise maxima of
   vreg columns per tile: no cross-lane work) and, fused lse, its sum of exp.
2. select, grid ``(row blocks,)``: ``m`` (the max of the chunk maxima), ``lse``; the chunk maxima
   become log-probabilities (``x -> (x - m) - lse`` is non-decreasing, so a chunk's max z is z of
   its max x); the K-th largest chunk key ``T0`` by bisection over order-preserving int32 keys
   (32 count reductions over the ``V / G`` maxima, no sort). The chosen chunks: every chunk with
   key ``> T0`` (fewer than K), and the chunks with key ``== T0`` in the tiles up to ``t*``, the
   first tile at which there are enough of them (K minus the first count; another bisection).
   They hold the top-K set: a top-K value above T0 lies in a chunk above T0; if the K-th value is
   T0 the kept T0-values are the lowest-index ones, and a T0-value in a later tile has at least
   that many T0-values before it (one in each T0-chunk of the tiles up to ``t*``). Tiles, not
   chunks, break the ties because a tile's chunks interleave by column (the Triton version's
   contiguous chunks can be ordered by column, these cannot without z, which stats cannot compute
   before ``lse``). So at most ``K + 127`` chunks, ``K`` plus one tile's chunks; exact with ties,
   no fallback.
3. gather, grid ``(row blocks, tiles)``, the tile axis a reduction: the chosen chunks of each
   tile move into a per-row-block VMEM buffer of ``K + 127`` chunk slots, in chunk order. A tile's
   chosen lanes get consecutive slots after the ones before (an inclusive lane prefix count: 7
   rotate-and-add steps, ``pltpu.roll``); each slot finds its source lane by halving over that
   count (7 steps, each a lane gather ``take_along_axis``, Mosaic's ``tpu.dynamic_gather`` within
   a vreg), and the G vreg columns are gathered with that lane map. Only the slot windows the
   block's rows reach in this tile are visited. Row blocks skip the tiles where none of their rows
   chose a chunk: the list of tiles to fetch is scalar-prefetched into SMEM and read by the index
   map (a skipped step repeats the last tile, so nothing is copied; at the target's size every tile
   is needed, at small K many are not). At the last tile, on the ``G (K + 127)`` candidates in
   VMEM: the exact K-th key T (bisection, 32 counts), the index cut among values equal to T (a
   bisection over column indices: the lowest-index ones, ``lax.top_k``'s tie rule), the K kept
   compacted by the same prefix-count-and-gather step, and the output order by counting: each
   kept pair's rank is the number of kept pairs before it (larger value, or equal value and lower
   index), placed with a one-hot select (K steps over K lanes).

What differs from the Triton version and why (TPU):

* Strided chunks (a lane of a tile) instead of 32 contiguous columns: the chunk maxima are then
  elementwise maxima of vreg columns; contiguous chunks would need segmented cross-lane
  reductions. Their column ranges interleave, hence the tie rule by tile above and up to 127
  more chunk slots than K.
* A second streaming pass instead of gathering K chunks of 32 from L2: Mosaic gathers only within
  a vreg (``take_along_axis`` along lanes or sublanes), and a DMA per strided chunk would be 32
  single-element copies. The gather pass reads each tile once per row block (minus the skipped
  tiles), moves the chosen lanes with in-vreg gathers and keeps the candidates in VMEM, so the
  selection, compaction and ordering of step 3 never go back to HBM.
* No cumsum or scatter (Mosaic has neither): stable compaction is an inclusive prefix count by
  ``pltpu.roll`` and an inverse map by halving with lane gathers; the final placement is a one-hot
  select per kept pair.
* Per-row values (``m``, ``lse``, a bad-row flag) travel packed, one column each, in one
  ``(block_rows, 128)`` VMEM block, as in the sampler: vector code needs them as ``(rows, 1)``
  columns. Scalar prefetch carries what the index maps need: each row block's tiles to fetch.

Reads at the target's size (B*L = 240 rows x 163,840 bf16 = 78 MB): stats 1, gather 1 (nearly every
tile is needed at K = 256), plus XLA's 1 for ``lse="xla"``; the Triton version reads 1 plus 5% (and
XLA's 1). Everything else works on the ``V / 32`` chunk maxima and the ``32 (K + 127)`` candidates
of a row block in VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._shared import LSE_MODES, _bisect, _zkey, check_top_k_args, xla_log_sum_exp

__all__ = ["CHUNK", "LSE_MODES", "vocab_top_k", "vocab_top_k_debug"]

LANES = 128
CHUNK = 32  # vreg columns per tile: the elements of a chunk (one lane of a tile)
MAX_TILE = CHUNK * LANES
_INT_MIN = np.int32(np.iinfo(np.int32).min)
_BIG = np.int32(2**30)
_LOG2E = np.float32(np.log2(np.e))


# ----------------------------------------------------------------------------- in-kernel helpers


def _lane_iota(shape):
    return jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def _count(mask):
    """Per row of a ``(windows, rows, 128)`` mask: the number of true entries, ``(rows, 1)`` i32."""
    return jnp.sum(jnp.sum(mask.astype(jnp.int32), axis=0), axis=1, keepdims=True)


def _lane_prefix(a):
    """Inclusive prefix sum along the 128 lanes of an int32 ``(rows, 128)`` array (7 steps of
    rotate-and-add; Mosaic has no cumsum)."""
    lane = _lane_iota(a.shape)

    def step(i, a):
        s = jnp.left_shift(jnp.int32(1), i)
        return a + jnp.where(lane >= s, pltpu.roll(a, s, 1), 0)

    return jax.lax.fori_loop(0, 7, step, a)


def _source_lane(P, r):
    """For each lane: the smallest lane ``l`` with ``P[l] > r`` (P an inclusive prefix count of a
    mask, so that is the ``r``-th set lane, counting from 0), by 7 halvings of ``(-1, 127]``, each a
    lane gather of P; lanes where no such l exists get some lane in [0, 127] (the caller masks
    them)."""

    def step(_, c):
        lo, hi = c
        mid = (lo + hi) >> 1  # (lo + hi = 2 lo + 2^k: exact; floor division would lower through sign)
        ok = jnp.take_along_axis(P, mid, axis=1, mode="promise_in_bounds") > r
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 7, step, (jnp.full(r.shape, -1, jnp.int32), jnp.full(r.shape, LANES - 1, jnp.int32)))[1]


def _c(ref, j):
    """Column j of a packed ``(rows, 128)`` block -> ``(rows, 1)``."""
    return ref[:, j : j + 1]


def _packed(cols, n_rows):
    """List of ``(rows, 1)`` values -> ``(rows, 128)`` float32 (column j = cols[j])."""
    lane = _lane_iota((n_rows, LANES))
    out = jnp.zeros((n_rows, LANES), jnp.float32)
    for j, v in enumerate(cols):
        out = jnp.where(lane == j, v.astype(jnp.float32), out)
    return out


# ----------------------------------------------------------------------------- 1: stats


def _stats_kernel(x_ref, cm_ref, *cs_ref, G):
    """Chunk maxima of one ``(rows, tile)`` block (and, fused lse, the chunks' sums of
    ``exp(x - chunk max)``), ``(rows, 128)`` each."""
    cols = [x_ref[:, j * LANES : (j + 1) * LANES].astype(jnp.float32) for j in range(G)]
    mx = cols[0]
    for c in cols[1:]:
        mx = jnp.maximum(mx, c)
    cm_ref[...] = mx
    if cs_ref:
        # A chunk of -inf sums exp2(-inf) = 0; NaN -> NaN; +inf -> the max flags the row.
        safe = jnp.where(jnp.abs(mx) < jnp.inf, mx, 0.0)
        s = jnp.zeros_like(mx)
        for c in cols:
            s = s + jnp.exp2((c - safe) * _LOG2E)
        cs_ref[0][...] = s


# ----------------------------------------------------------------------------- 2: select


def _select_kernel(cm_ref, aux_ref, prm_ref, sel_ref, *, K, V, tile, nt, fused, select_all):
    """aux: the chunk sums (fused) or a packed block with lse in column 0. prm out: [m, lse, bad];
    sel out: 1 for the chosen chunks (none for a bad row)."""
    cm = cm_ref[...]  # (nt, rows, 128)
    m = jnp.max(jnp.max(cm, axis=0), axis=1, keepdims=True)  # (rows, 1)
    if fused:
        lse = jnp.log(jnp.sum(jnp.sum(aux_ref[...] * jnp.exp(cm - m), axis=0), axis=1, keepdims=True))
    else:
        lse = _c(aux_ref, 0)
    bad = (lse != lse) | (m == jnp.inf) | (m == -jnp.inf)  # NaN, +inf, or all -inf: an all-NaN row
    tix = jax.lax.broadcasted_iota(jnp.int32, cm.shape, 0)
    real = tix * tile + _lane_iota(cm.shape) < V
    if select_all:  # no more real chunks than K
        sel = real
    else:
        ck = jnp.where(real, _zkey((cm - m) - lse), _INT_MIN)
        rows = (cm.shape[1], 1)
        T0 = _bisect(lambda mid: _count(ck > mid) < K, jnp.full(rows, _INT_MIN), jnp.zeros(rows, jnp.int32), 32)
        eq = ck == T0
        q = K - _count(ck > T0)
        t_star = _bisect(lambda w: _count(eq & (tix <= w)) >= q, jnp.full(rows, -1), jnp.full(rows, nt - 1),
                         int(nt).bit_length())
        sel = (ck > T0) | (eq & (tix <= t_star))
    sel_ref[...] = (sel & ~bad).astype(jnp.int32)
    prm_ref[...] = _packed([m, lse, bad], cm.shape[1])


# ----------------------------------------------------------------------------- 3: gather, then the top-K


def _compact_into(P, s, off, n_windows, move, carry):
    """The set lanes of one ``(rows, 128)`` window (inclusive prefix count ``P``, total ``s``) go to
    slots ``off, off + 1, ..`` in lane order: for every destination window w a row reaches, each
    slot finds its source lane ``src`` and ``carry = move(w, ok, src, carry)`` writes window w where
    ``ok``. -> the final carry."""
    rows = P.shape[0]
    lane = _lane_iota(P.shape)
    # Destination windows any row reaches (a row writes slots off .. off + s - 1; none if s = 0).
    w_lo = jnp.min(jnp.where(s > 0, off, _BIG)) >> 7
    w_hi = jnp.minimum(jnp.max(jnp.where(s > 0, off + s - 1, -1)) >> 7, n_windows - 1)

    def body(w, carry):
        r = w * LANES + lane - jnp.broadcast_to(off, (rows, LANES))
        return move(w, (r >= 0) & (r < s), _source_lane(P, r), carry)

    return jax.lax.fori_loop(w_lo, w_hi + 1, body, carry)


def _gather_kernel(fetch_ref, need_ref, x_ref, sel_ref, prm_ref, val_ref, idx_ref, cx_ref, cc_ref, ck_ref, off_ref,
                   *, K, V, Vp, tile, G, nt, Kw, Kwo):
    """cx / cc: candidate values (x as f32) and columns, window ``j * Kw + w`` = vreg column j of
    slot window w (columns < 0: empty slot); ck: their keys; off: slots filled so far."""
    del fetch_ref  # (read by the index maps)
    rb, t = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]

    @pl.when(t == 0)
    def _():
        cx_ref[...] = jnp.full(cx_ref.shape, -jnp.inf, jnp.float32)
        cc_ref[...] = jnp.full(cc_ref.shape, -1, jnp.int32)
        off_ref[...] = jnp.zeros(off_ref.shape, jnp.int32)

    @pl.when(need_ref[rb * nt + t] != 0)
    def _():
        P = _lane_prefix(sel_ref[...])
        s = jnp.max(P, axis=1, keepdims=True)
        off = off_ref[:, 0:1]
        x = x_ref[...].astype(jnp.float32)

        def move(w, ok, src, carry):
            for j in range(G):
                u = j * Kw + w
                g = jnp.take_along_axis(x[:, j * LANES : (j + 1) * LANES], src, axis=1, mode="promise_in_bounds")
                cx_ref[u] = jnp.where(ok, g, cx_ref[u])
                cc_ref[u] = jnp.where(ok, t * tile + j * LANES + src, cc_ref[u])
            return carry

        _compact_into(P, s, off, Kw, move, 0)
        off_ref[...] = jnp.broadcast_to(off + s, off_ref.shape)

    @pl.when(t == nt - 1)
    def _():
        m, lse, bad = _c(prm_ref, 0), _c(prm_ref, 1), _c(prm_ref, 2) > 0
        col = cc_ref[...]
        ck_ref[...] = jnp.where((col >= 0) & (col < V), _zkey((cx_ref[...] - m) - lse), _INT_MIN)
        r1 = (rows, 1)
        # The exact K-th key T, then the lowest-index values equal to T up to K (lax.top_k's ties).
        T = _bisect(lambda mid: _count(ck_ref[...] > mid) < K, jnp.full(r1, _INT_MIN), jnp.zeros(r1, jnp.int32), 32)
        q = K - _count(ck_ref[...] > T)
        F = _bisect(lambda c: _count((ck_ref[...] == T) & (cc_ref[...] <= c)) >= q, jnp.full(r1, -1),
                    jnp.full(r1, Vp - 1), int(Vp).bit_length())
        # The K kept pairs, compacted into K slots ((Kwo, rows, 128) values) in candidate order.
        shape3 = (Kwo, rows, LANES)
        win = jax.lax.broadcasted_iota(jnp.int32, shape3, 0)

        def compact(u, c):
            off, oz, oc = c
            key, cu = ck_ref[u], cc_ref[u]
            P = _lane_prefix(((key > T) | ((key == T) & (cu <= F))).astype(jnp.int32))
            s = jnp.max(P, axis=1, keepdims=True)
            z = (cx_ref[u] - m) - lse

            def move(w, ok, src, c2):
                hit = (win == w) & ok[None]
                return (jnp.where(hit, jnp.take_along_axis(z, src, axis=1, mode="promise_in_bounds")[None], c2[0]),
                        jnp.where(hit, jnp.take_along_axis(cu, src, axis=1, mode="promise_in_bounds")[None], c2[1]))

            return (off + s, *_compact_into(P, s, off, Kwo, move, (oz, oc)))

        _, oz, oc = jax.lax.fori_loop(0, G * Kw, compact, (jnp.zeros(r1, jnp.int32), jnp.full(shape3, -jnp.inf),
                                                            jnp.full(shape3, _BIG)))
        # Order: rank = #(kept pairs with a larger key, or an equal key and a lower column), placed
        # with a one-hot select; pair i sits at slot i.
        pos = win * LANES + _lane_iota(shape3)
        kk = jnp.where(pos < K, _zkey(oz), _INT_MIN)
        out_lane = _lane_iota((rows, Kwo * LANES))

        def place(i, c):
            at = pos == i
            kq = jnp.max(jnp.max(jnp.where(at, kk, _INT_MIN), axis=0), axis=1, keepdims=True)[None]
            cq = jnp.max(jnp.max(jnp.where(at, oc, -1), axis=0), axis=1, keepdims=True)
            zq = jnp.max(jnp.max(jnp.where(at, oz, -jnp.inf), axis=0), axis=1, keepdims=True)
            hit = out_lane == _count(kk > kq) + _count((kk == kq) & (oc < cq[None]))
            return jnp.where(hit, zq, c[0]), jnp.where(hit, cq, c[1])

        vals, idx = jax.lax.fori_loop(0, K, place, (jnp.full(out_lane.shape, jnp.nan), out_lane))
        val_ref[...] = jnp.where(bad, jnp.nan, vals)
        idx_ref[...] = jnp.where(bad, out_lane, idx)


# ----------------------------------------------------------------------------- pass launchers
# Each pass is its own jitted function, and the wrapper is not jitted: called on its own, a pass
# that does not depend on K (stats) or on the lse mode (gather) compiles once for all of them
# (interpret mode's cost is mostly compilation); inside a caller's jit they are one program.

_interp = lambda interpret: pltpu.InterpretParams() if interpret else False  # noqa: E731


@functools.partial(jax.jit, static_argnames=("tile", "rows", "fused", "interpret"))
def _stats_pass(x, *, tile, rows, fused, interpret):
    Rp, Vp = x.shape
    nt, G = Vp // tile, tile // LANES
    sd = jax.ShapeDtypeStruct((nt, Rp, LANES), jnp.float32)
    out = pl.BlockSpec((None, rows, LANES), lambda rb, t: (t, rb, 0))
    res = pl.pallas_call(
        functools.partial(_stats_kernel, G=G),
        grid=(Rp // rows, nt),
        in_specs=[pl.BlockSpec((rows, tile), lambda rb, t: (rb, t))],
        out_specs=[out] * (2 if fused else 1),
        out_shape=[sd] * (2 if fused else 1),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interp(interpret),
        name="ddtree_tpu_topk_stats",
    )(x)
    return res[0], (res[1] if fused else None)


@functools.partial(jax.jit, static_argnames=("K", "V", "tile", "rows", "select_all", "interpret"))
def _select_pass(cm, aux, *, K, V, tile, rows, select_all, interpret):
    nt, Rp, _ = cm.shape
    fused = aux.ndim == 3
    tiles = pl.BlockSpec((nt, rows, LANES), lambda rb: (0, rb, 0))
    packed = pl.BlockSpec((rows, LANES), lambda rb: (rb, 0))
    prm, sel = pl.pallas_call(
        functools.partial(_select_kernel, K=K, V=V, tile=tile, nt=nt, fused=fused, select_all=select_all),
        grid=(Rp // rows,),
        in_specs=[tiles, tiles if fused else packed],
        out_specs=[packed, tiles],
        out_shape=[jax.ShapeDtypeStruct((Rp, LANES), jnp.float32), jax.ShapeDtypeStruct(cm.shape, jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=_interp(interpret),
        name="ddtree_tpu_topk_select",
    )(cm, aux)
    return prm, sel


@functools.partial(jax.jit, static_argnames=("K", "V", "tile", "rows", "Kw", "interpret"))
def _gather_pass(x, sel, prm, *, K, V, tile, rows, Kw, interpret):
    Rp, Vp = x.shape
    nt, G, nb = Vp // tile, tile // LANES, Rp // rows
    Kwo = pl.cdiv(K, LANES)
    # Tiles a row block needs (some row chose a chunk there); a step that needs none repeats the
    # last fetched tile (or the first needed one), so the pipeline copies nothing for it.
    need = jnp.any(sel.reshape(nt, nb, rows * LANES) != 0, axis=2).T  # (nb, nt)
    tt = jnp.arange(nt, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(need, tt, -1), axis=1)
    first = jnp.min(jnp.where(need, tt, nt - 1), axis=1, keepdims=True)
    fetch = jnp.where(last >= 0, last, first).astype(jnp.int32).reshape(-1)
    f32, i32 = jnp.float32, jnp.int32
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nb, nt),
        in_specs=[pl.BlockSpec((rows, tile), lambda rb, t, f, n: (rb, f[rb * nt + t])),
                  pl.BlockSpec((None, rows, LANES), lambda rb, t, f, n: (f[rb * nt + t], rb, 0)),
                  pl.BlockSpec((rows, LANES), lambda rb, t, f, n: (rb, 0))],
        out_specs=[pl.BlockSpec((rows, Kwo * LANES), lambda rb, t, f, n: (rb, 0))] * 2,
        scratch_shapes=[pltpu.VMEM((G * Kw, rows, LANES), f32), pltpu.VMEM((G * Kw, rows, LANES), i32),
                        pltpu.VMEM((G * Kw, rows, LANES), i32), pltpu.VMEM((rows, LANES), i32)],
    )
    # VMEM: the candidate buffers (3 x 4 bytes per slot and vreg column), x double-buffered, the
    # outputs. Past 12 MiB (K > ~900 at 16 rows) raise the scoped limit (the default is 16 or 32 MiB
    # by TPU generation); block_rows = 8 halves the need.
    vmem = 12 * G * Kw * rows * LANES + 2 * rows * tile * x.dtype.itemsize + 16 * rows * Kwo * LANES
    limit = vmem + 4 * 2**20 if vmem > 12 * 2**20 else None
    return pl.pallas_call(
        functools.partial(_gather_kernel, K=K, V=V, Vp=Vp, tile=tile, G=G, nt=nt, Kw=Kw, Kwo=Kwo),
        grid_spec=gs,
        out_shape=[jax.ShapeDtypeStruct((Rp, Kwo * LANES), f32), jax.ShapeDtypeStruct((Rp, Kwo * LANES), i32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=limit),
        interpret=_interp(interpret),
        name="ddtree_tpu_topk_gather",
    )(fetch, need.astype(i32).reshape(-1), x, sel, prm)


# ----------------------------------------------------------------------------- wrapper


def _tile_for(V: int, tile: int | None) -> int:
    t = tile or MAX_TILE
    if t % LANES or t > MAX_TILE:
        raise ValueError(f"tile must be a multiple of {LANES} up to {MAX_TILE} on TPU, got {t}")
    return min(t, pl.cdiv(V, LANES) * LANES)


@functools.partial(jax.jit, static_argnames=("rows",))
def _xla_lse(logits, cm, *, rows):
    """``lse="xla"``: the reference's expression (``jax.nn.log_softmax``) with the kernel's row max
    (exact: the max of the chunk maxima), packed in column 0 of ``(Rp, 128)``."""
    R = logits.size // logits.shape[-1]
    lse = xla_log_sum_exp(logits, jnp.max(cm[:, :R], axis=(0, 2)))
    return jnp.pad(lse[:, None], ((0, cm.shape[1] - R), (0, LANES - 1)))


def vocab_top_k_debug(
    logits: jax.Array,
    k: int,
    *,
    lse: str = "kernel",
    interpret: bool = False,
    tile: int | None = None,
    block_rows: int = 16,
) -> dict:
    """``vocab_top_k`` with the row statistics: dict of ``values`` f32 ``[..., k]``, ``indices``
    i32 ``[..., k]``, ``max`` and ``lse`` f32 ``[...]`` (the ``m`` and ``lse`` the values use).
    Knobs (all exact): ``tile`` (vocabulary columns per grid step, a multiple of 128 up to 4096,
    the default; a chunk has ``tile / 128`` elements), ``block_rows`` (rows per block, a multiple of
    8; 16 suits bf16). ``interpret``: run in Pallas' TPU interpret mode (off a TPU)."""
    check_top_k_args(logits.shape, k, lse)
    if block_rows % 8:
        raise ValueError(f"block_rows must be a multiple of 8, got {block_rows}")
    *lead, V = logits.shape
    tile = _tile_for(V, tile)
    nt = pl.cdiv(V, tile)
    x = logits.reshape(-1, V)
    R = x.shape[0]
    Rp = pl.cdiv(R, block_rows) * block_rows
    x = jnp.pad(x, ((0, Rp - R), (0, nt * tile - V)), constant_values=-jnp.inf)  # padded rows: bad
    n_real = (nt - 1) * LANES + min(LANES, V - (nt - 1) * tile)  # chunks holding a real column
    select_all = n_real <= k
    Kw = pl.cdiv(n_real if select_all else min(k + LANES - 1, n_real), LANES)  # chunk slot windows
    opts = dict(tile=tile, rows=block_rows, interpret=interpret)
    fused = lse == "kernel"
    cm, cs = _stats_pass(x, fused=fused, **opts)
    aux = cs if fused else _xla_lse(logits, cm, rows=block_rows)
    prm, sel = _select_pass(cm, aux, K=k, V=V, select_all=select_all, **opts)
    vals, idx = _gather_pass(x, sel, prm, K=k, V=V, Kw=Kw, **opts)
    return dict(
        values=vals[:R, :k].reshape(*lead, k),
        indices=idx[:R, :k].reshape(*lead, k),
        max=prm[:R, 0].reshape(lead),
        lse=prm[:R, 1].reshape(lead),
    )


def vocab_top_k(logits: jax.Array, k: int, *, lse: str = "kernel", interpret: bool = False, **tuning):
    """``lax.top_k(log_softmax(logits), k)`` (see the module doc; ``lse`` = "kernel" | "xla").
    -> ``(values f32 [..., k], indices i32 [..., k])``."""
    out = vocab_top_k_debug(logits, k, lse=lse, interpret=interpret, **tuning)
    return out["values"], out["indices"]
