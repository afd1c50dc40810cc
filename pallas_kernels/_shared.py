"""Backend-neutral pieces both kernel families use (plain jnp on scalars and vectors; imports only
JAX and numpy). Inside kernels: the per-row random stream (one contract, bit for bit, for the
Triton and the Mosaic TPU sampler), the order-preserving int32 keys of float32 values, the
bisection the threshold searches use, and the samplers' common algorithm (path codes, row filters,
first-draw tile weights, inverse-CDF pick, the pivot-rejection decision). Host-side: the vocabulary
top-k's argument checks and its XLA normaliser (``lse="xla"``). Design notes: docs/kernels.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _u32(x):
    return jnp.asarray(x, jnp.uint32)


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * _u32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _u32(0xC2B2AE35)
    return h ^ (h >> 16)


def _uniform(s0, s1, stream):
    """Uniform in [0, 1) with 24 bits from (seed words, stream index). ``stream`` is a Python int
    or a traced int32 scalar (the same index gives the same value either way: uint32 products wrap)."""
    if isinstance(stream, int):
        salt = _u32((0x9E3779B9 * (stream + 1)) & 0xFFFFFFFF)
    else:
        salt = _u32(0x9E3779B9) * (stream + 1).astype(jnp.uint32)
    h = _fmix32(s1 + salt)
    h = _fmix32(s0 ^ h)
    return (h >> 8).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-24)


def _zkey(z):
    """Monotone int32 key of a float32 (no NaN); -0.0 and +0.0 share key 0."""
    b = jax.lax.bitcast_convert_type(z, jnp.int32)
    k = jnp.where(b < 0, b ^ np.int32(0x7FFFFFFF), b)
    return jnp.where(z == 0, 0, k)


def _key_to_float(k):
    b = jnp.where(k < 0, k ^ np.int32(0x7FFFFFFF), k)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _midpoint(lo, hi):
    """``floor((lo + hi) / 2)`` of int32 values without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _bisect(pred, lo, hi, steps: int):
    """The smallest int32 ``v`` in ``(lo, hi]`` with ``pred(v)``, for ``pred`` monotone (false, then
    true) and true at ``hi``; ``lo``, ``hi`` scalars or arrays (elementwise: ``pred`` maps an array of
    midpoints to an array of the same shape). ``steps`` >= ``ceil(log2(hi - lo))`` halvings (more
    are no-ops), each one evaluation of ``pred``."""

    def body(_, c):
        lo, hi = c
        done = hi <= lo + 1
        mid = _midpoint(lo, hi)
        ok = pred(mid)
        return jnp.where(done | ok, lo, mid), jnp.where(done | ~ok, hi, mid)

    return jax.lax.fori_loop(0, steps, body, (lo, hi))[1]


def _bisect_while(pred, lo, hi):
    """``_bisect`` with exactly as many halvings as ``(lo, hi]`` needs (a while loop; scalars):
    for a range known to be narrow, e.g. between two keys of nearby floats."""

    def body(c):
        lo, hi = c
        mid = _midpoint(lo, hi)
        ok = pred(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.while_loop(lambda c: (c[1] > c[0]) & (c[1] - 1 > c[0]), body, (lo, hi))[1]


# ----------------------------------------------------------------------------- samplers (Triton and Mosaic TPU)

INVALID_TOKEN = -1  # the token of a row with no law (NaN, +inf, or all -inf logits)
MAX_TILE = 4096  # default vocabulary tile of both samplers (so both pick the same tile with the same uniform)
MAX_ROUNDS = 16  # pivot-rejection rounds before the exact threshold-search fallback (PATH_SLOW)
# ``path`` of ``fused_sample_debug``: greedy or invalid, temperature only, top-k candidate chunks,
# full-row threshold searches, pivot rejection.
PATH_NONE, PATH_TEMPERATURE, PATH_CANDIDATES, PATH_SLOW, PATH_REJECT = 0, 1, 2, 3, 4
INT_MIN = np.int32(np.iinfo(np.int32).min)
BIG = np.int32(2**30)  # an index above every real one


def _row_filters(T, k, p, min_p, V: int):
    """(greedy, top-k on, top-p on, any filter) of per-row parameters (scalars or vectors)."""
    greedy = T == 0.0
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    return greedy, k_on, p_on, k_on | p_on | (min_p > 0.0)


def _interpret_div(a, b):
    """``a / b`` as one IEEE division (interpret mode): XLA:CPU may compute ``x / broadcast(T)`` as
    ``x * (1/T)`` in one fusion and not in another; barriers keep every pass's division alike."""
    a, b = jax.lax.optimization_barrier((a, jnp.broadcast_to(b, a.shape)))
    return jax.lax.optimization_barrier(a / b)


def _tile_weights(tile_max, tile_mass, row_max, inv_t):
    """The first draw's tile weights ``s_t exp((m_t - M) / T)`` from per-tile maxima and masses
    ``s_t = sum exp((x - m_t) / T)`` (``row_max`` and ``inv_t`` broadcast against the tiles)."""
    return jnp.where(tile_max > -jnp.inf, tile_mass * jnp.exp((tile_max - row_max) * inv_t), 0.0)


def _pick(weights, u):
    """Inverse CDF along the last axis: the index of the first ``cumsum(weights) > u * total``
    among positive weights, else the last positive weight (float prefix sums need not be
    monotone), -1 if none is positive. ``u`` has the shape of ``weights`` without its last axis."""
    axis = weights.ndim - 1
    iota = jax.lax.broadcasted_iota(jnp.int32, weights.shape, axis)
    cw = jnp.cumsum(weights, axis=axis)
    if axis:
        total = jnp.max(cw, axis=axis, keepdims=True)
        u = jnp.expand_dims(u, axis)
    else:
        total = jnp.max(cw)
    first = jnp.min(jnp.where((cw > u * total) & (weights > 0), iota, BIG), axis=axis)
    last = jnp.max(jnp.where(weights > 0, iota, -1), axis=axis)
    return jnp.where(first < BIG, first, last)


def _key_threshold(key):
    """The float32 threshold of an int32 key; ``INT_MIN`` (no cut) -> -inf."""
    return jnp.where(key == INT_MIN, -jnp.inf, _key_to_float(key))


def _pivot_bound(pivot):
    """Smallest z above the last rejected pivot (a negative float: its bits minus one), -inf
    before any rejection: the rejection path's reported ``tau``."""
    above = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(pivot, jnp.int32) - 1, jnp.float32)
    return jnp.where(pivot > -jnp.inf, above, -jnp.inf)


