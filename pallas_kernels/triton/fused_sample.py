"""Fused per-row sampling on NVIDIA GPUs (Pallas Triton lowering): the canonical pipeline
(temperature, top-k, top-p, min-p, as ``ddtree_jax.sampling.target_logprobs`` defines it) and one
exact draw per row, without sorting.

``fused_sample(logits [R, V] f32|bf16, temperature, top_k, top_p, min_p [R], seeds u32 [R, 2])``
-> i32 ``[R]``; ``fused_sample_debug`` also returns each row's thresholds, path and pass counts.
Invariants: temperature 0 is greedy (lowest-index argmax); rows with NaN, +inf or only -inf
logits give ``INVALID_TOKEN``; the top-k set is exact (ties kept), top-p and min-p equal the
reference's up to float32 rounding at the boundary, and the draw has the exact law of the kept
set; a row's outputs are the same bits whatever else shares the call. Random numbers:
``_shared._uniform`` of the row's seeds (streams 0, 1; rejection round i: 2 + 2i, 3 + 2i).
Three launches: stats (one read of the row), check (light rows, first rejection passes), select
(filtered rows: top-k candidate chunks, pivot rejection, full-row bisections).
Design and measurements: docs/kernels.md, "Fused sampler"; tests: tests/test_triton_fused_sample.py.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shared import (
    BIG,
    INT_MIN,
    INVALID_TOKEN,
    MAX_ROUNDS,
    MAX_TILE,
    PATH_CANDIDATES,
    PATH_NONE,
    PATH_REJECT,
    PATH_SLOW,
    PATH_TEMPERATURE,
    _bisect,
    _interpret_div,
    _key_threshold,
    _key_to_float,
    _pick,
    _pivot_bound,
    _pivot_kept,
    _row_filters,
    _tile_weights,
    _top_k_mass_undecided,
    _uniform,
    _zkey,
)

__all__ = ["CAND_CHUNKS", "CHUNK", "INVALID_TOKEN", "MAX_ROUNDS", "fused_sample", "fused_sample_debug"]

CHUNK = 64  # columns per chunk maximum
CAND_CHUNKS = 128  # candidate chunks gathered by the top-k candidate path (k <= CAND_CHUNKS)
CHECK_SEG = 4  # tiles per segment of a check launch's pass (fixed: its sums never depend on the batch)
_CHECK_SEG_BITS = CHECK_SEG.bit_length() - 1
_ONE_KEY = np.int32(0x3F800000)  # bit pattern of 1.0f
_KEY_NEG_INF = np.float32(-np.inf).view(np.int32) ^ np.int32(0x7FFFFFFF)  # _zkey(-inf)
_KEY_POS_INF = np.int32(0x7F800000)  # _zkey(+inf)
_LOG2E = np.float32(np.log2(np.e))
_TARGET_PROGRAMS = 256  # programs to aim for in the stats and check launches (about two waves of SMs)
_MAX_SPLITS = 16


# ----------------------------------------------------------------------------- shapes, refs, rows


class _Geometry(NamedTuple):
    """Static shape of a call: ``vocab`` columns in ``n_tiles`` tiles of ``tile`` columns, tiles
    grouped in ``n_segments`` segments of CHECK_SEG; ``*_p2``: the next power of two (Triton block
    shapes); ``stats_splits``: programs per row of the stats launch."""

    vocab: int
    tile: int
    n_tiles: int
    tiles_p2: int
    chunks_p2: int
    n_segments: int
    segments_p2: int
    stats_splits: int

    @property
    def n_chunks(self) -> int:
        return self.n_tiles * (self.tile // CHUNK)


class _ParamRefs(NamedTuple):
    """Per-row sampling parameters: ``[R]`` temperature, top_k, top_p, min_p; ``[R, 2]`` seeds."""

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any


class _StatsRefs(NamedTuple):
    """The stats launch's results: per (row, split) the max, the lowest-index argmax and the
    validity bits (2 * NaN-or-+inf + any-finite); per (row, tile) the max ``m_t`` and the mass
    ``sum exp((x - m_t) / T)``; per (row, chunk) the chunk maxima (top-k candidate rows only)."""

    split_max: Any
    split_argmax: Any
    split_flags: Any
    tile_max: Any
    tile_mass: Any
    chunk_max: Any


class _PassRefs(NamedTuple):
    """A rejection round's full-row pass as a check launch stores it: per (row, tile) the mass of
    the next draw set ``{z > z_v, z >= log(min_p)}``, per (row, segment) ``#{z > z_v}`` and the
    total mass (``seg_total``: round 0 only, None for round 1)."""

    tile_weights: Any
    seg_count: Any
    seg_total: Any


class _OutRefs(NamedTuple):
    """Per-row results ``[R]``: the fields of ``fused_sample_debug``."""

    token: Any
    tau: Any
    q_thr: Any
    norm: Any
    path: Any
    passes: Any
    rounds: Any


class _Result(NamedTuple):
    """A select path's per-row result; ``fell_back`` 1 when pivot rejection ran out of rounds."""

    token: Any
    tau: Any
    q_thr: Any
    norm: Any
    passes: Any
    rounds: Any
    fell_back: Any


class _Row(NamedTuple):
    """One row in a check or select program (``r``: the grid's first axis): its parameters, the
    stats launch's row max, argmax and validity, its filters, and the division every pass uses."""

    x_ref: Any
    geo: _Geometry
    division: str
    r: Any
    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seed: tuple
    row_max: Any
    argmax: Any
    valid: Any
    greedy: Any
    k_on: Any
    p_on: Any
    filtered: Any
    cand_row: Any  # the top-k candidate path may apply (unless more than CAND_CHUNKS chunks tie)
    t_div: Any  # the temperature, 1 on greedy rows
    inv_t: Any
    exp2_scale: Any  # log2(e) / T: exp(y / T) = exp2(y * exp2_scale)
    log_min_p: Any  # min-p on the rejection path: z >= log(min_p) (-inf when off)
    zero_i: Any  # traced zeros and -inf: lax.cond branches must return traced values (Triton lowering)
    zero_f: Any
    neg_inf: Any

    def z(self, x):
        """``z = (x - M) / T``, the division IEEE (as the reference's) unless ``exact_div_asm`` is off."""
        return _div(x - self.row_max, jnp.full(x.shape, self.t_div, jnp.float32), self.division)

    def uniform(self, stream):
        return _uniform(self.seed[0], self.seed[1], stream)

    def load_tile(self, t, live):
        """Tile t of the row (-inf past the vocabulary; nothing loaded where ``live`` is false)."""
        return _load_tile(self.x_ref, self.r, t, live, self.geo)

    def tile_loop(self, body, init):
        """``body(t, x, carry)`` over the row's tiles in order (``_tile_loop``): one full-row pass."""
        return _tile_loop(self.load_tile, 0, self.geo.n_tiles, body, init)


