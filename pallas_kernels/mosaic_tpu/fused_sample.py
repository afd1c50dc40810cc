"""Fused per-row sampling for TPUs (Pallas Mosaic TPU), sort-free, with the Triton sampler's
contract (``pallas_kernels.triton.fused_sample``: the same thresholds, tie rules, random streams
and ``fused_sample_debug`` fields).

``fused_sample(logits [R, V] f32|bf16, temperature, top_k, top_p, min_p [R], seeds u32 [R, 2])``
-> i32 ``[R]`` (``INVALID_TOKEN`` for rows with no law); ``V < 2**24`` (token ids and counts ride
as float32). Rows are padded to ``block_rows``, the vocabulary to whole tiles, with -inf; each
pass is a ``pallas_call`` over ``(row blocks, tiles)`` and the per-row logic between passes is
plain JAX on ``[rows]`` arrays. Paths: greedy/invalid; temperature only (a tile by its mass, one
draw pass); pivot rejection for any filter (no top-k candidate path: Mosaic has no vector
gathers, so top-k <= 128 rows draw the same law with another mapping of the uniforms); exact
radix-16 threshold searches as its fallback. Checked in TPU interpret mode and lowered for a TPU
(``jax.export``); not run on one. Design: docs/kernels.md, "TPU kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._shared import (
    BIG,
    INT_MIN,
    INVALID_TOKEN,
    MAX_ROUNDS,
    MAX_TILE,
    PATH_NONE,
    PATH_REJECT,
    PATH_SLOW,
    PATH_TEMPERATURE,
    _interpret_div,
    _key_threshold,
    _pick,
    _pivot_bound,
    _pivot_kept,
    _row_filters,
    _tile_weights,
    _top_k_mass_undecided,
    _uniform,
    _zkey,
)

__all__ = ["INVALID_TOKEN", "MAX_ROUNDS", "fused_sample", "fused_sample_debug"]

LANES = 128
PIVOTS = 16  # keys tested per pass by the threshold searches (radix 16)
_LOG2E = np.float32(np.log2(np.e))


# ----------------------------------------------------------------------------- helpers


def _zof(x, M, Ts, barrier: bool):
    """``(x - M) / T``: the one division every pass uses (between barriers in interpret mode)."""
    a, b = x - M, jnp.broadcast_to(Ts, x.shape)
    if barrier:
        return _interpret_div(a, b)
    return a / b


def _radix_pivots(lo, hi):
    """``[R]`` search intervals ``(lo, hi]`` of int32 keys -> ``[R, PIVOTS]`` keys splitting each
    into PIVOTS parts (``floor(lo + d * b / 16)``, b = 1..16, without overflow; == lo where the
    interval is too narrow)."""
    b16 = jnp.arange(1, PIVOTS + 1, dtype=jnp.uint32)[None, :]
    d = hi.astype(jnp.uint32) - lo.astype(jnp.uint32)  # exact mod 2**32
    off = (d >> 4)[:, None] * b16 + (((d & 15)[:, None] * b16) >> 4)
    return (lo.astype(jnp.uint32)[:, None] + off).astype(jnp.int32)


def _radix_update(lo, hi, piv, pred, live):
    """One radix step of a search for the smallest key with ``pred`` (false at lo, true at hi):
    the new ``(lo, hi]`` from the pivots' ``pred [R, PIVOTS]``, for the ``live`` rows."""
    fresh = piv > lo[:, None]
    ok = fresh & (pred | (piv >= hi[:, None]))
    nlo = jnp.max(jnp.where(fresh & ~ok, piv, lo[:, None]), axis=1)
    nhi = jnp.min(jnp.where(ok, piv, hi[:, None]), axis=1)
    return jnp.where(live, nlo, lo), jnp.where(live, nhi, hi)


# ----------------------------------------------------------------------------- pass 1: stats
# Per-row parameters and results travel packed, one column each, in (rows, 128) lane-dense blocks
# (one copy per block and step, whatever their number); counts ride as float32 (exact below 2**24).


def _c(ref, j):
    """Column j of a packed ``(rows, 128)`` block -> ``(rows, 1)``."""
    return ref[:, j : j + 1]


