"""Model definitions: the Kimi K2 / DeepSeek-V3 target and the DFlash drafter, their configs, the
interface the decode loop relies on, and the architecture registry."""

from ddtree_jax.models.dflash import DFlashDrafter, DraftCache
from ddtree_jax.models.dflash_config import DFlashConfig, default_target_layer_ids
from ddtree_jax.models.int4 import Int4Format
from ddtree_jax.models.interface import DraftModel, RowCache, TargetModel
from ddtree_jax.models.kimi import KimiForCausalLM, KVCache
from ddtree_jax.models.kimi_config import KimiConfig
from ddtree_jax.models.registry import DRAFTERS, TARGETS, lookup_architecture
from ddtree_jax.models.rope import YarnScaling

__all__ = [
    "DRAFTERS",
    "TARGETS",
    "DFlashConfig",
    "DFlashDrafter",
    "DraftCache",
    "DraftModel",
    "Int4Format",
    "KVCache",
    "KimiConfig",
    "KimiForCausalLM",
    "RowCache",
    "TargetModel",
    "YarnScaling",
    "default_target_layer_ids",
    "lookup_architecture",
]
