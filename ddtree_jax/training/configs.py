"""Model sizes for the training stages: ``h200`` (the shipped pair: a 6-layer Kimi-style target
and a 2-layer DFlash drafter, under 40 MB together in bfloat16) and ``tiny`` (CPU smoke tests).
``target_config`` and ``drafter_config`` turn a ``Size`` into the models' configs. Why the
``h200`` sizes are what they are: docs/training.md, "Model sizes".
"""

from __future__ import annotations

import dataclasses

from ddtree_jax.models import DFlashConfig, KimiConfig, YarnScaling, default_target_layer_ids

__all__ = ["SIZES", "Size", "drafter_config", "target_config"]


@dataclasses.dataclass(frozen=True)
class Size:
    """The knobs of one size; the rest of Kimi K2's structure is fixed in ``target_config``."""

    hidden: int
    layers: int
    heads: int
    dense_intermediate: int
    experts: int
    expert_intermediate: int
    experts_per_token: int
    groups: int
    topk_groups: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    draft_layers: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_intermediate: int
    max_positions: int


SIZES = {
    "h200": Size(hidden=384, layers=6, heads=8, dense_intermediate=1024, experts=16, expert_intermediate=96,
                 experts_per_token=2, groups=4, topk_groups=2, q_lora_rank=192, kv_lora_rank=128, nope_dim=32,
                 rope_dim=16, v_dim=32, draft_layers=2, draft_heads=6, draft_kv_heads=2, draft_head_dim=64,
                 draft_intermediate=768, max_positions=2048),
    "tiny": Size(hidden=64, layers=2, heads=2, dense_intermediate=128, experts=8, expert_intermediate=32,
                 experts_per_token=2, groups=2, topk_groups=1, q_lora_rank=32, kv_lora_rank=16, nope_dim=16,
                 rope_dim=8, v_dim=16, draft_layers=1, draft_heads=2, draft_kv_heads=1, draft_head_dim=32,
                 draft_intermediate=128, max_positions=1024),
}


def target_config(size: Size, vocab_size: int) -> KimiConfig:
    return KimiConfig(
        vocab_size=vocab_size, hidden_size=size.hidden, intermediate_size=size.dense_intermediate,
        moe_intermediate_size=size.expert_intermediate, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, q_lora_rank=size.q_lora_rank, kv_lora_rank=size.kv_lora_rank,
        qk_nope_head_dim=size.nope_dim, qk_rope_head_dim=size.rope_dim, v_head_dim=size.v_dim,
        n_routed_experts=size.experts, num_experts_per_tok=size.experts_per_token, n_shared_experts=1,
        n_group=size.groups, topk_group=size.topk_groups, first_k_dense_replace=1, routed_scaling_factor=2.827,
        rope_theta=50000.0, max_position_embeddings=size.max_positions, model_type="kimi_k2",
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=size.max_positions // 4,
                                 beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    )


def drafter_config(size: Size, target: KimiConfig, mask_token_id: int, block_size: int = 16) -> DFlashConfig:
    n = size.draft_layers
    return DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=size.draft_intermediate, num_hidden_layers=n,
        num_attention_heads=size.draft_heads, num_key_value_heads=size.draft_kv_heads, head_dim=size.draft_head_dim,
        num_target_layers=target.num_hidden_layers, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=default_target_layer_ids(target.num_hidden_layers, n),
        layer_types=("full_attention",) * n, rope_theta=50000.0, max_position_embeddings=size.max_positions,
        vocab_size=target.vocab_size,
    )