def _load_row(x_ref, params: _ParamRefs, stats: _StatsRefs, geo: _Geometry, division: str) -> _Row:
    """The row of this program (``program_id(0)``) in a check or select launch."""
    r = pl.program_id(0)
    T = params.temperature[r]
    k = params.top_k[r]
    p = params.top_p[r]
    min_p = params.min_p[r]
    seed = (params.seeds[r, 0], params.seeds[r, 1])
    M, argmax, valid = _combine_splits(stats, r, geo.stats_splits)
    greedy, k_on, p_on, filtered = _row_filters(T, k, p, min_p, geo.vocab)
    t_div = jnp.where(greedy, 1.0, T)
    inv_t = 1.0 / t_div
    zero_f = T * 0.0
    return _Row(
        x_ref, geo, division, r, T, k, p, min_p, seed, M, argmax, valid, greedy, k_on, p_on, filtered,
        k_on & (k <= CAND_CHUNKS), t_div, inv_t, inv_t * _LOG2E, jnp.log(min_p), k * 0, zero_f, zero_f - jnp.inf,
    )


# ----------------------------------------------------------------------------- helpers


def _div(a, b, division: str):
    """``a / b``: "ptx": IEEE round-to-nearest ``div.rn.f32`` through inline PTX; "approx":
    Triton's '/' (approximate on f32); "interpret": one IEEE division between optimization
    barriers."""
    if division == "interpret":
        return _interpret_div(a, b)
    if division == "approx":
        return a / b
    b = jnp.broadcast_to(b, a.shape)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )[0]


def _load_tile(x_ref, r, t, live, geo: _Geometry):
    iota = jnp.arange(geo.tile, dtype=jnp.int32)
    mask = (t * geo.tile + iota < geo.vocab) & live
    return plgpu.load(x_ref.at[r, pl.ds(t * geo.tile, geo.tile)], mask=mask, other=-jnp.inf)


def _tile_loop(load, t0, n, body, init):
    """``body(i, x, carry)`` over tiles ``t0 .. t0 + n - 1`` in order, ``x`` tile ``t0 + i`` as
    float32 (``load(t, live)`` loads tile t, nothing where ``live`` is false). Tile i + 1 is
    loaded before tile i is processed (it rides in the loop carry); the last step's load is
    masked off."""

    def step(i, c):
        x, carry = c
        nxt = load(t0 + jnp.minimum(i + 1, n - 1), i + 1 < n)
        return nxt, body(i, x.astype(jnp.float32), carry)

    return jax.lax.fori_loop(0, n, step, (load(t0, True), init))[1]


