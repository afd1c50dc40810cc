"""The built-in defaults: the shipped pair, and the CPU recipe that can remake a small one.

``SHIPPED_DIR`` (inside the package, ``ddtree_jax/default_pair/``) holds the default that the
command line, the examples and the serving bench load: a Kimi-style MoE target (16.0M parameters,
MLA + sigmoid group-routed experts with a shared expert) and a 2-layer DFlash drafter (2.9M),
trained on one H200 on the Python standard library by ``ddtree_jax.training``, as bfloat16 HF
checkpoints (37.8 MB together) with their byte-level BPE ``tokenizer.json``, the data record
(``data.json``) and the training record (``training.json``). Its ``README.md`` says how it was
made and what it measures. Nothing is trained at first use.

``make_default(path)`` is the CPU recipe (``python -m ddtree_jax demo --retrain``): it writes
three real artefacts that load like any other model: a target checkpoint (``target/``), a drafter
checkpoint (``drafter/``) and a ``tokenizer.json`` trained with the ``tokenizers`` library on a
small corpus that ships inside this module. Both models are trained on the CPU in a few minutes
(``ddtree_jax.train``): the target learns the corpus (small enough to memorise), then the drafter
learns the target's own greedy continuations by the DFlash recipe. On corpus-like prompts the
pair agrees often; on anything else it is as weak as its corpus is small. The tests use it at a
few training steps, because it is quick to make.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX and the models are imported where used, so the folders and is_complete stay light
    from ddtree_jax.models import DFlashConfig, KimiConfig

__all__ = ["CODE_PROMPTS", "CORPUS_PROMPTS", "RECIPE_DIR", "SHIPPED_DIR", "default_configs", "is_complete",
           "make_default"]

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_pair")
RECIPE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                          "ddtree_jax", "default-v2")
# Prompts each default knows what to do with: code for the shipped pair (it learned the standard
# library), the corpus's own sentences for the CPU recipe.
CODE_PROMPTS = (
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
)
CORPUS_PROMPTS = ("Speculative decoding lets", "A draft tree", "With sampling, every node")
EOS, MASK = "<|endoftext|>", "<|mask|>"

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


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, MASK], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def default_configs(vocab_size: int, mask_token_id: int) -> tuple[KimiConfig, DFlashConfig]:
    """Kimi K2's structure at a small size: MLA with q-LoRA and yarn, 1 dense + 3 MoE layers,
    sigmoid routing over 16 experts (2 per token, 1 shared); a 2-layer DFlash drafter, block 16."""
    from ddtree_jax.models import DFlashConfig, KimiConfig, YarnScaling, default_target_layer_ids

    target = KimiConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=2048, model_type="kimi_k2",
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
    )
    layers = 2
    drafter = DFlashConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_target_layers=target.num_hidden_layers, block_size=16,
        mask_token_id=mask_token_id, target_layer_ids=default_target_layer_ids(target.num_hidden_layers, layers),
        layer_types=("full_attention",) * layers, rope_theta=50000.0, max_position_embeddings=2048,
        vocab_size=vocab_size,
    )
    return target, drafter


def _loss_record(losses: list[float]) -> dict:
    """A training run in numbers: the first step's loss and the mean over the last 10% of steps (one step's
    loss is one batch's, and for the drafter one context length's, so it is noisy)."""
    tail = max(1, len(losses) // 10)
    return dict(steps=len(losses), first_loss=losses[0], final_loss=sum(losses[-tail:]) / tail,
                final_loss_is=f"mean over the last {tail} steps")


def is_complete(path: str) -> bool:
    """Whether ``make_default`` finished writing a default under ``path`` (the shipped pair is
    complete as it ships)."""
    if os.path.abspath(path) == SHIPPED_DIR:
        return True
    return os.path.isfile(os.path.join(path, "COMPLETE"))


def make_default(path: str = RECIPE_DIR, *, seed: int = 0, vocab_size: int = 512, target_steps: int = 200,
                 drafter_steps: int = 300, drafter_contexts: tuple[int, ...] = (4, 8, 16, 32, 64), log=print) -> str:
    """Makes, trains and writes the default target, drafter and tokenizer under ``path``
    (once; reused after). Steps of 0 leave that model at its random initialisation."""
    if is_complete(path):
        return path
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ddtree_jax.checkpoints import save_checkpoint
    from ddtree_jax.models import DFlashDrafter, KimiForCausalLM
    from ddtree_jax.train import train_drafter, train_target

    t0 = time.perf_counter()
    os.makedirs(path, exist_ok=True)
    log(f"[default] training a byte-level BPE tokenizer (vocabulary {vocab_size}) on the built-in corpus ...")
    tok = _train_tokenizer(vocab_size)
    tok.save(os.path.join(path, "tokenizer.json"))
    V = tok.get_vocab_size()
    tcfg, dcfg = default_configs(V, tok.token_to_id(MASK))
    log(f"[default] initialising the target ({tcfg.num_hidden_layers} layers, {tcfg.n_routed_experts} experts) and "
        f"the drafter ({dcfg.num_hidden_layers} layers, block {dcfg.block_size}) ({time.perf_counter() - t0:.0f}s)")
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(seed), dtype=jnp.float32)
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
        losses["target"] = train_target(target, stream, steps=target_steps, seed=seed, log=log)
    if drafter_steps:
        losses["drafter"] = train_drafter(drafter, target, stream, steps=drafter_steps, contexts=drafter_contexts,
                                          seed=seed, log=log)
    log(f"[default] writing target/, drafter/ and tokenizer.json to {path} ({time.perf_counter() - t0:.0f}s)")
    save_checkpoint(target, os.path.join(path, "target"))
    save_checkpoint(drafter, os.path.join(path, "drafter"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.token_to_id(EOS), "seed": seed,
                   "training": {k: _loss_record(v) for k, v in losses.items()}},
                  f, indent=2)
    open(os.path.join(path, "COMPLETE"), "w").close()
    return path
