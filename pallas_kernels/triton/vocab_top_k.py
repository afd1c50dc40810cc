"""Exact top-K of each row's log-softmax over a large vocabulary, sort-free (Pallas Triton): the
DDTree builder's per-depth tables (``ddtree_jax.tree``) straight from the draft logits.

``vocab_top_k(logits [..., V] bf16|f32, k, lse="kernel"|"xla")`` -> ``(values f32 [..., k],
indices i32 [..., k])``: the ``k`` largest ``z = (x - m) - lse``, descending, ties by lower
index, as ``jax.lax.top_k(ddtree_jax.draft_logprobs(x), k)`` (tests/test_vocab_top_k.py). Rows
with a NaN, +inf or only -inf: values NaN, indices ``0 .. k-1``. Requires ``1 <= k <= V``.
``lse="xla"``: the normaliser by XLA in ``_shared.fixed_order_sum``'s order, the reference's bits;
``"kernel"``: fused into the stats pass (one read of the row, about an ulp off XLA's; the top-K
is exact for its own ``lse``, which ``vocab_top_k_with_stats`` returns). Four launches: stats (chunk
and tile maxima), chunks (the K chunks that provably hold the top-K, ties included), candidates
(their exact top-K), order (ranks by counting). Design: docs/kernels.md, "Tree builder".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._shared import LSE_MODES, _bisect, _bisect_while, _zkey, check_top_k_args, xla_log_sum_exp

__all__ = ["CHUNK", "LSE_MODES", "vocab_top_k", "vocab_top_k_with_stats"]

# Columns per chunk maximum (16: 16 K candidates for V / 16 chunk maxima; docs/kernels.md).
CHUNK = 16
MAX_TILE = 4096  # columns per load in the stats pass
_INT_MIN = np.int32(np.iinfo(np.int32).min)
_BIG = np.int32(2**30)
_LOG2E = np.float32(np.log2(np.e))
# Stats launch: aim for about four programs per SM (of a 132-SM GPU).
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 16
_RANK_BLOCK = 32  # rows of the K x K comparison per program of the order launch


def _count_above(parts, t):
    """``#(keys > t)`` over a row held as one or more int32 key vectors (``parts``)."""
    return jnp.sum(functools.reduce(jnp.add, [jnp.where(x > t, 1, 0) for x in parts]))


def _kth_key(parts, k, lo, hi):
    """The k-th largest of a row's int32 keys (``_zkey``; a NaN gets some key, and NaN rows are
    replaced at the end; entries ``_INT_MIN`` are padding; at least k real keys), held as one or
    more vectors: the smallest T in ``(lo, hi]`` with ``#(keys > T) < k``, by bisection (the
    caller's bounds hold it)."""
    return _bisect_while(lambda mid: _count_above(parts, mid) < k, lo, hi)


def _keep_first_k(parts, k, T):
    """Masks of the k kept entries of a row held as key vectors in column order, given the k-th key
    T: ``key > T``, then ``key == T`` in column order (across the vectors)."""
    room = k - _count_above(parts, T)
    sel, before = [], None
    for x in parts:
        eq = x == T
        rank = jnp.cumsum(eq.astype(jnp.int32))
        if before is not None:
            rank = rank + before
        sel.append((x > T) | (eq & (rank <= room)))
        before = jnp.sum(eq.astype(jnp.int32)) if before is None else before + jnp.sum(eq.astype(jnp.int32))
    return sel


def _partition_dest(sel, idx):
    """Stable partition of a row held as vectors (masks ``sel``, column indices ``idx``): selected
    entries to 0.., the others after them (a permutation, so a scatter has distinct indices even
    where interpret mode writes masked-off lanes too)."""
    n = functools.reduce(jnp.add, [jnp.sum(x.astype(jnp.int32)) for x in sel])
    dests, done = [], None
    for x, c in zip(sel, idx, strict=True):
        xi = x.astype(jnp.int32)
        pos = jnp.cumsum(xi) - 1
        if done is not None:
            pos = pos + done
        dests.append(jnp.where(x, pos, n + c - pos - 1))
        done = jnp.sum(xi) if done is None else done + jnp.sum(xi)
    return dests