def _combine_splits(stats: _StatsRefs, r, splits: int):
    """The stats launch's per-split results of row r combined exactly: (max, lowest-index argmax,
    valid)."""
    mxs = stats.split_max[r, pl.ds(0, splits)]
    M = jnp.max(mxs)
    argmax = jnp.min(jnp.where(mxs == M, stats.split_argmax[r, pl.ds(0, splits)], BIG))
    oks = stats.split_flags[r, pl.ds(0, splits)]
    valid = (jnp.max(oks // 2) == 0) & (jnp.max(oks % 2) == 1)
    return M, argmax, valid


def _first_draw_weights(row: _Row, stats: _StatsRefs):
    """The row's per-tile masses of exp(z) ``[tiles_p2]`` (the first draw's tile weights)."""
    geo = row.geo
    iota = jnp.arange(geo.tiles_p2, dtype=jnp.int32)
    tm = plgpu.load(stats.tile_max.at[row.r, pl.ds(0, geo.tiles_p2)], mask=iota < geo.n_tiles, other=-jnp.inf)
    ts = plgpu.load(stats.tile_mass.at[row.r, pl.ds(0, geo.tiles_p2)], mask=iota < geo.n_tiles, other=0.0)
    return _tile_weights(tm, ts, row.row_max, row.inv_t)


def _draw(row: _Row, weights, u_tile, u_elem, allowed):
    """Two-level inverse CDF over exp(z) restricted to ``allowed(z, e)``: a tile by ``weights``
    (the restricted per-tile masses) and ``u_tile``, then that one tile re-read and an element
    picked in it by ``u_elem``. -> (token, z, exp(z)). The same inputs give the same bits in every
    launch (the check and select launches draw a row's first pivots through it)."""
    tile = row.geo.tile
    t = jnp.maximum(_pick(weights, u_tile), 0)
    cols = t * tile + jnp.arange(tile, dtype=jnp.int32)
    x = plgpu.load(row.x_ref.at[row.r, pl.ds(t * tile, tile)], mask=cols < row.geo.vocab, other=-jnp.inf)
    z = row.z(x.astype(jnp.float32))
    e = jnp.exp(z)
    j = _pick(jnp.where(allowed(z, e), e, 0.0), u_elem)
    hit = jnp.arange(tile, dtype=jnp.int32) == j
    # (j < 0 cannot happen: a positive weight says the tile holds an allowed value)
    tok = jnp.where(j >= 0, t * tile + j, row.argmax)
    zv = jnp.where(j >= 0, jnp.sum(jnp.where(hit, z, 0.0)), 0.0)
    ev = jnp.where(j >= 0, jnp.sum(jnp.where(hit, e, 0.0)), 1.0)
    return tok, zv, ev


def _finite(z, e):
    return z > -jnp.inf


def _draw_set(pivot, z_floor):
    """A rejection round's draw set: z above the last rejected pivot and z >= ``z_floor`` (-inf at
    first; log(min_p) after a rejection)."""
    return lambda z, e: (z > pivot) & (z > -jnp.inf) & (z >= z_floor)


# ----------------------------------------------------------------------------- the check pass


def _check_tile(x, M, exp2_scale, x_w, x_up, cnt, tot, with_count, with_total):
    """One tile (float32) of a check pass: its mass of ``{x >= x_w}`` (a weight of the next draw:
    one block reduction), and the per-lane count of ``{x >= x_up}`` (z > zv) and total mass
    carried on; masses ``exp2((x - M) * log2(e) / T)`` as the stats pass. -> (w_t, cnt, tot)."""
    e = jnp.exp2((x - M) * exp2_scale)
    if with_count:
        cnt = cnt + jnp.where(x >= x_up, 1, 0)
    if with_total:
        tot = tot + e
    return jnp.sum(jnp.where(x >= x_w, e, 0.0)), cnt, tot


def _x_bounds(zof, zv, log_min_p):
    """``(x_up, x_m)``: the smallest float32 x with ``zof(x) > zv`` and the smallest with
    ``zof(x) >= log_min_p``. ``zof`` is monotone in x, so ``{z > zv} = {x >= x_up}`` and
    ``{z >= log(min_p)} = {x >= x_m}`` exactly and a pass compares x instead of dividing every
    element. Both by one bisection over the int32 keys of the floats from -inf to +inf (32 steps
    on a 2-vector); ``zof(-inf) = -inf`` passes only ``>= -inf`` (min-p off)."""
    iota2 = jnp.arange(2, dtype=jnp.int32)
    zt = jnp.where(iota2 == 0, zv, log_min_p)

    def passes(k):
        z = zof(_key_to_float(k))
        return jnp.where(iota2 == 0, z > zt, z >= zt)

    lo, hi = jnp.full((2,), _KEY_NEG_INF, jnp.int32), jnp.full((2,), _KEY_POS_INF, jnp.int32)
    k = jnp.where(passes(lo), lo, _bisect(passes, lo, hi, 32))
    xb = _key_to_float(k)
    return jnp.max(jnp.where(iota2 == 0, xb, -jnp.inf)), jnp.max(jnp.where(iota2 == 1, xb, -jnp.inf))


def _by_filters(k_on, p_on, run):
    """``run(with_count, with_total)`` compiled four ways, the one for this row's (top-k on,
    top-p on) taken: a pass accumulates only what the row's tests read."""
    return jax.lax.cond(
        k_on,
        lambda: jax.lax.cond(p_on, lambda: run(True, True), lambda: run(True, False)),
        lambda: jax.lax.cond(p_on, lambda: run(False, True), lambda: run(False, False)),
    )


def _check_pass(row: _Row, zv, with_count, with_total):
    """One program's full-row pass for the drawn value zv: per-tile masses of
    ``{z > zv, z >= log(min_p)}`` ``[tiles_p2]`` (the next round's weights), ``#{z > zv}`` (top-k)
    and the total mass (top-p). One block reduction per tile; the count and total accumulate per
    lane and are reduced once at the end."""
    x_up, x_m = _x_bounds(row.z, zv, row.log_min_p)
    x_w = jnp.maximum(x_up, x_m)
    iota_nt = jnp.arange(row.geo.tiles_p2, dtype=jnp.int32)

    def body(t, x, c):
        W, cnt, tot = c
        w_t, cnt, tot = _check_tile(x, row.row_max, row.exp2_scale, x_w, x_up, cnt, tot, with_count, with_total)
        return jnp.where(iota_nt == t, w_t, W), cnt, tot

    tile = row.geo.tile
    init = (jnp.zeros((row.geo.tiles_p2,), jnp.float32), jnp.zeros((tile,), jnp.int32), jnp.zeros((tile,), jnp.float32))
    W, cnt, tot = row.tile_loop(body, init)
    return W, (jnp.sum(cnt) if with_count else row.zero_i), (jnp.sum(tot) if with_total else row.zero_f)


def _check_segments(row: _Row, out: _PassRefs, segments: tuple, zv, with_count, with_total):
    """A check launch program's part of the pass for zv: ``segments = (first, count)``. Stores per tile its mass of
    ``{z > zv, z >= log(min_p)}`` and per segment ``#{z > zv}`` and (round 0) the total mass:
    every stored value is one tile's or one fixed segment's, whatever the programs per row."""
    geo = row.geo
    x_up, x_m = _x_bounds(row.z, zv, row.log_min_p)
    x_w = jnp.maximum(x_up, x_m)
    g0, n_seg = segments
    t0 = g0 * CHECK_SEG
    n = jnp.clip(geo.n_tiles - t0, 0, n_seg * CHECK_SEG)

    def body(i, x, c):
        out.tile_weights[row.r, t0 + i], cnt, tot = _check_tile(
            x, row.row_max, row.exp2_scale, x_w, x_up, *c, with_count, with_total
        )
        # (CHECK_SEG is a power of two: masks and shifts, no '%' in the loop)
        last = ((i & (CHECK_SEG - 1)) == CHECK_SEG - 1) | (i == n - 1)
        g = g0 + (i >> _CHECK_SEG_BITS)

        @pl.when(last)
        def _():
            out.seg_count[row.r, g] = jnp.sum(cnt) if with_count else row.zero_i
            if out.seg_total is not None:
                out.seg_total[row.r, g] = jnp.sum(tot) if with_total else row.zero_f

        return jnp.where(last, 0, cnt), jnp.where(last, 0.0, tot)

    init = (jnp.zeros((geo.tile,), jnp.int32), jnp.zeros((geo.tile,), jnp.float32))
    _tile_loop(row.load_tile, t0, n, body, init)
    return row.zero_i


def _stored_pass(row: _Row, stored: _PassRefs):
    """A check launch's stored pass of the row, summed as every reader sums them (the same bits in
    the second check launch and the select launch): (per-tile weights, count, total)."""
    geo = row.geo
    iota_nt = jnp.arange(geo.tiles_p2, dtype=jnp.int32)
    iota_s = jnp.arange(geo.segments_p2, dtype=jnp.int32)

    def seg_sum(ref, other):
        return jnp.sum(plgpu.load(ref.at[row.r, pl.ds(0, geo.segments_p2)], mask=iota_s < geo.n_segments, other=other))

    W = plgpu.load(stored.tile_weights.at[row.r, pl.ds(0, geo.tiles_p2)], mask=iota_nt < geo.n_tiles, other=0.0)
    return W, seg_sum(stored.seg_count, 0), seg_sum(stored.seg_total, 0.0)


def _in_check_launches(row: _Row):
    """Rows whose first rejection rounds' passes the check launches run (filtered, sampled, not
    top-k candidate rows)."""
    return row.valid & ~row.greedy & row.filtered & ~row.cand_row


# ----------------------------------------------------------------------------- launch 1: stats


def _stats_kernel(x_ref, temp_ref, topk_ref, stats: _StatsRefs, *, geo: _Geometry, tiles_per_split: int):
    """Program (r, s) reads tiles ``[s * tiles_per_split, (s + 1) * tiles_per_split)`` of row r:
    per-tile max and mass and per-chunk maxima to their own slots, the row max / argmax /
    validity of its part to ``[r, s]`` (combined by the later launches)."""
    r = pl.program_id(0)
    split = pl.program_id(1)
    t0 = split * tiles_per_split
    tile = geo.tile
    cpt = tile // CHUNK
    T = temp_ref[r]
    k = topk_ref[r]
    greedy = T == 0.0
    inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, T))
    exp2_scale = inv_t * _LOG2E  # exp(y / T) = exp2(y * exp2_scale): one FMA + ex2 per element
    # Chunk maxima are read only by the top-k candidate path: other rows skip the store.
    need_cm = ~greedy & (k > 0) & (k < geo.vocab) & (k <= CAND_CHUNKS)
    iota = jnp.arange(tile, dtype=jnp.int32)
    iota_cpt = jnp.arange(cpt, dtype=jnp.int32)

    def body(i, x, c):
        m, am, bad, fin = c
        t = t0 + i
        cols = t * tile + iota
        cmax = jnp.max(x.reshape(cpt, CHUNK), axis=1)  # (max ignores NaN on the GPU: maxnumf)
        plgpu.store(stats.chunk_max.at[r, pl.ds(t * cpt, cpt)], cmax, mask=need_cm & (iota_cpt >= 0))
        tmax = jnp.max(cmax)
        # Sampled rows: the tile mass is NaN iff the tile holds a NaN (x finite or -inf and tmax
        # finite give terms in [0, 1]); greedy rows need an explicit NaN test instead.
        safe = jnp.where(jnp.abs(tmax) < jnp.inf, tmax, 0.0)
        s = jax.lax.cond(
            greedy,
            lambda: jnp.where(jnp.max(jnp.where(x != x, 1, 0)) > 0, jnp.nan, inv_t * 0.0),
            lambda: jnp.sum(jnp.exp2((x - safe) * exp2_scale)),
        )
        bad = bad | (s != s) | (tmax == jnp.inf)
        fin = fin | (tmax > -jnp.inf)
        stats.tile_max[r, t] = tmax
        stats.tile_mass[r, t] = s
        better = tmax > m  # the lowest-index argmax is searched only in tiles that raise the max
        targ = jax.lax.cond(better, lambda: jnp.min(jnp.where(x == tmax, cols, BIG)), lambda: am)
        return jnp.where(better, tmax, m), targ, bad, fin

    def load(t, live):
        return _load_tile(x_ref, r, t, live, geo)

    init = (jnp.float32(-jnp.inf), jnp.int32(0), jnp.bool_(False), jnp.bool_(False))
    m, am, bad, fin = _tile_loop(load, t0, jnp.minimum(tiles_per_split, geo.n_tiles - t0), body, init)
    stats.split_max[r, split] = m
    stats.split_argmax[r, split] = am
    stats.split_flags[r, split] = bad.astype(jnp.int32) * 2 + fin.astype(jnp.int32)