def _packed(cols, n_rows):
    """List of ``(rows, 1)`` values -> ``(rows, 128)`` (column j = cols[j])."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (n_rows, LANES), 1)
    out = jnp.zeros((n_rows, LANES), jnp.float32)
    for j, v in enumerate(cols):
        out = jnp.where(lane == j, v.astype(jnp.float32), out)
    return out


def _stats_kernel(x_ref, prm_ref, out_ref, tm_ref, ts_ref, acc_s, *, tile):
    """prm: [T]; out: [max, argmax, valid]; acc_s: running [max, argmax, bad, finite]."""
    t = pl.program_id(1)
    nt = pl.num_programs(1)
    rows = x_ref.shape[0]

    @pl.when(t == 0)
    def _():
        acc_s[...] = _packed([jnp.full((rows, 1), -jnp.inf)], rows)
        tm_ref[...] = jnp.full(tm_ref.shape, -jnp.inf, jnp.float32)
        ts_ref[...] = jnp.zeros(ts_ref.shape, jnp.float32)

    T = _c(prm_ref, 0)
    inv_t = 1.0 / jnp.where(T == 0.0, 1.0, T)  # greedy rows: any finite scale (the mass only flags NaN)
    x = x_ref[...].astype(jnp.float32)
    cols = t * tile + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    tmax = jnp.max(x, axis=1, keepdims=True)
    safe = jnp.where(jnp.abs(tmax) < jnp.inf, tmax, 0.0)
    # NaN iff the tile holds a NaN (terms in [0, 1] when tmax is finite or -inf)
    s = jnp.sum(jnp.exp2((x - safe) * (inv_t * _LOG2E)), axis=1, keepdims=True)
    lane = jax.lax.broadcasted_iota(jnp.int32, tm_ref.shape, 1)
    tm_ref[...] = jnp.where(lane == t, tmax, tm_ref[...])
    ts_ref[...] = jnp.where(lane == t, s, ts_ref[...])
    m, am, bad, fin = (_c(acc_s, j) for j in range(4))
    better = tmax > m
    targ = jnp.min(jnp.where(x == tmax, cols, BIG), axis=1, keepdims=True).astype(jnp.float32)
    bad = jnp.maximum(bad, ((s != s) | (tmax == jnp.inf)).astype(jnp.float32))
    fin = jnp.maximum(fin, (tmax > -jnp.inf).astype(jnp.float32))
    acc_s[...] = _packed([jnp.where(better, tmax, m), jnp.where(better, targ, am), bad, fin], rows)

    @pl.when(t == nt - 1)
    def _():
        out_ref[...] = _packed([_c(acc_s, 0), _c(acc_s, 1), (1.0 - _c(acc_s, 2)) * _c(acc_s, 3)], rows)


# ----------------------------------------------------------------------------- draw: one tile per row


def _draw_kernel(tl_ref, nd_ref, x_ref, prm_ref, out_ref, *, tile, nt, barrier):
    """Step j of row block rb holds tile ``tl[rb, j]``, the j-th distinct tile that an active row of
    the block chose (the scalar-prefetched list; steps past their count repeat the last tile, so the
    pipeline fetches nothing new). The rows that chose it pick in it by inverse CDF over exp(z)
    restricted to ``{z > P, z >= zlo, z > -inf, exp(z) / S >= q_thr}``.
    prm: [tile, active, M, T, P, zlo, S, q_thr, u]; out: [token, z, exp(z)]."""
    rb, j = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]

    @pl.when(j == 0)
    def _():
        out_ref[...] = _packed([jnp.full((rows, 1), -1.0), jnp.zeros((rows, 1)), jnp.ones((rows, 1))], rows)

    @pl.when(j < nd_ref[rb])
    def _():
        t = tl_ref[rb * nt + j]
        mine = (_c(prm_ref, 0) == t.astype(jnp.float32)) & (_c(prm_ref, 1) > 0)
        x = x_ref[...].astype(jnp.float32)
        z = _zof(x, _c(prm_ref, 2), _c(prm_ref, 3), barrier)
        e = jnp.exp(z)
        kept = ((z > _c(prm_ref, 4)) & (z >= _c(prm_ref, 5)) & (z > -jnp.inf)
                & (e / _c(prm_ref, 6) >= _c(prm_ref, 7)))
        w = jnp.where(kept, e, 0.0)
        iota = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
        thr = _c(prm_ref, 8) * jnp.sum(w, axis=1, keepdims=True)

        def prefix(k):
            return jnp.sum(jnp.where(iota <= k, w, 0.0), axis=1, keepdims=True)

        # Smallest k with prefix(k) > u * total: a binary search (no cumsum in Mosaic).
        lo = jnp.full(thr.shape, -1, jnp.int32)
        hi = jnp.full(thr.shape, tile - 1, jnp.int32)
        for _ in range(int(tile - 1).bit_length()):
            mid = (lo + hi) >> 1  # (floor division lowers through sign, which needs a TPU to lower)
            ok = prefix(mid) > thr
            hi, lo = jnp.where(ok, mid, hi), jnp.where(ok, lo, mid)
        wk = jnp.sum(jnp.where(iota == hi, w, 0.0), axis=1, keepdims=True)
        found = (prefix(hi) > thr) & (wk > 0)
        last = jnp.max(jnp.where(w > 0, iota, -1), axis=1, keepdims=True)  # (non-monotone float sums)
        k = jnp.where(found, hi, last)
        hit = iota == k
        tok = jnp.where(k >= 0, t * tile + k, -1)
        zv = jnp.where(k >= 0, jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True), 0.0)
        ev = jnp.where(k >= 0, jnp.sum(jnp.where(hit, e, 0.0), axis=1, keepdims=True), 1.0)
        out_ref[...] = jnp.where(mine, _packed([tok, zv, ev], rows), out_ref[...])


# ----------------------------------------------------------------------------- check pass (rejection)


def _check_kernel(blk_ref, x_ref, prm_ref, w_ref, out_ref, *, barrier):
    """Per row, for its drawn value zv: per-tile masses of ``{z > zv, z >= log(min_p)}`` (the next
    round's tile weights), ``#{z > zv}`` and the total mass; masses with exp2((x - M) log2(e) / T)
    as the stats pass. prm: [M, T, zv, log(min_p)]; out: [count, total]."""
    rb, t = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]

    @pl.when(blk_ref[rb] > 0)
    def _():
        @pl.when(t == 0)
        def _():
            out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)
            w_ref[...] = jnp.zeros(w_ref.shape, jnp.float32)

        M, Ts, zv, tau_m = (_c(prm_ref, j) for j in range(4))
        x = x_ref[...].astype(jnp.float32)
        z = _zof(x, M, Ts, barrier)
        e = jnp.exp2((x - M) * ((1.0 / Ts) * _LOG2E))
        up = z > zv
        s = jnp.sum(jnp.where(up & (z >= tau_m), e, 0.0), axis=1, keepdims=True)
        lane = jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 1)
        w_ref[...] = jnp.where(lane == t, s, w_ref[...])
        out_ref[...] += _packed([jnp.sum(up.astype(jnp.float32), axis=1, keepdims=True),
                                 jnp.sum(e, axis=1, keepdims=True)], rows)


# ----------------------------------------------------------------------------- threshold-search pass


def _bisect_kernel(blk_ref, x_ref, prm_ref, key_ref, out_ref, w_ref, *, barrier):
    """One full-row pass of the threshold searches, per row and for each of its ``PIVOTS`` keys
    ``K_b`` (lanes 0..15 of the key block): ``#{key(z) > K_b}`` (top-k) and
    ``sum exp(z) [z >= tau0] / S [key(z) > K_b]`` (top-p); and once: the mass
    ``sum exp(z) [z >= tau0]`` (S_k) and the per-tile masses of the final kept set
    ``{z >= tau, z > -inf, exp(z) / S >= q_thr}``.
    prm: [M, T, tau0, S, tau, q_thr]; out: [count_b (16), above_b (16), mass]."""
    rb, t = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]

    @pl.when(blk_ref[rb] > 0)
    def _():
        @pl.when(t == 0)
        def _():
            out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)
            w_ref[...] = jnp.zeros(w_ref.shape, jnp.float32)

        M, Ts, tau0, S, tau, qthr = (_c(prm_ref, j) for j in range(6))
        x = x_ref[...].astype(jnp.float32)
        z = _zof(x, M, Ts, barrier)
        e = jnp.exp(z)
        key = _zkey(z)
        e0 = jnp.where(z >= tau0, e, 0.0)
        q0 = e0 / S
        cols = []
        for b in range(PIVOTS):
            cols.append(jnp.sum((key > key_ref[:, b : b + 1]).astype(jnp.float32), axis=1, keepdims=True))
        for b in range(PIVOTS):
            cols.append(jnp.sum(jnp.where(key > key_ref[:, b : b + 1], q0, 0.0), axis=1, keepdims=True))
        cols.append(jnp.sum(e0, axis=1, keepdims=True))
        out_ref[...] += _packed(cols, rows)
        kept = (z >= tau) & (z > -jnp.inf) & (e / S >= qthr)
        s = jnp.sum(jnp.where(kept, e, 0.0), axis=1, keepdims=True)
        lane = jax.lax.broadcasted_iota(jnp.int32, w_ref.shape, 1)
        w_ref[...] = jnp.where(lane == t, s, w_ref[...])


# ----------------------------------------------------------------------------- pass launchers
# Each pass is its own jitted function, so a pass called from several places of the wrapper is
# traced and lowered once (in interpret mode most of the cost of a call site is its compile).

_STATIC = ("tile", "rows", "interpret")


def _pack(*cols):
    """[Rp] vectors -> [Rp, 128] float32, column j = cols[j] (per-row parameters, one block)."""
    a = jnp.stack([c.astype(jnp.float32) for c in cols], axis=1)
    return jnp.pad(a, ((0, 0), (0, LANES - a.shape[1])))


def _interp(interpret):
    return pltpu.InterpretParams() if interpret else False


def _geometry(x, tile, rows):
    Rp, Vp = x.shape
    nt = Vp // tile
    return Rp, nt, pl.cdiv(nt, LANES) * LANES, Rp // rows


def _block_active(active, rows):
    return jnp.any(active.reshape(-1, rows), axis=1).astype(jnp.int32)


def _reduce_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _stats_pass(x, temp, *, tile, rows, interpret):
    """-> (max, argmax, valid) [Rp] and per-tile (max, mass) [Rp, ntp]."""
    Rp, nt, ntp, nb = _geometry(x, tile, rows)
    sd = jax.ShapeDtypeStruct
    f32 = jnp.float32
    row = pl.BlockSpec((rows, LANES), lambda rb, t: (rb, 0))
    tiles = pl.BlockSpec((rows, ntp), lambda rb, t: (rb, 0))
    out, tm, ts = pl.pallas_call(
        functools.partial(_stats_kernel, tile=tile),
        grid=(nb, nt),
        in_specs=[pl.BlockSpec((rows, tile), lambda rb, t: (rb, t)), row],
        out_specs=[row, tiles, tiles],
        out_shape=[sd((Rp, LANES), f32), sd((Rp, ntp), f32), sd((Rp, ntp), f32)],
        scratch_shapes=[pltpu.VMEM((rows, LANES), f32)],
        compiler_params=_reduce_params(),
        interpret=_interp(interpret),
        name="ddtree_tpu_sample_stats",
    )(x, _pack(temp))
    return out[:, 0], out[:, 1].astype(jnp.int32), out[:, 2] > 0, tm, ts


@functools.partial(jax.jit, static_argnames=_STATIC)
def _draw_pass(x, active, tile_idx, M, Ts, P, zlo, S, qthr, u, *, tile, rows, interpret):
    """-> (token, z, exp(z)) [Rp] of the active rows (token -1 elsewhere)."""
    Rp, nt, ntp, nb = _geometry(x, tile, rows)
    # Per row block: the distinct tiles its active rows chose, ascending, the last one repeated.
    need = jnp.any((active[:, None] & (tile_idx[:, None] == jnp.arange(nt)[None, :])).reshape(nb, rows, nt), axis=1)
    order = jnp.argsort(~need, axis=1, stable=True).astype(jnp.int32)
    nd = jnp.sum(need, axis=1).astype(jnp.int32)
    tl = jnp.take_along_axis(order, jnp.minimum(jnp.arange(nt)[None, :], jnp.maximum(nd, 1)[:, None] - 1), axis=1)
    row = pl.BlockSpec((rows, LANES), lambda rb, j, tl, nd: (rb, 0))
    gs = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nb, nt),
        in_specs=[pl.BlockSpec((rows, tile), lambda rb, j, tl, nd: (rb, tl[rb * nt + j])), row],
        out_specs=row,
    )
    out = pl.pallas_call(
        functools.partial(_draw_kernel, tile=tile, nt=nt, barrier=bool(interpret)),
        grid_spec=gs,
        out_shape=jax.ShapeDtypeStruct((Rp, LANES), jnp.float32),
        compiler_params=_reduce_params(),
        interpret=_interp(interpret),
        name="ddtree_tpu_sample_draw",
    )(tl.reshape(-1), nd, x, _pack(tile_idx, active, M, Ts, P, zlo, S, qthr, u))
    return out[:, 0].astype(jnp.int32), out[:, 1], out[:, 2]


def _gated_specs(rows, tile, ntp):
    """An inactive block's index map returns the block it already holds: no copy."""
    stream = pl.BlockSpec((rows, tile), lambda rb, t, blk: (rb, jnp.where(blk[rb] > 0, t, 0)))
    row = pl.BlockSpec((rows, LANES), lambda rb, t, blk: (rb, 0))
    tiles = pl.BlockSpec((rows, ntp), lambda rb, t, blk: (rb, 0))
    return stream, row, tiles


@functools.partial(jax.jit, static_argnames=_STATIC)
def _check_pass(x, active, M, Ts, zv, tau_m, *, tile, rows, interpret):
    """-> (per-tile masses [Rp, ntp], count [Rp], total [Rp]) for the active rows."""
    Rp, nt, ntp, nb = _geometry(x, tile, rows)
    sd = jax.ShapeDtypeStruct
    f32 = jnp.float32
    stream, row, tiles = _gated_specs(rows, tile, ntp)
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(nb, nt), in_specs=[stream, row],
                                      out_specs=[tiles, row])
    W, out = pl.pallas_call(
        functools.partial(_check_kernel, barrier=bool(interpret)),
        grid_spec=gs,
        out_shape=[sd((Rp, ntp), f32), sd((Rp, LANES), f32)],
        compiler_params=_reduce_params(),
        interpret=_interp(interpret),
        name="ddtree_tpu_sample_check",
    )(_block_active(active, rows), x, _pack(M, Ts, zv, tau_m))
    return W, out[:, 0].astype(jnp.int32), out[:, 1]


