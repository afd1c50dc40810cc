"""Exact top-K of each row's log-softmax for TPUs (Pallas Mosaic TPU), sort-free: the DDTree
builder's per-depth tables from the draft logits.

``vocab_top_k`` / ``vocab_top_k_with_stats`` with the Triton version's contract
(``pallas_kernels.triton.vocab_top_k``; reference ``jax.lax.top_k(ddtree_jax.draft_logprobs(x), k)``;
tests/test_tpu_kernels.py): the ``k`` largest log-probabilities, descending, ties by lower index,
NaN rows NaN with indices ``0 .. k-1``; ``lse="xla"`` bit-exact, ``"kernel"`` fused (about an ulp
off). Two launches over ``(row blocks, tiles)``, each streaming the row once through VMEM: stats
(maxima of strided chunks, a chunk being one lane of a tile), then top-k (select at the first
tile, the chosen chunks gathered into VMEM at every tile, the exact cut and the order at the
last). Exact with any ties, no fallback. Checked in TPU interpret mode and lowered for a TPU
(``jax.export``); not run on one. Design: docs/kernels.md, "TPU kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._shared import LSE_MODES, _bisect, _zkey, check_top_k_args, xla_log_sum_exp

__all__ = ["CHUNK", "LSE_MODES", "vocab_top_k", "vocab_top_k_with_stats"]

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
    x = x_ref[...].astype(jnp.float32)
    cols = [x[:, j * LANES : (j + 1) * LANES] for j in range(G)]
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


# ----------------------------------------------------------------------------- 2: top-k (select at its first step)


def _select(cm, aux, *, K, V, tile, fused, select_all):
    """From a row block's chunk maxima ``cm (nt, rows, 128)`` and ``aux`` (the chunk sums when
    fused, else a packed block with lse in column 0): the chosen chunks ``(nt, rows, 128)`` i32
    (1 = chosen; none for a bad row) and the packed ``[m, lse, bad]``."""
    nt = cm.shape[0]
    m = jnp.max(jnp.max(cm, axis=0), axis=1, keepdims=True)  # (rows, 1)
    if fused:
        lse = jnp.log(jnp.sum(jnp.sum(aux * jnp.exp(cm - m), axis=0), axis=1, keepdims=True))
    else:
        lse = aux[:, 0:1]
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
    return (sel & ~bad).astype(jnp.int32), _packed([m, lse, bad], cm.shape[1])


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


def _topk_kernel(x_ref, cm_ref, aux_ref, val_ref, idx_ref, prm_ref, sel_ref, cx_ref, cc_ref, ck_ref, off_ref,
                 *, K, V, Vp, tile, G, nt, Kw, Kwo, fused, select_all):
    """Outputs: values, indices, packed [m, lse, bad] (written at the first step). Scratch: sel,
    the chosen chunks; cx / cc, candidate values (x as f32) and columns, window ``w * G + j`` = vreg
    column j of slot window w (columns < 0: empty slot); ck, their keys; off, slots filled so far."""
    t = pl.program_id(1)
    rows = x_ref.shape[0]

    @pl.when(t == 0)
    def _():
        sel_ref[...], prm_ref[...] = _select(cm_ref[...], aux_ref[...], K=K, V=V, tile=tile, fused=fused,
                                             select_all=select_all)
        cx_ref[...] = jnp.full(cx_ref.shape, -jnp.inf, jnp.float32)
        cc_ref[...] = jnp.full(cc_ref.shape, -1, jnp.int32)
        off_ref[...] = jnp.zeros(off_ref.shape, jnp.int32)

    S = sel_ref[t]

    @pl.when(jnp.max(S) > 0)  # some row of the block chose a chunk of this tile
    def _():
        P = _lane_prefix(S)
        s = jnp.max(P, axis=1, keepdims=True)
        off = off_ref[:, 0:1]
        x = x_ref[...].astype(jnp.float32)
        x3 = jnp.stack([x[:, j * LANES : (j + 1) * LANES] for j in range(G)])  # (G, rows, 128): the vreg columns
        col0 = t * tile + jax.lax.broadcasted_iota(jnp.int32, x3.shape, 0) * LANES

        def move(w, ok, src, carry):
            # one lane map for all G vreg columns: the chosen chunks' G values each
            src3 = jnp.broadcast_to(src[None], x3.shape)
            blk = pl.ds(w * G, G)
            g = jnp.take_along_axis(x3, src3, axis=2, mode="promise_in_bounds")
            cx_ref[blk] = jnp.where(ok[None], g, cx_ref[blk])
            cc_ref[blk] = jnp.where(ok[None], col0 + src3, cc_ref[blk])
            return carry

        _compact_into(P, s, off, Kw, move, 0)
        off_ref[...] = jnp.broadcast_to(off + s, off_ref.shape)

    @pl.when(t == nt - 1)
    def _():
        prm = prm_ref[...]
        m, lse, bad = prm[:, 0:1], prm[:, 1:2], prm[:, 2:3] > 0
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
            zq = jnp.max(jnp.max(jnp.where(at, oz, -jnp.inf), axis=0), axis=1, keepdims=True)
            cq = jnp.max(jnp.max(jnp.where(at, oc, -1), axis=0), axis=1, keepdims=True)
            kq = _zkey(zq)[None]
            hit = out_lane == _count((kk > kq) | ((kk == kq) & (oc < cq[None])))
            return jnp.where(hit, zq, c[0]), jnp.where(hit, cq, c[1])

        vals, idx = jax.lax.fori_loop(0, K, place, (jnp.full(out_lane.shape, jnp.nan), out_lane))
        val_ref[...] = jnp.where(bad, jnp.nan, vals)
        idx_ref[...] = jnp.where(bad, out_lane, idx)


# ----------------------------------------------------------------------------- pass launchers
# Each launch is its own jitted function, and the wrapper is not jitted: called on its own, the
# stats pass (independent of K) compiles once for all K (interpret mode's cost is mostly
# compilation); inside a caller's jit they are one program.

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


@functools.partial(jax.jit, static_argnames=("K", "V", "tile", "rows", "Kw", "select_all", "interpret"))
def _topk_pass(x, cm, aux, *, K, V, tile, rows, Kw, select_all, interpret):
    Rp, Vp = x.shape
    nt, G, nb = Vp // tile, tile // LANES, Rp // rows
    Kwo = pl.cdiv(K, LANES)
    fused = aux.ndim == 3
    f32, i32 = jnp.float32, jnp.int32
    tiles = pl.BlockSpec((nt, rows, LANES), lambda rb, t: (0, rb, 0))
    packed = pl.BlockSpec((rows, LANES), lambda rb, t: (rb, 0))
    out = pl.BlockSpec((rows, Kwo * LANES), lambda rb, t: (rb, 0))
    # VMEM: the candidate buffers (3 x 4 bytes per slot and vreg column), the chunk statistics and
    # choices, x; double buffers. Past 12 MiB (K > ~1,500 at 16 rows of 163,840) raise the scoped
    # limit (the default is 16 or 32 MiB by TPU generation); block_rows = 8 halves the need.
    vmem = 4 * rows * LANES * (3 * G * Kw + 5 * nt + 4 * Kwo) + 2 * rows * tile * x.dtype.itemsize
    limit = vmem + 4 * 2**20 if vmem > 12 * 2**20 else None
    return pl.pallas_call(
        functools.partial(_topk_kernel, K=K, V=V, Vp=Vp, tile=tile, G=G, nt=nt, Kw=Kw, Kwo=Kwo, fused=fused,
                          select_all=select_all),
        grid=(nb, nt),
        in_specs=[pl.BlockSpec((rows, tile), lambda rb, t: (rb, t)), tiles, tiles if fused else packed],
        out_specs=[out, out, packed],
        out_shape=[jax.ShapeDtypeStruct((Rp, Kwo * LANES), f32), jax.ShapeDtypeStruct((Rp, Kwo * LANES), i32),
                   jax.ShapeDtypeStruct((Rp, LANES), f32)],
        scratch_shapes=[pltpu.VMEM((nt, rows, LANES), i32), pltpu.VMEM((G * Kw, rows, LANES), f32),
                        pltpu.VMEM((G * Kw, rows, LANES), i32), pltpu.VMEM((G * Kw, rows, LANES), i32),
                        pltpu.VMEM((rows, LANES), i32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=limit),
        interpret=_interp(interpret),
        name="ddtree_tpu_topk",
    )(x, cm, aux)


# ----------------------------------------------------------------------------- wrapper


def _tile_for(V: int, tile: int | None) -> int:
    t = tile or MAX_TILE
    if t % LANES or t > MAX_TILE:
        raise ValueError(f"tile must be a multiple of {LANES} up to {MAX_TILE} on TPU, got {t}")
    return min(t, pl.cdiv(V, LANES) * LANES)


@jax.jit
def _xla_lse(logits, cm):
    """``lse="xla"``: the reference's normaliser (``xla_log_sum_exp``) with the kernel's row max
    (exact: the max of the chunk maxima), packed in column 0 of ``(Rp, 128)``."""
    R = logits.size // logits.shape[-1]
    lse = xla_log_sum_exp(logits, jnp.max(cm[:, :R], axis=(0, 2)))
    return jnp.pad(lse[:, None], ((0, cm.shape[1] - R), (0, LANES - 1)))


@functools.partial(jax.jit, static_argnames=("tile", "rows"))
def _padded(logits, *, tile, rows):
    """``[..., V]`` -> ``[Rp, nt * tile]``, padded with -inf (a padded row is a bad row)."""
    x = logits.reshape(-1, logits.shape[-1])
    R, V = x.shape
    return jnp.pad(x, ((0, pl.cdiv(R, rows) * rows - R), (0, pl.cdiv(V, tile) * tile - V)), constant_values=-jnp.inf)


@functools.partial(jax.jit, static_argnames=("k", "lead"))
def _results(vals, idx, prm, *, k, lead):
    R = int(np.prod(lead))
    return dict(values=vals[:R, :k].reshape(*lead, k), indices=idx[:R, :k].reshape(*lead, k),
                max=prm[:R, 0].reshape(lead), lse=prm[:R, 1].reshape(lead))


def vocab_top_k_with_stats(
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
    x = _padded(logits, tile=tile, rows=block_rows)
    n_real = (nt - 1) * LANES + min(LANES, V - (nt - 1) * tile)  # chunks holding a real column
    select_all = n_real <= k
    Kw = pl.cdiv(n_real if select_all else min(k + LANES - 1, n_real), LANES)  # chunk slot windows
    opts = dict(tile=tile, rows=block_rows, interpret=interpret)
    fused = lse == "kernel"
    cm, cs = _stats_pass(x, fused=fused, **opts)
    aux = cs if fused else _xla_lse(logits, cm)
    vals, idx, prm = _topk_pass(x, cm, aux, K=k, V=V, Kw=Kw, select_all=select_all, **opts)
    return _results(vals, idx, prm, k=k, lead=tuple(lead))


def vocab_top_k(logits: jax.Array, k: int, *, lse: str = "kernel", interpret: bool = False, **tuning):
    """``lax.top_k(log_softmax(logits), k)`` (see the module doc; ``lse`` = "kernel" | "xla").
    -> ``(values f32 [..., k], indices i32 [..., k])``."""
    out = vocab_top_k_with_stats(logits, k, lse=lse, interpret=interpret, **tuning)
    return out["values"], out["indices"]
