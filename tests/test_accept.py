"""accept_path: the walk against a first-child/next-sibling walk, greedy, shapes and errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from tests._random_inputs import random_draft_logits
from tests._reference import walk_first_child


def _check_against_reference_walk(tree, samples):
    res = dt.accept_path(tree, jnp.asarray(samples))
    B, M = samples.shape
    L = tree.draft_len
    chex.assert_shape([res.path, res.committed], (B, L + 1))
    chex.assert_shape([res.num_accepted, res.bonus], (B,))
    chex.assert_type([res.path, res.committed, res.num_accepted, res.bonus], jnp.int32)
    t = jax.tree.map(np.asarray, tree)
    for b in range(B):
        path, bonus = walk_first_child(t.tokens[b], t.first_child[b], t.next_sibling[b], samples[b])
        n = len(path) - 1
        assert int(res.num_accepted[b]) == n and int(res.bonus[b]) == bonus
        np.testing.assert_array_equal(np.asarray(res.path[b]), path + [-1] * (L - n))
        np.testing.assert_array_equal(
            np.asarray(res.committed[b]), [int(t.tokens[b, i]) for i in path[1:]] + [bonus] + [-1] * (L - n)
        )
    return res


@pytest.mark.parametrize("B,L,V,budget", [(6, 4, 3, 20), (5, 7, 6, 40), (3, 15, 50, 255), (4, 2, 2, 100)])
def test_walk_matches_first_child_walk(B, L, V, budget):
    rng = np.random.default_rng(B + L + V)
    tree = dt.build_draft_tree(jnp.asarray(random_draft_logits(rng.integers(1 << 30), B, L, V)), budget)
    # Samples that often match a child: each node's draw is a child token with prob. 0.95.
    t = jax.tree.map(np.asarray, tree)
    samples = rng.integers(0, V, size=(B, budget + 1))
    for b in range(B):
        for n in range(budget + 1):
            kids = t.tokens[b][(t.parents[b] == n) & t.valid[b]]
            if len(kids) and rng.random() < 0.95:
                samples[b, n] = rng.choice(kids)
    res = _check_against_reference_walk(tree, samples.astype(np.int32))
    assert int(res.num_accepted.max()) >= 2, "the test should exercise deep paths"


def test_greedy_accepts_the_longest_argmax_path():
    rng = np.random.default_rng(0)
    B, L, V, budget = 8, 5, 4, 60
    tree = dt.build_draft_tree(jnp.asarray(random_draft_logits(1, B, L, V)), budget)
    node_logits = jnp.asarray(rng.standard_normal((B, budget + 1, V)).astype(np.float32))
    samples = dt.sample_tree_nodes(node_logits, dt.SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(samples), np.asarray(node_logits).argmax(-1))
    res = _check_against_reference_walk(tree, np.asarray(samples))
    # The walk stops exactly where the argmax is not a child token.
    t = jax.tree.map(np.asarray, tree)
    for b in range(B):
        last = int(res.path[b, res.num_accepted[b]])
        kids = t.tokens[b][(t.parents[b] == last) & t.valid[b]]
        assert int(res.bonus[b]) not in kids.tolist()


def test_chain_tree_walk():
    B, L = 3, 6
    tree = dt.chain_draft_tree(jnp.asarray(random_draft_logits(4, B, L, 9)))
    t = np.asarray(tree.tokens)
    samples = np.full((B, L + 1), 8, np.int32)
    samples[0, :-1] = t[0, 1:]  # row 0: the target agrees with every draft: L accepted + bonus
    samples[1, :2] = t[1, 1:3]  # row 1: two accepted, then a token that is not the next draft
    samples[1, 2] = (t[1, 3] + 1) % 9
    res = _check_against_reference_walk(tree, samples)
    np.testing.assert_array_equal(np.asarray(res.num_accepted[:2]), [L, 2])


def test_invalid_sample_ends_the_walk():
    """An INVALID_TOKEN draw (invalid target logits) is never accepted and becomes the bonus."""
    tree = dt.chain_draft_tree(jnp.asarray(random_draft_logits(4, 1, 3, 9)))
    samples = np.asarray(tree.tokens).copy()
    samples[0, :-1] = samples[0, 1:]
    samples[0, 1] = dt.INVALID_TOKEN
    res = dt.accept_path(tree, jnp.asarray(samples))
    assert int(res.num_accepted[0]) == 1 and int(res.bonus[0]) == dt.INVALID_TOKEN


def test_bad_inputs():
    tree = dt.build_draft_tree(jnp.zeros((2, 3, 5)), 4)
    with pytest.raises(ValueError, match=r"node_samples must have the tree's shape"):
        dt.accept_path(tree, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer token ids"):
        dt.accept_path(tree, jnp.zeros((2, 5), jnp.float32))
    with pytest.raises(TypeError, match="DraftTree"):
        dt.accept_path({"tokens": 1}, jnp.zeros((2, 5), jnp.int32))
