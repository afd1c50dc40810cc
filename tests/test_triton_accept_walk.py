"""Triton accept walk (interpret mode) == the reference walk of ddtree_jax.accept, and the impl dispatch."""

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from tests._random_inputs import random_draft_logits
from tests._reference import walk_first_child


def _samples(tree, V, rng, p_follow):
    """Draws that often follow the tree (deep walks) and sometimes miss (bonus)."""
    tk, fc = np.asarray(tree.tokens), np.asarray(tree.first_child)
    ns = np.asarray(tree.next_sibling)
    follow = np.where(fc >= 0, np.take_along_axis(tk, np.maximum(fc, 0), 1), 0)
    # sometimes follow the second child instead
    second = np.where(fc >= 0, np.take_along_axis(ns, np.maximum(fc, 0), 1), -1)
    follow2 = np.where(second >= 0, np.take_along_axis(tk, np.maximum(second, 0), 1), follow)
    follow = np.where(rng.random(tk.shape) < 0.3, follow2, follow)
    miss = rng.integers(0, V, tk.shape)
    return np.where(rng.random(tk.shape) < p_follow, follow, miss).astype(np.int32)


# (2, 4, 37, 21) and (2, 3, 5, 100) are shapes the builder tests also build (shared compiles).
@pytest.mark.parametrize(
    "B,L,V,budget,seed", [(2, 4, 37, 21, 0), (2, 6, 11, 50, 1), (2, 3, 5, 100, 2), (1, 1, 7, 3, 3)]
)
def test_walk_matches_reference(B, L, V, budget, seed):
    rng = np.random.default_rng(seed)
    tree = dt.build_draft_tree(jnp.asarray(random_draft_logits(seed, B, L, V)), budget, impl="reference")
    tree = tree.with_root_tokens(jnp.asarray(rng.integers(0, V, B)))
    for p_follow in (0.95, 0.5):
        smp = _samples(tree, V, rng, p_follow)
        smp[0, 0] = -1 if p_follow < 0.9 else smp[0, 0]  # an invalid draw at the root is a bonus of -1
        ref = dt.accept_path(tree, jnp.asarray(smp), impl="reference")
        ker = dt.accept_path(tree, jnp.asarray(smp), impl="pallas")
        for f in ("path", "num_accepted", "bonus", "committed"):
            np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)
        for b in range(B):  # and the first-child/next-sibling numpy walk
            path, bonus = walk_first_child(
                np.asarray(tree.tokens[b]), np.asarray(tree.first_child[b]), np.asarray(tree.next_sibling[b]), smp[b]
            )
            n = len(path)
            assert list(np.asarray(ker.path[b, :n])) == path and int(ker.bonus[b]) == bonus


def test_bad_impl():
    tree = dt.build_draft_tree(jnp.zeros((1, 1, 7)), 3)  # the shape of the last case above
    with pytest.raises(ValueError, match="impl"):
        dt.accept_path(tree, jnp.zeros((1, 4), jnp.int32), impl="triton")
