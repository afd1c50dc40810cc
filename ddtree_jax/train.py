"""Small-scale training of a target and its DFlash drafter (the built-in default's recipe).

* ``train_target``: next-token cross-entropy on random windows of a token stream.
* ``train_drafter``: the public DFlash recipe (ALGORITHMS.md section 2) with the target frozen:
  each example is a window of ``context`` tokens whose target hidden states (after
  ``config.target_layer_ids``) condition the drafter, then a block ``[token at the anchor, MASK x
  (B-1)]``; depth k is trained to predict the token k places after the anchor, with loss weight
  ``exp(-(k-1)/gamma)``. Labels are the target's own greedy continuation, so the drafter learns
  what the target will accept.

Both print progress every ``log_every`` steps. Optimiser: AdamW (optax) with warm-up + cosine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["train_drafter", "train_target"]


def _optimizer(model, lr: float, steps: int) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr * 0.05)
    return nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)


def _windows(rng: np.random.Generator, stream: np.ndarray, batch: int, length: int) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length + 1, size=batch)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)


def train_target(model, stream: np.ndarray, *, steps: int = 300, batch: int = 16, seq_len: int = 64, lr: float = 3e-3,
                 seed: int = 0, log: Callable[[str], None] = print, log_every: int = 50) -> list[float]:
    """Trains ``model`` (a ``KimiForCausalLM``) in place; returns the loss per step."""
    if len(stream) <= seq_len:
        raise ValueError(f"the token stream ({len(stream)} tokens) must be longer than seq_len={seq_len}")
    opt = _optimizer(model, lr, steps)

    @nnx.jit
    def step(model, opt, ids):
        def loss_fn(m):
            logits = m(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    return _loop("target", step, model, opt, lambda rng: _windows(rng, stream, batch, seq_len + 1), steps, seed, log, log_every)


def train_drafter(drafter, target, stream: np.ndarray, *, steps: int = 400, batch: int = 16,
                  contexts: tuple[int, ...] = (4, 8, 16, 32, 64), lr: float = 3e-3, gamma: float = 7.0, seed: int = 0,
                  log: Callable[[str], None] = print, log_every: int = 50, pool: int = 128) -> list[float]:
    """Trains ``drafter`` (a ``DFlashDrafter``) in place against the frozen ``target``.

    Examples match decoding exactly: ``C`` context tokens (C from ``contexts``, ``pool``
    windows each) whose target hidden states the drafter sees, the next token as the block's
    first (root) token, and as labels the target's own greedy continuation after it, made with
    ``generate(method="ar")``.
    """
    from ddtree_jax.generate import generate

    cfg = drafter.config
    bs = cfg.block_size
    if len(stream) <= max(contexts) + 1:
        raise ValueError(f"the token stream ({len(stream)} tokens) must be longer than the largest context {max(contexts)} + 1")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    hidden_fn = nnx.jit(lambda m, ids: jnp.concatenate(m.forward_uncached(ids, hidden_layer_ids=cfg.target_layer_ids)[1], axis=-1))
    data = []
    for c in contexts:
        windows = _windows(rng, stream, pool, c + 1)
        cont = np.array(generate(target, None, windows, method="ar", max_new_tokens=bs - 1).tokens, np.int32)
        hidden = np.asarray(hidden_fn(target, jnp.asarray(windows[:, :-1])))
        data.append((hidden, np.concatenate([windows[:, -1:], cont], axis=1)))  # block: root + continuation
    log(f"[train drafter] {pool} examples x contexts {contexts} of the target's greedy blocks in {time.perf_counter() - t0:.1f}s")
    weights = jnp.exp(-(jnp.arange(1, bs) - 1) / gamma)
    opt = _optimizer(drafter, lr, steps)

    @nnx.jit
    def step(drafter, opt, target, hidden, block):
        def loss_fn(d):
            logits = d(target, hidden, block[:, 0])  # [B, bs-1, V]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, block[:, 1:])
            return (ce * weights).sum(-1).mean() / weights.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(drafter)
        opt.update(drafter, grads)
        return loss

    def sample(rng):
        hidden, blocks = data[rng.integers(len(data))]
        idx = rng.integers(0, len(blocks), size=batch)
        return hidden[idx], blocks[idx]

    return _loop("drafter", lambda d, o, b: step(d, o, target, *b), drafter, opt, sample, steps, seed, log, log_every)


def _loop(name, step, model, opt, sample, steps, seed, log, log_every):
    rng = np.random.default_rng(seed + 1)
    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        losses.append(float(step(model, opt, sample(rng))))
        if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
            log(f"[train {name}] step {i + 1}/{steps} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
    return losses