# ----------------------------------------------------------------------------- launch 2: light rows, first check passes


def _finish_light_row(row: _Row, stats: _StatsRefs, out: _OutRefs):
    """Invalid row -> INVALID_TOKEN; greedy row -> the argmax; temperature only -> a two-level
    draw (a tile by its mass with stream 0, one tile re-read, an element with stream 1)."""

    def temperature_draw():
        W = _first_draw_weights(row, stats)
        return _draw(row, W, row.uniform(0), row.uniform(1), _finite)[0], jnp.sum(W)

    def no_draw():
        return jnp.where(row.valid, row.argmax, INVALID_TOKEN), row.zero_f

    tok, S = jax.lax.cond(~row.valid | row.greedy, no_draw, temperature_draw)
    light = (row.valid & ~row.greedy).astype(jnp.int32)
    r = row.r
    out.token[r] = tok.astype(jnp.int32)
    out.tau[r] = row.neg_inf
    out.q_thr[r] = row.zero_f
    out.norm[r] = S
    out.path[r] = light * PATH_TEMPERATURE + (1 - light) * PATH_NONE
    out.passes[r] = row.zero_i
    out.rounds[r] = row.zero_i


def _first_check_kernel(
    x_ref, params, stats, round0: _PassRefs, light: _OutRefs, *, geo, segments_per_program, division, reject
):
    """Check launch 0, grid (rows, programs per row): program (r, 0) finishes the light rows
    (``_finish_light_row``; the select launch skips them); with ``reject``, every program runs its
    segments of round 0's pass for the row's first pivot (streams 2, 3; the select launch draws
    the same pivot bit for bit). Min-p-only rows whose pivot passes min-p need no pass."""
    row = _load_row(x_ref, params, stats, geo, division)
    program = pl.program_id(1)

    @pl.when((program == 0) & (~row.valid | row.greedy | ~row.filtered))
    def _():
        _finish_light_row(row, stats, light)

    if not reject:
        return
    W0 = _first_draw_weights(row, stats)

    @pl.when(_in_check_launches(row))
    def _():
        zv = _draw(row, W0, row.uniform(2), row.uniform(3), _draw_set(row.neg_inf, row.neg_inf))[1]

        @pl.when(row.k_on | row.p_on | (zv < row.log_min_p))
        def _():
            segments = (program * segments_per_program, segments_per_program)
            _by_filters(row.k_on, row.p_on, functools.partial(_check_segments, row, round0, segments, zv))


def _second_check_kernel(x_ref, params, stats, round0: _PassRefs, round1: _PassRefs, *, geo, segments_per_program,
                         division):
    """Check launch 1: each program replays round 0 from launch 0's stored pass (the same draw and
    decision as the select launch) and, for rows with top-k or top-p whose pivot was rejected
    without needing the exact top-k mass, runs its segments of round 1's pass (streams 4, 5).
    (Min-p alone: round 1 draws from ``{z >= log(min_p)}``, which needs no test.)"""
    row = _load_row(x_ref, params, stats, geo, division)
    segments = (pl.program_id(1) * segments_per_program, segments_per_program)
    W0 = _first_draw_weights(row, stats)

    @pl.when(_in_check_launches(row) & (row.k_on | row.p_on))
    def _():
        _, zv0, ev0 = _draw(row, W0, row.uniform(2), row.uniform(3), _draw_set(row.neg_inf, row.neg_inf))
        ran0 = row.k_on | row.p_on  # (true here: round 0 ran its pass)
        W1, cnt, tot = _stored_pass(row, round0)
        m_gt = jnp.sum(W1)
        filters = (row.top_k, row.top_p, row.k_on, row.p_on, row.log_min_p)
        need_sk = _top_k_mass_undecided(zv0, ev0, ran0, cnt, m_gt, tot, *filters, row.zero_i)
        rejected = ran0 & ~need_sk & ~_pivot_kept(zv0, cnt, m_gt, tot, *filters)

        @pl.when(rejected)
        def _():
            zv1 = _draw(row, W1, row.uniform(4), row.uniform(5), _draw_set(zv0, row.log_min_p))[1]
            check = functools.partial(_check_segments, row, round1, segments, zv1)
            jax.lax.cond(row.k_on, lambda: check(True, False), lambda: check(False, False))


