"""A batch-invariant dense product ``y = x @ w`` (Pallas Triton): every row is computed the same
way whatever the row count (XLA's dot picks an algorithm by shape).

``dense_matmul(x [..., K], w [K, N])`` -> ``[..., N]``, or per group ``x [..., G, K]``,
``w [G, K, N]`` -> ``[..., G, N]``; ``dense_matmul_reference`` is the plain product. Order: each
output element accumulates in float32 over K in ascending chunks of ``block_k`` (a function of K
alone), one dot per chunk of the row's slice and the weight's ``[block_k, block_n]`` tile. Rows
never meet, so the row count only sets how many row tiles the grid ``(G, M_padded / block_m,
N / block_n)`` has. ``x`` is padded to whole row tiles (the weight is never copied); ``block_n``
and ``block_k`` are powers of two dividing N and K, at least 16 on the GPU. Design and
measurements: docs/kernels.md, "Batch-invariant dense products".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["DenseBlocks", "choose_blocks", "dense_matmul", "dense_matmul_reference"]

_IEEE = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class DenseBlocks:
    """The tiles: ``block_m`` rows per program (the only one that depends on M), ``block_n``
    columns, ``block_k`` the reduction chunk (a function of K alone: see the module docstring)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def choose_blocks(m: int) -> DenseBlocks:
    """Row tiles by the row count: 16 rows for a decode step or a small verify, larger tiles
    (fewer reads of the weight) for long verifies and prefill."""
    if m <= 16:
        return DenseBlocks(block_m=16)
    if m <= 64:
        return DenseBlocks(block_m=64)
    return DenseBlocks(block_m=128, block_n=128, num_warps=8)


def _pow2_divisor(dim: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides ``dim``."""
    b = want
    while dim % b:
        b //= 2
    return b


def _kernel(x_ref, w_ref, y_ref, *, bm, bn, bk, k_chunks, precision):
    g = pl.program_id(0)
    r0 = pl.multiple_of(pl.program_id(1) * bm, bm)
    n0 = pl.multiple_of(pl.program_id(2) * bn, bn)

    def body(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        xb = x_ref[pl.ds(r0, bm), g, pl.ds(k0, bk)]
        wb = w_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)]
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32, precision=precision)

    acc = jax.lax.fori_loop(0, k_chunks, body, jnp.zeros((bm, bn), jnp.float32))
    y_ref[pl.ds(r0, bm), g, pl.ds(n0, bn)] = acc.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "blocks", "interpret"))
def dense_matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, blocks: DenseBlocks | None = None,
                 interpret: bool = False) -> jax.Array:
    """``x [..., K] @ w [K, N] -> [..., N]`` in ``out_dtype`` (default ``x``'s), accumulated in
    float32 in the fixed order of the module docstring. ``x`` is cast to ``w``'s dtype first (as
    the model's ``Linear`` does); float32 operands multiply in IEEE float32 (no TF32).

    Per-group weights: ``w [G, K, N]`` with ``x [..., G, K] -> [..., G, N]``, group g's rows
    times ``w[g]`` (the absorbed attention's per-head products), every row in the same order.

    ``blocks``: pinned tiles (``None``: ``choose_blocks`` by the row count). On the GPU, N and K
    must be multiples of 16 (a ``ValueError`` says which is not)."""
    grouped = w.ndim == 3
    if w.ndim not in (2, 3) or x.shape[-1] != w.shape[-2] or (grouped and (x.ndim < 2 or x.shape[-2] != w.shape[0])):
        want = "[..., G, K] @ [G, K, N]" if grouped else "[..., K] @ [K, N]"
        raise ValueError(f"dense_matmul: x {x.shape} and w {w.shape} do not multiply ({want})")
    K, N = w.shape[-2:]
    if not interpret and (K % 16 or N % 16):
        raise ValueError(f"dense_matmul: K ({K}) and N ({N}) must be multiples of 16 on the GPU")
    w3 = w if grouped else w[None]
    G = w3.shape[0]
    lead = x.shape[:-2] if grouped else x.shape[:-1]
    a = x.reshape(-1, G, K).astype(w.dtype)
    m = a.shape[0]
    blocks = blocks or choose_blocks(m)
    bm = blocks.block_m
    bn, bk = _pow2_divisor(N, blocks.block_n), _pow2_divisor(K, blocks.block_k)
    padded = -(-max(m, 1) // bm) * bm
    a = jnp.pad(a, ((0, padded - m), (0, 0), (0, 0)))
    precision = _IEEE if w.dtype == jnp.float32 else None
    y = pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, bk=bk, k_chunks=K // bk, precision=precision),
        grid=(G, padded // bm, N // bn),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((padded, G, N), out_dtype or x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="ddtree_dense_matmul",
    )(a, w3)
    y = y[:m]
    return y.reshape(*lead, G, N) if grouped else y.reshape(*lead, N)


def dense_matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """The plain product (per group for ``w [G, K, N]``): ``x`` cast to ``w``'s dtype, float32
    accumulation, cast to ``out_dtype``."""
    spec = "...gk,gkn->...gn" if w.ndim == 3 else "...k,kn->...n"
    y = jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32,
                   precision=_IEEE if w.dtype == jnp.float32 else None)
    return y.astype(out_dtype or x.dtype)
