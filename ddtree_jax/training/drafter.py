"""Stage 3: train the DFlash drafter against the frozen target.
``python -m ddtree_jax.training.drafter --out RUN --minutes 8``

Data: the target's own continuations (``RUN/target_best``), made once and kept in
``RUN/drafter_data/``: prompts of ``--prompt-lengths`` tokens from the training split, continued
to ``--seq-len`` tokens by ``generate(method="ar")``, chunks alternating greedy and sampled
temperatures (``--temperatures``, default 0, 1, 0, 0.6), so the drafter learns what the target
accepts greedily and its sampled behaviour. A held-out set (greedy continuations of held-out
prompts) measures acceptance.

Recipe (the public DFlash / SpecForge one): per sequence, ``--anchors`` random anchor positions in
the generated part; block ``[token at anchor, MASK x 15]`` sees the target's hidden states
strictly before its anchor (``DFlashDrafter.anchored_blocks``: one target pass per sequence
serves every anchor); depth k predicts the token k places after the anchor with loss weight
``exp(-(k-1)/gamma)``. Target frozen (bfloat16 compute on an accelerator); the drafter trains
with AdamW, warm-up + cosine, float32 master weights.

Every ``--eval-every`` steps it reports acceptance per depth on the held-out set: the fraction of
blocks whose greedy draft matches the target's greedy continuation through depth k, and the
linear-DFlash acceptance length it implies (1 + sum over k), and saves the best drafter as
``RUN/drafter_best`` (HF checkpoint). Resumable like the target stage (``RUN/drafter_state``).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ddtree_jax.compiled import CompiledFn
from ddtree_jax.models import DFlashDrafter
from ddtree_jax.training.configs import SIZES, drafter_config
from ddtree_jax.training.data import write_json
from ddtree_jax.training.loop import train_steps
from ddtree_jax.training.optim import cast_params, compute_dtype_for, make_optimizer, param_count
from ddtree_jax.training.run import Clock, RunFolder, enable_compilation_cache
from ddtree_jax.training.state import MAX_SHARD_BYTES, load_state, read_info, save_state

__all__ = ["acceptance_by_depth", "drafter_batch", "drafter_train_step", "main", "make_continuations",
           "sample_anchors", "train_drafter_stage"]


def make_continuations(target, stream: np.ndarray, *, count: int, prompt_len: int, seq_len: int, temperature: float,
                       seed: int, impl="auto") -> dict:
    """``count`` prompts of ``prompt_len`` tokens at random places of ``stream``, continued by the
    target to ``seq_len`` tokens (``temperature`` 0: greedy). Returns ``tokens int32 [count, seq_len]``
    and per row ``prompt_len`` and ``temperature``."""
    from ddtree_jax.generation import generate
    from ddtree_jax.sampling import SamplingParams

    rng = np.random.default_rng([seed, prompt_len])
    starts = rng.integers(0, len(stream) - prompt_len, size=count)
    prompts = np.stack([stream[s : s + prompt_len] for s in starts]).astype(np.int32)
    out = generate(target, None, prompts, method="ar", sampling=SamplingParams(temperature=temperature),
                   max_new_tokens=seq_len - prompt_len, seed=seed, impl=impl)
    cont = np.array(out.tokens, np.int32)
    return dict(tokens=np.concatenate([prompts, cont], axis=1), prompt_len=np.full(count, prompt_len, np.int32),
                temperature=np.full(count, temperature, np.float32))


def sample_anchors(rng: np.random.Generator, prompt_len: np.ndarray, seq_len: int, count: int,
                   block_size: int) -> np.ndarray:
    """``int32 [B, count]`` anchors per row, uniform over ``[prompt_len - 1, seq_len - block_size]``:
    the root is the last prompt token or a generated one, and every label is generated."""
    lo = prompt_len[:, None] - 1
    return (lo + rng.integers(0, np.iinfo(np.int32).max, (len(prompt_len), count)) % (seq_len - block_size + 1 - lo)
            ).astype(np.int32)


def drafter_batch(data: dict, step: int, *, seed: int, batch: int, anchors: int, block_size: int):
    """The batch of training step ``step`` (a function of ``(seed, step)`` alone): ``batch`` rows of
    ``data`` (``make_continuations``' fields, rows stacked) and ``anchors`` anchors per row
    (``sample_anchors``), as ``(tokens int32 [batch, S], anchors int32 [batch, anchors])``."""
    rng = np.random.default_rng([seed, step])
    rows = rng.integers(0, len(data["tokens"]), batch)
    anc = sample_anchors(rng, data["prompt_len"][rows], data["tokens"].shape[1], anchors, block_size)
    return jnp.asarray(data["tokens"][rows]), jnp.asarray(anc)


def _target_features(target, tokens, layer_ids):
    _, hidden = target.forward_uncached(tokens, hidden_layer_ids=layer_ids, dense_experts=True)
    return jax.lax.stop_gradient(jnp.concatenate(hidden, axis=-1))


def _block_loss(drafter, target, tokens, anchors, compute_dtype, gamma):
    cfg = drafter.config
    features = _target_features(target, tokens, cfg.target_layer_ids)
    d = cast_params(drafter, compute_dtype)
    logits = d.anchored_blocks(target, features.astype(compute_dtype), tokens, anchors)  # [B, A, bs-1, V]
    idx = anchors[..., None] + jnp.arange(1, cfg.block_size)  # [B, A, bs-1]
    labels = jnp.take_along_axis(tokens[:, None, :], idx, axis=2)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    weights = jnp.exp(-(jnp.arange(1, cfg.block_size) - 1) / gamma)
    matches = jnp.cumprod(jnp.argmax(logits, -1) == labels, axis=-1)  # greedy draft correct through depth k
    return (ce * weights).sum(-1).mean() / weights.sum(), matches


def drafter_train_step(drafter, opt, target, tokens, anchors, *, compute_dtype=jnp.float32, gamma: float = 7.0):
    """One step on ``tokens int32 [B, S]`` with ``anchors int32 [B, A]``; returns the loss (before the step).
    Compiled by ``CompiledFn(drafter_train_step, updates=(drafter, opt), reads=(target,), compute_dtype=...,
    gamma=...)``."""
    grad_fn = nnx.value_and_grad(lambda d: _block_loss(d, target, tokens, anchors, compute_dtype, gamma)[0])
    loss, grads = grad_fn(drafter)
    opt.update(drafter, grads)
    return loss


@functools.partial(nnx.jit, static_argnames=("compute_dtype", "gamma"))
def _eval_blocks(drafter, target, tokens, anchors, compute_dtype, gamma):
    loss, matches = _block_loss(drafter, target, tokens, anchors, compute_dtype, gamma)
    return loss, matches.reshape(-1, matches.shape[-1]).mean(0)


def acceptance_by_depth(drafter, target, data: dict, *, anchors: int, batch: int, compute_dtype,
                        gamma: float = 7.0) -> dict:
    """On ``data`` (greedy continuations): loss, and per depth k the fraction of blocks (``anchors``
    evenly spaced per row over the generated part) whose greedy draft equals the target's greedy
    tokens through depth k; ``tau`` = 1 + their sum, linear DFlash's expected acceptance length."""
    bs = drafter.config.block_size
    tokens, plen = data["tokens"], data["prompt_len"]
    s = tokens.shape[1]
    frac = np.linspace(0.0, 1.0, anchors)
    anc = (plen[:, None] - 1 + frac[None] * (s - bs - plen[:, None] + 1)).astype(np.int32)
    losses, rates = [], []
    for i in range(0, max(1, len(tokens) - batch + 1), batch):
        loss, rate = _eval_blocks(drafter, target, jnp.asarray(tokens[i : i + batch]), jnp.asarray(anc[i : i + batch]),
                                  compute_dtype, gamma)
        losses.append(float(loss))
        rates.append(np.asarray(rate))
    rate = np.mean(rates, axis=0)
    return dict(loss=float(np.mean(losses)), accept_through_depth=[round(float(r), 4) for r in rate],
                tau=float(1.0 + rate.sum()))


def _load_chunks(folder: str) -> dict:
    files = sorted(glob.glob(os.path.join(folder, "chunk-*.npz")))
    if not files:
        return {}
    parts = [dict(np.load(f)) for f in files]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _save_npz(path: str, data: dict) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **data)
    os.replace(tmp, path)


