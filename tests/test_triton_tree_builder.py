"""Triton DDTree builder (interpret mode) == the reference build of ddtree_jax.tree, field by field.

Interpret mode spends most of its time compiling one program per (shape, budget), so the cases
share shapes: (B=2, L=4, V=37, budget 21) carries random, masked, all-tied and NaN inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from pallas_kernels.triton import tree_builder
from tests._random_inputs import random_draft_logits

FIELDS = ["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"]


def _assert_same(a, b):
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f)
    assert a.draft_len == b.draft_len


def _shared_shape_inputs():
    """Four [2, 4, 37] inputs: random, 90% masked (-inf), rounded (many score ties), all-equal
    with a NaN drafter row (FIFO tie rule; no nodes at that depth)."""
    B, L, V = 2, 4, 37
    rand = random_draft_logits(1, B, L, V)
    masked = random_draft_logits(2, B, L, V, mask_frac=0.9)
    ties = np.zeros((B, L, V), np.float32)
    ties[1, 1] = np.nan
    return {"random": rand, "masked": masked, "rounded": np.round(rand), "ties_nan": ties}


@pytest.mark.parametrize("kind", ["random", "masked", "rounded", "ties_nan"])
def test_builder_shared_shape(kind):
    logits = jnp.asarray(_shared_shape_inputs()[kind])
    ref = dt.build_draft_tree(logits, 21, impl="reference")
    _assert_same(dt.build_draft_tree(logits, 21, impl="pallas"), ref)


@pytest.mark.parametrize("B,L,V,budget", [(2, 3, 5, 100), (1, 5, 700, 63)])
def test_builder_matches_reference(B, L, V, budget):
    """budget > V (K = V) with a frontier that fills up; larger V, budget not a power of two."""
    logits = jnp.asarray(random_draft_logits(B + L + V + budget, B, L, V))
    _assert_same(
        dt.build_draft_tree(logits, budget, impl="pallas"), dt.build_draft_tree(logits, budget, impl="reference")
    )


def test_kernel_refuses_sizes_it_cannot_pack():
    assert tree_builder.supports(16383, 15, 16383)
    assert not tree_builder.supports(16384, 15, 16384)
    with pytest.raises(ValueError, match="budget"):
        tree_builder.build_tree(jnp.zeros((1, 15, 8)), jnp.zeros((1, 15, 8), jnp.int32), budget=1 << 15, interpret=True)
    with pytest.raises(ValueError, match="num_warps"):  # the slot scratch needs the argmax's block barrier
        tree_builder.build_tree(jnp.zeros((1, 15, 8)), jnp.zeros((1, 15, 8), jnp.int32), budget=8, num_warps=1)


def test_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        dt.build_draft_tree(jnp.zeros((1, 2, 5)), 3, impl="gpu")
