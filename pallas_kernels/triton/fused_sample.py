"""Fused per-row sampling: the canonical pipeline (temperature, top-k, top-p, min-p) and one
exact draw per row, without sorting. Reference: ``ddtree_jax.sampling.target_logprobs`` (the law)
and ``ddtree_jax.sampling.reference_sample`` (a draw from it); tests/test_fused_sample.py compares.

Backend: the Pallas Triton lowering (``pl.pallas_call`` + ``jax.experimental.pallas.triton``).
Why not Mosaic GPU: this kernel needs row argmax, cumsum, pointer gathers (candidate chunks) and
data-dependent control flow (``lax.cond``/``while``); the Triton lowering has all of them, Mosaic GPU
on our jax versions has no argmax/cumsum lowering and no integer gathers (docs/kernels.md), and a
Triton row-max/argmax pass ran at ~90% of copy bandwidth on the H200.
We did not build a Mosaic GPU variant to measure against (device-time budget); see the bench
results for the measured fraction of copy bandwidth this Triton version reaches.

Algorithm (three launches; the first two spread a row over several programs when rows are few):

1. ``_stats_kernel`` reads the row from HBM once, tile by tile: row max ``M`` and argmax (lowest
   index on ties: the greedy token), the NaN/+inf/all--inf validity flags, per-tile ``(m_t, s_t)``
   with ``s_t = sum exp((x - m_t) / T)`` (the unfiltered tile masses), and per-chunk maxima
   (chunks of 64 columns) for the top-k candidate search.
   Per-element work is kept small (per-element ALU work, not HBM, limits such passes: docs/kernels.md):
   the tile
   argmax is searched only in tiles that raise the running max (``lax.cond``); ``s_t`` uses
   ``exp2((x - m_t) * log2(e) / T)`` (one ``ex2``; ``expf`` costs several more instructions);
   +inf / all -inf come from the tile max, NaN from ``s_t`` being NaN (sampled rows) or one
   ``x != x`` reduction (greedy rows); chunk maxima are stored only for rows that can take the
   top-k candidate path.
2. ``_check_kernel`` (8 warps, like the stats launch) finishes the light rows and runs the
   rejection path's first full-row pass (below) split over programs:

   * invalid row -> -1; greedy row (T == 0) -> the argmax. (Which temperatures count as greedy is
     the caller's rule: ``ddtree_jax.sampling`` maps T < 1e-5 to 0 before calling. Tiny positive
     temperatures stay finite here: z = (x - max) / T <= 0, so exp never overflows.)
   * temperature only: two-level inverse CDF with two counter-based uniforms: pick a tile with
     probability ``w_t = s_t exp((m_t - M)/T)`` / sum, re-read that ONE tile (4096 columns) and
     pick inside it by a cumulative sum of ``exp(z)``. One HBM pass plus one tile.
3. ``_select_kernel`` (one program per row, 16 warps) takes the filtered rows only (light rows
   exit at once; their outputs, written by launch 2, pass through aliased buffers), choosing per
   row by nested ``lax.cond`` on per-row flags, so mixed batches pay only for what each row needs:

   * top-k (k <= 128) with optional top-p / min-p: the k-th largest chunk maximum ``L`` is a lower
     bound of the k-th largest value, and every element ``>= L`` lies in the (exactly k, or a few
     more on ties) chunks whose maximum is ``>= L``. Those chunks (<= 128 x 64 = 8192 values)
     are gathered (from L2) into registers; the exact top-k threshold, the top-p threshold and the
     min-p threshold are found there by bisection over float bit patterns (31 count/sum
     reductions each, no sort), then one draw by inverse CDF over the kept candidates.
     The candidate chunks are listed in column order by one min-reduction per chunk
     (``compact="loop"``) or by one cumsum + scatter into a per-row scratch + a CTA barrier
     (``compact="scatter"``, the default: replaces ~k serial 4096-wide reductions; equal outputs
     in interpret mode and on the H200).
   * anything else (top-p or min-p without top-k, k > 128, more than 128 candidate chunks):
     pivot rejection (``PATH_REJECT``; the idea of FlashInfer's sort-free samplers, adapted to
     this law). The kept set K is an upper set in z (every rule keeps all values above a kept
     one), so: draw v from exp(z) restricted to U = {z > P} (P = -inf at first) by the same
     two-level inverse CDF as the temperature path (tile by per-tile masses of U, then one tile
     re-read), then decide ``v in K`` exactly with ONE full-row pass for ``z_v``:
     ``#{z > z_v} < k`` (top-k, ties kept), ``mass{z > z_v} < top_p * S`` (top-p, S the top-k
     mass) and ``z_v >= log(min_p)`` (min-p; local, no pass). The same pass stores the per-tile
     masses of ``{z > z_v, z >= log(min_p)}``. The pass compares the IEEE z of every element
     (exact membership) with one block reduction per tile (see ``check_pass``). Accept -> done. Reject -> every u with
     ``z_u <= z_v`` is out of K too, so P = z_v and redraw from the smaller U (fresh uniforms,
     streams 2 + 2i, 3 + 2i). Each round draws from q restricted to some U containing K and
     keeps the draw iff it lies in K, so the accepted token has exactly the law of q on K.
     Passes: top-p alone / top-k alone ~1 per round (expected rounds ~1 / (mass fraction of K
     reached by the first draws), about 1.05 for top_p 0.95); min-p alone 0 passes when the first
     draw passes min-p, else 1 (the redraw from {z >= log(min_p)} needs no test). top-k with top-p
     (k > 128): S_k is bounded by ``mass{z >= z_v} <= S_k <= total``; when the bounds do not
     decide, S_k is computed exactly once per row (bisection for z_(k): 33 passes).
     The first round's pass runs in launch 2, over several programs per row when rows are few
     (segments of ``CHECK_SEG`` tiles: the per-tile masses, and per segment the count and the
     total, so the select launch adds the same values in the same order whatever the split); the
     select launch draws the same first pivot (same streams, same code) and reads its results.
     Later rounds, and the first round of rows sent here by more than CAND_CHUNKS tied candidate
     chunks, run in the select launch's own program.
     After ``MAX_ROUNDS`` rejections the row falls back to the full-row bisections below (an
     independent draw of the same exact law; worst case ``MAX_ROUNDS`` + ~66 passes).
   * fallback (and ``max_rounds=0``, the previous behaviour): the same bisections as the
     candidate path with full-row passes (~34 to ~67 passes: ``PATH_SLOW``). Its top-p
     cut is a threshold on z (bisection over z keys of ``mass{z > K} < top_p``), not on q: the
     passes recompute the values, and a q threshold equals the smallest kept q, so any 1-ulp
     difference in a recomputed ``exp`` dropped that token from the draws (found on CPU: a kept
     token with expected count 71 in 3000 draws never drawn).

Exactness of the cut: every rule is a threshold on one row, evaluated as in the reference:
``z = (x - M) / T`` with IEEE division (``div.rn.f32``; in interpret mode a division between
optimization barriers, since XLA:CPU computes ``x / broadcast(T)`` as ``x * (1/T)``, 1 ulp off),
top-k keeps ``z >= z_(k)`` (ties kept),
top-p keeps ``q_v`` iff the mass of ``{q_u > q_v}`` is ``< top_p`` with ``q = exp(z)/S_k`` over the
top-k set, min-p keeps ``q_v >= min_p * max q`` (on the rejection path: ``z_v >= log(min_p)``,
the same rule since max z = 0). The top-k set is bit-exact; top-p and min-p can differ from the
reference only where a value lies within float32 rounding of the boundary (the masses are summed
in a different order; min-p's ratio is rounded differently). The draw is exact up to float32
rounding of the masses (inverse CDF with 24-bit uniforms at two levels, tile then element).

Random numbers: two uniforms per draw (streams 0, 1; rejection round i: 2 + 2i, 3 + 2i) from an
integer hash (murmur3 finaliser chain) of the row's two seed words (``seeds[r] = (k0, k1)``) and
the stream index, computed in the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shared import _bisect, _key_to_float, _uniform, _zkey

__all__ = ["CAND_CHUNKS", "CHUNK", "INVALID_TOKEN", "MAX_ROUNDS", "fused_sample", "fused_sample_debug"]

INVALID_TOKEN = -1  # the token of a row with no law (NaN, +inf, or all -inf logits)

CHUNK = 64  # columns per chunk maximum
CAND_CHUNKS = 128  # candidate chunks gathered for the top-k fast path (k <= CAND_CHUNKS)
MAX_TILE = 4096
_INT_MIN = np.int32(np.iinfo(np.int32).min)
_BIG = np.int32(2**30)
_ONE_KEY = np.int32(0x3F800000)  # bit pattern of 1.0f
_KEY_NEG_INF = np.float32(-np.inf).view(np.int32) ^ np.int32(0x7FFFFFFF)  # _zkey(-inf)
_KEY_POS_INF = np.int32(0x7F800000)  # _zkey(+inf)

# IEEE division through inline PTX on GPU (set False only to diagnose a toolchain without it).
EXACT_DIV_ASM = True

PATH_NONE, PATH_TEMPERATURE, PATH_CANDIDATES, PATH_SLOW, PATH_REJECT = 0, 1, 2, 3, 4
MAX_ROUNDS = 16  # pivot-rejection rounds before the exact bisection fallback (PATH_SLOW)
CHECK_SEG = 4  # tiles per segment of the first check pass (fixed: its sums never depend on the batch)
_CHECK_SEG_BITS = CHECK_SEG.bit_length() - 1


# ----------------------------------------------------------------------------- helpers


def _div(a, b, exact_asm: bool):
    """IEEE round-to-nearest division (Triton's '/' on f32 is div.full, ~2 ulp)."""
    if not exact_asm:
        # Interpret mode (CPU): XLA's fusion may compute the same division differently in two
        # fusion contexts (measured: 1 ulp); a threshold found in one pass and compared in
        # another then drops the boundary token. Barriers keep each division a plain IEEE op.
        a, b = jax.lax.optimization_barrier((a, jnp.broadcast_to(b, a.shape)))
        return jax.lax.optimization_barrier(a / b)
    b = jnp.broadcast_to(b, a.shape)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )[0]


