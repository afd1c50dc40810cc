"""Stage 2: train the Kimi-style MoE target. ``python -m ddtree_jax.training.target --out RUN --minutes 8``

Next-token cross-entropy on windows of the standard library's training split (stage 1's token
stream, ``TokenWindows``: the batch of step ``s`` depends on ``s`` only), AdamW with warm-up +
cosine over ``--steps``, bfloat16 compute over float32 master weights on an accelerator. The
experts run densely in training (``dense_experts``: every expert on every token, weighted by the
routing; exact and differentiable, and at 16 small experts cheaper than it sounds). Routing is
balanced the DeepSeek-V3 / Kimi way, without an auxiliary loss: after each step every MoE
layer's ``e_score_correction_bias`` moves by ``--bias-rate`` towards under-loaded experts.

Each command stops cleanly before ``--minutes`` and saves ``RUN/target_state`` (parameters,
optimiser state, step; the data position is the step); the next command resumes from it and
continues to ``--steps``. Every ``--eval-every`` steps it reports the held-out loss (fixed
windows of the held-out files) and writes the best weights so far as an HF checkpoint,
``RUN/target_best`` (float32), which the drafter stage and the export read. Progress goes to
stdout and ``RUN/target_log.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddtree_jax.compiled import CompiledFn
from ddtree_jax.models import KimiForCausalLM
from ddtree_jax.models.kimi import MoE, Router
from ddtree_jax.training.configs import SIZES, target_config
from ddtree_jax.training.data import TokenWindows, heldout_windows
from ddtree_jax.training.loop import train_steps
from ddtree_jax.training.optim import cast_params, compute_dtype_for, make_optimizer, param_count
from ddtree_jax.training.run import Clock, RunFolder, enable_compilation_cache
from ddtree_jax.training.state import load_state, read_info, save_state

__all__ = ["TRAINABLE", "evaluate_target", "init_target", "main", "target_train_step", "train_target_stage"]

# Everything but the routers' correction biases, which move by the balancing rule, not by gradients.
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("e_score_correction_bias")))


class ExpertLoad(nnx.Variable):
    """Tokens routed to each expert in the last forward pass (training only; not a checkpoint tensor)."""


class LoadRecordingRouter(Router):
    """``Router`` that also records its expert loads (for the bias balancing); same parameters."""

    def __call__(self, x, **placement):
        weights, ids = super().__call__(x, **placement)
        self.load[...] = jnp.zeros(self.load.shape, jnp.float32).at[ids.reshape(-1)].add(1.0)
        return weights, ids


def _moe_layers(model: KimiForCausalLM) -> list[MoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def record_expert_loads(model: KimiForCausalLM) -> KimiForCausalLM:
    """Make every router record its loads (in place; parameters and checkpoint names unchanged)."""
    for moe in _moe_layers(model):
        if not isinstance(moe.gate, LoadRecordingRouter):
            moe.gate.__class__ = LoadRecordingRouter
            moe.gate.load = ExpertLoad(jnp.zeros((model.config.n_routed_experts,), jnp.float32))
    return model


def init_target(cfg, seed: int = 0) -> KimiForCausalLM:
    model = KimiForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, impl="reference")
    return record_expert_loads(model)


def _cross_entropy(model, ids, compute_dtype):
    m = cast_params(model, compute_dtype)
    logits = m.forward_uncached(ids[:, :-1], dense_experts=True)[0]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return loss, [moe.gate.load[...] for moe in _moe_layers(m)]


def target_train_step(model, opt, ids, *, compute_dtype=jnp.float32, bias_rate: float = 1e-3):
    """One optimiser step on ``ids int32 [B, T+1]``; returns the batch's loss (before the step).
    Compiled by ``CompiledFn(target_train_step, updates=(model, opt), compute_dtype=..., bias_rate=...)``."""
    grad_fn = nnx.value_and_grad(lambda m: _cross_entropy(m, ids, compute_dtype), argnums=nnx.DiffState(0, TRAINABLE),
                                 has_aux=True)
    (loss, loads), grads = grad_fn(model)
    opt.update(model, grads)
    for moe, load in zip(_moe_layers(model), loads, strict=True):  # aux-loss-free balancing (DeepSeek-V3)
        bias = moe.gate.e_score_correction_bias
        bias[...] = bias[...] + bias_rate * jnp.sign(load.mean() - load)
    return loss


@functools.partial(nnx.jit, static_argnames=("compute_dtype",))
def _eval_loss(model, ids, compute_dtype):
    loss, loads = _cross_entropy(model, ids, compute_dtype)
    return loss, jnp.stack(loads)


def evaluate_target(model, windows: np.ndarray, batch: int, compute_dtype) -> tuple[float, float]:
    """``(mean held-out cross-entropy, max expert load / mean load)`` over ``windows [N, T+1]``
    (batches of ``batch``; a short last batch is dropped unless it is the only one)."""
    losses, imbalance = [], []
    for i in range(0, max(1, len(windows) - batch + 1), batch):
        loss, loads = _eval_loss(model, jnp.asarray(windows[i : i + batch]), compute_dtype)
        losses.append(float(loss))
        loads = np.asarray(loads)
        imbalance.append(float((loads.max(-1) / loads.mean(-1)).mean()))
    return float(np.mean(losses)), float(np.mean(imbalance))


def _save_best(model, path: str) -> None:
    from ddtree_jax.checkpoints import save_checkpoint
    from ddtree_jax.training.state import MAX_SHARD_BYTES

    tmp = path + ".tmp"
    save_checkpoint(model, tmp, max_shard_bytes=MAX_SHARD_BYTES)
    if os.path.exists(path):
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def train_target_stage(run: str, *, size: str = "h200", minutes: float = 8.0, steps: int = 1500, batch: int = 64,
                       seq_len: int = 512, lr: float = 2e-3, warmup: int = 200, weight_decay: float = 0.1,
                       bias_rate: float = 1e-3, eval_every: int = 100, eval_windows: int = 256,
                       save_every_s: float = 180.0, compute_dtype: str = "auto", seed: int = 0,
                       max_steps_this_call: int | None = None, log=print) -> dict:
    """Trains (or resumes) the target in ``run`` until ``steps`` or the clock; returns state.json's info."""
    clock = Clock(minutes, reserve_s=min(45.0, minutes * 60 * 0.1))
    folder = RunFolder(run)
    dtype = compute_dtype_for(compute_dtype)
    cfg = target_config(SIZES[size], folder.vocab_size)
    model = init_target(cfg, seed)
    opt = make_optimizer(model, TRAINABLE, lr=lr, total_steps=steps, warmup=warmup, weight_decay=weight_decay)
    state_dir = folder.file("target_state")
    hyper = dict(size=size, steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, weight_decay=weight_decay,
                 bias_rate=bias_rate, seed=seed, compute_dtype=jnp.dtype(dtype).name)
    info = read_info(state_dir)
    if info is not None:
        changed = {k: (info["hyper"].get(k), v) for k, v in hyper.items()
                   if k != "compute_dtype" and info["hyper"].get(k) != v}
        if changed:
            raise SystemExit(f"{state_dir}: saved with different settings {changed}; "
                             "use another --out or the same flags")
        trees, info = load_state(state_dir, {"model": nnx.state(model), "opt": nnx.state(opt)})
        nnx.update(model, trees["model"])
        nnx.update(opt, trees["opt"])
        log(f"[target] resumed at step {info['step']}/{steps} from {state_dir} (best held-out loss "
            f"{info['best_heldout']:.4f})")
    else:
        info = dict(step=0, best_heldout=math.inf, best_step=None, hyper=hyper, config=cfg.to_hf_dict(),
                    params=param_count(model), evals=[])
        log(f"[target] new {size} target: {info['params'] / 1e6:.2f}M parameters ({cfg.num_hidden_layers} layers, "
            f"{cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok} + shared); {steps} steps of {batch} x "
            f"{seq_len} tokens; compute {jnp.dtype(dtype).name} on {jax.default_backend()}")
    windows = TokenWindows(folder.tokens("train"), seq_len + 1, batch, seed)
    heldout = heldout_windows(folder.tokens("heldout"), seq_len + 1, eval_windows)
    log(f"[target] data: {len(windows.stream):,} training tokens ({windows.steps_per_epoch} steps per epoch), "
        f"{len(heldout)} held-out windows")

    step = CompiledFn(target_train_step, updates=(model, opt), compute_dtype=dtype, bias_rate=bias_rate)

    def save(reason: str):
        t = time.perf_counter()
        step.sync()
        info["data_position"] = windows.position(info["step"])
        save_state(state_dir, {"model": nnx.state(model), "opt": nnx.state(opt)}, info)
        log(f"[target] saved step {info['step']} to {state_dir} ({reason}, {time.perf_counter() - t:.1f}s)")

    def evaluate():
        t = time.perf_counter()
        step.sync()
        loss, imbalance = evaluate_target(model, heldout, batch, dtype)
        improved = loss < info["best_heldout"]
        if improved:
            info["best_heldout"], info["best_step"] = loss, info["step"]
            _save_best(model, folder.file("target_best"))
        rec = dict(step=info["step"], heldout_loss=loss, expert_load_max_over_mean=imbalance, best=improved)
        info["evals"].append(rec)
        folder.log_line("target", {**rec, "time": time.time()})
        log(f"[target] step {info['step']}/{steps}: held-out loss {loss:.4f} (ppl {math.exp(loss):.2f}), expert load "
            f"max/mean {imbalance:.2f}{' (best: saved target_best)' if improved else ''} "
            f"({time.perf_counter() - t:.1f}s)")
        return time.perf_counter() - t

    start_step = info["step"]
    train_steps("target", step, lambda s: (jnp.asarray(windows.batch_at(s)),), info, steps=steps,
                limit=None if max_steps_this_call is None else start_step + max_steps_this_call, log=log, clock=clock,
                note=lambda s: f"epoch {s / windows.steps_per_epoch:.1f}",
                record=lambda r: folder.log_line("target", r), evaluate=evaluate, eval_every=eval_every, save=save,
                save_every_s=save_every_s)
    if info["step"] == steps and (not info["evals"] or info["evals"][-1]["step"] != steps):
        evaluate()
    if info["step"] > start_step or read_info(state_dir) is None:
        save("end of command" if info["step"] < steps else "finished")
    if info["step"] >= steps:
        log(f"[target] done: {steps} steps; best held-out loss {info['best_heldout']:.4f} at step "
            f"{info['best_step']} -> {folder.file('target_best')}")
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.training.target", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run folder of stage 1 (tokenizer)")
    p.add_argument("--size", choices=sorted(SIZES), default="h200")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock limit of this command (stops before it)")
    p.add_argument("--steps", type=int, default=1500,
                   help="total steps of the run (the schedule's length; 1500 x 64 x 512 tokens: ~15 stdlib epochs)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router bias balancing step")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="JAX's on-disk cache of compiled programs (default: $DDTREE_JAX_COMPILATION_CACHE or ~/.cache)")
    a = p.parse_args(argv)
    enable_compilation_cache(a.compilation_cache)
    train_target_stage(a.out, size=a.size, minutes=a.minutes, steps=a.steps, batch=a.batch, seq_len=a.seq_len, lr=a.lr,
                       warmup=a.warmup, weight_decay=a.weight_decay, bias_rate=a.bias_rate, eval_every=a.eval_every,
                       eval_windows=a.eval_windows, compute_dtype=a.compute_dtype, seed=a.seed)


if __name__ == "__main__":
    main()
