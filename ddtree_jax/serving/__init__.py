"""Serving: a continuous-batching ``Engine`` over fixed decoding slots, an OpenAI-compatible HTTP
server (``ddtree_jax.serving.server``, needs the ``serve`` extra) and mesh set-up
(``ddtree_jax.serving.sharding``)."""

from ddtree_jax.serving.engine import (
    Engine,
    EngineOverloaded,
    RequestError,
    RequestHandle,
    RequestResult,
    StreamChunk,
)

__all__ = ["Engine", "EngineOverloaded", "RequestError", "RequestHandle", "RequestResult", "StreamChunk"]