def _zof(x, M, Ts, exact_asm: bool):
    """z = (x - M) / T with IEEE division, as the reference computes it."""
    return _div(x - M, jnp.full(x.shape, Ts, jnp.float32), exact_asm)


def _pick(weights, u, iota):
    """Index of the first ``cumsum(weights) > u * total`` among positive weights (1-D); falls back
    to the last positive weight (float prefix sums need not be monotone). -1 if none positive."""
    cw = jnp.cumsum(weights, axis=0)
    total = jnp.max(cw)
    big = jnp.int32(_BIG)
    first = jnp.min(jnp.where((cw > u * total) & (weights > 0), iota, big))
    last = jnp.max(jnp.where(weights > 0, iota, -1))
    return jnp.where(first < big, first, last)


def _tile_loop(load, t0, n, body, init):
    """``body(i, x, carry)`` over tiles ``t0 .. t0 + n - 1`` in order, ``x`` tile ``t0 + i`` as
    float32 (``load(t, live)`` loads tile t, nothing where ``live`` is false). Tile i + 1's loads
    are issued before tile i is processed (the loaded tile rides in the loop carry), so a program
    that holds a row alone waits on HBM once per pass rather than once per tile; the last step's
    load is masked off. (Triton's own pipelining, ``num_stages`` 2, was no faster than none.)"""

    def step(i, c):
        x, carry = c
        nxt = load(t0 + jnp.minimum(i + 1, n - 1), i + 1 < n)
        return nxt, body(i, x.astype(jnp.float32), carry)

    return jax.lax.fori_loop(0, n, step, (load(t0, True), init))[1]


# ----------------------------------------------------------------------------- per-row pieces


def _row_flags(T, k, p, minp, V):
    """(greedy, k_on, p_on, m_on, filtered, cand_row) of one row's parameters. ``cand_row``: the
    top-k candidate path may apply (it does unless more than CAND_CHUNKS chunks tie)."""
    greedy = T == 0.0
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    m_on = minp > 0.0
    return greedy, k_on, p_on, m_on, k_on | p_on | m_on, k_on & (k <= CAND_CHUNKS)


