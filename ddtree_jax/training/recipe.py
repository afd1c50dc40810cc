"""The CPU recipe: a small default pair made on this machine (``python -m ddtree_jax demo --retrain``).

``make_default(path)`` writes three real artefacts that load like any other model: a target
checkpoint (``target/``), a drafter checkpoint (``drafter/``) and a ``tokenizer.json``, made from
a small corpus that ships inside this module. It is the GPU stages' recipe at a small size
(``SIZE``) on that corpus, through the same pieces: the tokenizer (``training.tokenizer``), the
target's and the drafter's steps and data (``training.target``, ``training.drafter``), the
optimiser (``training.optim``) and the loop (``training.loop``). The target learns the corpus
(small enough to memorise), then the drafter learns the target's own greedy continuations of
corpus windows. On corpus-like prompts the pair agrees often; on anything else it is as weak as
its corpus is small. Nothing is held out or resumed: a folder is complete
(``default_model.is_complete``) once everything is written, and is made again from the start
otherwise. The tests use it at a few steps, because it is quick to make.
"""

from __future__ import annotations

import json
import os
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.checkpoints import load_target, save_checkpoint
from ddtree_jax.compiled import CompiledFn
from ddtree_jax.default_model import RECIPE_DIR, is_complete, mark_complete
from ddtree_jax.models import DFlashConfig, DFlashDrafter, KimiConfig
from ddtree_jax.training.configs import Size, drafter_config, target_config
from ddtree_jax.training.data import TokenWindows
from ddtree_jax.training.drafter import drafter_batch, drafter_train_step, make_continuations
from ddtree_jax.training.loop import train_steps
from ddtree_jax.training.optim import make_optimizer
from ddtree_jax.training.target import TRAINABLE, init_target, target_train_step
from ddtree_jax.training.tokenizer import EOS, MASK, build_tokenizer

__all__ = ["SIZE", "default_configs", "make_default"]

# Kimi K2's structure at a small size: MLA with q-LoRA and yarn, 1 dense + 3 MoE layers, sigmoid
# routing over 16 experts (2 per token, 1 shared); a 2-layer DFlash drafter, block 16.
SIZE = Size(hidden=128, layers=4, heads=4, dense_intermediate=256, experts=16, expert_intermediate=64,
            experts_per_token=2, groups=1, topk_groups=1, q_lora_rank=64, kv_lora_rank=32, nope_dim=16, rope_dim=8,
            v_dim=16, draft_layers=2, draft_heads=4, draft_kv_heads=2, draft_head_dim=32, draft_intermediate=256,
            max_positions=2048)
LR, WEIGHT_DECAY, GAMMA = 3e-3, 0.01, 7.0
TARGET_BATCH, TARGET_SEQ_LEN = 16, 64  # windows of TARGET_SEQ_LEN + 1 tokens
DRAFTER_BATCH, DRAFTER_ANCHORS = 16, 4  # sequences per step, blocks per sequence
CONTINUATIONS = 128  # the target's continuations per prompt length

_CORPUS = """\
Speculative decoding lets a large model verify many proposed tokens in one forward pass.
A small drafter proposes a block of tokens; the target checks them and keeps the longest
prefix it agrees with, plus one token of its own. When the drafter is good, each pass of the
target yields several tokens instead of one, and the output is exactly what the target alone
would have produced.
A block diffusion drafter predicts a whole block of future tokens in a single pass. Each
position gets its own distribution over the vocabulary. A draft tree keeps the most probable
continuations under a node budget, and the target verifies the whole tree at once, each node
attending only to its ancestors.
With sampling, every node draws one token from the target's own rule: temperature, then top-k,
then top-p, then min-p. The walk moves to a child when the draw matches it, and the first draw
that matches no child becomes the bonus token. The law of the committed tokens is the target's
law, token by token.
Mixture-of-experts models route each token to a few experts chosen by sigmoid scores. Latent
attention caches a compressed vector per token instead of full keys and values, so long
contexts fit in memory. The quick brown fox jumps over the lazy dog. 0123456789.
"""


def default_configs(vocab_size: int, mask_token_id: int) -> tuple[KimiConfig, DFlashConfig]:
    """The target's and the drafter's configs at ``SIZE``."""
    target = target_config(SIZE, vocab_size)
    return target, drafter_config(SIZE, target, mask_token_id)