# ----------------------------------------------------------------------------- launch 3: select, top-k candidate path


def _chunk_max_keys(row: _Row, stats: _StatsRefs):
    """z-keys of the row's chunk maxima ``[chunks_p2]``, and which slots hold a chunk."""
    geo = row.geo
    real = jnp.arange(geo.chunks_p2, dtype=jnp.int32) < geo.n_chunks
    cmv = plgpu.load(stats.chunk_max.at[row.r, pl.ds(0, geo.chunks_p2)], mask=real, other=-jnp.inf)
    return _zkey(row.z(cmv)), real


def _count_candidate_chunks(row: _Row, stats: _StatsRefs):
    """-> (number of candidate chunks, their key bound): the bound is the key of the k-th largest
    chunk maximum, a lower bound of the k-th largest z; every z at or above it lies in a chunk
    whose maximum's key is at or above it (exactly k chunks, or more on ties)."""
    keys, real = _chunk_max_keys(row, stats)
    ck = jnp.where(real, keys, INT_MIN)
    bound = _bisect(lambda K: jnp.sum(jnp.where(ck > K, 1, 0)) < row.top_k, INT_MIN, jnp.int32(0), 31)
    return jnp.sum(jnp.where(ck >= bound, 1, 0)), bound


def _list_candidate_chunks(row: _Row, flag, n_cand, scratch, *, compact, interpret_mode):
    """Indices of the flagged chunks in column order ``[CAND_CHUNKS]`` (-1 past ``n_cand``):
    ``compact="scatter"``: one cumsum, a scatter into the row's scratch and a CTA barrier;
    ``"loop"``: one min-reduction per chunk. Both give the same list."""
    iota_c = jnp.arange(row.geo.chunks_p2, dtype=jnp.int32)
    iota_k = jnp.arange(CAND_CHUNKS, dtype=jnp.int32)
    if compact == "scatter":
        # Flagged chunk c goes to slot (#flagged before c); the barrier (bar.sync orders global
        # memory within a CTA) makes the stores visible to the program's threads. Masked-off
        # lanes get distinct indices past the slots: interpret mode scatters them too, with
        # their old values, and duplicate indices would race.
        pos = jnp.cumsum(flag.astype(jnp.int32)) - 1
        live = flag & (pos < CAND_CHUNKS)
        plgpu.store(scratch.at[row.r, jnp.where(live, pos, CAND_CHUNKS + iota_c)], iota_c, mask=live)
        if not interpret_mode:
            plgpu.debug_barrier()
        return plgpu.load(scratch.at[row.r, pl.ds(0, CAND_CHUNKS)], mask=iota_k < n_cand, other=-1)

    def next_chunk(j, c):
        cidx, prev = c
        cj = jnp.min(jnp.where(flag & (iota_c > prev), iota_c, BIG))
        return jnp.where(iota_k == j, cj, cidx), cj

    return jax.lax.fori_loop(0, n_cand, next_chunk, (jnp.full((CAND_CHUNKS,), -1, jnp.int32), jnp.int32(-1)))[0]


def _candidate_kept_weights(row: _Row, z, live):
    """Exact cuts on the gathered candidates ``z [CAND_CHUNKS, CHUNK]``: the top-k key, the top-p
    cut on ``q = exp(z) / S_k`` and min-p, each by bisection over keys on the flat view (one block
    reduction per step). -> (kept masses exp(z), tau, q_thr, S_k)."""
    n = CAND_CHUNKS * CHUNK
    zk = jnp.where(live, _zkey(z), INT_MIN)
    zk1 = zk.reshape(n)
    K_k = _bisect(lambda K: jnp.sum(jnp.where(zk1 > K, 1, 0)) < row.top_k, INT_MIN, jnp.int32(0), 31)
    topk = zk >= K_k
    e = jnp.where(topk, jnp.exp(z), 0.0)
    S = jnp.sum(e.reshape(n))
    q = e / S
    q1 = q.reshape(n)
    qk1 = jax.lax.bitcast_convert_type(q1, jnp.int32)

    def top_p_key():
        return _bisect(lambda K: jnp.sum(jnp.where(qk1 > K, q1, 0.0)) < row.top_p, jnp.int32(-1), _ONE_KEY, 30)

    K_p = jax.lax.cond(row.p_on & (jnp.sum(q1) >= row.top_p), top_p_key, lambda: row.zero_i - 1)
    tau = _key_threshold(K_k)
    t_p = jnp.where(K_p >= 0, jax.lax.bitcast_convert_type(K_p, jnp.float32), 0.0)
    q_thr = jnp.maximum(t_p, row.min_p * (1.0 / S))
    kept = topk & (z > -jnp.inf) & (q >= q_thr)
    return jnp.where(kept, e, 0.0), tau, q_thr, S


def _candidate_path(row: _Row, stats: _StatsRefs, scratch, n_cand, bound, *, compact, interpret_mode) -> _Result:
    """top-k (k <= CAND_CHUNKS) with optional top-p / min-p: the candidate chunks (those whose
    maximum's key is at or above ``bound``) gathered into registers, the exact cuts found there,
    then one draw by inverse CDF over the kept candidates (a chunk with stream 0, an element of
    it with stream 1)."""
    keys, real = _chunk_max_keys(row, stats)
    cidx = _list_candidate_chunks(row, real & (keys >= bound), n_cand, scratch, compact=compact,
                                  interpret_mode=interpret_mode)
    cols = cidx[:, None] * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)[None, :]
    live = (cidx[:, None] >= 0) & (cols < row.geo.vocab)
    x = plgpu.load(row.x_ref.at[row.r, jnp.where(live, cols, 0)], mask=live, other=-jnp.inf)
    w, tau, q_thr, S = _candidate_kept_weights(row, row.z(x.astype(jnp.float32)), live)
    iota_k = jnp.arange(CAND_CHUNKS, dtype=jnp.int32)
    slot = jnp.maximum(_pick(jnp.sum(w, axis=1), row.uniform(0)), 0)
    j = _pick(jnp.sum(jnp.where(iota_k[:, None] == slot, w, 0.0), axis=0), row.uniform(1))
    chunk = jnp.sum(jnp.where(iota_k == slot, cidx, 0))
    tok = jnp.where(j >= 0, chunk * CHUNK + j, row.argmax)
    zi = row.zero_i
    return _Result(tok.astype(jnp.int32), tau, q_thr, S, zi, zi, zi)