def _pivot_kept(zv, count, mass_above, top_p_norm, k, p, k_on, p_on, log_min_p):
    """Pivot rejection: the drawn value (z = zv) is kept: min-p (``zv >= log(min_p)``), top-k
    (fewer than k values above it: ``count``) and top-p (``mass_above`` below ``p`` of
    ``top_p_norm``: the top-k mass, or the total mass without top-k)."""
    return (zv >= log_min_p) & (~k_on | (count < k)) & (~p_on | (mass_above < p * top_p_norm))


def _top_k_mass_undecided(zv, ev, ran, count, mass_above, total, k, p, k_on, p_on, log_min_p, have_top_k_mass):
    """Pivot rejection with top-k and top-p: the drawn value passes min-p and top-k, and the bounds
    ``mass_above + exp(zv) <= S_k <= total`` of the top-k mass decide top-p neither way, so S_k
    must be computed exactly (once per row: ``have_top_k_mass``)."""
    passes_k = (zv >= log_min_p) & (~k_on | (count < k))
    sure_kept = mass_above < p * (mass_above + ev)
    sure_cut = mass_above >= p * total
    return ran & k_on & p_on & passes_k & (have_top_k_mass == 0) & ~sure_kept & ~sure_cut


# ----------------------------------------------------------------------------- vocabulary top-k (host side)

LSE_MODES = ("kernel", "xla")  # where the top-k kernels' log-softmax normaliser comes from


def check_top_k_args(shape, k: int, lse: str) -> None:
    """The vocabulary top-k's argument checks (``ValueError`` naming the argument)."""
    if lse not in LSE_MODES:
        raise ValueError(f"lse must be one of {LSE_MODES}, got {lse!r}")
    V = shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"vocab_top_k needs 1 <= k <= V, got k={k}, V={V}")


def fixed_order_sum(v: jax.Array, width: int = 32) -> jax.Array:
    """``v [..., n]`` summed over the last axis in one fixed order, whatever the backend or the
    fusion around it: groups of ``width`` consecutive values (zero-padded; ``+ 0`` is exact) added
    pairwise by halving, with explicit adds, whose IEEE order XLA keeps (a ``reduce`` leaves the
    order to the backend: XLA's GPU emitter sums a row differently in and out of a fused
    ``log_softmax``); then the group sums likewise, until one is left. A barrier after each level
    keeps XLA from fusing the levels into a few long serial sums. -> ``[...]``."""
    while v.shape[-1] > 1:
        n = v.shape[-1]
        g = width if n > width else 1 << (n - 1).bit_length()
        if n % g:
            v = jnp.concatenate([v, jnp.zeros((*v.shape[:-1], g - n % g), v.dtype)], axis=-1)
        v = v.reshape(*v.shape[:-1], -1, g)
        while v.shape[-1] > 1:
            h = v.shape[-1] // 2
            v = v[..., :h] + v[..., h:]
        v = jax.lax.optimization_barrier(v[..., 0])
    return v[..., 0]


def xla_log_sum_exp(logits, m):
    """The log-softmax normaliser ``log(sum(exp(x - m)))`` per row of ``logits [..., V]`` given the
    exact row max ``m [R]`` (R = the product of the leading dims), the sum in ``fixed_order_sum``'s
    order: the same bits in the reference's ``draft_logprobs`` and between kernel launches
    (``lse="xla"``). -> f32 ``[R]``."""
    *lead, _ = logits.shape
    shifted = logits.astype(jnp.float32) - m.reshape(*lead, 1)
    return jnp.log(fixed_order_sum(jnp.exp(shifted))).reshape(-1)
