"""Pallas DDTree builder (interpret mode) == ddtree_jax.tree.build_draft_tree, field by field."""

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from pallas_kernels.tree_builder import exact_top_k
from tests.test_tree import random_draft_logits

FIELDS = ["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"]


def _assert_same(a, b):
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f)
    assert a.draft_len == b.draft_len


@pytest.mark.parametrize(
    "B,L,V,budget,mask_frac",
    [(2, 4, 37, 21, 0.0), (2, 3, 5, 100, 0.0), (1, 2, 300, 45, 0.0), (2, 3, 50, 30, 0.9), (1, 5, 700, 63, 0.0)],
)
def test_builder_matches_reference(B, L, V, budget, mask_frac):
    logits = jnp.asarray(random_draft_logits(B + L + V + budget, B, L, V, mask_frac=mask_frac))
    _assert_same(dt.build_draft_tree(logits, budget, impl="pallas"), dt.build_draft_tree(logits, budget, impl="reference"))


def test_builder_ties_and_nan_rows():
    """All-equal scores (FIFO tie rule) and a NaN drafter row (no nodes at that depth)."""
    logits = np.zeros((2, 3, 4), np.float32)
    logits[1, 1] = np.nan
    logits = jnp.asarray(logits)
    _assert_same(dt.build_draft_tree(logits, 12, impl="pallas"), dt.build_draft_tree(logits, 12, impl="reference"))


def test_exact_top_k_matches_lax():
    rng = np.random.default_rng(0)
    for ties in (False, True):
        x = rng.standard_normal((2, 3, 4096)).astype(np.float32)
        if ties:
            x = np.round(x * 2) / 2  # the chunk bound cannot certify: falls back, still exact
        v, i = exact_top_k(jnp.asarray(x), 100)
        v2, i2 = __import__("jax").lax.top_k(jnp.asarray(x), 100)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(i2))


def test_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        dt.build_draft_tree(jnp.zeros((1, 2, 5)), 3, impl="gpu")
