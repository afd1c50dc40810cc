"""Exactness by statistics: sample_tree_nodes + accept_path reproduce the target's own law.

Set-up: a small vocabulary (V = 5), a DDTree of 8 nodes (L = 3) built from random draft logits,
and explicit random target logits at every node, correlated with the drafter so that paths of
every length occur. The exact law of the committed sequence (accepted drafts + bonus) is
enumerated in closed form from the numpy reference pipeline (tests/_reference.py). Each
configuration draws N = 100,000 independent rounds and runs a chi-square goodness-of-fit test
(bins with expected count < 5 pooled). Pass: p > 1e-4. Any outcome outside the exact law's
support (a removed token emitted or accepted) fails outright. Seeds are fixed, so a run is
reproducible; with a correct sampler a failure at 1e-4 would be a 1-in-10,000 event per
configuration.

Negative controls (each must be REJECTED, p < 1e-6, by the same test at the same N): filtering
only after the acceptance step, drawing the bonus independently of the walk's draw (the
residual bug), and ignoring the filters altogether.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from tests._reference import chisquare_pvalue, committed_law, filtered_probs

V, L, BUDGET = 5, 3, 8
N_SAMPLES = 100_000
PASS_P, REJECT_P = 1e-4, 1e-6

CONFIGS = [
    dict(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product([0.5, 1.0, 1.7], [0, 2], [1.0, 0.7], [0.0, 0.2])
]


def make_problem(seed, budget=BUDGET):
    """One random tree (as a batch of 1) and target logits ``[M, V]`` at its nodes."""
    rng = np.random.default_rng(seed)
    draft = (rng.standard_normal((1, L, V)) * 1.5).astype(np.float32)
    tree = dt.build_draft_tree(jnp.asarray(draft), budget)
    depth = np.asarray(tree.depth[0])
    # The target at a node of depth d resembles the drafter at depth d + 1 (plus noise).
    target = (
        np.where((depth < L)[:, None], draft[0][np.minimum(depth, L - 1)], 0.0)
        + rng.standard_normal((budget + 1, V)) * 0.7
    )
    return tree, target.astype(np.float32)


def tile(tree, n):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape[1:]), tree)


def encode(committed: np.ndarray) -> np.ndarray:
    """Each committed row (tokens then -1 padding) as one integer, base V + 1."""
    digits = np.where(committed >= 0, committed + 1, 0).astype(np.int64)
    return (digits * (V + 1) ** np.arange(committed.shape[1])).sum(axis=1)


def law_pvalue(committed: np.ndarray, law: dict) -> float:
    """Chi-square p-value of the committed rows against the exact law; 0 if any row lies
    outside the law's support."""
    n = committed.shape[0]
    keys = encode(np.array([list(seq) + [-1] * (L + 1 - len(seq)) for seq in law]))
    probs = np.array(list(law.values()))
    codes, counts = np.unique(encode(committed), return_counts=True)
    if not np.isin(codes, keys).all():
        return 0.0
    index = {k: i for i, k in enumerate(keys)}
    observed = np.zeros(len(keys))
    for c, k in zip(codes, counts, strict=False):
        observed[index[c]] = k
    return chisquare_pvalue(observed, probs * n)


def exact_law(tree, target, params):
    probs = np.stack([filtered_probs(target[m], **params) for m in range(target.shape[0])])
    t = jax.tree.map(lambda a: np.asarray(a[0]), tree)
    return committed_law(t.tokens, t.parents, t.valid, probs)


def draw(tree, target, params, key, n=N_SAMPLES, impl="auto"):
    node_logits = jnp.broadcast_to(jnp.asarray(target), (n,) + target.shape)
    samples = dt.sample_tree_nodes(node_logits, dt.SamplingParams(**params), key, impl=impl)
    return dt.accept_path(tile(tree, n), samples, impl=impl), node_logits


