"""How the models' logical axes map onto a device mesh's axes (imports no JAX: the command line
checks its options against these maps before anything heavy loads).

A map sends each logical name the models declare on their weights (``"expert"``, ``"tensor"``) to a
mesh axis, and ``"rows"`` to the mesh axes batch rows split over (``ddtree_jax.rows``). The
loaders (``load_target`` / ``load_drafter`` / ``init_on_mesh``) and
``ddtree_jax.serving.sharding.state_sharding`` take one as ``mesh_axes``; design note:
docs/sharding.md.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MESH_AXES", "NO_DP_ATTENTION", "ROW_AXES"]

# Rows split over data and expert: data-parallel attention over the expert devices.
ROW_AXES = ("data", "expert")

DEFAULT_MESH_AXES = {"expert": "expert", "tensor": "tensor", "rows": ROW_AXES}

# Rows split over data only: every device of the expert axis holds and computes every row of its
# data shard.
NO_DP_ATTENTION = {"expert": "expert", "tensor": "tensor", "rows": ("data",)}