# ----------------------------------------------------------------------------- 1: stats


def _stats_kernel(x_ref, cm_ref, tm_ref, ts_ref, *, V, tile, nt, tps, chunk, with_sum):
    r = pl.program_id(0)
    t0 = pl.program_id(1) * tps
    cpt = tile // chunk
    iota = jnp.arange(tile, dtype=jnp.int32)

    def body(i, carry):
        t = t0 + i
        cols = t * tile + iota
        x = plgpu.load(x_ref.at[r, pl.ds(t * tile, tile)], mask=cols < V, other=-jnp.inf).astype(jnp.float32)
        cmax = jnp.max(x.reshape(cpt, chunk), axis=1)
        plgpu.store(cm_ref.at[r, pl.ds(t * cpt, cpt)], cmax)
        tmax = jnp.max(cmax)
        tm_ref[r, t] = tmax
        if with_sum:
            # NaN -> the sum is NaN; +inf -> tmax = inf (the row is marked bad from the max).
            safe = jnp.where(jnp.abs(tmax) < jnp.inf, tmax, 0.0)
            ts_ref[r, t] = jnp.sum(jnp.exp2((x - safe) * _LOG2E))
        return carry

    jax.lax.fori_loop(0, jnp.minimum(tps, nt - t0), body, 0)


# ----------------------------------------------------------------------------- 2: chunks