def train_drafter_stage(run: str, *, size: str = "h200", minutes: float = 8.0, steps: int = 3000, batch: int = 32,
                        anchors: int = 32, seq_len: int = 512, prompt_lengths=(32, 128),
                        temperatures=(0.0, 1.0, 0.0, 0.6),
                        sequences: int = 8192, gen_batch: int = 512, heldout_sequences: int = 128, lr: float = 2e-3,
                        warmup: int = 200, weight_decay: float = 0.01, gamma: float = 7.0, eval_every: int = 250,
                        eval_anchors: int = 16, save_every_s: float = 180.0, compute_dtype: str = "auto",
                        seed: int = 0, gen_impl: str = "auto", max_steps_this_call: int | None = None,
                        log=print) -> dict:
    """Makes the continuations (if not yet made), then trains (or resumes) the drafter until
    ``steps`` or the clock; returns state.json's info."""
    from ddtree_jax.checkpoints import load_target, save_checkpoint

    clock = Clock(minutes, reserve_s=min(45.0, minutes * 60 * 0.1))
    folder = RunFolder(run)
    dtype = compute_dtype_for(compute_dtype)
    target_dir = folder.file("target_best")
    if not os.path.isdir(target_dir):
        raise SystemExit(f"{target_dir}: missing; run the target stage first")
    gen_target = load_target(target_dir, dtype=dtype, impl=gen_impl)
    target = load_target(target_dir, dtype=dtype, impl="reference")  # the frozen target of the training passes
    cfg = drafter_config(SIZES[size], target.config, folder.mask_id)
    data_dir = folder.file("drafter_data")
    os.makedirs(data_dir, exist_ok=True)
    # The continuations belong to one target: refuse to mix them with (or train against) another.
    made_by = {k: v for k, v in (read_info(folder.file("target_state")) or {}).items()
               if k in ("best_step", "best_heldout")}
    made_by_path = os.path.join(data_dir, "target.json")
    if os.path.exists(made_by_path):
        with open(made_by_path) as f:
            if json.load(f) != made_by:
                raise SystemExit(f"{data_dir} was made by another target_best ({made_by_path}); delete {data_dir} and "
                                 f"{folder.file('drafter_state')} to start the drafter over")
    else:
        write_json(made_by_path, made_by)

    # -- the target's continuations, chunk by chunk (a stopped command resumes at the next chunk) --
    heldout_path = os.path.join(data_dir, "heldout.npz")
    if not os.path.exists(heldout_path):
        t = time.perf_counter()
        held = make_continuations(gen_target, folder.tokens("heldout"), count=heldout_sequences,
                                  prompt_len=max(prompt_lengths), seq_len=seq_len, temperature=0.0, seed=seed + 10**6,
                                  impl=gen_impl)
        _save_npz(heldout_path, held)
        log(f"[drafter] held-out set: {heldout_sequences} greedy continuations of held-out prompts "
            f"({time.perf_counter() - t:.0f}s)")
    heldout = dict(np.load(heldout_path))
    stream = folder.tokens("train")
    chunks = -(-sequences // gen_batch)
    for c in range(chunks):
        path = os.path.join(data_dir, f"chunk-{c:05d}.npz")
        if os.path.exists(path):
            continue
        if clock.should_stop(60.0):
            log(f"[drafter] stopping before the {minutes:g}-minute limit while making data ({c}/{chunks} chunks); "
                "run the same command again to continue")
            return {}
        t = time.perf_counter()
        plen, temp = prompt_lengths[c % len(prompt_lengths)], temperatures[c % len(temperatures)]
        _save_npz(path, make_continuations(gen_target, stream, count=gen_batch, prompt_len=plen, seq_len=seq_len,
                                           temperature=temp, seed=seed * 100_000 + c, impl=gen_impl))
        log(f"[drafter] data chunk {c + 1}/{chunks}: {gen_batch} continuations, prompt {plen}, temperature {temp:g} "
            f"({time.perf_counter() - t:.1f}s, {clock.elapsed():.0f}s)")
    data = _load_chunks(data_dir)
    del gen_target

    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(seed + 1), dtype=jnp.float32)
    opt = make_optimizer(drafter, nnx.Param, lr=lr, total_steps=steps, warmup=warmup, weight_decay=weight_decay)
    state_dir = folder.file("drafter_state")
    hyper = dict(size=size, steps=steps, batch=batch, anchors=anchors, seq_len=seq_len, lr=lr, warmup=warmup,
                 weight_decay=weight_decay, gamma=gamma, seed=seed, sequences=int(len(data["tokens"])))
    info = read_info(state_dir)
    if info is not None:
        changed = {k: (info["hyper"].get(k), v) for k, v in hyper.items() if info["hyper"].get(k) != v}
        if changed:
            raise SystemExit(f"{state_dir}: saved with different settings {changed}; use the same flags")
        trees, info = load_state(state_dir, {"model": nnx.state(drafter), "opt": nnx.state(opt)})
        nnx.update(drafter, trees["model"])
        nnx.update(opt, trees["opt"])
        log(f"[drafter] resumed at step {info['step']}/{steps} (best held-out tau {info['best_tau']:.3f})")
    else:
        info = dict(step=0, best_tau=-math.inf, best_step=None, hyper=hyper, config=cfg.to_hf_dict(),
                    params=param_count(drafter), evals=[])
        log(f"[drafter] new {size} drafter: {info['params'] / 1e6:.2f}M parameters ({cfg.num_hidden_layers} layers, "
            f"block {cfg.block_size}, target layers {cfg.target_layer_ids}); {len(data['tokens'])} sequences of "
            f"{seq_len} tokens; {steps} steps of {batch} sequences x {anchors} anchors")

    step = CompiledFn(drafter_train_step, updates=(drafter, opt), reads=(target,), compute_dtype=dtype, gamma=gamma)

    def save(reason: str):
        t = time.perf_counter()
        step.sync()
        info["data_position"] = dict(step=info["step"], rule="rows and anchors of step s from default_rng([seed, s])")
        save_state(state_dir, {"model": nnx.state(drafter), "opt": nnx.state(opt)}, info)
        log(f"[drafter] saved step {info['step']} ({reason}, {time.perf_counter() - t:.1f}s)")

    def evaluate():
        t = time.perf_counter()
        step.sync()
        res = acceptance_by_depth(drafter, target, heldout, anchors=eval_anchors, batch=batch, compute_dtype=dtype,
                                  gamma=gamma)
        improved = res["tau"] > info["best_tau"]
        if improved:
            info["best_tau"], info["best_step"] = res["tau"], info["step"]
            tmp = folder.file("drafter_best.tmp")
            save_checkpoint(drafter, tmp, max_shard_bytes=MAX_SHARD_BYTES)
            import shutil

            shutil.rmtree(folder.file("drafter_best"), ignore_errors=True)
            os.replace(tmp, folder.file("drafter_best"))
        rec = dict(step=info["step"], heldout_loss=res["loss"], tau_linear_greedy=res["tau"],
                   accept_through_depth=res["accept_through_depth"], best=improved)
        info["evals"].append(rec)
        folder.log_line("drafter", {**rec, "time": time.time()})
        depths = " ".join(f"{r:.2f}" for r in res["accept_through_depth"])
        log(f"[drafter] step {info['step']}/{steps}: held-out loss {res['loss']:.4f}, linear greedy tau "
            f"{res['tau']:.3f}; accepted through depth 1..{cfg.block_size - 1}: {depths}"
            f"{' (best: saved drafter_best)' if improved else ''} ({time.perf_counter() - t:.1f}s)")
        return time.perf_counter() - t

    start_step = info["step"]
    eval_s = evaluate() if start_step == 0 and not info["evals"] else 10.0
    train_steps("drafter", step,
                lambda s: drafter_batch(data, s, seed=seed, batch=batch, anchors=anchors, block_size=cfg.block_size),
                info, steps=steps, limit=None if max_steps_this_call is None else start_step + max_steps_this_call,
                log=log, clock=clock, record=lambda r: folder.log_line("drafter", r), evaluate=evaluate,
                eval_every=eval_every, eval_s=eval_s, save=save, save_every_s=save_every_s)
    if info["step"] > start_step or read_info(state_dir) is None:
        save("end of command" if info["step"] < steps else "finished")
    if info["step"] >= steps:
        log(f"[drafter] done: best held-out linear greedy tau {info['best_tau']:.3f} at step {info['best_step']} -> "
            f"{folder.file('drafter_best')}")
    return info


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(","))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.training.drafter", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run folder (holds target_best from the target stage)")
    p.add_argument("--size", choices=sorted(SIZES), default="h200")
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-lengths", default="32,128")
    p.add_argument("--temperatures", default="0,1,0,0.6", help="per data chunk, cycled")
    p.add_argument("--sequences", type=int, default=8192, help="target continuations to make (once)")
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--heldout-sequences", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) at depth k")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-anchors", type=int, default=16)
    p.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--gen-impl", default="auto", help="the generating target's kernels (ddtree_jax.backend)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="JAX's on-disk cache of compiled programs (default: $DDTREE_JAX_COMPILATION_CACHE or ~/.cache)")
    a = p.parse_args(argv)
    enable_compilation_cache(a.compilation_cache)
    train_drafter_stage(a.out, size=a.size, minutes=a.minutes, steps=a.steps, batch=a.batch, anchors=a.anchors,
                        seq_len=a.seq_len, prompt_lengths=tuple(int(x) for x in a.prompt_lengths.split(",")),
                        temperatures=_floats(a.temperatures), sequences=a.sequences, gen_batch=a.gen_batch,
                        heldout_sequences=a.heldout_sequences, lr=a.lr, warmup=a.warmup, gamma=a.gamma,
                        eval_every=a.eval_every, eval_anchors=a.eval_anchors, compute_dtype=a.compute_dtype,
                        gen_impl=a.gen_impl, seed=a.seed)


if __name__ == "__main__":
    main()
