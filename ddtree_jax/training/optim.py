"""How every training loop here optimises: the one AdamW set-up, mixed precision, parameter counts.

``make_optimizer`` is the optimiser of the target and drafter stages and of the CPU recipe
(``ddtree_jax.training.recipe``). Mixed precision: the parameters stay float32 (master weights),
a step computes through ``cast_params`` in ``compute_dtype_for(...)`` and its gradients reach the
float32 originals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["cast_params", "compute_dtype_for", "make_optimizer", "param_count"]


def compute_dtype_for(name: str):
    """``auto``: bfloat16 on an accelerator (float32 master weights), float32 on the CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _keep_float32(path) -> bool:
    # The MoE router (``mlp.gate``: weight and correction bias) stays float32, as in the model itself.
    return any(getattr(k, "key", getattr(k, "name", None)) == "gate" for k in path)


def cast_params(model: nnx.Module, dtype) -> nnx.Module:
    """A copy of ``model`` whose parameters are in ``dtype`` (router excepted). Gradients taken
    through the copy reach the float32 originals: mixed precision with float32 master weights."""
    if dtype == jnp.float32:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    cast = jax.tree_util.tree_map_with_path(lambda path, x: x if _keep_float32(path) else x.astype(dtype), params)
    return nnx.merge(graphdef, cast, rest)


@functools.lru_cache(maxsize=32)
def _adamw(lr: float, total_steps: int, warmup: int, weight_decay: float, clip: float) -> optax.GradientTransformation:
    # Cached: the transformation is static in the optimiser's graph, so an equal object lets a new
    # optimiser (a resumed run, a test) reuse the compiled step instead of compiling it again.
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(total_steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask))


def _decay_mask(params):
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(model: nnx.Module, wrt, *, lr: float, total_steps: int, warmup: int, weight_decay: float = 0.1,
                   clip: float = 1.0) -> nnx.Optimizer:
    """AdamW (b2 0.95) on the variables of ``model`` that ``wrt`` selects, with linear warm-up then
    cosine decay to lr/10 over ``total_steps``, global-norm clipping at ``clip``, and weight decay
    on matrices only (not norms or biases)."""
    return nnx.Optimizer(model, _adamw(lr, total_steps, warmup, weight_decay, clip), wrt=wrt)


def param_count(model: nnx.Module) -> int:
    """Number of scalars in the ``nnx.Param`` variables of ``model``."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