@pytest.mark.parametrize(
    "cfg_index", range(len(CONFIGS)), ids=lambda i: "T{temperature}-k{top_k}-p{top_p}-m{min_p}".format(**CONFIGS[i])
)
def test_committed_law_is_exact(cfg_index):
    params = CONFIGS[cfg_index]
    tree, target = make_problem(100 + cfg_index)
    res, _ = draw(tree, target, params, jax.random.key(cfg_index))
    committed = np.asarray(res.committed)
    assert np.asarray(res.num_accepted).max() >= 2, "paths of several accepted tokens must occur"
    p = law_pvalue(committed, exact_law(tree, target, params))
    assert p > PASS_P, f"chi-square p = {p:.3g} for {params}"


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1.0, top_k=3, top_p=0.8, min_p=0.1), dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.3)],
    ids=["k3-p0.8", "T0.7-m0.3"],
)
def test_committed_law_is_exact_with_the_kernels(params):
    """The Pallas sampler and walk (interpret mode here) through the same test: N = 2,500 rounds
    of a 5-node tree (interpret mode runs each row as a program, hence the smaller N), two
    settings in which top-k and top-p, then temperature and min-p, change the law; pass at
    p > 1e-4. (Power at this N, measured with the reference sampler on this tree, 5 seeds each:
    the laws of temperature x 1.25, of top-k off and of top-p off (first setting), of temperature
    x 1.25 and of min-p off (second setting) give p = 0 in floating point in every seed; the
    true laws gave p = 0.35-0.96.)"""
    tree, target = make_problem(5, budget=4)
    res, _ = draw(tree, target, params, jax.random.key(5), n=2_500, impl="pallas")
    assert np.asarray(res.num_accepted).max() >= 2
    p = law_pvalue(np.asarray(res.committed), exact_law(tree, target, params))
    assert p > PASS_P, f"chi-square p = {p:.3g} with the kernels"


def test_mixed_settings_in_one_batch():
    """Four settings (one greedy) share one batch; each row follows its own law."""
    tree, target = make_problem(7)
    settings = [CONFIGS[0], CONFIGS[13], CONFIGS[23], dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)]
    n = 25_000
    params = [dt.SamplingParams(**s) for s in settings for _ in range(n)]
    node_logits = jnp.broadcast_to(jnp.asarray(target), (4 * n,) + target.shape)
    res = dt.accept_path(tile(tree, 4 * n), dt.sample_tree_nodes(node_logits, params, jax.random.key(3)))
    committed = np.asarray(res.committed)
    for i, s in enumerate(settings):
        p = law_pvalue(committed[i * n : (i + 1) * n], exact_law(tree, target, s))
        assert p > PASS_P, f"chi-square p = {p:.3g} for {s} in a mixed batch"


# --- negative controls: broken samplers the same test must reject ---------------------------

FILTERED = [dict(temperature=1.0, top_k=2, top_p=0.7, min_p=0.2), dict(temperature=0.5, top_k=0, top_p=0.7, min_p=0.0)]
UNFILTERED = dict(top_k=0, top_p=1.0, min_p=0.0)


def _bonus_replaced(res, node_logits, params, key):
    """Commits the walk's accepted tokens, then a fresh draw at the last accepted node."""
    fresh = np.asarray(dt.sample_tree_nodes(node_logits, dt.SamplingParams(**params), key))
    committed = np.asarray(res.committed).copy()
    rows = np.arange(committed.shape[0])
    last = np.asarray(res.path)[rows, np.asarray(res.num_accepted)]
    committed[rows, np.asarray(res.num_accepted)] = fresh[rows, last]
    return committed


@pytest.mark.parametrize("params", FILTERED, ids=["k2-p0.7-m0.2", "T0.5-p0.7"])
@pytest.mark.parametrize("control", ["filter_after_acceptance", "independent_bonus", "no_filter"])
def test_negative_controls_are_rejected(params, control):
    tree, target = make_problem(11)
    law = exact_law(tree, target, params)
    if control == "filter_after_acceptance":
        # Accept children with the unfiltered law; apply the filters only to the emitted bonus.
        res, node_logits = draw(tree, target, {**params, **UNFILTERED}, jax.random.key(1))
        committed = _bonus_replaced(res, node_logits, params, jax.random.key(2))
    elif control == "independent_bonus":
        # Correct acceptance, but the bonus is a second draw from q (not q without the children).
        res, node_logits = draw(tree, target, params, jax.random.key(1))
        committed = _bonus_replaced(res, node_logits, params, jax.random.key(2))
    else:
        res, _ = draw(tree, target, {**params, **UNFILTERED}, jax.random.key(1))
        committed = np.asarray(res.committed)
    p = law_pvalue(committed, law)
    assert p < REJECT_P, f"the {control} control was not rejected (p = {p:.3g})"