# ----------------------------------------------------------------------------- launch 3: full-row bisection path


def _row_sum(row: _Row, fn, init):
    """``sum_t fn(z of tile t, t)`` over the row's tiles in order: one full-row pass."""
    return row.tile_loop(lambda t, x, acc: jax.tree.map(jnp.add, acc, fn(row.z(x), t)), init)


def _top_k_key(row: _Row):
    """Key of z_(k), the k-th largest z, by bisection: 32 full-row count passes."""

    def fewer_than_k_above(K):
        return _row_sum(row, lambda z, t: jnp.sum(jnp.where(_zkey(z) > K, 1, 0)), jnp.int32(0)) < row.top_k

    return _bisect(fewer_than_k_above, INT_MIN, jnp.int32(0), 32)


def _mass_at_or_above(row: _Row, tau):
    """``sum exp(z) [z >= tau]``: one full-row pass."""
    return _row_sum(row, lambda z, t: jnp.sum(jnp.where(z >= tau, jnp.exp(z), 0.0)), jnp.float32(0.0))


def _top_p_key(row: _Row, tau_k, S):
    """Top-p as a cut in z: the smallest z-key K with ``mass{z > K, z >= tau_k} / S < top_p``
    (INT_MIN when top-p is off or cuts nothing). -> (K, full-row passes)."""
    zi = row.zero_i

    def mass_above(K):
        def f(z, t):
            q = jnp.where(z >= tau_k, jnp.exp(z), 0.0) / S
            return jnp.sum(jnp.where(_zkey(z) > K, q, 0.0))

        return _row_sum(row, f, jnp.float32(0.0))

    def search():
        return _bisect(lambda K: mass_above(K) < row.top_p, jnp.int32(INT_MIN), jnp.int32(0), 32), zi + 33

    def cuts():
        return jax.lax.cond(mass_above(jnp.int32(INT_MIN)) >= row.top_p, search, lambda: (zi + INT_MIN, zi + 1))

    return jax.lax.cond(row.p_on, cuts, lambda: (zi + INT_MIN, zi))


def _bisection_path(row: _Row) -> _Result:
    """Exact thresholds by bisection over float keys with full-row passes (top-k key, top-k mass,
    top-p key in z, then the kept set's per-tile masses), then one two-level draw (streams 0, 1).
    The rejection path's fallback, and its replacement when ``max_rounds`` is 0."""
    zi = row.zero_i
    K_k = jax.lax.cond(row.k_on, lambda: _top_k_key(row), lambda: zi + INT_MIN)
    tau_k = _key_threshold(K_k)
    S = _mass_at_or_above(row, tau_k)
    K_p, p_passes = _top_p_key(row, tau_k, S)
    tau = _key_threshold(jnp.maximum(K_k, K_p))
    q_thr = row.min_p * (1.0 / S)
    iota_nt = jnp.arange(row.geo.tiles_p2, dtype=jnp.int32)

    def kept(z, e):
        return (z >= tau) & (z > -jnp.inf) & (e / S >= q_thr)

    def tile_w(z, t):
        e = jnp.exp(z)
        return jnp.where(iota_nt == t, jnp.sum(jnp.where(kept(z, e), e, 0.0)), 0.0)

    W = _row_sum(row, tile_w, jnp.zeros((row.geo.tiles_p2,), jnp.float32))
    tok = _draw(row, W, row.uniform(0), row.uniform(1), kept)[0]
    passes = row.k_on.astype(jnp.int32) * 32 + 2 + p_passes
    return _Result(tok.astype(jnp.int32), tau, q_thr, S, passes, zi, zi)


# ----------------------------------------------------------------------------- launch 3: pivot-rejection path


class _Rounds(NamedTuple):
    """The pivot-rejection loop's carry: accepted yet, the accepted token, the last rejected pivot
    and the z floor of the draw set, the draw set's per-tile weights, the exact top-k mass (once
    known), full-row passes and rounds used."""

    done: Any
    token: Any
    pivot: Any
    z_floor: Any
    weights: Any
    have_top_k_mass: Any
    top_k_mass: Any
    passes: Any
    rounds: Any


def _decide_pivot(row: _Row, zv, ev, ran, count, mass_above, total, have_top_k_mass, top_k_mass):
    """Is the drawn value (z = zv, exp(z) = ev) kept, given its pass's count of larger values, the
    mass above it and the total mass? top-p with top-k: bounds on S_k decide most rows, otherwise
    S_k is computed exactly (33 passes, once per row). -> (kept, have S_k, S_k, extra passes)."""
    filters = (row.top_k, row.top_p, row.k_on, row.p_on, row.log_min_p)
    need = _top_k_mass_undecided(zv, ev, ran, count, mass_above, total, *filters, have_top_k_mass)

    def exact_top_k_mass():
        return row.zero_i + 1, _mass_at_or_above(row, _key_threshold(_top_k_key(row)))

    have_top_k_mass, top_k_mass = jax.lax.cond(need, exact_top_k_mass, lambda: (have_top_k_mass, top_k_mass))
    norm = jnp.where(have_top_k_mass > 0, top_k_mass, total)
    kept = _pivot_kept(zv, count, mass_above, norm, *filters)
    return kept, have_top_k_mass, top_k_mass, need.astype(jnp.int32) * 33


