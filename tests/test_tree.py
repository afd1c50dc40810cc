"""build_draft_tree / chain_draft_tree: equality with a heapq builder and structural invariants."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from tests._random_inputs import random_draft_logits
from tests._reference import heapq_draft_tree


def _cases():
    rng = np.random.default_rng(1234)
    cases = [(3, 1, 2, 1), (2, 2, 2, 10), (2, 3, 3, 64), (2, 16, 7, 5), (2, 4, 5000, 512), (4, 15, 300, 256)]
    for _ in range(8):
        cases.append(
            (int(rng.integers(2, 5)), int(rng.integers(1, 17)), int(rng.integers(2, 5001)), int(rng.integers(1, 513)))
        )
    return cases


@pytest.mark.parametrize("B,L,V,budget", _cases())
def test_matches_heapq_builder(B, L, V, budget):
    logits = random_draft_logits(B * 1000 + L * 10 + V + budget, B, L, V)
    tree = dt.build_draft_tree(jnp.asarray(logits), budget)
    logq = np.asarray(dt.draft_logprobs(jnp.asarray(logits)))
    M = budget + 1
    chex.assert_shape(
        [tree.tokens, tree.parents, tree.depth, tree.score, tree.first_child, tree.next_sibling, tree.valid], (B, M)
    )
    chex.assert_shape(tree.ancestor_mask, (B, M, M))
    chex.assert_type([tree.tokens, tree.parents, tree.depth], jnp.int32)
    for b in range(B):
        ref = heapq_draft_tree(logq[b], budget)
        n = len(ref["tokens"])
        np.testing.assert_array_equal(np.asarray(tree.valid[b]), np.arange(M) < n)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:n]), ref["tokens"][1:])
        np.testing.assert_array_equal(np.asarray(tree.parents[b, :n]), ref["parents"])
        np.testing.assert_array_equal(np.asarray(tree.depth[b, :n]), ref["depth"])
        np.testing.assert_array_equal(np.asarray(tree.score[b, :n]), ref["score"])
        check_invariants(jax.tree.map(lambda a, b=b: np.asarray(a[b]), tree), logq[b])


def check_invariants(t, logq):
    """Structural invariants of one request's tree (numpy arrays)."""
    L, V = logq.shape
    M = t.tokens.shape[0]
    valid = t.valid
    n = int(valid.sum())
    assert valid[:n].all() and not valid[n:].any(), "valid nodes are a prefix of the slots"
    assert t.parents[0] == -1 and t.depth[0] == 0 and t.score[0] == 0
    # Unused slots are fully blank.
    for name, blank in [("tokens", -1), ("parents", -1), ("first_child", -1), ("next_sibling", -1), ("depth", 0)]:
        assert (getattr(t, name)[n:] == blank).all(), name
    assert not t.ancestor_mask[n:].any() and not t.ancestor_mask[:, n:].any()
    for i in range(1, n):
        p = t.parents[i]
        assert 0 <= p < i and valid[p], "ancestor closure: parent created first"
        assert t.depth[i] == t.depth[p] + 1 <= L
        assert 0 <= t.tokens[i] < V
        np.testing.assert_allclose(t.score[i], t.score[p] + logq[t.depth[i] - 1, t.tokens[i]], rtol=1e-5, atol=1e-5)
    assert (np.diff(t.score[1:n]) <= 0).all(), "scores non-increasing in creation order"
    # Siblings: distinct tokens, created in descending draft probability.
    for p in range(n):
        kids = [i for i in range(1, n) if t.parents[i] == p]
        toks = [t.tokens[i] for i in kids]
        assert len(set(toks)) == len(toks), "siblings carry distinct tokens"
        if kids:
            lq = logq[t.depth[kids[0]] - 1, toks]
            assert (np.diff(lq) <= 0).all(), "siblings in descending draft probability"
        # first_child / next_sibling enumerate exactly these children, in creation order.
        listed, c = [], t.first_child[p]
        while c >= 0:
            listed.append(int(c))
            c = t.next_sibling[c]
        assert listed == kids
    # ancestor_mask == reflexive transitive closure of the parent relation.
    closure = np.zeros((M, M), bool)
    for i in range(n):
        j = i
        while j >= 0:
            closure[i, j] = True
            j = t.parents[j]
    np.testing.assert_array_equal(t.ancestor_mask, closure)


