"""Small-scale training of a target and its DFlash drafter (the built-in default's recipe).

* ``train_target``: next-token cross-entropy on random windows of a token stream.
* ``train_drafter``: the public DFlash training recipe (SpecForge-style) with the target frozen:
  each example is a window of ``context`` tokens whose target hidden states (after
  ``config.target_layer_ids``) condition the drafter, then a block ``[token at the anchor, MASK x
  (B-1)]``; depth k is trained to predict the token k places after the anchor, with loss weight
  ``exp(-(k-1)/gamma)``. Labels are the target's own greedy continuation, so the drafter learns
  what the target will accept.

Both print progress every ``log_every`` steps: the mean loss of the steps since the previous line
(a single step's loss is one batch's, and for the drafter one context length's: noisy). Optimiser:
AdamW (optax) with warm-up + cosine. ``train_drafter`` also prints while it makes its examples.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddtree_jax.training._common import CompiledStep

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

    def step(model, opt, ids):
        def loss_fn(m):
            logits = m(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    log(f"[train target] {steps} steps, batches of {batch} windows of {seq_len + 1} tokens; step 1 compiles first ...")
    return _loop("target", CompiledStep(step, (model, opt)),
                 lambda rng: ((_windows(rng, stream, batch, seq_len + 1),), None), steps, seed, log, log_every)


def train_drafter(drafter, target, stream: np.ndarray, *, steps: int = 400, batch: int = 16,
                  contexts: tuple[int, ...] = (4, 8, 16, 32, 64), lr: float = 3e-3, gamma: float = 7.0, seed: int = 0,
                  log: Callable[[str], None] = print, log_every: int = 50, pool: int = 128) -> list[float]:
    """Trains ``drafter`` (a ``DFlashDrafter``) in place against the frozen ``target``.

    Examples match decoding exactly: ``C`` context tokens (C from ``contexts``, ``pool``
    windows each) whose target hidden states the drafter sees, the next token as the block's
    first (root) token, and as labels the target's own greedy continuation after it, made with
    ``generate(method="ar")``.
    """
    from ddtree_jax.generation import generate

    cfg = drafter.config
    bs = cfg.block_size
    if len(stream) <= max(contexts) + 1:
        raise ValueError(f"the token stream ({len(stream)} tokens) must be longer than the largest context "
                         f"{max(contexts)} + 1")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    def hidden_states(m, ids):
        return jnp.concatenate(m.forward_uncached(ids, hidden_layer_ids=cfg.target_layer_ids)[1], axis=-1)

    hidden_fn = nnx.jit(hidden_states)
    log(f"[train drafter] making examples: for each context length in {contexts}, {pool} windows, the target's hidden "
        f"states and its greedy continuation of {bs - 1} tokens (each length compiles its own shapes) ...")
    data = []
    for j, c in enumerate(contexts):
        windows = _windows(rng, stream, pool, c + 1)
        cont = np.array(generate(target, None, windows, method="ar", max_new_tokens=bs - 1).tokens, np.int32)
        hidden = np.asarray(hidden_fn(target, jnp.asarray(windows[:, :-1])))
        data.append((hidden, np.concatenate([windows[:, -1:], cont], axis=1)))  # block: root + continuation
        log(f"[train drafter]   context length {c}: {pool} examples ({j + 1}/{len(contexts)}, "
            f"{time.perf_counter() - t0:.0f}s)")
    log(f"[train drafter] {pool} examples x contexts {contexts} of the target's greedy blocks in "
        f"{time.perf_counter() - t0:.1f}s")
    weights = jnp.exp(-(jnp.arange(1, bs) - 1) / gamma)
    opt = _optimizer(drafter, lr, steps)

    def step(drafter, opt, target, hidden, block):
        def loss_fn(d):
            logits = d(target, hidden, block[:, 0])  # [B, bs-1, V]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, block[:, 1:])
            return (ce * weights).sum(-1).mean() / weights.sum()

        loss, grads = nnx.value_and_grad(loss_fn)(drafter)
        opt.update(drafter, grads)
        return loss

    def sample(rng):
        g = rng.integers(len(data))  # one context length per step (the shapes differ between lengths)
        hidden, blocks = data[g]
        idx = rng.integers(0, len(blocks), size=batch)
        return (hidden[idx], blocks[idx]), contexts[g]

    log(f"[train drafter] {steps} steps, batches of {batch} examples of one context length each; "
        "step 1 compiles first (and each new context length's shapes once) ...")
    return _loop("drafter", CompiledStep(step, (drafter, opt), (target,)), sample, steps, seed, log, log_every,
                 group_name="context")


def _loop(name, step: CompiledStep, sample, steps, seed, log, log_every, group_name=None):
    """Runs ``steps`` steps; ``sample(rng)`` gives ``(batch args, group)``. Logs, every ``log_every`` steps, the
    mean loss since the previous log line, and with ``group_name`` that mean per group (the drafter's
    context lengths differ in difficulty, so one step's loss says little). Leaves the trained state
    in the modules."""
    rng = np.random.default_rng(seed + 1)
    losses, groups, t0, since = [], [], time.perf_counter(), 0
    for i in range(steps):
        batch, group = sample(rng)
        losses.append(float(step(*batch)))
        groups.append(group)
        if (i + 1) % log_every == 0 or i == 0 or i + 1 == steps:
            window = losses[since:]
            what = f"loss {window[0]:.3f} (step 1, includes compilation" if i == 0 else \
                f"mean loss {np.mean(window):.3f} (steps {since + 1}-{i + 1}"
            by = ""
            if group_name and i > 0:
                per = {}
                for g, v in zip(groups[since:], window, strict=True):
                    per.setdefault(g, []).append(v)
                by = f"; by {group_name} " + ", ".join(f"{g}: {np.mean(per[g]):.2f}" for g in sorted(per))
            log(f"[train {name}] step {i + 1}/{steps} {what}{by}, {time.perf_counter() - t0:.0f}s)")
            since = i + 1
    step.sync()
    return losses