def _rejection_round(row: _Row, i, c: _Rounds, stored: _PassRefs | None = None) -> _Rounds:
    """Round i: a draw from the current draw set (streams 2 + 2i, 3 + 2i; one tile re-read), then
    the full-row pass for it (this program's own, or ``stored``: the one a check launch ran for
    this round, the same draw bit for bit) and the decision. Rejected: every z at or below the
    drawn one is out of the kept set (an upper set in z), so it becomes the pivot."""
    zi, zf = row.zero_i, row.zero_f
    si = 2 * i + 2
    v, zv, ev = _draw(row, c.weights, row.uniform(si), row.uniform(si + 1), _draw_set(c.pivot, c.z_floor))
    # min-p alone: the test is local (z_v >= log(min_p)); a pass only after a rejection
    ran = (row.k_on | row.p_on) | (zv < row.log_min_p)

    def own_pass():
        return _by_filters(row.k_on, row.p_on, functools.partial(_check_pass, row, zv))

    run = own_pass if stored is None else functools.partial(_stored_pass, row, stored)
    W, cnt, tot = jax.lax.cond(ran, run, lambda: (c.weights, zi, zf + 1.0))
    # sum(W) = mass{z > zv} whenever the drawn value passes min-p ({z > zv} then passes too)
    kept, have_sk, S_k, sk_passes = _decide_pivot(row, zv, ev, ran, cnt, jnp.sum(W), tot, c.have_top_k_mass,
                                                  c.top_k_mass)
    passes = c.passes + ran.astype(jnp.int32) + sk_passes
    tok, pivot, z_floor, weights = jax.tree.map(
        lambda a, b: jnp.where(kept, a, b), (v, c.pivot, c.z_floor, c.weights), (c.token, zv, row.log_min_p, W)
    )
    return _Rounds(kept, tok, pivot, z_floor, weights, have_sk, S_k, passes, c.rounds + 1)


def _rejection_path(row: _Row, stats: _StatsRefs, round0: _PassRefs, round1: _PassRefs, *, max_rounds,
                    check_rounds) -> _Result:
    """Pivot rejection (top-p / min-p without top-k, top-k > CAND_CHUNKS, or more than CAND_CHUNKS
    tied candidate chunks): up to ``max_rounds`` rounds (``_rejection_round``); rounds 0 and (with
    ``check_rounds`` 2) 1 read the check launches' passes for the rows those served. Accepted: the
    token, ``tau`` the bound above the last pivot, ``q_thr`` = min_p (a superset of the kept set);
    otherwise the exact bisections with independent uniforms (the law stays exact)."""
    zi, zf = row.zero_i, row.zero_f
    served = ~row.cand_row

    def maybe_round(i, c):
        in_launch0 = (i == 0) & served
        in_launch1 = (i == 1) & served & (c.have_top_k_mass == 0) if check_rounds > 1 else zi > 0

        def run():
            return jax.lax.cond(
                in_launch0,
                lambda: _rejection_round(row, i, c, round0),
                lambda: jax.lax.cond(
                    in_launch1, lambda: _rejection_round(row, i, c, round1), lambda: _rejection_round(row, i, c)
                ),
            )

        return jax.lax.cond(c.done, lambda: c, run)

    init = _Rounds(jnp.bool_(False), row.argmax, row.neg_inf, row.neg_inf, _first_draw_weights(row, stats), zi,
                   zf + 1.0, zi, zi)
    c = jax.lax.fori_loop(0, max_rounds, maybe_round, init)

    def accepted():
        return _Result(c.token.astype(jnp.int32), _pivot_bound(c.pivot), row.min_p, zf + 1.0, c.passes, c.rounds, zi)

    def fallback():
        out = _bisection_path(row)
        return out._replace(passes=c.passes + out.passes, rounds=c.rounds, fell_back=zi + 1)

    return jax.lax.cond(c.done, accepted, fallback)


# ----------------------------------------------------------------------------- launch 3: select


def _select_kernel(x_ref, params, stats, round0: _PassRefs, round1: _PassRefs, light_in: _OutRefs, out: _OutRefs,
                   scratch, *, geo, division, compact, interpret_mode, max_rounds, check_rounds):
    """Rows with a filter, one program per row: the top-k candidate path, pivot rejection or the
    full-row bisections. ``light_in`` (the check launch's results, light rows written) is aliased
    to ``out``; ``scratch`` holds the candidate listing's slots."""
    del light_in
    row = _load_row(x_ref, params, stats, geo, division)
    zi = row.zero_i
    use_cand = row.valid & ~row.greedy & row.cand_row
    n_cand, bound = jax.lax.cond(use_cand, lambda: _count_candidate_chunks(row, stats), lambda: (zi + BIG, zi))
    use_cand = use_cand & (n_cand <= CAND_CHUNKS)
    # (Arithmetic, not nested jnp.where on scalar bools: the compiled Triton kernel stored wrong
    # values for that form.)
    other_path = PATH_REJECT if max_rounds > 0 else PATH_SLOW
    path = PATH_CANDIDATES + (~use_cand).astype(jnp.int32) * (other_path - PATH_CANDIDATES)
    round1 = round1._replace(seg_total=round0.seg_total)  # (round 1's pass reads round 0's total)

    def candidates():
        return _candidate_path(row, stats, scratch, n_cand, bound, compact=compact, interpret_mode=interpret_mode)

    def rejection():
        return _rejection_path(row, stats, round0, round1, max_rounds=max_rounds, check_rounds=check_rounds)

    def bisections():
        return _bisection_path(row)

    @pl.when(row.valid & ~row.greedy & row.filtered)
    def _():
        res = jax.lax.cond(use_cand, candidates, rejection if max_rounds > 0 else bisections)
        r = row.r
        out.token[r] = res.token
        out.tau[r] = res.tau
        out.q_thr[r] = res.q_thr
        out.norm[r] = res.norm
        out.path[r] = path - res.fell_back  # PATH_REJECT -> PATH_SLOW when the rounds ran out
        out.passes[r] = res.passes
        out.rounds[r] = res.rounds


# ----------------------------------------------------------------------------- wrapper


