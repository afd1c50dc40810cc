"""The random-stream rules, in one place.

Every random number a request uses derives from the caller's key and the request's own identity,
never from its batch position or its neighbours, so a seeded request gives the same output
whatever else shares the batch, and a request keeps its stream when the serving loop moves it
between batch rows:

* request key: ``fold_in(fold_in(key, 0), seed)`` for a seeded request,
  ``fold_in(fold_in(key, 1), request_id)`` for an unseeded one (``request_keys``);
* first-token key: ``fold_in(request key, FIRST_TOKEN)`` (``first_token_keys``): the draw of a
  request's first new token from the prefill's last position (``FIRST_TOKEN`` is no round count);
* round key: ``fold_in(request key, the request's own round count)`` (``round_keys``);
* node draws: the reference sampler draws Gumbel noise ``[M, V]`` from the round key; the fused
  kernel hashes two seed words per node, those of ``fold_in(round key, node)``
  (``node_seed_words``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FIRST_TOKEN", "first_token_keys", "node_seed_words", "request_keys", "round_keys"]

FIRST_TOKEN = 0xFFFFFFFF
"""The fold of a request's first-token key (``first_token_keys``): a round count no request reaches."""


def _as_key(key: jax.Array) -> jax.Array:
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ValueError(f"key must be a JAX PRNG key (typed, or raw uint32[..., 2]); got {key.dtype}{key.shape}")
        key = jax.random.wrap_key_data(key)
    return key


def request_keys(key: jax.Array, params, request_ids: jax.Array | None = None) -> jax.Array:
    """Per-request keys ``[B]`` from one key (typed, or raw ``uint32[2]``).

    ``params`` carries ``seed`` (u32 ``[B]``) and ``has_seed`` (bool ``[B]``), e.g. a
    ``SamplingBatch``. ``request_ids`` (default: the row index) identifies unseeded requests; a
    caller that moves requests between rows passes stable ids. ``key`` may also already be
    ``[B]`` keys, returned as they are.
    """
    key = _as_key(key)
    B = params.seed.shape[0]
    if key.shape == ():
        fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
        seeded = fold(jax.random.fold_in(key, 0), params.seed)
        ids = jnp.arange(B, dtype=jnp.uint32) if request_ids is None else request_ids.astype(jnp.uint32)
        unseeded = fold(jax.random.fold_in(key, 1), ids)
        return jnp.where(params.has_seed, seeded, unseeded)
    if key.shape != (B,):
        raise ValueError(f"key must be one key or one per request ({B}); got shape {key.shape}")
    return key


def round_keys(base_key: jax.Array, params, request_ids: jax.Array, rounds: jax.Array) -> jax.Array:
    """Keys ``[B]`` of one decoding round: each request's key folded with its own round count."""
    return jax.vmap(jax.random.fold_in)(request_keys(base_key, params, request_ids), rounds)


def first_token_keys(base_key: jax.Array, params, request_ids: jax.Array) -> jax.Array:
    """Keys ``[B]`` of each request's first new token (drawn from the prefill's last position, as
    node 0 of a round draws): its request key folded with ``FIRST_TOKEN``."""
    keys = request_keys(base_key, params, request_ids)
    return jax.vmap(lambda k: jax.random.fold_in(k, jnp.uint32(FIRST_TOKEN)))(keys)


def node_seed_words(keys: jax.Array, num_nodes: int) -> jax.Array:
    """u32 ``[B, num_nodes, 2]``: the fused sampler's seed words of every node of every request."""
    node_keys = jax.vmap(lambda k: jax.vmap(lambda m: jax.random.fold_in(k, m))(
        jnp.arange(num_nodes, dtype=jnp.uint32)))(_as_key(keys))
    data = jax.random.key_data(node_keys)
    return data.reshape(data.shape[0], num_nodes, -1)[..., :2].astype(jnp.uint32)