def _combine_splits(mx_ref, am_ref, ok_ref, r, splits):
    """The stats launch's per-split results of row r combined exactly: (max, lowest-index argmax,
    valid)."""
    mxs = mx_ref[r, pl.ds(0, splits)]
    M = jnp.max(mxs)
    argmax = jnp.min(jnp.where(mxs == M, am_ref[r, pl.ds(0, splits)], _BIG))
    oks = ok_ref[r, pl.ds(0, splits)]
    valid = (jnp.max(oks // 2) == 0) & (jnp.max(oks % 2) == 1)
    return M, argmax, valid


def _tile_masses(tm_ref, ts_ref, r, nt, ntp, M, inv_t):
    """Per-tile masses ``s_t exp((m_t - M) / T)`` of row r (the first draw's tile weights)."""
    iota = jnp.arange(ntp, dtype=jnp.int32)
    tm = plgpu.load(tm_ref.at[r, pl.ds(0, ntp)], mask=iota < nt, other=-jnp.inf)
    ts = plgpu.load(ts_ref.at[r, pl.ds(0, ntp)], mask=iota < nt, other=0.0)
    return jnp.where(tm > -jnp.inf, ts * jnp.exp((tm - M) * inv_t), 0.0)


def _draw(x_ref, r, W, u_t, u_e, allowed, *, tile, V, zof, argmax):
    """Two-level inverse CDF over exp(z) restricted to ``allowed(z, e)``: a tile by the weights W
    (the restricted per-tile masses) and ``u_t``, then that one tile re-read and an element picked
    in it by ``u_e``. -> (token, z, exp(z)). The check and select launches draw a row's first
    pivot through this with the same inputs: the same bits in both."""
    iota_nt = jnp.arange(W.shape[0], dtype=jnp.int32)
    iota_t = jnp.arange(tile, dtype=jnp.int32)
    t = jnp.maximum(_pick(W, u_t, iota_nt), 0)
    cols = t * tile + iota_t
    x = plgpu.load(x_ref.at[r, pl.ds(t * tile, tile)], mask=cols < V, other=-jnp.inf).astype(jnp.float32)
    z = zof(x)
    e = jnp.exp(z)
    j = _pick(jnp.where(allowed(z, e), e, 0.0), u_e, iota_t)
    hit = iota_t == j
    # (j < 0 cannot happen: W_t > 0 says the tile holds an allowed value; argmax is kept anyway)
    tok = jnp.where(j >= 0, t * tile + j, argmax)
    zv = jnp.where(j >= 0, jnp.sum(jnp.where(hit, z, 0.0)), 0.0)
    ev = jnp.where(j >= 0, jnp.sum(jnp.where(hit, e, 0.0)), 1.0)
    return tok, zv, ev


def _finite(z, e):
    return z > -jnp.inf


def _allowed(P, zfl):
    """A rejection round's draw set: z above the last rejected pivot P and z >= zfl (-inf at
    first; log(min_p) after a rejection)."""
    return lambda z, e: (z > P) & (z > -jnp.inf) & (z >= zfl)


def _sk_undecided(zv, ev, ran, cnt, m_gt, tot, k, p, k_on, p_on, tau_m, have_sk):
    """top-k with top-p on the rejection path: the drawn value passes min-p and top-k, and the
    bounds ``m_gt + ev <= S_k <= tot`` of the top-k mass S_k decide neither way (then S_k is
    computed exactly, 33 passes, once per row)."""
    ok_in = (zv >= tau_m) & (~k_on | (cnt < k))
    sure_acc = m_gt < p * (m_gt + ev)
    sure_rej = m_gt >= p * tot
    return ran & k_on & p_on & ok_in & (have_sk == 0) & ~sure_acc & ~sure_rej


def _accepts(zv, cnt, m_gt, S_p, k, p, k_on, p_on, tau_m):
    """The drawn value (z = zv) is kept: min-p (z >= log(min_p)), top-k (fewer than k larger) and
    top-p (the mass above it below top_p of S_p: the top-k mass, or the total without top-k)."""
    return (zv >= tau_m) & (~k_on | (cnt < k)) & (~p_on | (m_gt < p * S_p))


def _check_tile(x, M, c2, x_w, x_up, cnt, tot, with_count, with_total):
    """One tile (float32) of a check pass: its mass of ``{x >= x_w}`` (a weight of the next draw:
    one block reduction), and the per-lane count of ``{x >= x_up}`` (z > zv) and total mass
    carried on; masses ``exp2((x - M) * log2(e) / T)`` as the stats pass. -> (w_t, cnt, tot)."""
    e = jnp.exp2((x - M) * c2)
    if with_count:
        cnt = cnt + jnp.where(x >= x_up, 1, 0)
    if with_total:
        tot = tot + e
    return jnp.sum(jnp.where(x >= x_w, e, 0.0)), cnt, tot


def _stored_round(w_ref, cnt_ref, tot_ref, r, nt, ntp, nsegp):
    """A check launch's stored results of row r, summed as every reader sums them (the same bits in
    the second check launch and the select launch): per-tile weights ``[ntp]``, the count and the
    total (``tot_ref``: round 0's)."""
    nseg = pl.cdiv(nt, CHECK_SEG)
    iota_nt = jnp.arange(ntp, dtype=jnp.int32)
    iota_s = jnp.arange(nsegp, dtype=jnp.int32)

    def seg_sum(ref, other):
        return jnp.sum(plgpu.load(ref.at[r, pl.ds(0, nsegp)], mask=iota_s < nseg, other=other))

    W = plgpu.load(w_ref.at[r, pl.ds(0, ntp)], mask=iota_nt < nt, other=0.0)
    return W, seg_sum(cnt_ref, 0), seg_sum(tot_ref, 0.0)


def _by_filters(k_on, p_on, run):
    """``run(with_count, with_total)`` compiled four ways, the one for this row's (top-k on,
    top-p on) taken: a pass accumulates only what the row's tests read."""
    return jax.lax.cond(
        k_on,
        lambda: jax.lax.cond(p_on, lambda: run(True, True), lambda: run(True, False)),
        lambda: jax.lax.cond(p_on, lambda: run(False, True), lambda: run(False, False)),
    )


def _x_bounds(zof, zv, tau_m):
    """``(x_up, x_m)``: the smallest float32 x with ``zof(x) > zv`` and the smallest with
    ``zof(x) >= tau_m`` (= log(min_p)). ``zof`` is monotone in x (a rounded subtraction, then a
    rounded division by T > 0), so ``{z > zv} = {x >= x_up}`` and ``{z >= log(min_p)} = {x >= x_m}``
    exactly, and a pass compares x instead of dividing every element. Both by one bisection over
    the int32 keys of the floats from -inf to +inf (32 steps on a 2-vector, elementwise: no
    reduction); ``zof(+inf) = +inf`` passes both, ``zof(-inf) = -inf`` passes only ``>= -inf``
    (min-p off), which the last line keeps."""
    iota2 = jnp.arange(2, dtype=jnp.int32)
    zt = jnp.where(iota2 == 0, zv, tau_m)

    def passes(k):
        z = zof(_key_to_float(k))
        return jnp.where(iota2 == 0, z > zt, z >= zt)

    lo, hi = jnp.full((2,), _KEY_NEG_INF, jnp.int32), jnp.full((2,), _KEY_POS_INF, jnp.int32)
    k = jnp.where(passes(lo), lo, _bisect(passes, lo, hi, 32))
    xb = _key_to_float(k)
    return jnp.max(jnp.where(iota2 == 0, xb, -jnp.inf)), jnp.max(jnp.where(iota2 == 1, xb, -jnp.inf))


# ----------------------------------------------------------------------------- kernel 1: stats


def _stats_kernel(
    x_ref, temp_ref, topk_ref, mx_ref, am_ref, ok_ref, tm_ref, ts_ref, cm_ref, *, V, tile, nt, tps
):
    """Program (r, s) reads tiles ``[s * tps, min((s + 1) * tps, nt))`` of row r: per-tile stats go
    to their own slots, the row max / argmax / validity of its part to ``[r, s]`` (combined by the
    later launches). Several programs per row keep small row counts from being latency bound."""
    r = pl.program_id(0)
    split = pl.program_id(1)
    t0 = split * tps
    cpt = tile // CHUNK
    T = temp_ref[r]
    k = topk_ref[r]
    greedy = T == 0.0
    inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, T))
    c2 = inv_t * np.float32(np.log2(np.e))  # exp(y / T) = exp2(y * c2): one FMA + ex2 per element
    # Chunk maxima are read only by the top-k candidate path: other rows skip the store.
    need_cm = ~greedy & (k > 0) & (k < V) & (k <= CAND_CHUNKS)
    iota = jnp.arange(tile, dtype=jnp.int32)
    iota_cpt = jnp.arange(cpt, dtype=jnp.int32)

    def load_tile(t, live):
        return plgpu.load(x_ref.at[r, pl.ds(t * tile, tile)], mask=(t * tile + iota < V) & live, other=-jnp.inf)

    def body(i, x, c):
        m, am, bad, fin = c
        t = t0 + i
        cols = t * tile + iota
        cmax = jnp.max(x.reshape(cpt, CHUNK), axis=1)  # (max ignores NaN on the GPU: maxnumf)
        plgpu.store(cm_ref.at[r, pl.ds(t * cpt, cpt)], cmax, mask=need_cm & (iota_cpt >= 0))
        tmax = jnp.max(cmax)
        # Sampled rows: the tile mass is NaN iff the tile holds a NaN (x finite or -inf and tmax
        # finite give terms in [0, 1]); greedy rows need an explicit NaN test instead.
        safe = jnp.where(jnp.abs(tmax) < jnp.inf, tmax, 0.0)
        s = jax.lax.cond(
            greedy,
            lambda: jnp.where(jnp.max(jnp.where(x != x, 1, 0)) > 0, jnp.nan, inv_t * 0.0),
            lambda: jnp.sum(jnp.exp2((x - safe) * c2)),
        )
        bad = bad | (s != s) | (tmax == jnp.inf)
        fin = fin | (tmax > -jnp.inf)
        tm_ref[r, t] = tmax
        ts_ref[r, t] = s
        better = tmax > m  # the lowest-index argmax is searched only in tiles that raise the max
        targ = jax.lax.cond(better, lambda: jnp.min(jnp.where(x == tmax, cols, _BIG)), lambda: am)
        return jnp.where(better, tmax, m), targ, bad, fin

    init = (jnp.float32(-jnp.inf), jnp.int32(0), jnp.bool_(False), jnp.bool_(False))
    m, am, bad, fin = _tile_loop(load_tile, t0, jnp.minimum(tps, nt - t0), body, init)
    mx_ref[r, split] = m
    am_ref[r, split] = am
    ok_ref[r, split] = bad.astype(jnp.int32) * 2 + fin.astype(jnp.int32)  # combined by the later launches


