"""Tiny model configs, random trees and jitted entry points shared by the model tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.config import ExecutionConfig
from ddtree_jax.models import DFlashConfig, DFlashDrafter, KimiConfig, KimiForCausalLM, YarnScaling

VOCAB = 128


def tiny_kimi_config(**overrides) -> KimiConfig:
    """3 layers (1 dense + 2 MoE), hidden 64, 8 experts in 2 groups, q_lora, yarn."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, max_position_embeddings=256,
                rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64,
                                         mscale=0.8, mscale_all_dim=1.0))
    return KimiConfig(**{**base, **overrides})


def tiny_kimi(seed: int = 0, execution: ExecutionConfig | None = None, **overrides) -> KimiForCausalLM:
    """A random tiny target (config ``overrides``, computing as ``execution``); router biases
    randomised so that routing depends on them."""
    model = KimiForCausalLM(tiny_kimi_config(**overrides), rngs=nnx.Rngs(seed), execution=execution)
    rng = np.random.default_rng(seed)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            bias = layer.mlp.gate.e_score_correction_bias
            bias[...] = jnp.asarray(rng.normal(0, 0.5, bias.shape), jnp.float32)
    return model


def tiny_dflash_config(target: KimiConfig, **overrides) -> DFlashConfig:
    base = dict(hidden_size=target.hidden_size, intermediate_size=80, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_target_layers=target.num_hidden_layers, block_size=5, mask_token_id=VOCAB - 1,
                target_layer_ids=(0, 1), layer_types=("full_attention", "full_attention"),
                rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=target.vocab_size)
    return DFlashConfig(**{**base, **overrides})


def tiny_dflash(target: KimiForCausalLM, seed: int = 1, **overrides) -> DFlashDrafter:
    drafter = DFlashDrafter(tiny_dflash_config(target.config, **overrides), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(drafter):  # non-trivial norm weights catch a skipped norm
        if isinstance(var, nnx.Param) and path[-1] == "weight":
            var[...] = jnp.asarray(1 + 0.3 * rng.normal(size=var.shape), var.dtype)
    return drafter


def tiny_pair(seed: int = 0) -> tuple[KimiForCausalLM, DFlashDrafter]:
    """The tiny target at two layers (1 dense + 1 MoE) and a one-layer drafter reading both: every
    kind of layer once, for tests where the depth does not matter (compiles faster than the
    three-layer target and two-layer drafter)."""
    target = tiny_kimi(seed, num_hidden_layers=2)
    return target, tiny_dflash(target, seed + 1, num_hidden_layers=1, layer_types=("full_attention",))


def random_tree(rng: np.random.Generator, size: int):
    """A random rooted tree of ``size`` nodes, node 0 the root, parents before children.

    Returns ``(parents [size] (-1 for the root), depths [size], ancestor_mask [size, size])``
    with ``ancestor_mask[i, j]`` true iff j is i or an ancestor of i.
    """
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, size)])
    depths = np.zeros(size, np.int32)
    mask = np.eye(size, dtype=bool)
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return parents, depths, mask


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Node indices from the root to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


@nnx.jit(static_argnames=("hidden_layer_ids",))
def forward_uncached(model, ids, hidden_layer_ids=()):
    return model.forward_uncached(ids, hidden_layer_ids=hidden_layer_ids)


@nnx.jit(static_argnames=("hidden_layer_ids",))
def prefill(model, ids, lengths, cache, hidden_layer_ids=()):
    return model.prefill(ids, lengths, cache, hidden_layer_ids=hidden_layer_ids)


@nnx.jit(static_argnames=("hidden_layer_ids",))
def verify(model, tokens, depths, mask, cache, hidden_layer_ids=()):
    return model.verify(tokens, depths, mask, cache, hidden_layer_ids=hidden_layer_ids)


commit = jax.jit(KimiForCausalLM.commit)

