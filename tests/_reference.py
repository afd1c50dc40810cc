"""Plain numpy references, written for obviousness, not speed (small V only)."""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The canonical pipeline on one row, with the tie rules stated in ddtree_jax.sampling.

    O(V^2) pairwise comparisons instead of sorts, so it shares no code path with the library.
    """
    x = np.asarray(logits, np.float64)
    V = x.shape[0]
    if np.float32(temperature) < np.float32(1e-5):  # the library's GREEDY_BELOW rule, restated
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0  # numpy argmax: lowest index on ties
        return out
    z = (x - x.max()) / temperature
    keep = np.isfinite(z)
    if 0 < top_k < V:
        n_greater = (z[None, :] > z[:, None]).sum(axis=1)  # entries strictly above z_v
        keep &= n_greater < top_k  # z_v >= k-th largest  <=>  fewer than k entries above it
    q = np.where(keep, np.exp(z), 0.0)
    q /= q.sum()
    if top_p < 1.0:
        mass_above = np.array([q[q > q[v]].sum() for v in range(V)])
        keep &= mass_above < top_p
    if min_p > 0:
        keep &= q >= min_p * q.max()
    out = np.where(keep, np.exp(z), 0.0)
    return out / out.sum()


def heapq_draft_tree(logq: np.ndarray, budget: int) -> dict:
    """DDTree best-first build for one request with Python's heapq.

    ``logq``: float32 ``[L, V]`` log-probabilities. Ties in score pop in push order, a pop
    pushes the sibling before the child, and -inf entries are never pushed (the library's
    documented rules). Returns lists of node tokens/parents/depths/scores, root first.
    """
    L, V = logq.shape
    K = min(budget, V)
    ranked = np.argsort(-logq, axis=1, kind="stable")[:, :K]
    top = np.take_along_axis(logq, ranked, axis=1).astype(np.float32)
    tokens, parents, depth, score = [-1], [-1], [0], [np.float32(0.0)]
    heap, counter = [], itertools.count()

    def push(s, parent, d, r):
        heapq.heappush(heap, (-float(s), next(counter), s, parent, d, r))

    if top[0, 0] > -np.inf:
        push(np.float32(score[0] + top[0, 0]), 0, 1, 0)
    while heap and len(tokens) <= budget:
        _, _, s, parent, d, r = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ranked[d - 1, r]))
        parents.append(parent)
        depth.append(d)
        score.append(s)
        if r + 1 < K and top[d - 1, r + 1] > -np.inf:
            push(np.float32(score[parent] + top[d - 1, r + 1]), parent, d, r + 1)
        if d < L and top[d, 0] > -np.inf:
            push(np.float32(s + top[d, 0]), node, d + 1, 0)
    return dict(tokens=tokens, parents=parents, depth=depth, score=np.array(score, np.float32))


def walk_first_child(tokens, first_child, next_sibling, samples) -> tuple[list[int], int]:
    """Sample-then-walk through first-child/next-sibling lists: (path of node ids, bonus)."""
    path, cur = [0], 0
    while True:
        child = first_child[cur]
        while child >= 0 and tokens[child] != samples[cur]:
            child = next_sibling[child]
        if child < 0:
            return path, int(samples[cur])
        path.append(int(child))
        cur = child


def committed_law(tokens, parents, valid, probs: np.ndarray) -> dict[tuple[int, ...], float]:
    """Exact law of the committed sequence (accepted drafts + bonus) for one tree.

    ``probs[n]`` is the target's filtered distribution at node n. Enumerates every outcome.
    """
    M, V = probs.shape
    children = {n: {} for n in range(M)}
    for n in range(1, M):
        if valid[n]:
            children[int(parents[n])][int(tokens[n])] = n
    law: dict[tuple[int, ...], float] = {}

    def rec(node, prefix, pr):
        for v in range(V):
            pv = probs[node, v]
            if pv == 0:
                continue
            if v in children[node]:
                rec(children[node][v], prefix + (v,), pr * pv)
            else:
                law[prefix + (v,)] = law.get(prefix + (v,), 0.0) + pr * pv

    rec(0, (), 1.0)
    return law


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value; bins with expected count < 5 are pooled into one.

    A single remaining bin (a point mass) returns 1.0: nothing to test beyond the support,
    which callers check separately.
    """
    from scipy import stats

    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(expected) == 1:
        return 1.0
    expected = expected * observed.sum() / expected.sum()  # guard against float drift in the law's sum
    return float(stats.chisquare(observed, expected).pvalue)
