"""Backend-neutral pieces both kernel families use inside their kernels (plain jnp on scalars and
vectors; imports only JAX and numpy): the per-row random stream, one contract bit for bit for the
Triton and the Mosaic TPU sampler, and the order-preserving int32 keys of float32 values."""

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