# ----------------------------------------------------------------------------- kernel 2: light rows, first check


def _check_kernel(*refs, V, tile, nt, ntp, nsegp, sps, splits, exact_asm, reject, rnd):
    """Launch ``rnd`` (0 or 1) of the check passes, on a (rows, programs per row) grid, lighter
    than the select launch:

    * Launch 0 finishes the light rows (invalid, greedy, temperature only) in program (r, 0): the
      argmax, or a two-level draw (a tile by its mass with stream 0, one tile re-read, an element
      with stream 1). The select launch skips them.
    * The rejection path's check pass of round ``rnd``, spread over programs (r, s) that each take
      segments ``[s * sps, (s + 1) * sps)`` of CHECK_SEG tiles: for the row's pivot of that round
      (``_draw`` with streams 2 + 2 rnd, 3 + 2 rnd, which the select launch repeats bit for bit),
      per tile the mass of ``{z > z_v, z >= log(min_p)}`` (``w``, the next draw's weights), per
      segment ``#{z > z_v}`` (``cnt``) and, in round 0, the total mass (``tot``). Every stored
      value is one tile's or one fixed segment's, so the select launch sums the same values in
      the same order whatever the number of programs. Min-p-only rows whose pivot passes min-p
      need no pass. Launch 1 replays round 0 from launch 0's results (the same draw, the same
      decision as the select launch) and runs round 1's pass only for rows whose round-0 pivot was
      rejected without needing the exact top-k mass. (``reject`` False: max_rounds = 0, no
      rejection path, only the first job.)"""
    (x_ref, temp_ref, topk_ref, topp_ref, minp_ref, seed_ref, mx_ref, am_ref, ok_ref, tm_ref, ts_ref) = refs[:11]
    if rnd == 0:
        w_ref, cnt_ref, tot_ref, tok_ref, tau_ref, qthr_ref, norm_ref, path_ref, passes_ref, rounds_ref = refs[11:]
    else:
        w0_ref, cnt0_ref, tot0_ref, w_ref, cnt_ref = refs[11:]
    r = pl.program_id(0)
    sp = pl.program_id(1)
    T = temp_ref[r]
    k = topk_ref[r]
    p = topp_ref[r]
    minp = minp_ref[r]
    greedy, k_on, p_on, _, filtered, cand_row = _row_flags(T, k, p, minp, V)
    M, argmax, valid = _combine_splits(mx_ref, am_ref, ok_ref, r, splits)
    Ts = jnp.where(greedy, 1.0, T)
    inv_t = 1.0 / Ts
    c2 = inv_t * np.float32(np.log2(np.e))
    zof = functools.partial(_zof, M=M, Ts=Ts, exact_asm=exact_asm)
    tau_m = jnp.log(minp)
    iota_t = jnp.arange(tile, dtype=jnp.int32)
    zi, zf = k * 0, T * 0.0
    neg_inf = zf - jnp.inf
    s0, s1 = seed_ref[r, 0], seed_ref[r, 1]
    draw = functools.partial(_draw, x_ref, r, tile=tile, V=V, zof=zof, argmax=argmax)

    if rnd == 0:

        @pl.when((sp == 0) & (~valid | greedy | ~filtered))
        def _():
            def temperature():
                W = _tile_masses(tm_ref, ts_ref, r, nt, ntp, M, inv_t)
                return draw(W, _uniform(s0, s1, 0), _uniform(s0, s1, 1), _finite)[0], jnp.sum(W)

            tok, S = jax.lax.cond(~valid | greedy, lambda: (jnp.where(valid, argmax, INVALID_TOKEN), zf), temperature)
            light = (valid & ~greedy).astype(jnp.int32)
            tok_ref[r] = tok.astype(jnp.int32)
            tau_ref[r] = neg_inf
            qthr_ref[r] = zf
            norm_ref[r] = S
            path_ref[r] = light * PATH_TEMPERATURE + (1 - light) * PATH_NONE
            passes_ref[r] = zi
            rounds_ref[r] = zi

    if not reject:
        return

    def check(zv, with_count, with_total):
        """This program's segments of the pass for the drawn value zv."""
        x_up, x_m = _x_bounds(zof, zv, tau_m)
        x_w = jnp.maximum(x_up, x_m)
        g0 = sp * sps
        t0 = g0 * CHECK_SEG
        n = jnp.clip(nt - t0, 0, sps * CHECK_SEG)

        def load_tile(t, live):
            cols = t * tile + iota_t
            return plgpu.load(x_ref.at[r, pl.ds(t * tile, tile)], mask=(cols < V) & live, other=-jnp.inf)

        def body(i, x, c):
            w_ref[r, t0 + i], cnt, tot = _check_tile(x, M, c2, x_w, x_up, *c, with_count, with_total)
            # (CHECK_SEG is a power of two: masks and shifts, no '%' in the loop)
            last = ((i & (CHECK_SEG - 1)) == CHECK_SEG - 1) | (i == n - 1)
            g = g0 + (i >> _CHECK_SEG_BITS)

            @pl.when(last)
            def _():
                cnt_ref[r, g] = jnp.sum(cnt) if with_count else zi
                if rnd == 0:
                    tot_ref[r, g] = jnp.sum(tot) if with_total else zf

            return jnp.where(last, 0, cnt), jnp.where(last, 0.0, tot)

        init = (jnp.zeros((tile,), jnp.int32), jnp.zeros((tile,), jnp.float32))
        _tile_loop(load_tile, t0, n, body, init)
        return zi

    W0 = _tile_masses(tm_ref, ts_ref, r, nt, ntp, M, inv_t)
    rows = valid & ~greedy & filtered & ~cand_row
    if rnd == 0:

        @pl.when(rows)
        def _():
            zv = draw(W0, _uniform(s0, s1, 2), _uniform(s0, s1, 3), _allowed(neg_inf, neg_inf))[1]

            @pl.when(k_on | p_on | (zv < tau_m))
            def _():
                _by_filters(k_on, p_on, functools.partial(check, zv))

        return

    # (min-p alone: round 1 draws from {z >= log(min_p)}, which needs no test, so no pass)
    @pl.when(rows & (k_on | p_on))
    def _():
        _, zv0, ev0 = draw(W0, _uniform(s0, s1, 2), _uniform(s0, s1, 3), _allowed(neg_inf, neg_inf))
        ran0 = k_on | p_on  # (true here: round 0 ran its pass)
        W1, cnt, tot = _stored_round(w0_ref, cnt0_ref, tot0_ref, r, nt, ntp, nsegp)
        m_gt = jnp.sum(W1)
        need_sk = _sk_undecided(zv0, ev0, ran0, cnt, m_gt, tot, k, p, k_on, p_on, tau_m, zi)
        rejected = ran0 & ~need_sk & ~_accepts(zv0, cnt, m_gt, tot, k, p, k_on, p_on, tau_m)

        @pl.when(rejected)
        def _():
            zv1 = draw(W1, _uniform(s0, s1, 4), _uniform(s0, s1, 5), _allowed(zv0, tau_m))[1]
            jax.lax.cond(k_on, lambda: check(zv1, True, False), lambda: check(zv1, False, False))


