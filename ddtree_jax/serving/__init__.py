"""Serving: a continuous-batching ``Engine`` over fixed decoding slots (``engine``), an
OpenAI-compatible HTTP server (``server``; needs the ``serve`` extra), the ``serve`` command
(``cli``) and mesh set-up (``sharding``).

Names are imported on first use, so the command line's argument parsing does not import JAX.
"""

from __future__ import annotations

from ddtree_jax._lazy import lazy_exports

_EXPORTS = {name: "ddtree_jax.serving.engine" for name in
            ("Engine", "EngineOverloaded", "RequestError", "RequestHandle", "RequestResult", "StreamChunk")}
_EXPORTS.update({"make_mesh": "ddtree_jax.serving.sharding", "parse_mesh_spec": "ddtree_jax.serving.sharding",
                 "EngineConfig": "ddtree_jax.config"})

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