@functools.partial(jax.jit, static_argnames=_STATIC)
def _bisect_pass(x, active, M, Ts, K, tau0, S, tau, qthr, *, tile, rows, interpret):
    """``K [Rp, PIVOTS]`` -> (#{key(z) > K_b} [Rp, PIVOTS], mass{z >= tau0} [Rp], mass above K_b of
    the tau0-set / S [Rp, PIVOTS], per-tile kept masses [Rp, ntp]) for the active rows."""
    Rp, nt, ntp, nb = _geometry(x, tile, rows)
    sd = jax.ShapeDtypeStruct
    f32 = jnp.float32
    stream, row, tiles = _gated_specs(rows, tile, ntp)
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(nb, nt), in_specs=[stream, row, row],
                                      out_specs=[row, tiles])
    keys = jnp.pad(K.astype(jnp.int32), ((0, 0), (0, LANES - PIVOTS)))
    out, W = pl.pallas_call(
        functools.partial(_bisect_kernel, barrier=bool(interpret)),
        grid_spec=gs,
        out_shape=[sd((Rp, LANES), f32), sd((Rp, ntp), f32)],
        compiler_params=_reduce_params(),
        interpret=_interp(interpret),
        name="ddtree_tpu_sample_bisect",
    )(_block_active(active, rows), x, _pack(M, Ts, tau0, S, tau, qthr), keys)
    return out[:, :PIVOTS].astype(jnp.int32), out[:, 2 * PIVOTS], out[:, PIVOTS:2 * PIVOTS], W


