"""ddtree-jax: exact tree speculative decoding (DFlash drafter + DDTree) in JAX."""

from ddtree_jax.checkpoints import DEFAULT_MESH_AXES, CheckpointError, load_drafter, load_target, save_checkpoint
from ddtree_jax.generate import GenerateOutput, RequestOutput, generate
from ddtree_jax.models import (
    DFlashConfig,
    DFlashDrafter,
    DraftCache,
    KimiConfig,
    KimiForCausalLM,
    KVCache,
    YarnScaling,
    default_target_layer_ids,
)
from ddtree_jax.sampling import (
    INVALID_TOKEN,
    SamplingBatch,
    SamplingParams,
    batch_sampling,
    sample_tree_nodes,
    target_logprobs,
)
from ddtree_jax.tree import DraftTree, build_draft_tree, chain_draft_tree, draft_logprobs
from ddtree_jax.verify import AcceptResult, accept_path

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MESH_AXES",
    "INVALID_TOKEN",
    "AcceptResult",
    "CheckpointError",
    "DFlashConfig",
    "DFlashDrafter",
    "DraftCache",
    "DraftTree",
    "GenerateOutput",
    "KimiConfig",
    "KVCache",
    "KimiForCausalLM",
    "RequestOutput",
    "SamplingBatch",
    "SamplingParams",
    "accept_path",
    "YarnScaling",
    "batch_sampling",
    "build_draft_tree",
    "chain_draft_tree",
    "default_target_layer_ids",
    "draft_logprobs",
    "generate",
    "load_drafter",
    "load_target",
    "sample_tree_nodes",
    "save_checkpoint",
    "target_logprobs",
]