def _loss_record(losses: list[float]) -> dict:
    """A training run in numbers: the first step's loss and the mean over the last 10% of steps (one step's
    loss is one batch's, so it is noisy)."""
    tail = max(1, len(losses) // 10)
    return dict(steps=len(losses), first_loss=losses[0], final_loss=sum(losses[-tail:]) / tail,
                final_loss_is=f"mean over the last {tail} steps")


def _train_target(target, stream: np.ndarray, *, steps: int, seed: int, log) -> list[float]:
    windows = TokenWindows(stream, TARGET_SEQ_LEN + 1, TARGET_BATCH, seed)
    opt = make_optimizer(target, TRAINABLE, lr=LR, total_steps=steps, warmup=steps // 10, weight_decay=WEIGHT_DECAY)
    step = CompiledFn(target_train_step, updates=(target, opt))
    log(f"[default] training the target: {steps} steps of {TARGET_BATCH} windows of {TARGET_SEQ_LEN + 1} tokens")
    losses = train_steps("target", step, lambda s: (jnp.asarray(windows.batch_at(s)),), {"step": 0}, steps=steps,
                         log=log)
    step.sync()
    return losses


def _train_drafter(drafter, target, stream: np.ndarray, *, steps: int, prompt_lengths: tuple[int, ...], seed: int,
                   log) -> list[float]:
    bs = drafter.config.block_size
    seq_len = max(prompt_lengths) + bs  # every prompt length has an anchor whose block is all generated
    t0 = time.perf_counter()
    log(f"[default] the target's greedy continuations to {seq_len} tokens of {CONTINUATIONS} prompts of each length "
        f"in {prompt_lengths} (each length compiles its own shapes) ...")
    parts = [make_continuations(target, stream, count=CONTINUATIONS, prompt_len=p, seq_len=seq_len, temperature=0.0,
                                seed=seed) for p in prompt_lengths]
    data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    log(f"[default] {len(data['tokens'])} continuations in {time.perf_counter() - t0:.0f}s; training the drafter: "
        f"{steps} steps of {DRAFTER_BATCH} sequences x {DRAFTER_ANCHORS} blocks")
    opt = make_optimizer(drafter, nnx.Param, lr=LR, total_steps=steps, warmup=steps // 10, weight_decay=WEIGHT_DECAY)
    step = CompiledFn(drafter_train_step, updates=(drafter, opt), reads=(target,), gamma=GAMMA)
    losses = train_steps(
        "drafter", step,
        lambda s: drafter_batch(data, s, seed=seed, batch=DRAFTER_BATCH, anchors=DRAFTER_ANCHORS, block_size=bs),
        {"step": 0}, steps=steps, log=log)
    step.sync()
    return losses


def make_default(path: str = RECIPE_DIR, *, seed: int = 0, vocab_size: int = 512, target_steps: int = 200,
                 drafter_steps: int = 300, drafter_prompt_lengths: tuple[int, ...] = (4, 8, 16, 32, 64),
                 log=print) -> str:
    """Makes, trains and writes the default target, drafter and tokenizer under ``path`` (once: a
    complete folder is returned as it is). Steps of 0 leave that model at its random initialisation."""
    if is_complete(path):
        return path
    t0 = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    log(f"[default] training a byte-level BPE tokenizer (vocabulary {vocab_size}) on the built-in corpus ...")
    tok = build_tokenizer(_CORPUS.splitlines(), vocab_size)
    tok.save(os.path.join(path, "tokenizer.json"))
    tcfg, dcfg = default_configs(tok.get_vocab_size(), tok.token_to_id(MASK))
    log(f"[default] initialising the target ({tcfg.num_hidden_layers} layers, {tcfg.n_routed_experts} experts) and "
        f"the drafter ({dcfg.num_hidden_layers} layers, block {dcfg.block_size}) ({time.perf_counter() - t0:.0f}s)")
    target = init_target(tcfg, seed)
    # Random but not degenerate routing: a spread of correction biases.
    rng = np.random.default_rng(seed)
    for layer in target.model.layers:
        if hasattr(layer.mlp, "gate"):
            bias = layer.mlp.gate.e_score_correction_bias
            bias[...] = jnp.asarray(rng.normal(0.0, 0.1, bias.shape), jnp.float32)
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(seed + 1), dtype=jnp.float32)
    stream = np.array(tok.encode(_CORPUS).ids * 4, np.int32)  # repeated: windows may wrap past the end
    losses = {}
    if target_steps:
        losses["target"] = _train_target(target, stream, steps=target_steps, seed=seed, log=log)
    save_checkpoint(target, os.path.join(path, "target"))
    # The drafter learns from (and is trained against) the target as it loads, as in the drafter stage.
    target = load_target(os.path.join(path, "target"), impl="reference")
    if drafter_steps:
        losses["drafter"] = _train_drafter(drafter, target, stream, steps=drafter_steps,
                                           prompt_lengths=drafter_prompt_lengths, seed=seed, log=log)
    log(f"[default] writing drafter/ and generation_config.json to {path} ({time.perf_counter() - t0:.0f}s)")
    save_checkpoint(drafter, os.path.join(path, "drafter"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.token_to_id(EOS), "seed": seed,
                   "training": {k: _loss_record(v) for k, v in losses.items()}},
                  f, indent=2)
    mark_complete(path)
    return path
