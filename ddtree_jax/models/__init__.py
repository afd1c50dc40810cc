"""Model definitions: the Kimi K2 / DeepSeek-V3 target and the DFlash drafter."""

from ddtree_jax.models.dflash import DFlashConfig, DFlashDrafter, DraftCache, default_target_layer_ids
from ddtree_jax.models.kimi import KimiConfig, KimiForCausalLM, KVCache, YarnScaling

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DraftCache",
    "KVCache",
    "KimiConfig",
    "KimiForCausalLM",
    "YarnScaling",
    "default_target_layer_ids",
]
