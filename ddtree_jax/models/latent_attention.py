"""MLA attention core in the absorbed form: a block's queries against the latent cache.

``latent_attention`` dispatches on the ``Backend``: the Pallas kernel
(``pallas_kernels.triton.mla_attention``: online softmax, reads each row's cache only up to its
current length) or ``latent_attention_reference`` (the dense computation: scores over the whole
cache under the dense ``[B,T,S]`` mask). ``W_UK`` is applied before and ``W_UV``/``o_proj`` after,
by ``ddtree_jax.models.kimi.MLAttention``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ddtree_jax.backend import Backend, has_kernel
from ddtree_jax.models._layers import masked_softmax
from ddtree_jax.models.tree_cache import BlockMask

__all__ = ["latent_attention", "latent_attention_reference"]


def latent_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                               mask: BlockMask, *, scale: float) -> jax.Array:
    """``q_latent [B,T,H,r]``, ``q_rope [B,T,H,dr]`` over ``latent [B,S,r]``, ``k_rope [B,S,dr]``
    -> ``[B,T,H,r]`` in ``q_latent``'s dtype; softmax in float32 over the dense mask."""
    b, t = q_latent.shape[:2]
    dense = mask.dense(t, latent.shape[1])
    dtype = q_latent.dtype
    scores = jnp.einsum("btnr,bsr->bnts", q_latent, latent.astype(dtype)) + jnp.einsum(
        "btnd,bsd->bnts", q_rope, k_rope.astype(q_rope.dtype)
    )
    probs = masked_softmax(scores * scale, dense[:, None]).astype(dtype)
    return jnp.einsum("bnts,bsr->btnr", probs, latent.astype(dtype))


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, mask: BlockMask,
                     *, scale: float, backend: Backend) -> jax.Array:
    """Absorbed MLA attention (see ``latent_attention_reference`` for the shapes), by ``backend``.

    The block's own latents must already be in ``latent``/``k_rope`` at ``[start, start+T)``.
    """
    b, t, h, r = q_latent.shape
    s = latent.shape[1]
    chex.assert_shape([q_latent, latent, mask.start], [(b, t, h, r), (b, s, r), (b,)])
    if not has_kernel(backend, "mla_attention"):  # no kernel for this family (TPU): the reference
        return latent_attention_reference(q_latent, q_rope, latent, k_rope, mask, scale=scale)
    from pallas_kernels.triton.mla_attention import auto_split_keys, default_tiles, mla_attention

    dtype, tiles = q_latent.dtype, default_tiles(latent.dtype)
    out = mla_attention(
        q_latent.astype(latent.dtype),
        q_rope.astype(k_rope.dtype),
        latent,
        k_rope,
        mask.start,
        mask.within,
        scale=float(scale),
        causal=mask.causal,
        split_keys=auto_split_keys(b, t * h, s, block_m=tiles["block_m"], block_k=tiles["block_k"]),
        interpret=backend.interpret,
    )
    return out.astype(dtype)
