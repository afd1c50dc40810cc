"""Pallas DDTree builder (interpret mode) == ddtree_jax.tree.build_draft_tree, field by field.

Interpret mode spends most of its time compiling one program per (shape, budget), so the cases
share shapes: (B=2, L=4, V=37, budget 21) carries random, masked, all-tied and NaN inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from pallas_kernels.tree_builder import ancestor_mask_by_squaring, ancestor_mask_from_parents, build_draft_tree_pallas, exact_top_k
from tests.test_tree import random_draft_logits

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
    if kind in ("rounded", "ties_nan"):  # the previous kernel (kept for the GPU bench) too
        _assert_same(build_draft_tree_pallas(logits, 21, interpret=True, kernel="v1", mask="pointers"), ref)


@pytest.mark.parametrize("B,L,V,budget", [(2, 3, 5, 100), (1, 5, 700, 63)])
def test_builder_matches_reference(B, L, V, budget):
    """budget > V (K = V) with a frontier that fills up; larger V, budget not a power of two."""
    logits = jnp.asarray(random_draft_logits(B + L + V + budget, B, L, V))
    _assert_same(dt.build_draft_tree(logits, budget, impl="pallas"), dt.build_draft_tree(logits, budget, impl="reference"))


def test_ancestor_mask_by_squaring():
    rng = np.random.default_rng(3)
    for L, M in ((1, 4), (4, 30), (15, 257)):
        # random trees: node i's parent is a random earlier node with depth < L, some invalid
        par = np.full((2, M), -1, np.int32)
        dep = np.zeros((2, M), np.int32)
        valid = rng.random((2, M)) < 0.9
        valid[:, 0] = True
        for b in range(2):
            for i in range(1, M):
                cand = [j for j in range(i) if dep[b, j] < L and valid[b, j]]
                if valid[b, i] and cand:
                    par[b, i] = cand[-1] if rng.random() < 0.5 else rng.choice(cand)
                    dep[b, i] = dep[b, par[b, i]] + 1
                else:
                    valid[b, i] = False
        a = ancestor_mask_by_squaring(jnp.asarray(par), jnp.asarray(valid), L)
        r = ancestor_mask_from_parents(jnp.asarray(par), jnp.asarray(valid), L)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_exact_top_k_matches_lax():
    rng = np.random.default_rng(0)
    for ties in (False, True):
        x = rng.standard_normal((2, 3, 4096)).astype(np.float32)
        if ties:
            x = np.round(x * 2) / 2  # the chunk bound cannot certify: falls back, still exact
        v, i = exact_top_k(jnp.asarray(x), 100)
        v2, i2 = jax.lax.top_k(jnp.asarray(x), 100)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(i2))


def test_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        dt.build_draft_tree(jnp.zeros((1, 2, 5)), 3, impl="gpu")