# ----------------------------------------------------------------------------- wrapper


def _tile_for(V: int, tile: int | None) -> int:
    t = tile or MAX_TILE
    if t % LANES:
        raise ValueError(f"tile must be a multiple of {LANES} on TPU, got {t}")
    return max(LANES, min(t, pl.cdiv(V, LANES) * LANES))


@functools.partial(jax.jit, static_argnames=("interpret", "tile", "block_rows"))
def fused_sample_debug(
    logits: jax.Array,  # [R, V] f32 or bf16
    temperature: jax.Array,  # f32 [R] (0 = greedy)
    top_k: jax.Array,  # i32 [R]
    top_p: jax.Array,  # f32 [R]
    min_p: jax.Array,  # f32 [R]
    seeds: jax.Array,  # u32 [R, 2]
    *,
    interpret: bool = False,
    tile: int | None = None,
    block_rows: int = 16,
    max_rounds: int | jax.Array = MAX_ROUNDS,
) -> dict:
    """The kernel with its per-row thresholds (for tests): dict of ``[R]`` arrays as the Triton
    version's ``fused_sample_debug``: ``token``, ``tau`` (kept requires ``z >= tau``), ``q_thr``
    (kept requires ``exp(z)/norm >= q_thr``), ``norm``, ``path`` (0 greedy/invalid, 1 temperature,
    3 full-row threshold searches, 4 pivot rejection; 2, the Triton version's candidate path, is
    never taken here), ``passes`` (full-row passes after the stats pass, draw passes not counted)
    and ``rounds`` (pivot-rejection rounds). On path 4 ``tau``/``q_thr``
    (``norm`` = 1) describe a superset of the kept set, as in the Triton version.

    ``interpret``: run in Pallas' TPU interpret mode (off a TPU). ``tile``: vocabulary columns per
    grid step (a multiple of 128; default 4096). ``block_rows``: rows per block (a multiple of 8;
    16 suits bf16). ``max_rounds`` (traced: no recompile) = 0 turns the rejection path off (path 3
    instead)."""
    R, V = logits.shape
    if V >= 2**24:
        raise ValueError(f"vocabularies up to 2**24 (token ids and counts ride as float32), got {V}")
    if block_rows % 8:
        raise ValueError(f"block_rows must be a multiple of 8, got {block_rows}")
    tile = _tile_for(V, tile)
    nt = pl.cdiv(V, tile)
    Rp = pl.cdiv(R, block_rows) * block_rows
    f32, i32 = jnp.float32, jnp.int32
    x = jnp.pad(logits, ((0, Rp - R), (0, nt * tile - V)), constant_values=-jnp.inf)  # padded rows: invalid
    pad = lambda a, v: jnp.pad(a, ((0, Rp - R),) + ((0, 0),) * (a.ndim - 1), constant_values=v)  # noqa: E731
    T = pad(temperature.astype(f32), 1.0)
    k = pad(top_k.astype(i32), 0)
    p = pad(top_p.astype(f32), 1.0)
    minp = pad(min_p.astype(f32), 0.0)
    seeds = pad(seeds.astype(jnp.uint32), 0)
    s0, s1 = seeds[:, 0], seeds[:, 1]
    opts = dict(tile=tile, rows=block_rows, interpret=interpret)

    M, argmax, valid, tm, ts = _stats_pass(x, T, **opts)
    greedy, k_on, p_on, filtered = _row_filters(T, k, p, minp, V)
    Ts = jnp.where(greedy, 1.0, T)
    inv_t = 1.0 / Ts
    sampled = valid & ~greedy
    neg_inf = jnp.full((Rp,), -jnp.inf, f32)
    zeros, ones, izeros = jnp.zeros((Rp,), f32), jnp.ones((Rp,), f32), jnp.zeros((Rp,), i32)
    u1, u2 = _uniform(s0, s1, 0), _uniform(s0, s1, 1)
    W0 = _tile_weights(tm, ts, M[:, None], inv_t[:, None])

    def draw(active, W, u_t, u_e, P, zlo, S, qthr):
        t = jnp.maximum(_pick(W, u_t), 0)
        tok, zv, ev = _draw_pass(x, active, t, M, Ts, P, zlo, S, qthr, u_e, **opts)
        ok = tok >= 0  # (j < 0 cannot happen when W_t > 0; the argmax is kept anyway)
        return jnp.where(ok, tok, argmax), jnp.where(ok, zv, 0.0), jnp.where(ok, ev, 1.0)

    # --- path 1: temperature only: round 0 of the loop below with streams 0, 1 (no filter can
    # reject the draw, so it is accepted without a pass; one draw-pass call site for both paths)
    temp_rows = sampled & ~filtered
    S_t = jnp.sum(W0, axis=1)

    # --- exact threshold searches (PATH_SLOW and the exact S_k of the rejection path)
    # One loop of full-row passes (one call site of the pass: interpret mode compiles each site),
    # through phases every row goes through in step (a row sits out a phase it does not need):
    # 0 the key of z_(k) (radix search on #{key > K} < k), 1 S = mass{z >= z_(k)},
    # 2 whether top-p cuts at all (mass above the lowest key >= p), 3 the top-p key (radix search
    # on mass{key > K} / S < p), 4 the per-tile masses of the kept set. ``last`` = 2 stops after S.
    int_min = jnp.full((Rp,), INT_MIN, i32)

    def thresholds(rows, last):
        """-> dict(K_k, tau0, S, K_p, tau, qthr, W, passes) for ``rows`` (phases 0 .. last - 1)."""

        def act_of(c):
            ph, lo, hi = c["phase"], c["lo"], c["hi"]
            return jnp.select(
                [ph == 0, ph == 1, ph == 2, ph == 3],
                [rows & k_on & (hi > lo + 1), rows, rows & p_on, c["need"] & (hi > lo + 1)], rows)

        def body(c):
            ph = c["phase"]
            act = act_of(c)
            any_act = jnp.any(act)
            tau0 = _key_threshold(c["K_k"])
            tau = _key_threshold(jnp.maximum(c["K_k"], c["K_p"]))
            qthr = minp * (1.0 / c["S"])
            piv = _radix_pivots(c["lo"], c["hi"])
            K = jnp.where((ph == 0) | (ph == 3), piv, jnp.where(ph == 2, INT_MIN, 0))
            t0 = jnp.where(ph == 0, -jnp.inf, jnp.where(ph == 4, -jnp.inf, tau0))
            S = jnp.where(ph <= 1, 1.0, c["S"])
            tt, qq = jnp.where(ph == 4, tau, -jnp.inf), jnp.where(ph == 4, qthr, 0.0)
            cnt, mass, above, W = jax.lax.cond(
                any_act, lambda: _bisect_pass(x, act, M, Ts, K, t0, S, tt, qq, **opts),
                lambda: (jnp.zeros((Rp, PIVOTS), i32), zeros, jnp.zeros((Rp, PIVOTS), f32), c["W"]))
            c = dict(c, passes=c["passes"] + act.astype(i32))
            # phase 0 / 3: one radix step; the phase ends when no row is left in it
            pred = jnp.where(ph == 0, cnt < k[:, None], above < p[:, None])
            lo, hi = _radix_update(c["lo"], c["hi"], piv, pred, act & ((ph == 0) | (ph == 3)))
            c = dict(c, lo=lo, hi=hi)
            searching = ((ph == 0) | (ph == 3)) & jnp.any(act_of(c))
            done0 = (ph == 0) & ~searching
            done3 = (ph == 3) & ~searching
            c["K_k"] = jnp.where(done0, jnp.where(rows & k_on, c["hi"], INT_MIN), c["K_k"])
            c["S"] = jnp.where(ph == 1, jnp.where(rows, mass, 1.0), c["S"])
            need = rows & p_on & (above[:, 0] >= p)
            c["need"] = jnp.where(ph == 2, need, c["need"])
            c["K_p"] = jnp.where(done3, jnp.where(c["need"], c["hi"], INT_MIN), c["K_p"])
            c["W"] = jnp.where(ph == 4, W, c["W"])
            # entering phase 3: a fresh search interval
            c["lo"] = jnp.where(done0 | (ph == 2), int_min, c["lo"])
            c["hi"] = jnp.where(done0 | (ph == 2), izeros, c["hi"])
            c["phase"] = jnp.where(searching, ph, ph + 1)
            return c

        init = dict(phase=jnp.int32(0), lo=int_min, hi=izeros, K_k=int_min, K_p=int_min, S=ones,
                    need=jnp.zeros((Rp,), bool), W=jnp.zeros_like(W0), passes=izeros)
        c = jax.lax.while_loop(lambda c: c["phase"] < last, body, init)
        tau0 = _key_threshold(c["K_k"])
        tau = _key_threshold(jnp.maximum(c["K_k"], c["K_p"]))
        return dict(c, tau0=tau0, tau=tau, qthr=minp * (1.0 / c["S"]))

    def p_slow(rows):
        th = thresholds(rows, 5)
        tok, _, _ = draw(rows, th["W"], u1, u2, neg_inf, th["tau"], th["S"], th["qthr"])
        return tok, th["tau"], th["qthr"], th["S"], th["passes"]

    def run_slow(rows):
        return jax.lax.cond(jnp.any(rows), p_slow, lambda r: (argmax, neg_inf, zeros, ones, izeros), rows)

    # --- path 4: pivot rejection
    rej_rows = sampled & filtered
    tau_m = jnp.log(minp)  # min-p on the rejection path: z >= log(min_p) (-inf when off)
    need_pass_kp = k_on | p_on

    def round_(c):
        i, done, tok, P, zfl, W, have_sk, S_k, passes, nr = c
        active = (temp_rows | (rej_rows & (i < max_rounds))) & ~done
        u_t = jnp.where(temp_rows, u1, _uniform(s0, s1, 2 * i + 2))
        u_e = jnp.where(temp_rows, u2, _uniform(s0, s1, 2 * i + 3))
        v, zv, ev = draw(active, W, u_t, u_e, P, zfl, ones, zeros)
        ok_m = zv >= tau_m
        # min-p alone: the test is local (z_v >= log(min_p)); a pass only after a rejection
        ran = active & (need_pass_kp | ~ok_m)
        Wc, cnt, tot = jax.lax.cond(jnp.any(ran), lambda: _check_pass(x, ran, M, Ts, zv, tau_m, **opts),
                                    lambda: (W, izeros, ones))
        Wn = jnp.where(ran[:, None], Wc, W)
        cnt, tot = jnp.where(ran, cnt, 0), jnp.where(ran, tot, 1.0)
        m_gt = jnp.sum(Wn, axis=1)  # = mass{z > zv} whenever v passes min-p
        # top-p with top-k: S_k >= mass{z >= zv} >= m_gt + ev decides acceptance, S_k <= tot
        # rejection; otherwise S_k exactly (a radix-16 search, once per row).
        need_sk = _top_k_mass_undecided(zv, ev, ran, cnt, m_gt, tot, k, p, k_on, p_on, tau_m, have_sk)

        # Computed for every undecided top-k + top-p row at once (a pass costs the same for one row
        # of a block as for all; the decisions do not depend on when S_k became known).
        sk_rows = need_sk | (active & k_on & p_on & (have_sk == 0))

        def exact_sk():
            th = thresholds(sk_rows, 2)
            return th["S"], th["passes"]

        S_new, n_sk = jax.lax.cond(jnp.any(need_sk), exact_sk, lambda: (ones, izeros))
        got = sk_rows & jnp.any(need_sk)
        S_k = jnp.where(got, S_new, S_k)
        have_sk = jnp.where(got, 1, have_sk)
        S_p = jnp.where(have_sk > 0, S_k, tot)
        acc = active & _pivot_kept(zv, cnt, m_gt, S_p, k, p, k_on, p_on, tau_m)
        rej = active & ~acc
        passes = passes + ran.astype(i32) + jnp.where(got, n_sk, 0)
        # Rejected: every u with z_u <= z_v is out of the kept set (an upper set in z).
        return (i + 1, done | acc, jnp.where(acc, v, tok), jnp.where(rej, zv, P), jnp.where(rej, tau_m, zfl),
                jnp.where(rej[:, None], Wn, W), have_sk, S_k, passes, nr + active.astype(i32))

    def more(c):
        return ((c[0] < max_rounds) & jnp.any(rej_rows & ~c[1])) | ((c[0] == 0) & jnp.any(temp_rows))

    init = (jnp.int32(0), ~sampled, argmax, neg_inf, neg_inf, W0, izeros, ones, izeros, izeros)
    _, done, tok_r, P, _, _, _, _, passes_r, rounds = jax.lax.while_loop(more, round_, init)
    fell = rej_rows & ~done
    tok_s, tau_s, qthr_s, S_s, passes_s = run_slow(fell)
    # accepted: kept requires z > P (tau = the next float above P; P < 0) and z >= log(min_p)
    tau_r = _pivot_bound(P)

    path = jnp.where(sampled, jnp.where(filtered, jnp.where(fell, PATH_SLOW, PATH_REJECT), PATH_TEMPERATURE),
                     PATH_NONE)
    token = jnp.where(valid, argmax, INVALID_TOKEN)
    token = jnp.where(temp_rows, tok_r, token)
    token = jnp.where(rej_rows, jnp.where(fell, tok_s, tok_r), token)
    tau = jnp.where(fell, tau_s, jnp.where(rej_rows, tau_r, -jnp.inf))
    q_thr = jnp.where(fell, qthr_s, jnp.where(rej_rows, minp, 0.0))
    norm = jnp.where(fell, S_s, jnp.where(rej_rows, 1.0, jnp.where(temp_rows, S_t, 0.0)))
    passes = jnp.where(rej_rows, passes_r + jnp.where(fell, passes_s, 0), 0)
    out = dict(token=token.astype(i32), tau=tau, q_thr=q_thr, norm=norm, path=path.astype(i32), passes=passes,
               rounds=jnp.where(rej_rows, rounds, 0))
    return {name: a[:R] for name, a in out.items()}


def fused_sample(logits, temperature, top_k, top_p, min_p, seeds, *, interpret: bool = False,
                 tile: int | None = None, **tuning) -> jax.Array:
    """One exact draw per row of ``logits [R, V]`` under per-row (temperature, top_k, top_p,
    min_p), seeds ``u32 [R, 2]``; ``INVALID_TOKEN`` for NaN/+inf/all--inf rows. i32 ``[R]``."""
    return fused_sample_debug(logits, temperature, top_k, top_p, min_p, seeds, interpret=interpret, tile=tile,
                              **tuning)["token"]
