"""ddtree-jax: exact tree speculative decoding (DFlash drafter + DDTree) in JAX.

The public names are imported on first use (PEP 562), so ``import ddtree_jax`` and the command
line's argument checks do not pay for importing JAX.
"""

from __future__ import annotations

from ddtree_jax._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "DEFAULT_MESH_AXES": "ddtree_jax.mesh_axes",
    "CheckpointError": "ddtree_jax.checkpoints",
    "init_on_mesh": "ddtree_jax.checkpoints",
    "load_drafter": "ddtree_jax.checkpoints",
    "load_target": "ddtree_jax.checkpoints",
    "save_checkpoint": "ddtree_jax.checkpoints",
    "ConfigError": "ddtree_jax.config",
    "DecodeConfig": "ddtree_jax.config",
    "EngineConfig": "ddtree_jax.config",
    "ExecutionConfig": "ddtree_jax.config",
    "GenerateOutput": "ddtree_jax.generation",
    "RequestOutput": "ddtree_jax.generation",
    "generate": "ddtree_jax.generation",
    "DFlashConfig": "ddtree_jax.models",
    "DFlashDrafter": "ddtree_jax.models",
    "DraftCache": "ddtree_jax.models",
    "Int4Format": "ddtree_jax.models",
    "KimiConfig": "ddtree_jax.models",
    "KimiForCausalLM": "ddtree_jax.models",
    "KVCache": "ddtree_jax.models",
    "YarnScaling": "ddtree_jax.models",
    "default_target_layer_ids": "ddtree_jax.models",
    "INVALID_TOKEN": "ddtree_jax.sampling",
    "SamplingBatch": "ddtree_jax.sampling",
    "SamplingParams": "ddtree_jax.sampling",
    "batch_sampling": "ddtree_jax.sampling",
    "sample_tree_nodes": "ddtree_jax.sampling",
    "target_logprobs": "ddtree_jax.sampling",
    "DraftTree": "ddtree_jax.tree",
    "build_draft_tree": "ddtree_jax.tree",
    "chain_draft_tree": "ddtree_jax.tree",
    "draft_logprobs": "ddtree_jax.tree",
    "AcceptResult": "ddtree_jax.accept",
    "accept_path": "ddtree_jax.accept",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