def _splits_for(R: int, nt: int) -> int:
    """Programs per row (a power of two): 1 once R rows fill the GPU, more for small R, never more
    than the row has tiles (or segments)."""
    want = pl.next_power_of_2(max(1, -(-_TARGET_PROGRAMS // R)))
    return max(1, min(want, _MAX_SPLITS, 1 << (nt.bit_length() - 1)))


def _tile_for(V: int, tile: int | None) -> int:
    t = tile or MAX_TILE
    return max(CHUNK, min(t, pl.next_power_of_2(V)))


def _launch(kernel, grid, args, out_shape, *, warps, stages, interpret, name, aliases=None):
    """``pl.pallas_call`` with every operand in HBM (``pl.ANY``): ``args`` and ``out_shape`` are
    pytrees (the kernel receives refs of the same structure); ``aliases`` maps flat input indices
    to flat output indices."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=jax.tree.map(lambda _: any_spec, args),
        out_specs=jax.tree.map(lambda _: any_spec, out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=name,
    )(*args)


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
        "exact_div_asm",
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
    exact_div_asm: bool = True,
) -> dict:
    """``fused_sample`` with each row's thresholds (for tests): dict of ``[R]`` arrays ``token``,
    ``tau`` (kept requires ``z >= tau``), ``q_thr`` (kept requires ``exp(z)/norm >= q_thr``),
    ``norm``, ``path`` (``PATH_*``), ``passes`` (full-row passes after the stats launch; tile
    re-reads not counted) and ``rounds`` (pivot-rejection rounds). On ``PATH_REJECT`` ``tau`` and
    ``q_thr`` (``norm`` = 1) describe a superset of the kept set (z above the last rejected pivot,
    z >= log(min_p), ``q_thr`` = min_p); the token is kept, and so is every z >= its z.

    Knobs (every value gives an exact draw): ``tile`` (columns per tile, default 4096);
    ``max_rounds`` (0: no rejection path, the full-row bisections instead); ``check_rounds`` (1
    or 2: rejection rounds whose passes run in check launches spread over programs);
    ``check_splits`` (programs per row of the check launches; the same bits for any value);
    ``compact`` ("scatter" | "loop": how the candidate chunks are listed; the same list);
    ``num_warps`` / ``num_stages`` (stats and check launches), ``select_warps`` /
    ``select_stages`` (select launch): fixed, not chosen by row count, so a row's bits never
    depend on the batch. ``exact_div_asm`` (compiled only): IEEE division through inline PTX;
    False: Triton's approximate division (thresholds then need not match the reference's), only
    to diagnose a toolchain without inline PTX. ``ValueError`` on an unknown knob value."""
    if compact not in ("loop", "scatter"):
        raise ValueError(f"compact must be 'loop' or 'scatter', got {compact!r}")
    if check_rounds not in (1, 2):
        raise ValueError(f"check_rounds must be 1 or 2, got {check_rounds!r}")
    R, V = logits.shape
    tile = _tile_for(V, tile)
    nt = pl.cdiv(V, tile)
    nseg = pl.cdiv(nt, CHECK_SEG)
    geo = _Geometry(
        vocab=V,
        tile=tile,
        n_tiles=nt,
        tiles_p2=pl.next_power_of_2(nt),
        chunks_p2=pl.next_power_of_2(nt * (tile // CHUNK)),
        n_segments=nseg,
        segments_p2=pl.next_power_of_2(nseg),
        stats_splits=_splits_for(R, nt),
    )
    division = "interpret" if interpret else "ptx" if exact_div_asm else "approx"
    f32, i32 = jnp.float32, jnp.int32
    sd = jax.ShapeDtypeStruct
    top_k = top_k.astype(i32)
    params = _ParamRefs(temperature, top_k, top_p.astype(f32), min_p.astype(f32), seeds.astype(jnp.uint32))
    launch = functools.partial(_launch, interpret=interpret)
    small = dict(warps=num_warps, stages=num_stages)

    splits = geo.stats_splits
    stats_shape = _StatsRefs(
        sd((R, splits), f32), sd((R, splits), i32), sd((R, splits), i32),
        sd((R, geo.tiles_p2), f32), sd((R, geo.tiles_p2), f32), sd((R, geo.chunks_p2), f32),
    )
    (stats,) = launch(
        functools.partial(_stats_kernel, geo=geo, tiles_per_split=pl.cdiv(nt, splits)),
        (R, splits), (logits, temperature, top_k), (stats_shape,), name="ddtree_sample_stats", **small,
    )

    # with max_rounds = 0 no row takes the rejection path: one program per row finishes the light rows
    csplits = min(check_splits or _splits_for(R, nseg), nseg) if max_rounds > 0 else 1
    check = dict(geo=geo, segments_per_program=pl.cdiv(nseg, csplits), division=division)
    row_outs = _OutRefs(sd((R,), i32), sd((R,), f32), sd((R,), f32), sd((R,), f32), sd((R,), i32), sd((R,), i32),
                        sd((R,), i32))
    round0, light = launch(
        functools.partial(_first_check_kernel, reject=max_rounds > 0, **check),
        (R, csplits), (logits, params, stats),
        (_PassRefs(sd((R, geo.tiles_p2), f32), sd((R, geo.segments_p2), i32), sd((R, geo.segments_p2), f32)),
         row_outs),
        name="ddtree_sample_check", **small,
    )
    rounds_in_checks = min(check_rounds, max_rounds)
    if rounds_in_checks > 1:
        (round1,) = launch(
            functools.partial(_second_check_kernel, **check),
            (R, csplits), (logits, params, stats, round0),
            (_PassRefs(sd((R, geo.tiles_p2), f32), sd((R, geo.segments_p2), i32), None),),
            name="ddtree_sample_check_round1", **small,
        )
    else:  # (not read)
        round1 = round0._replace(seg_total=None)

    # select scratch: the scatter listing's slots (+ a distinct dummy per chunk)
    scratch = sd((R, CAND_CHUNKS + geo.chunks_p2 if compact == "scatter" else 1), i32)
    args = (logits, params, stats, round0, round1, light)
    first_light = len(jax.tree.leaves(args[:-1]))
    out, _ = launch(
        functools.partial(
            _select_kernel, geo=geo, division=division, compact=compact, interpret_mode=interpret,
            max_rounds=max_rounds, check_rounds=rounds_in_checks,
        ),
        (R,), args, (row_outs, scratch), name="ddtree_sample_select",
        aliases={first_light + i: i for i in range(len(_OutRefs._fields))},
        warps=select_warps, stages=select_stages,
    )
    return out._asdict()


def fused_sample(
    logits, temperature, top_k, top_p, min_p, seeds, *, interpret: bool = False, tile: int | None = None,
    exact_div_asm: bool = True, **tuning
) -> jax.Array:
    """One exact draw per row of ``logits [R, V]`` under per-row (temperature, top_k, top_p,
    min_p), seeds ``u32 [R, 2]``; ``INVALID_TOKEN`` for NaN/+inf/all--inf rows. i32 ``[R]``.
    ``tuning``: the knobs of ``fused_sample_debug``."""
    return fused_sample_debug(
        logits, temperature, top_k, top_p, min_p, seeds, interpret=interpret, tile=tile,
        exact_div_asm=exact_div_asm, **tuning
    )["token"]