# ----------------------------------------------------------------------------- kernel 3: select


def _select_kernel(
    x_ref,
    temp_ref,
    topk_ref,
    topp_ref,
    minp_ref,
    seed_ref,
    mx_ref,
    am_ref,
    ok_ref,
    tm_ref,
    ts_ref,
    cm_ref,
    w_ref,
    cnt_ref,
    tot_ref,
    w1_ref,
    cnt1_ref,
    _tok_in,  # the check launch's outputs (light rows written), aliased to the outputs below
    _tau_in,
    _qthr_in,
    _norm_in,
    _path_in,
    _passes_in,
    _rounds_in,
    tok_ref,
    tau_ref,
    qthr_ref,
    norm_ref,
    path_ref,
    passes_ref,
    rounds_ref,
    scr_ref,
    *,
    V,
    tile,
    nt,
    ntp,
    ncp,
    exact_asm,
    compact,
    interpret_mode,
    max_rounds,
    splits,
    nseg,
    check_rounds,
):
    """Rows with a filter: the top-k candidate path, the pivot rejection or the full-row
    bisections, one program per row (light rows: the check launch has written them)."""
    r = pl.program_id(0)
    T = temp_ref[r]
    k = topk_ref[r]
    p = topp_ref[r]
    minp = minp_ref[r]
    s0 = seed_ref[r, 0]
    s1 = seed_ref[r, 1]
    M, argmax, valid = _combine_splits(mx_ref, am_ref, ok_ref, r, splits)
    greedy, k_on, p_on, _, filtered, cand_row = _row_flags(T, k, p, minp, V)
    Ts = jnp.where(greedy, 1.0, T)
    inv_t = 1.0 / Ts
    # Values returned by lax.cond branches must be traced values, not literals (Triton lowering).
    zi, zf = k * 0, T * 0.0
    u1 = _uniform(s0, s1, 0)
    u2 = _uniform(s0, s1, 1)
    nc = nt * (tile // CHUNK)
    iota_t = jnp.arange(tile, dtype=jnp.int32)

    zof = functools.partial(_zof, M=M, Ts=Ts, exact_asm=exact_asm)

    # Candidate chunks for the top-k fast path (computed only where it can be used).
    iota_c = jnp.arange(ncp, dtype=jnp.int32)

    def cand_count():
        cmv = plgpu.load(cm_ref.at[r, pl.ds(0, ncp)], mask=iota_c < nc, other=-jnp.inf)
        ck = jnp.where(iota_c < nc, _zkey(zof(cmv)), _INT_MIN)
        # Smallest key K with #(ck > K) < k: the key of the k-th largest chunk maximum.
        kc = _bisect(lambda K: jnp.sum(jnp.where(ck > K, 1, 0)) < k, _INT_MIN, jnp.int32(0), 31)
        return jnp.sum(jnp.where(ck >= kc, 1, 0)), kc

    use_cand = valid & ~greedy & cand_row
    n_cand, kc = jax.lax.cond(use_cand, cand_count, lambda: (zi + _BIG, zi))
    use_cand = use_cand & (n_cand <= CAND_CHUNKS)

    # (Arithmetic, not nested jnp.where on scalar bools: that stored wrong values on jax 0.11 GPU.)
    other_path = PATH_REJECT if max_rounds > 0 else PATH_SLOW
    path = PATH_CANDIDATES + (~use_cand).astype(jnp.int32) * (other_path - PATH_CANDIDATES)

    neg_inf = zf - jnp.inf

    def finish_thresholds(K_k, S, K_p):
        tau = jnp.where(K_k == _INT_MIN, neg_inf, _key_to_float(K_k))
        qmax = 1.0 / S
        t_p = jnp.where(K_p >= 0, jax.lax.bitcast_convert_type(K_p, jnp.float32), 0.0)
        return tau, jnp.maximum(t_p, minp * qmax)

    iota_nt = jnp.arange(ntp, dtype=jnp.int32)
    draw = functools.partial(_draw, x_ref, r, tile=tile, V=V, zof=zof, argmax=argmax)

    # --- path 2: candidate chunks
    def p_cand():
        cmv = plgpu.load(cm_ref.at[r, pl.ds(0, ncp)], mask=iota_c < nc, other=-jnp.inf)
        flag = (iota_c < nc) & (_zkey(zof(cmv)) >= kc)
        iota_k = jnp.arange(CAND_CHUNKS, dtype=jnp.int32)

        if compact == "scatter":
            # Stream compaction in one step: flagged chunk c goes to slot (#flagged before c),
            # through this row's scratch (L1/L2); the barrier makes the scattered stores visible
            # to all threads of the program (bar.sync orders global memory within a CTA).
            # (Masked-off lanes get distinct indices past the slots: interpret mode scatters them
            # too, with their old values, and duplicate indices would race.)
            pos = jnp.cumsum(flag.astype(jnp.int32)) - 1
            live_c = flag & (pos < CAND_CHUNKS)
            plgpu.store(scr_ref.at[r, jnp.where(live_c, pos, CAND_CHUNKS + iota_c)], iota_c, mask=live_c)
            if not interpret_mode:
                plgpu.debug_barrier()
            cidx = plgpu.load(scr_ref.at[r, pl.ds(0, CAND_CHUNKS)], mask=iota_k < n_cand, other=-1)
        else:  # one min-reduction per candidate chunk (the first version)

            def enum(j, c):
                cidx, prev = c
                cj = jnp.min(jnp.where(flag & (iota_c > prev), iota_c, _BIG))
                return jnp.where(iota_k == j, cj, cidx), cj

            cidx, _ = jax.lax.fori_loop(0, n_cand, enum, (jnp.full((CAND_CHUNKS,), -1, jnp.int32), jnp.int32(-1)))
        cols = cidx[:, None] * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
        live = (cidx[:, None] >= 0) & (cols < V)
        x = plgpu.load(x_ref.at[r, jnp.where(live, cols, 0)], mask=live, other=-jnp.inf).astype(jnp.float32)
        z = zof(x)
        zk = jnp.where(live, _zkey(z), _INT_MIN)
        # The searches run on flat views of the [chunks, 64] candidates: one block reduction per
        # step instead of two (per chunk, then across chunks), and exactly as many halvings as
        # the key range needs (31 for (INT_MIN, 0], 30 for (-1, bits of 1.0]).
        n = CAND_CHUNKS * CHUNK
        zk1 = zk.reshape(n)
        K_k = _bisect(lambda K: jnp.sum(jnp.where(zk1 > K, 1, 0)) < k, _INT_MIN, jnp.int32(0), 31)
        topk = zk >= K_k
        e = jnp.where(topk, jnp.exp(z), 0.0)
        S = jnp.sum(e.reshape(n))
        q = e / S
        q1 = q.reshape(n)
        qk1 = jax.lax.bitcast_convert_type(q1, jnp.int32)

        def cut():
            return _bisect(lambda K: jnp.sum(jnp.where(qk1 > K, q1, 0.0)) < p, jnp.int32(-1), _ONE_KEY, 30)

        K_p = jax.lax.cond(p_on & (jnp.sum(q1) >= p), cut, lambda: zi - 1)
        tau, qthr = finish_thresholds(K_k, S, K_p)
        kept = topk & (z > -jnp.inf) & (q >= qthr)
        w = jnp.where(kept, e, 0.0)
        slot = _pick(jnp.sum(w, axis=1), u1, iota_k)
        slot = jnp.maximum(slot, 0)
        wrow = jnp.sum(jnp.where(iota_k[:, None] == slot, w, 0.0), axis=0)
        j = _pick(wrow, u2, jnp.arange(CHUNK, dtype=jnp.int32))
        c = jnp.sum(jnp.where(iota_k == slot, cidx, 0))
        tok = jnp.where(j >= 0, c * CHUNK + j, argmax)
        return tok.astype(jnp.int32), tau, qthr, S, zi, zi, zi

    # --- path 3: full-row passes
    def load_tile(t, live):
        cols = t * tile + iota_t
        return plgpu.load(x_ref.at[r, pl.ds(t * tile, tile)], mask=(cols < V) & live, other=-jnp.inf)

    def row_loop(body, init):
        """``body(t, x, carry)`` over the row's tiles in order (``_tile_loop``)."""
        return _tile_loop(load_tile, 0, nt, body, init)

    def row_reduce(fn, init):
        return row_loop(lambda t, x, acc: jax.tree.map(jnp.add, acc, fn(zof(x), t)), init)

    def topk_key():
        """Key of z_(k) by bisection: 32 full-row count passes."""
        return _bisect(
            lambda K: row_reduce(lambda z, t: jnp.sum(jnp.where(_zkey(z) > K, 1, 0)), jnp.int32(0)) < k,
            _INT_MIN,
            jnp.int32(0),
            32,
        )

    def mass_from(tau0):
        return row_reduce(lambda z, t: jnp.sum(jnp.where(z >= tau0, jnp.exp(z), 0.0)), jnp.float32(0.0))

    def p_slow():
        K_k = jax.lax.cond(k_on, topk_key, lambda: zi + _INT_MIN)
        tau0 = jnp.where(K_k == _INT_MIN, neg_inf, _key_to_float(K_k))
        S = mass_from(tau0)

        # Top-p in the z domain: the smallest z-key K with mass{z > K} < top_p, so kept is
        # ``z >= tau`` with tau from a key. (A q-domain threshold would be compared with q values
        # recomputed in later passes; the smallest kept q IS the threshold, so a 1-ulp difference
        # in a recomputed exp drops that token: measured in interpret mode on CPU.)
        def mass_above(K):
            def f(z, t):
                q = jnp.where(z >= tau0, jnp.exp(z), 0.0) / S
                return jnp.sum(jnp.where(_zkey(z) > K, q, 0.0))

            return row_reduce(f, jnp.float32(0.0))

        K_p, np_passes = jax.lax.cond(
            p_on,
            lambda: jax.lax.cond(
                mass_above(jnp.int32(_INT_MIN)) >= p,
                lambda: (_bisect(lambda K: mass_above(K) < p, jnp.int32(_INT_MIN), jnp.int32(0), 32), zi + 33),
                lambda: (zi + _INT_MIN, zi + 1),
            ),
            lambda: (zi + _INT_MIN, zi),
        )
        K_t = jnp.maximum(K_k, K_p)
        tau = jnp.where(K_t == _INT_MIN, neg_inf, _key_to_float(K_t))
        qthr = minp * (1.0 / S)

        def tile_w(z, t):
            e = jnp.exp(z)
            s = jnp.sum(jnp.where((z >= tau) & (z > -jnp.inf) & (e / S >= qthr), e, 0.0))
            return jnp.where(iota_nt == t, s, 0.0)

        w = row_reduce(tile_w, jnp.zeros((ntp,), jnp.float32))
        tok = draw(w, u1, u2, lambda z, e: (z >= tau) & (z > -jnp.inf) & (e / S >= qthr))[0]
        passes = k_on.astype(jnp.int32) * 32 + 2 + np_passes
        return tok.astype(jnp.int32), tau, qthr, S, passes, zi, zi

    # --- path 4: pivot rejection (top-p / min-p without top-k, top-k > CAND_CHUNKS, ...)
    tau_m = jnp.log(minp)  # min-p on the rejection path: z >= log(min_p) (-inf when off)
    c2 = inv_t * np.float32(np.log2(np.e))

    def check_pass(zv, with_count, with_total):
        """One full-row pass for the drawn value zv: per-tile masses of {z > zv, z >= tau_m} (the
        next round's weights), #{z > zv} (top-k) and the total mass (top-p). z is the IEEE z of
        every element (exact membership: compared through the x bounds of ``x_bounds``, no
        division per element), masses exp2((x - M) * log2(e) / T) as the stats pass.
        Per tile ONE block reduction (the tile's mass, a weight of the next draw); the count and
        the total accumulate per lane across the tiles and are reduced once at the end: the pass
        is a chain of dependent reductions, so their number per tile sets its time when one
        program holds a row (few rows)."""

        x_up, x_m = _x_bounds(zof, zv, tau_m)
        x_w = jnp.maximum(x_up, x_m)

        def body(t, x, c):
            W, cnt, tot = c
            w_t, cnt, tot = _check_tile(x, M, c2, x_w, x_up, cnt, tot, with_count, with_total)
            return jnp.where(iota_nt == t, w_t, W), cnt, tot

        init = (jnp.zeros((ntp,), jnp.float32), jnp.zeros((tile,), jnp.int32), jnp.zeros((tile,), jnp.float32))
        W, cnt, tot = row_loop(body, init)
        return W, (jnp.sum(cnt) if with_count else zi), (jnp.sum(tot) if with_total else zf)

    nsegp = pl.next_power_of_2(nseg)

    def p_reject():
        W0 = _tile_masses(tm_ref, ts_ref, r, nt, ntp, M, inv_t)
        need_pass_kp = k_on | p_on

        def exact_sk():
            K_k = topk_key()
            return zi + 1, mass_from(jnp.where(K_k == _INT_MIN, neg_inf, _key_to_float(K_k)))

        def decide(zv, ev, ran, cnt, m_gt, tot, have_sk, S_k):
            """Is the drawn value (z = zv, exp(z) = ev) in the kept set, given its pass's count of
            larger values, the mass above it and the total mass? top-p with top-k: the bound
            S_k >= mass{z >= zv} >= m_gt + ev decides acceptance, S_k <= tot decides rejection;
            otherwise S_k exactly (33 passes, once per row; ``_sk_undecided``)."""
            need_sk = _sk_undecided(zv, ev, ran, cnt, m_gt, tot, k, p, k_on, p_on, tau_m, have_sk)
            have_sk, S_k = jax.lax.cond(need_sk, exact_sk, lambda: (have_sk, S_k))
            S_p = jnp.where(have_sk > 0, S_k, tot)
            acc = _accepts(zv, cnt, m_gt, S_p, k, p, k_on, p_on, tau_m)
            return acc, have_sk, S_k, need_sk.astype(jnp.int32) * 33

        def checked(j):
            """The pass results of round j as the check launch stored them (the total: round 0's)."""
            wj, cj = (w_ref, cnt_ref) if j == 0 else (w1_ref, cnt1_ref)
            return lambda: _stored_round(wj, cj, tot_ref, r, nt, ntp, nsegp)

        def round_(i, c, results=None):
            """Round i: a draw from {z > P, z >= zfl} (streams 2 + 2i, 3 + 2i; a tile re-read), then
            the pass for it: this program's own, or (``results``) the one the check launch ran for
            this round (rounds 0 and 1 of rows it served: the same draw, bit for bit)."""
            done, tok, P, zfl, W, have_sk, S_k, passes, nr = c
            si = 2 * i + 2
            v, zv, ev = draw(W, _uniform(s0, s1, si), _uniform(s0, s1, si + 1), _allowed(P, zfl))
            # min-p alone: the test is local (z_v >= log(min_p)); a pass only after a rejection
            ran = need_pass_kp | (zv < tau_m)
            own = lambda: _by_filters(k_on, p_on, functools.partial(check_pass, zv))  # noqa: E731
            Wn, cnt, tot = jax.lax.cond(ran, results or own, lambda: (W, zi, zf + 1.0))
            # m_gt = mass{z > zv} whenever v passes min-p ({z > zv} then passes too)
            acc, have_sk, S_k, sk_passes = decide(zv, ev, ran, cnt, jnp.sum(Wn), tot, have_sk, S_k)
            passes = passes + ran.astype(jnp.int32) + sk_passes
            # Rejected: every u with z_u <= z_v is out of the kept set (an upper set in z).
            tok, P, zfl, W = jax.tree.map(lambda a, b: jnp.where(acc, a, b), (v, P, zfl, W), (tok, zv, tau_m, Wn))
            return acc, tok, P, zfl, W, have_sk, S_k, passes, nr + 1

        def maybe_round(i, c):
            # The check launches ran round 0 for every row but cand_row ones, and round 1 for those
            # whose round 0 rejected without computing S_k (have_sk still 0).
            in_launch0 = (i == 0) & ~cand_row
            in_launch1 = (i == 1) & ~cand_row & (c[5] == 0) if check_rounds > 1 else zi > 0

            def serve():
                return jax.lax.cond(
                    in_launch0,
                    lambda: round_(i, c, checked(0)),
                    lambda: jax.lax.cond(in_launch1, lambda: round_(i, c, checked(1)), lambda: round_(i, c)),
                )

            return jax.lax.cond(c[0], lambda: c, serve)

        init = (jnp.bool_(False), argmax, neg_inf, neg_inf, W0, zi, zf + 1.0, zi, zi)
        done, tok, P, zfl, W, have_sk, S_k, passes, nr = jax.lax.fori_loop(0, max_rounds, maybe_round, init)
        # nr rounds used (a round is one tile re-read and at most one pass, plus the 33 passes of
        # S_k when needed); a row that exhausted them falls back to the exact bisections (with
        # independent uniforms, streams 0 and 1: the law stays exact).

        def accepted():
            # Described set: kept requires z > P (tau = the next float above P) and z >= log(min_p)
            # (reported as exp(z) / 1 >= min_p: the reference's form, up to rounding).
            # (P < 0: the argmax, z = 0, is never rejected; the next float above a negative P is bits - 1)
            above = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(P, jnp.int32) - 1, jnp.float32)
            tau = jnp.where(P > -jnp.inf, above, neg_inf)
            return tok.astype(jnp.int32), tau, minp, zf + 1.0, passes, nr, zi

        def fallback():
            out = p_slow()
            return out[:4] + (passes + out[4], nr, zi + 1)

        return jax.lax.cond(done, accepted, fallback)

    @pl.when(valid & ~greedy & filtered)
    def _():
        tok, tau, qthr, norm, passes, nr, fell_back = jax.lax.cond(
            use_cand, p_cand, p_reject if max_rounds > 0 else p_slow
        )
        tok_ref[r] = tok
        tau_ref[r] = tau
        qthr_ref[r] = qthr
        norm_ref[r] = norm
        path_ref[r] = path - fell_back  # PATH_REJECT -> PATH_SLOW when the rounds ran out
        passes_ref[r] = passes
        rounds_ref[r] = nr


