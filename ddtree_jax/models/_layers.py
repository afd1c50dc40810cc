"""Building blocks shared by the target and the drafter: linear, norm, embedding, attention.

Every parameter carries an ``axes`` metadata entry: a tuple of *logical* axis names, one per
array dimension (``None`` = replicated). ``ddtree_jax.checkpoints`` maps logical names to mesh
axes (``LOGICAL_AXES`` there) when it places weights on a mesh. Logical names used:

* ``"expert"``: the routed-experts axis (expert parallelism),
* ``"tensor"``: attention heads / MLP intermediate / vocabulary (tensor parallelism).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.backend import Backend, resolve_backend
from ddtree_jax.config import ConfigError, ExecutionConfig


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """Random N(0, 1/fan_in) weights: large enough that tiny random test models are not trivial.

    Drawn on the host from the key's bits when eager: eager ``jax.random`` compiles once per shape,
    which dominates building a tiny model on CPU. Under tracing (``nnx.jit``/``nnx.eval_shape``
    construction, e.g. large models built on device) it uses ``jax.random``.
    """
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    return jnp.asarray((rng.standard_normal(shape, np.float32) / math.sqrt(fan_in)).astype(dtype))


def execution_backend(execution: ExecutionConfig, role: str) -> Backend:
    """``execution``'s resolved backend, checked for a model (``role``: "model", "drafter"): a
    ``TypeError`` for anything but an ``ExecutionConfig``, a ``ConfigError`` naming
    ``batch_invariant`` where the fixed-order product has no kernels to run (it is a Triton kernel)."""
    if not isinstance(execution, ExecutionConfig):
        raise TypeError(f"execution must be an ExecutionConfig, got {type(execution).__name__}")
    backend = resolve_backend(execution.impl)
    if execution.batch_invariant and not (backend.kernels and backend.family == "triton"):
        raise ConfigError("ExecutionConfig", "batch_invariant",
                          f"needs the Triton kernels: impl 'pallas' (or 'auto' on an NVIDIA GPU); the {role} runs "
                          f"{backend}")
    return backend


def dense_product(x: jax.Array, kernel: jax.Array, fixed_order=None, out_dtype=None) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` (or per group: ``x [..., G, in] @ kernel [G, in, out]``,
    the fixed-order path only) with ``x`` cast to the kernel's dtype, in ``out_dtype``
    (``None``: the kernel's; float32 keeps the accumulation unrounded). ``fixed_order``: ``None``
    for XLA's dot, or a ``Backend`` that runs the kernels for the fixed-order Pallas product
    (``pallas_kernels/triton/dense_matmul.py``: each row computed the same way whatever the row
    count)."""
    if fixed_order is None:
        return jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel, preferred_element_type=out_dtype)
    from pallas_kernels.triton.dense_matmul import dense_matmul

    return dense_matmul(x, kernel, out_dtype=out_dtype or kernel.dtype, interpret=fixed_order.interpret)


class Linear(nnx.Module):
    """``y = x @ kernel`` without bias; ``kernel`` is ``[in, out]`` (HF stores ``weight = kernel.T``).
    ``fixed_order`` (static; ``None``: XLA's dot) as in ``dense_product``."""

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str | None, str | None],
                 rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = nnx.Param(normal_init(rngs, (d_in, d_out), d_in, dtype), axes=axes)
        self.fixed_order = None

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        """``[..., in] -> [..., out]`` (in ``out_dtype``, default the kernel's dtype)."""
        return dense_product(x, self.kernel[...], self.fixed_order, out_dtype)


class RMSNorm(nnx.Module):
    """HF-style RMSNorm: normalise in float32, cast back, then scale (``weight * x``)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., dim] -> [..., dim]``, in the input's dtype."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding table ``weight: [vocab, hidden]`` (the HF layout)."""

    def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.weight = nnx.Param(normal_init(rngs, (vocab, dim), dim, dtype), axes=("tensor", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``int[...] -> [..., dim]``."""
        return jnp.take(self.weight[...], tokens, axis=0)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The SwiGLU activation ``silu(gate) * up``."""
    return jax.nn.silu(gate) * up


class GatedMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (HF ``LlamaMLP``/``DeepseekV3MLP``/``Qwen3MLP``)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(dim, hidden, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.up_proj = Linear(dim, hidden, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.down_proj = Linear(hidden, dim, axes=("tensor", None), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., dim] -> [..., dim]``."""
        return self.down_proj(silu_glu(self.gate_proj(x), self.up_proj(x)))


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis in float32 where ``mask`` is False -> probability 0.

    ``scores [B, N, T, S]``, ``mask`` broadcastable bool ``[B, 1, T, S]``. Every query row must see
    at least one key (true for all masks built in this package: a token always sees itself).
    """
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def write_rows(buffer: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    """Write ``update [B, T, ...]`` into ``buffer [B, S, ...]`` at per-row offsets ``start [B]``.

    The caller guarantees ``start + T <= S`` (``dynamic_update_slice`` would clamp otherwise).
    """
    def one(buf, upd, s):
        return jax.lax.dynamic_update_slice_in_dim(buf, upd.astype(buf.dtype), s, axis=0)

    return jax.vmap(one)(buffer, update, start)
