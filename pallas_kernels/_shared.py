"""Backend-neutral pieces both kernel families use (plain jnp on scalars and vectors; imports only
JAX and numpy). Inside kernels: the per-row random stream, one contract bit for bit for the Triton
and the Mosaic TPU sampler, the order-preserving int32 keys of float32 values and the bisection
the top-k kernels search thresholds with. Host-side: the vocabulary top-k's argument checks and
its XLA normaliser (``lse="xla"``), the same for both families."""

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