@pytest.mark.parametrize("L,V,budget", [(1, 2, 5), (2, 2, 100), (3, 3, 1000), (2, 5, 31)])
def test_tree_smaller_than_budget(L, V, budget):
    """Tiny V and L: the tree holds every possible prefix and the rest of the slots are blank."""
    logits = random_draft_logits(7, 2, L, V)
    tree = dt.build_draft_tree(jnp.asarray(logits), budget)
    K = min(budget, V)
    possible = sum(K**d for d in range(1, L + 1))
    assert (np.asarray(tree.valid).sum(axis=1) == 1 + min(budget, possible)).all()
    logq = np.asarray(dt.draft_logprobs(jnp.asarray(logits)))
    for b in range(2):
        check_invariants(jax.tree.map(lambda a, b=b: np.asarray(a[b]), tree), logq[b])


def test_masked_vocabulary_is_never_drafted():
    """Tokens with -inf draft logits are never added, also when the budget is left unfilled."""
    logits = random_draft_logits(3, 3, 3, 50, mask_frac=0.9)
    tree = dt.build_draft_tree(jnp.asarray(logits), 400)
    logq = np.asarray(dt.draft_logprobs(jnp.asarray(logits)))
    for b in range(3):
        t = jax.tree.map(lambda a, b=b: np.asarray(a[b]), tree)
        ref = heapq_draft_tree(logq[b], 400)
        assert int(t.valid.sum()) == len(ref["tokens"]) < 401
        assert np.isfinite(logq[b][t.depth[1 : t.valid.sum()] - 1, t.tokens[1 : t.valid.sum()]]).all()
        check_invariants(t, logq[b])


def test_bf16_and_large_vocab():
    """A Kimi-sized vocabulary (163840) in bf16 works; compare with the heapq builder."""
    logits = jnp.asarray(random_draft_logits(11, 2, 3, 163840)).astype(jnp.bfloat16)
    tree = dt.build_draft_tree(logits, 40)
    logq = np.asarray(dt.draft_logprobs(logits))
    for b in range(2):
        ref = heapq_draft_tree(logq[b], 40)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:]), ref["tokens"][1:])
        np.testing.assert_array_equal(np.asarray(tree.parents[b]), ref["parents"])


def test_budget_1024_depth_32():
    """The documented extremes: budget 1024 and draft length 32."""
    logits = random_draft_logits(5, 2, 32, 97)
    tree = dt.build_draft_tree(jnp.asarray(logits), 1024)
    logq = np.asarray(dt.draft_logprobs(jnp.asarray(logits)))
    ref = heapq_draft_tree(logq[1], 1024)
    np.testing.assert_array_equal(np.asarray(tree.parents[1]), ref["parents"])
    np.testing.assert_array_equal(np.asarray(tree.tokens[1, 1:]), ref["tokens"][1:])
    check_invariants(jax.tree.map(lambda a: np.asarray(a[0]), tree), logq[0])


def test_equal_scores_pop_in_creation_order():
    """Uniform draft distributions make every score tie: the documented FIFO rule decides."""
    logits = np.zeros((1, 3, 4), np.float32)
    tree = dt.build_draft_tree(jnp.asarray(logits), 12)
    ref = heapq_draft_tree(np.asarray(dt.draft_logprobs(jnp.asarray(logits)))[0], 12)
    np.testing.assert_array_equal(np.asarray(tree.parents[0]), ref["parents"])
    np.testing.assert_array_equal(np.asarray(tree.tokens[0, 1:]), ref["tokens"][1:])
    # With all ties, FIFO fills depth 1 (tokens 0..3 in index order) before going deeper.
    np.testing.assert_array_equal(np.asarray(tree.tokens[0, 1:5]), [0, 1, 2, 3])


