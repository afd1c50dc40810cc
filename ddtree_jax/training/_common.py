"""Pieces both training stages share: mixed precision, the optimiser, the run folder, the clock."""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["Clock", "CompiledStep", "RunFolder", "cast_params", "compute_dtype_for", "enable_compilation_cache",
           "make_optimizer", "param_count"]


def enable_compilation_cache(flag: str | None) -> None:
    """JAX's persistent cache (``ddtree_jax.compilation_cache``): a resumed stage loads its compiled steps."""
    from ddtree_jax import compilation_cache

    path = compilation_cache.enable(compilation_cache.resolve(flag))
    print(f"[training] compilation cache: {path or 'off'}")


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
    """AdamW (b2 0.95) with linear warm-up then cosine decay to lr/10 over ``total_steps``, global-norm
    clipping, and weight decay on matrices only (not norms or biases)."""
    return nnx.Optimizer(model, _adamw(lr, total_steps, warmup, weight_decay, clip), wrt=wrt)


def param_count(model: nnx.Module) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


class CompiledStep:
    """``body(*updated, *frozen, *args, **static)`` compiled once on the modules' split state.

    ``nnx.jit`` walks every module it is given (model, optimiser, frozen target) on the host at
    each call, which on a GPU machine can cost as much as a small model's step (tens of ms measured
    for a model pass). Here the graphs are split once and stay static; the state of ``updated``
    is donated and carried from call to call, the state of ``frozen`` passed as it is.

    Between calls the modules' own variables are stale (their arrays were donated): ``sync()``
    writes the carried state back; call it before anything reads ``updated`` (evaluation, saving).
    """

    def __init__(self, body, updated: tuple, frozen: tuple = (), **static):
        self._nodes = tuple(updated)
        self._graph, self._state = nnx.split(self._nodes)
        frozen_graph, self._frozen = nnx.split(tuple(frozen))

        def pure(state, frozen_state, *args):
            nodes = nnx.merge(self._graph, state)
            out = body(*nodes, *nnx.merge(frozen_graph, frozen_state), *args, **static)
            return nnx.state(nodes), out

        self._step = jax.jit(pure, donate_argnums=0)

    def __call__(self, *args):
        self._state, out = self._step(self._state, self._frozen, *args)
        return out

    def sync(self) -> None:
        nnx.update(self._nodes, self._state)


class Clock:
    """Wall-clock budget of one command: ``should_stop(next_cost)`` once ``next_cost`` seconds more
    would pass the limit less a reserve (for the final evaluation and save)."""

    def __init__(self, minutes: float, reserve_s: float):
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + minutes * 60.0 - reserve_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def should_stop(self, next_cost: float = 0.0) -> bool:
        return time.perf_counter() + next_cost > self.deadline


class RunFolder:
    """The run folder of the stages: data.json, tokenizer.json and token streams from stage 1."""

    def __init__(self, path: str):
        self.path = path
        data = os.path.join(path, "data.json")
        if not os.path.isfile(data):
            raise SystemExit(f"{path}: no data.json; run `python -m ddtree_jax.training.tokenizer --out {path}` first")
        with open(data) as f:
            self.data = json.load(f)

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.file(f"{split}_tokens.npy")).astype(np.int32)

    @property
    def vocab_size(self) -> int:
        return self.data["tokenizer"]["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.data["tokenizer"]["eos_id"]

    @property
    def mask_id(self) -> int:
        return self.data["tokenizer"]["mask_id"]

    def log_line(self, name: str, record: dict) -> None:
        with open(self.file(f"{name}_log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
