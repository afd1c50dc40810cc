"""ddtree-jax: exact tree speculative decoding (DFlash drafter + DDTree) in JAX."""

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
    "INVALID_TOKEN",
    "AcceptResult",
    "DraftTree",
    "SamplingBatch",
    "SamplingParams",
    "accept_path",
    "batch_sampling",
    "build_draft_tree",
    "chain_draft_tree",
    "draft_logprobs",
    "sample_tree_nodes",
    "target_logprobs",
]