# ----------------------------------------------------------------------------- wrapper


# Programs to aim for in the stats and check launches: about two waves of the H200's 132 SMs.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16


def _splits_for(R: int, nt: int) -> int:
    """Programs per row (a power of two): 1 once R rows fill the GPU, more for small R (16-64
    rows: a batch-1 tree verify), never more than the row has tiles (or segments)."""
    want = pl.next_power_of_2(max(1, -(-_TARGET_PROGRAMS // R)))
    return max(1, min(want, _MAX_SPLITS, 1 << (nt.bit_length() - 1)))


def _tile_for(V: int, tile: int | None) -> int:
    t = tile or MAX_TILE
    return max(CHUNK, min(t, pl.next_power_of_2(V)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "interpret",
        "tile",
        "num_warps",
        "select_warps",
        "num_stages",
        "select_stages",
        "compact",
        "max_rounds",
        "check_splits",
        "check_rounds",
    ),
)
def fused_sample_debug(
    logits: jax.Array,  # [R, V] f32 or bf16
    temperature: jax.Array,  # f32 [R]
    top_k: jax.Array,  # i32 [R]
    top_p: jax.Array,  # f32 [R]
    min_p: jax.Array,  # f32 [R]
    seeds: jax.Array,  # u32 [R, 2]
    *,
    interpret: bool = False,
    tile: int | None = None,
    num_warps: int = 8,
    select_warps: int = 16,
    num_stages: int = 1,
    select_stages: int = 1,
    compact: str = "scatter",
    max_rounds: int = MAX_ROUNDS,
    check_splits: int | None = None,
    check_rounds: int = 2,
) -> dict:
    """The kernel with its per-row thresholds (for tests): dict of ``[R]`` arrays ``token``,
    ``tau`` (kept requires ``z >= tau``), ``q_thr`` (kept requires ``exp(z)/norm >= q_thr``),
    ``norm`` and ``path`` (0 greedy/invalid, 1 temperature, 2 candidates, 3 full-row bisections,
    4 pivot rejection), ``passes`` (full-row passes after the stats launch; tile re-reads not counted)
    and ``rounds`` (pivot-rejection rounds: one tile re-read each). On path 4 ``tau``/``q_thr``
    (``norm`` = 1) describe a SUPERSET of the kept set (necessary conditions: z above the last
    rejected pivot, z >= log(min_p), reported as ``q_thr`` = min_p); the token itself is kept and
    so is every z >= its z.
    ``max_rounds`` = 0 turns the rejection path off (path 3 instead: the previous behaviour).
    Tuning knobs (all exact): ``num_warps``/``num_stages`` of the stats pass; ``select_warps`` /
    ``select_stages`` of the select pass; ``compact`` = "loop" | "scatter" (how the candidate
    chunks are listed: one min-reduction per chunk, or one cumsum + scatter + barrier);
    ``check_splits``: programs per row of the check passes (default by row count; the same
    bits for any value). ``check_rounds`` (1 or 2): rejection rounds whose passes run in check
    launches spread over programs (2: a second check launch runs round 1 for rows with top-k or
    top-p whose first pivot was rejected; later rounds run in the select program). Measured on
    the H200 (docs/kernels.md): 2 is 6-13% faster for top-p 0.95 at R=16 and 64 (R=64 79 -> 73
    us), within +-3 us for greedy and top-k 1000, and up to 5 us slower for min-p 0.1 (the extra
    launch; min-p rows skip it). ``num_warps``/``num_stages`` also set the check launches'.

    The defaults do not depend on the row count, and must not: a block reduction's rounding
    depends on the warps that hold the block, so a row's masses (and, at a rounding boundary, its
    token) would then depend on how many rows share the call. With fixed launch parameters a row
    gets the same bits whatever the batch (the stats and check launches split rows by row count,
    but every value they store is one tile's or one fixed segment's, computed by one program, and
    combined in a fixed order).
    16 select warps: a row's select program is bound by its own instruction stream when it has an
    SM to itself (few rows); measured on the H200 at R=16, 20-27% faster than 8 warps on the
    rejection path when the select launch ran every round itself; with the first round in the
    check launch, 8 warps were 16% slower at R=16 and 17-22% faster at R >= 512 for top-k 50 +
    top-p 0.9 (docs/kernels.md). The scatter listing: 11% faster for top-k 50 + top-p 0.9 at
    R=16; both listings give the same chunks in the same order."""
    if compact not in ("loop", "scatter"):
        raise ValueError(f"compact must be 'loop' or 'scatter', got {compact!r}")
    if check_rounds not in (1, 2):
        raise ValueError(f"check_rounds must be 1 or 2, got {check_rounds!r}")
    R, V = logits.shape
    tile = _tile_for(V, tile)
    nt = pl.cdiv(V, tile)
    ntp = pl.next_power_of_2(nt)
    splits = _splits_for(R, nt)
    tps = pl.cdiv(nt, splits)
    ncp = pl.next_power_of_2(nt * (tile // CHUNK))
    f32, i32 = jnp.float32, jnp.int32
    top_k = top_k.astype(i32)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    sd = jax.ShapeDtypeStruct
    params = (temperature, top_k, top_p.astype(f32), min_p.astype(f32), seeds.astype(jnp.uint32))
    stats = pl.pallas_call(
        functools.partial(_stats_kernel, V=V, tile=tile, nt=nt, tps=tps),
        grid=(R, splits),
        in_specs=[any_spec] * 3,
        out_specs=[any_spec] * 6,
        out_shape=[
            sd((R, splits), f32),
            sd((R, splits), i32),
            sd((R, splits), i32),
            sd((R, ntp), f32),
            sd((R, ntp), f32),
            sd((R, ncp), f32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ddtree_sample_stats",
    )(logits, temperature, top_k)
    mx, am, ok, tm, ts, _ = stats
    # select scratch: the scatter listing's slots (+ a distinct dummy per chunk)
    scratch = CAND_CHUNKS + ncp if compact == "scatter" else 1
    nseg = pl.cdiv(nt, CHECK_SEG)
    nsegp = pl.next_power_of_2(nseg)
    # with max_rounds = 0 no row takes the rejection path: one program per row finishes the light rows
    csplits = min(check_splits or _splits_for(R, nseg), nseg) if max_rounds > 0 else 1
    row_outs = [sd((R,), i32), sd((R,), f32), sd((R,), f32), sd((R,), f32), sd((R,), i32), sd((R,), i32), sd((R,), i32)]
    check = functools.partial(
        _check_kernel, V=V, tile=tile, nt=nt, ntp=ntp, nsegp=nsegp, sps=pl.cdiv(nseg, csplits), splits=splits,
        exact_asm=EXACT_DIV_ASM and not interpret, reject=max_rounds > 0,
    )
    cparams = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    w0, cnt0, tot0, *light = pl.pallas_call(
        functools.partial(check, rnd=0),
        grid=(R, csplits),
        in_specs=[any_spec] * 11,
        out_specs=[any_spec] * 10,
        out_shape=[sd((R, ntp), f32), sd((R, nsegp), i32), sd((R, nsegp), f32), *row_outs],
        compiler_params=cparams,
        interpret=interpret,
        name="ddtree_sample_check",
    )(logits, *params, mx, am, ok, tm, ts)
    rounds_in_checks = min(check_rounds, max_rounds)
    if rounds_in_checks > 1:
        w1, cnt1 = pl.pallas_call(
            functools.partial(check, rnd=1),
            grid=(R, csplits),
            in_specs=[any_spec] * 14,
            out_specs=[any_spec] * 2,
            out_shape=[sd((R, ntp), f32), sd((R, nsegp), i32)],
            compiler_params=cparams,
            interpret=interpret,
            name="ddtree_sample_check_round1",
        )(logits, *params, mx, am, ok, tm, ts, w0, cnt0, tot0)
    else:  # (not read)
        w1, cnt1 = w0, cnt0
    tok, tau, qthr, norm, path, passes, rounds, _ = pl.pallas_call(
        functools.partial(
            _select_kernel,
            V=V,
            tile=tile,
            nt=nt,
            ntp=ntp,
            ncp=ncp,
            exact_asm=EXACT_DIV_ASM and not interpret,
            compact=compact,
            interpret_mode=interpret,
            max_rounds=max_rounds,
            splits=splits,
            nseg=nseg,
            check_rounds=rounds_in_checks,
        ),
        grid=(R,),
        in_specs=[any_spec] * 24,
        out_specs=[any_spec] * 8,
        out_shape=[*row_outs, sd((R, scratch), i32)],
        input_output_aliases={17 + i: i for i in range(7)},
        compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=select_stages),
        interpret=interpret,
        name="ddtree_sample_select",
    )(logits, *params, *stats, w0, cnt0, tot0, w1, cnt1, *light)
    return dict(token=tok, tau=tau, q_thr=qthr, norm=norm, path=path, passes=passes, rounds=rounds)


def fused_sample(
    logits, temperature, top_k, top_p, min_p, seeds, *, interpret: bool = False, tile: int | None = None, **tuning
) -> jax.Array:
    """One exact draw per row of ``logits [R, V]`` under per-row (temperature, top_k, top_p,
    min_p), seeds ``u32 [R, 2]``; ``INVALID_TOKEN`` for NaN/+inf/all--inf rows. i32 ``[R]``."""
    return fused_sample_debug(
        logits, temperature, top_k, top_p, min_p, seeds, interpret=interpret, tile=tile, **tuning
    )["token"]