def test_chain_tree():
    logits = random_draft_logits(9, 3, 6, 40)
    tree = dt.chain_draft_tree(jnp.asarray(logits))
    logq = np.asarray(dt.draft_logprobs(jnp.asarray(logits)))
    chex.assert_shape(tree.tokens, (3, 7))
    assert tree.draft_len == 6
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), logq.argmax(-1))
    for b in range(3):
        t = jax.tree.map(lambda a, b=b: np.asarray(a[b]), tree)
        np.testing.assert_array_equal(t.parents, np.arange(7) - 1)
        check_invariants(t, logq[b])


def test_root_tokens():
    tree = dt.build_draft_tree(jnp.asarray(random_draft_logits(1, 2, 3, 9)), 5).with_root_tokens(jnp.array([7, 8]))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), [7, 8])


@pytest.mark.parametrize(
    "shape,budget,match",
    [
        ((4, 10), 3, r"draft_logits must be \[B, L, V\]"),
        ((1, 2, 3, 4), 3, r"draft_logits must be \[B, L, V\]"),
        ((2, 0, 5), 3, "non-empty"),
        ((2, 3, 5), 0, "budget must be an integer >= 1"),
        ((2, 3, 5), -4, "budget must be an integer >= 1"),
        ((2, 3, 5), 2.5, "budget must be an integer >= 1"),
        ((2, 3, 5), True, "budget must be an integer >= 1"),
    ],
)
def test_bad_inputs(shape, budget, match):
    with pytest.raises(ValueError, match=match):
        dt.build_draft_tree(jnp.zeros(shape), budget)


def test_integer_logits_rejected():
    with pytest.raises(ValueError, match="floating point"):
        dt.build_draft_tree(jnp.zeros((1, 2, 3), jnp.int32), 2)
    with pytest.raises(ValueError, match="floating point"):
        dt.chain_draft_tree(jnp.zeros((1, 2, 3), jnp.int32))


def test_ancestor_mask_doubling_equals_pointer_walk():
    """Pointer doubling (bench alternative) == following parents L times, on random trees of every
    depth up to L (a chain among them) with invalid slots."""
    from ddtree_jax.tree import ancestor_mask_doubling, ancestor_mask_from_parents

    rng = np.random.default_rng(0)
    B, M, L = 6, 64, 15
    parents = np.full((B, M), -1, np.int32)
    depth = np.zeros((B, M), np.int32)
    for b in range(B):
        for i in range(1, M):
            p = i - 1 if b == 0 else int(rng.integers(0, i))  # row 0: a chain, cut at depth L
            while depth[b, p] >= L:
                p = parents[b, p]
            parents[b, i], depth[b, i] = p, depth[b, p] + 1
    valid = rng.random((B, M)) < 0.9
    valid[:, 0] = True
    parents[~valid] = -1
    args = (jnp.asarray(parents), jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(ancestor_mask_doubling(*args, L)),
                                  np.asarray(ancestor_mask_from_parents(*args, L)))


@pytest.mark.parametrize("budget", [1, 9])
def test_a_tree_of_budget_b_needs_only_the_first_b_depths(budget):
    """The round drafts only ``min(L, budget)`` depths: the best-first tree built from them is the
    tree built from all ``L`` (a tree of ``b`` nodes is at most ``b`` deep), field for field."""
    logits = jnp.asarray(random_draft_logits(budget, 3, 12, 50))
    for impl in ("reference", "pallas"):
        full = dt.build_draft_tree(logits, budget, impl=impl)
        cut = dt.build_draft_tree(logits[:, :budget], budget, impl=impl)
        for f in ("tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"):
            np.testing.assert_array_equal(np.asarray(getattr(cut, f)), np.asarray(getattr(full, f)), err_msg=f)
        assert int(full.depth.max()) <= budget