def _chunks_kernel(cm_ref, tm_ref, ts_ref, lse_in_ref, m_ref, lse_ref, bad_ref, cl_ref, t0_ref, *, k, nt, ntp, nc,
                   part, with_sum):
    """The chunk maxima are held as ``ceil(nc / part)`` register vectors of ``part`` (a power of
    two) lanes, not one vector padded to the next power of two: at V = 163,840 that is 5 x 2,048
    real lanes instead of 16,384 (37.5% padding) for every step of the bisection and both scans."""
    r = pl.program_id(0)
    iota_t = jnp.arange(ntp, dtype=jnp.int32)
    tm = plgpu.load(tm_ref.at[r, pl.ds(0, ntp)], mask=iota_t < nt, other=-jnp.inf)
    m = jnp.max(tm)
    if with_sum:
        ts = plgpu.load(ts_ref.at[r, pl.ds(0, ntp)], mask=iota_t < nt, other=0.0)
        lse = jnp.log(jnp.sum(ts * jnp.exp(tm - m)))
    else:
        lse = lse_in_ref[r]
    bad = (lse != lse) | (m == jnp.inf) | (m == -jnp.inf)  # NaN, +inf, or all -inf: an all-NaN row
    m_ref[r] = m
    lse_ref[r] = lse
    bad_ref[r] = bad.astype(jnp.int32)
    iota_p = jnp.arange(part, dtype=jnp.int32)
    cols = [j * part + iota_p for j in range(-(-nc // part))]
    real = [c < nc for c in cols]
    if nc > k:
        ck = []
        for j, ok in enumerate(real):
            cm = plgpu.load(cm_ref.at[r, pl.ds(j * part, part)], mask=ok, other=-jnp.inf)
            ck.append(jnp.where(ok, _zkey((cm - m) - lse), _INT_MIN))
        T = _bisect(lambda mid: _count_above(ck, mid) < k, jnp.int32(_INT_MIN), jnp.int32(0), 32)
        t0_ref[r] = T
        sel = _keep_first_k(ck, k, T)
    else:
        sel = real
        t0_ref[r] = jnp.int32(_INT_MIN) + r * 0
    for c, x, dest in zip(cols, sel, _partition_dest(sel, cols), strict=True):
        plgpu.store(cl_ref.at[r, dest], c, mask=x)


# ----------------------------------------------------------------------------- 3: candidates


def _candidates_kernel(x_ref, m_ref, lse_ref, cl_ref, t0_ref, zs_ref, ids_ref, *, V, k, nc, n_sel, width, chunk):
    r = pl.program_id(0)
    m = m_ref[r]
    lse = lse_ref[r]
    t0 = t0_ref[r]
    f = jnp.arange(width, dtype=jnp.int32)
    slot = f // chunk
    has = slot < n_sel
    c = plgpu.load(cl_ref.at[r, jnp.where(has, slot, 0)], mask=has, other=0)
    cols = c * chunk + (f % chunk)
    live = has & (c >= 0) & (c < nc) & (cols < V)  # (the range test only guards bad rows' lists)
    x = plgpu.load(x_ref.at[r, jnp.where(live, cols, 0)], mask=live, other=-jnp.inf).astype(jnp.float32)
    z = (x - m) - lse
    keys = jnp.where(live, _zkey(z), _INT_MIN)
    # The k-th key lies in [T0, key(-lse)]: at least k chunks reach the k-th chunk maximum T0 (so k
    # values do), and no z exceeds (m - m) - lse. About 25 halvings instead of 32 on draft rows.
    lo = jnp.where(t0 > _INT_MIN, t0 - 1, _INT_MIN)
    sel = _keep_first_k([keys], k, _kth_key([keys], k, lo, _zkey(-lse)))[0] & live
    (dest,) = _partition_dest([sel], [f])
    plgpu.store(zs_ref.at[r, dest], z, mask=sel)
    plgpu.store(ids_ref.at[r, dest], cols, mask=sel)


# ----------------------------------------------------------------------------- 4: order


def _order_kernel(zs_ref, ids_ref, bad_ref, val_ref, idx_ref, *, k, kp, rb):
    """Program (r, b): the ranks of pairs ``b * rb .. b * rb + rb - 1`` of row r among all ``k``
    (independent blocks: their ranks are disjoint parts of one permutation)."""
    r, b = pl.program_id(0), pl.program_id(1)
    bad = bad_ref[r] != 0
    j = jnp.arange(kp, dtype=jnp.int32)
    okj = j < k
    zj = plgpu.load(zs_ref.at[r, pl.ds(0, kp)], mask=okj, other=-jnp.inf)
    idj = plgpu.load(ids_ref.at[r, pl.ds(0, kp)], mask=okj, other=_BIG)
    kj = jnp.where(okj, _zkey(zj), _INT_MIN)
    i = b * rb + jnp.arange(rb, dtype=jnp.int32)
    oki = i < k
    zi = plgpu.load(zs_ref.at[r, pl.ds(b * rb, rb)], mask=oki, other=-jnp.inf)
    idi = plgpu.load(ids_ref.at[r, pl.ds(b * rb, rb)], mask=oki, other=_BIG)
    ki = _zkey(zi)
    kj2, ki2 = kj[None, :], ki[:, None]
    before = okj[None, :] & ((kj2 > ki2) | ((kj2 == ki2) & (idj[None, :] < idi[:, None])))
    rank = jnp.sum(jnp.where(before, 1, 0), axis=1)
    dest = jnp.where(oki & ~bad, rank, i)
    plgpu.store(val_ref.at[r, dest], jnp.where(bad, jnp.nan, zi), mask=oki)
    plgpu.store(idx_ref.at[r, dest], jnp.where(bad, i, idi), mask=oki)


# ----------------------------------------------------------------------------- wrapper


def _splits_for(R: int, nt: int) -> int:
    want = pl.next_power_of_2(max(1, -(-_TARGET_PROGRAMS // R)))
    return max(1, min(want, _MAX_SPLITS, 1 << (nt.bit_length() - 1)))


@functools.partial(jax.jit, static_argnames=("k", "lse", "interpret", "chunk", "tile", "num_warps", "select_warps",
                                             "order_warps", "part"))
def vocab_top_k_with_stats(
    logits: jax.Array,
    k: int,
    *,
    lse: str = "kernel",
    interpret: bool = False,
    chunk: int = CHUNK,
    tile: int = MAX_TILE,
    num_warps: int = 4,
    select_warps: int = 8,
    order_warps: int = 2,
    part: int = 2048,
) -> dict:
    """``vocab_top_k`` with the row statistics: dict of ``values`` f32 ``[..., k]``, ``indices``
    i32 ``[..., k]``, ``max`` and ``lse`` f32 ``[...]`` (the ``m`` and ``lse`` the values use).
    Tuning knobs (all exact): ``chunk`` (columns per chunk maximum, a power of two), ``tile``
    (columns per load of the stats pass), ``num_warps`` (stats pass), ``select_warps`` (chunks and
    candidates), ``order_warps`` (the order launch),
    ``part`` (lanes per register vector of chunk maxima in the chunks launch, a power of two)."""
    check_top_k_args(logits.shape, k, lse)
    *lead, V = logits.shape
    if chunk & (chunk - 1) or tile & (tile - 1) or part & (part - 1):
        raise ValueError(f"chunk, tile and part must be powers of two, got {chunk}, {tile}, {part}")
    x = logits.reshape(-1, V)
    R = x.shape[0]
    tile = max(chunk, min(tile, pl.next_power_of_2(V)))
    nt = pl.cdiv(V, tile)
    ntp = pl.next_power_of_2(nt)
    nc = pl.cdiv(V, chunk)
    ncp = pl.next_power_of_2(nt * (tile // chunk))
    splits = _splits_for(R, nt)
    tps = pl.cdiv(nt, splits)
    n_sel = min(k, nc)
    width = pl.next_power_of_2(n_sel) * chunk
    kp = max(pl.next_power_of_2(k), _RANK_BLOCK)
    f32, i32 = jnp.float32, jnp.int32
    sd = jax.ShapeDtypeStruct
    spec = pl.BlockSpec(memory_space=pl.ANY)
    fused = lse == "kernel"

    cm, tm, ts = pl.pallas_call(
        functools.partial(_stats_kernel, V=V, tile=tile, nt=nt, tps=tps, chunk=chunk, with_sum=fused),
        grid=(R, splits),
        in_specs=[spec],
        out_specs=[spec] * 3,
        out_shape=[sd((R, ncp), f32), sd((R, ntp), f32), sd((R, ntp if fused else 1), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_topk_stats",
    )(x)
    if fused:
        lse_in = jnp.zeros((R,), f32)
    else:
        # The reference's normaliser (draft_logprobs), with the kernel's row max (exact).
        lse_in = xla_log_sum_exp(logits, jnp.max(jnp.where(jnp.arange(ntp) < nt, tm, -jnp.inf), axis=-1))
    m, lse_r, bad, cl, t0 = pl.pallas_call(
        functools.partial(_chunks_kernel, k=k, nt=nt, ntp=ntp, nc=nc, part=min(pl.next_power_of_2(nc), part),
                          with_sum=fused),
        grid=(R,),
        in_specs=[spec] * 4,
        out_specs=[spec] * 5,
        out_shape=[sd((R,), f32), sd((R,), f32), sd((R,), i32), sd((R, ncp), i32), sd((R,), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_topk_chunks",
    )(cm, tm, ts, lse_in)
    zs, ids = pl.pallas_call(
        functools.partial(_candidates_kernel, V=V, k=k, nc=nc, n_sel=n_sel, width=width, chunk=chunk),
        grid=(R,),
        in_specs=[spec] * 5,
        out_specs=[spec] * 2,
        out_shape=[sd((R, max(width, kp)), f32), sd((R, max(width, kp)), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_topk_candidates",
    )(x, m, lse_r, cl, t0)
    vals, idx = pl.pallas_call(
        functools.partial(_order_kernel, k=k, kp=kp, rb=_RANK_BLOCK),
        grid=(R, kp // _RANK_BLOCK),
        in_specs=[spec] * 3,
        out_specs=[spec] * 2,
        out_shape=[sd((R, kp), f32), sd((R, kp), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=order_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_topk_order",
    )(zs, ids, bad)
    return dict(
        values=vals[:, :k].reshape(*lead, k),
        indices=idx[:, :k].reshape(*lead, k),
        max=m.reshape(lead),
        lse=lse_r.reshape(lead),
    )


def vocab_top_k(logits: jax.Array, k: int, *, lse: str = "kernel", interpret: bool = False, **tuning):
    """``lax.top_k(log_softmax(logits), k)`` (see the module doc; ``lse`` = "kernel" | "xla").
    -> ``(values f32 [..., k], indices i32 [..., k])``."""
    out = vocab_top_k_with_stats(logits, k, lse=lse, interpret=interpret, **tuning)
    return out["values"], out["indices"]
