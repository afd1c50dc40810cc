"""Pieces the Triton attention kernels share (``mla_attention``, ``block_attention``): the
FlashAttention-2 online softmax in base 2 over key tiles, its running ``(o, m, den)`` state and the
fold of two such states (the same expressions inside a kernel and in a merge after it, so a merge
gives the bits a single pass would), and where a key tile lies in a contiguous cache or a page
pool. Imports only JAX."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf.
_NEG = -1e30


def _dot(a, b, trans_b=False):
    # float32 inputs (tests, reference-precision runs) use IEEE products, not tf32.
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=False if exact else None)


def _merge(carry, part):
    """Fold one key range's unnormalised ``(o [..., D], m [...], den [...])`` into a running total
    (the same expressions in a kernel's loop and in a merge after it: same bits either way)."""
    o, m, den = carry
    o_s, m_s, den_s = part
    m_new = jnp.maximum(m, m_s)
    a, c = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)
    return o * a[..., None] + o_s * c[..., None], m_new, den * a + den_s * c


def _fresh(BM, RP):
    """The state of no keys yet: ``o`` zeros ``[BM, RP]``, maxima ``_NEG``, denominators 0."""
    return jnp.zeros((BM, RP), jnp.float32), jnp.full((BM,), _NEG, jnp.float32), jnp.zeros((BM,), jnp.float32)


def _contiguous_tile(b, k0):
    """The cache row and first slot of row ``b``'s key tile at position ``k0`` in a ``[B,S,...]`` cache."""
    return b, k0


def _paged(kernel):
    """``kernel`` (whose ``tile_at`` keyword says where a key tile lies) over a page pool, with the
    page table as its first operand: row ``b``'s key tile at position ``k0`` (a multiple of the
    tile, which divides ``page_size``) is slots ``[k0 % page_size, + tile)`` of page
    ``table[b, k0 // page_size]``."""

    def run(table_ref, *refs, page_size, **static):
        def tile_at(b, k0):
            return table_ref[b, k0 // page_size], k0 % page_size

        kernel(*refs, tile_at=tile_at, **static)

    return run
