"""Pallas GPU kernels (Triton lowering), each with its plain-JAX reference beside it.

* ``fused_sampling``: fused per-row filter (temperature/top-k/top-p/min-p) + one exact draw.
* ``tree_walk``: the accept walk, one program per request.
* ``tree_builder``: the DDTree best-first build, one program per request.
"""

from pallas_kernels._dispatch import resolve_impl
from pallas_kernels.fused_sampling import fused_sample, fused_sample_debug
from pallas_kernels.tree_builder import build_draft_tree_pallas
from pallas_kernels.tree_walk import accept_path_pallas

__all__ = ["accept_path_pallas", "build_draft_tree_pallas", "fused_sample", "fused_sample_debug", "resolve_impl"]
