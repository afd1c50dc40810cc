"""Draft trees: DDTree's best-first builder, the linear DFlash chain, and their encoding.

A ``DraftTree`` holds, per request, ``budget + 1`` node slots; node 0 is the root (the last
committed token, which the drafter did not propose), nodes ``1..budget`` are draft tokens in the
order the builder created them. Unused slots (a tree with fewer possible nodes than the budget)
have ``valid == False``, ``tokens == parents == first_child == next_sibling == -1``,
``depth == 0`` and ``score == -inf``.

DDTree (Ringel & Romano, arXiv 2604.12989) picks the ``budget`` most probable prefixes under the
product of the drafter's per-depth marginals by a best-first search over path scores
``sum_j log q_j(token_j)``. Details that are our decisions:

* Equal scores are popped in creation order (first pushed, first popped), where a pop pushes
  the new node's next sibling before its first child.
* A token whose draft log-probability is ``-inf`` (or NaN) is never added: it has no draft
  mass. So a drafter row of NaNs contributes no nodes at that depth; exactness of verification
  does not depend on which tree is verified.
* The sibling of a node is scored as ``score(parent) + log q_d(next rank)`` and a child as
  ``score(node) + log q_{d+1}(top token)``: one float32 addition each, so a plain implementation
  reproduces the scores bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from ddtree_jax.backend import Backend, has_kernel, kernel_module, resolve_backend
from ddtree_jax.topk import exact_top_k
from pallas_kernels._shared import xla_log_sum_exp

__all__ = ["DraftTree", "ancestor_mask_from_parents", "build_draft_tree", "chain_draft_tree", "draft_logprobs",
           "root_only_tree"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"],
    meta_fields=["draft_len"],
)
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, ``M = budget + 1`` node slots each (node 0 = root).

    Attributes:
      tokens: i32 ``[B, M]`` draft token per node (root: the given root token, else -1).
      parents: i32 ``[B, M]`` parent node index; -1 for the root and unused slots.
      depth: i32 ``[B, M]`` root 0, its children 1, ...; verify positions are ``start + depth``.
      score: f32 ``[B, M]`` path log-probability under the draft marginals (root 0).
      first_child: i32 ``[B, M]`` first child (most probable), -1 if none.
      next_sibling: i32 ``[B, M]`` next less probable sibling, -1 if none.
      valid: bool ``[B, M]``.
      ancestor_mask: bool ``[B, M, M]``: ``[b, i, j]`` iff j is i or an ancestor of i (the verify
        attention mask within the block).
      draft_len: static int L, the deepest depth the tree may have (the path length bound).
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    score: jax.Array
    first_child: jax.Array
    next_sibling: jax.Array
    valid: jax.Array
    ancestor_mask: jax.Array
    draft_len: int

    @property
    def num_nodes(self) -> int:
        """M = budget + 1 node slots."""
        return self.tokens.shape[-1]

    def with_root_tokens(self, root_tokens: jax.Array) -> DraftTree:
        """Returns the tree with ``tokens[:, 0]`` set to the last committed token of each request."""
        return dataclasses.replace(self, tokens=self.tokens.at[:, 0].set(root_tokens.astype(jnp.int32)))

    def prefix(self, num_nodes: int) -> DraftTree:
        """The tree of the first ``num_nodes`` slots (root included; static), links to later
        slots cut. For a best-first tree (``build_draft_tree``: nodes in creation order, every
        parent and earlier sibling before its node) this is the tree a build with budget
        ``num_nodes - 1`` gives; ``draft_len`` is kept (the commit's path width)."""
        n = num_nodes
        cut = lambda links: jnp.where(links < n, links, -1)
        return dataclasses.replace(
            self, tokens=self.tokens[:, :n], parents=self.parents[:, :n], depth=self.depth[:, :n],
            score=self.score[:, :n], first_child=cut(self.first_child[:, :n]),
            next_sibling=cut(self.next_sibling[:, :n]), valid=self.valid[:, :n],
            ancestor_mask=self.ancestor_mask[:, :n, :n])


def draft_logprobs(draft_logits: jax.Array) -> jax.Array:
    """``[B, L, V]`` logits -> float32 log-probabilities per depth: ``(x - m) - lse``, as
    ``jax.nn.log_softmax`` computes it, but with the normaliser summed in a fixed order
    (``pallas_kernels._shared.xla_log_sum_exp``), so that the kernels' tables reproduce these
    values bit for bit on any backend (within an ulp of ``jax.nn.log_softmax``)."""
    x = draft_logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    return (x - m) - xla_log_sum_exp(x, m.reshape(-1)).reshape(m.shape)


def _check_draft_logits(draft_logits) -> jax.Array:
    draft_logits = jnp.asarray(draft_logits)
    if draft_logits.ndim != 3:
        raise ValueError(f"draft_logits must be [B, L, V] (batch, depth, vocab), got shape {draft_logits.shape}")
    if not jnp.issubdtype(draft_logits.dtype, jnp.floating):
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    if 0 in draft_logits.shape:
        raise ValueError(f"draft_logits must have non-empty B, L and V, got shape {draft_logits.shape}")
    return draft_logits


def build_draft_tree(draft_logits: jax.Array, budget: int, *, impl: str | Backend = "auto") -> DraftTree:
    """DDTree: the ``budget`` best prefixes under the drafter's per-depth marginals.

    Args:
      draft_logits: ``[B, L, V]``, the drafter's logits for depths 1..L.
      budget: number of non-root nodes N (>= 1). Trees with fewer possible nodes than N
        (tiny V and L) fill the rest with invalid slots.
      impl: "auto" (the Pallas builder on GPU and TPU, the plain-JAX loop elsewhere), "pallas"
        (the platform's kernel; the Triton one in interpret mode off GPU/TPU), "pallas:triton" /
        "pallas:mosaic_tpu", "reference", or a resolved ``Backend`` (``ddtree_jax.backend``).
        All give identical trees.

    Returns:
      ``DraftTree`` with ``budget + 1`` slots; nodes in creation order, so scores are
      non-increasing and siblings appear in descending draft probability.
    """
    backend = resolve_backend(impl)
    draft_logits = _check_draft_logits(draft_logits)
    if not isinstance(budget, numbers.Integral) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    return _build_draft_tree(draft_logits, int(budget), backend)


def _build_draft_tree(draft_logits: jax.Array, budget: int, backend: Backend) -> DraftTree:
    """``build_draft_tree`` on validated inputs (traceable: the decode round calls it)."""
    if backend.kernels:
        L, V = draft_logits.shape[1:]
        if kernel_module(backend, "tree_builder").supports(budget, L, min(budget, V)):
            return _build_with_kernel(draft_logits, budget, backend)
    return _build_reference(draft_logits, budget)


@functools.partial(jax.jit, static_argnames=("budget", "backend"))
def _build_with_kernel(draft_logits: jax.Array, budget: int, backend: Backend) -> DraftTree:
    L, V = draft_logits.shape[1:]
    top_lq, top_ids = _top_k_tables(draft_logits, min(budget, V), backend)
    return _tree_from_tables(top_lq, top_ids, budget, backend)


def _tree_from_tables(top_lq: jax.Array, top_ids: jax.Array, budget: int, backend: Backend) -> DraftTree:
    """The kernel path after the per-depth top-k: the family's pop loop on ``[B, L, K]`` tables,
    then the ancestor mask (``bench/bench_tree_gpu.py`` calls it with other top-k tables)."""
    L = top_lq.shape[1]
    tok, par, dep, sc, fc, ns, valid = kernel_module(backend, "tree_builder").build_tree(
        top_lq, top_ids.astype(jnp.int32), budget=budget, interpret=backend.interpret)
    return DraftTree(tokens=tok, parents=par, depth=dep, score=sc, first_child=fc, next_sibling=ns, valid=valid,
                     ancestor_mask=ancestor_mask_doubling(par, valid, L), draft_len=L)


def _topk_lse(backend: Backend) -> str:
    """Where the kernel path's log-softmax normaliser comes from (``vocab_top_k`` of either
    family): compiled, ``"kernel"`` fuses it into the top-k's one pass over the logits (its scores
    can differ from the reference build's by the float32 rounding of the normaliser, about an ulp,
    and so its trees at near-ties); interpreted, ``"xla"`` computes it with the reference's
    expression (one more read of the logits), so that the tables and trees equal the reference
    build's bit for bit, which the CPU tests compare. Design note: docs/kernels.md, "Tree builder"."""
    return "xla" if backend.interpret else "kernel"


def _top_k_tables(draft_logits: jax.Array, k: int, backend: Backend):
    """Per-depth top-k of the draft log-probabilities, ``lax.top_k``'s order: the family's
    ``vocab_top_k`` kernel where it has one (Triton and Mosaic TPU both do), else ``exact_top_k`` in
    plain JAX."""
    if has_kernel(backend, "vocab_top_k"):
        return kernel_module(backend, "vocab_top_k").vocab_top_k(
            draft_logits, k, lse=_topk_lse(backend), interpret=backend.interpret)
    return exact_top_k(draft_logprobs(draft_logits), k)


@functools.partial(jax.jit, static_argnames=("budget",))
def _build_reference(draft_logits: jax.Array, budget: int) -> DraftTree:
    L, V = draft_logits.shape[1:]
    top_lq, top_ids = jax.lax.top_k(draft_logprobs(draft_logits), min(budget, V))  # [B, L, K]
    # Without the barrier XLA (CPU) fuses the log-softmax/top-k producer into the pop loop's
    # gathers and recomputes it per pop: 40x slower at V = 163840 (bench/bench_tree.py).
    # One array per barrier: a tuple barrier trips XLA's SPMD partitioner (sharded callers).
    top_lq = jax.lax.optimization_barrier(top_lq)
    top_ids = jax.lax.optimization_barrier(top_ids)
    fields = jax.vmap(functools.partial(_best_first_one, budget=budget))(top_lq, top_ids.astype(jnp.int32))
    return DraftTree(**fields, ancestor_mask=ancestor_mask_from_parents(fields["parents"], fields["valid"], L),
                     draft_len=L)


def ancestor_mask_from_parents(parents: jax.Array, valid: jax.Array, draft_len: int) -> jax.Array:
    """``[B, M]`` parent pointers -> ``[B, M, M]`` reflexive ancestor mask (``[b, i, j]`` iff j is i
    or an ancestor of i; invalid rows all False), by following the pointers ``draft_len`` times."""
    B, M = parents.shape
    idx = jnp.arange(M, dtype=jnp.int32)
    cur = jnp.broadcast_to(idx, (B, M))
    mask = cur[..., None] == idx
    for _ in range(draft_len):
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
        mask = mask | (cur[..., None] == idx)
    return mask & valid[..., None]


def ancestor_mask_doubling(parents: jax.Array, valid: jax.Array, draft_len: int) -> jax.Array:
    """``ancestor_mask_from_parents`` by pointer doubling: after step s each row holds its
    ancestors at distances ``< 2**s`` and ``up`` the ``2**s``-th ancestor, so ``ceil(log2(L + 1))``
    row gathers (4 at L = 15) instead of L pointer steps. Equal to it whenever depths are ``<= L``
    (every tree the builders make); bench/bench_tree_gpu.py times both."""
    B, M = parents.shape
    idx = jnp.arange(M, dtype=jnp.int32)
    mask = jnp.broadcast_to(idx[:, None] == idx, (B, M, M))
    up = parents
    for _ in range(max(0, int(draft_len)).bit_length()):
        ok = up >= 0
        safe = jnp.maximum(up, 0)
        mask = mask | (mask[jnp.arange(B)[:, None], safe] & ok[..., None])
        up = jnp.where(ok, jnp.take_along_axis(up, safe, axis=1), -1)
    return mask & valid[..., None]


def _best_first_one(top_lq: jax.Array, top_ids: jax.Array, budget: int) -> dict:
    """Best-first build for one request: a fixed loop of ``budget`` pops over a frontier array.

    The frontier never holds more than ``budget + 1`` entries (each pop removes one and adds at
    most two), so fixed shapes suffice.
    """
    L, K = top_lq.shape
    N, M = budget, budget + 1
    neg1 = jnp.full((M,), -1, jnp.int32)

    def push(f, slot, score, parent, depth, rank, prev, order, ok):
        row = dict(live=ok, score=score, parent=parent, depth=depth, rank=rank, prev=prev, order=order)
        return {k: f[k].at[slot].set(jnp.where(ok, v, f[k][slot])) for k, v in row.items()}

    frontier = dict(
        live=jnp.zeros((M,), bool).at[0].set(top_lq[0, 0] > -jnp.inf),
        score=jnp.full((M,), -jnp.inf, jnp.float32).at[0].set(top_lq[0, 0]),
        parent=jnp.zeros((M,), jnp.int32),
        depth=jnp.ones((M,), jnp.int32),
        rank=jnp.zeros((M,), jnp.int32),
        prev=neg1,
        order=jnp.zeros((M,), jnp.int32),
    )
    nodes = dict(
        tokens=neg1,
        parents=neg1,
        depth=jnp.zeros((M,), jnp.int32),
        score=jnp.full((M,), -jnp.inf, jnp.float32).at[0].set(0.0),
        first_child=neg1,
        next_sibling=neg1,
        valid=jnp.zeros((M,), bool).at[0].set(True),
    )

    def pop(i, carry):
        f, nd, counter = carry
        # Max score; among equal scores the earliest-created entry.
        best_score = jnp.max(jnp.where(f["live"], f["score"], -jnp.inf))
        tied = f["live"] & (f["score"] == best_score)
        slot = jnp.argmin(jnp.where(tied, f["order"], jnp.iinfo(jnp.int32).max))
        ok = jnp.any(f["live"])
        s, p, d, r, prev = f["score"][slot], f["parent"][slot], f["depth"][slot], f["rank"][slot], f["prev"][slot]

        def set_if(arr, idx, val):
            return arr.at[jnp.where(ok, idx, M)].set(val, mode="drop")

        nd = dict(
            tokens=set_if(nd["tokens"], i, top_ids[d - 1, r]),
            parents=set_if(nd["parents"], i, p),
            depth=set_if(nd["depth"], i, d),
            score=set_if(nd["score"], i, s),
            first_child=set_if(nd["first_child"], jnp.where(prev < 0, p, M), i),
            next_sibling=set_if(nd["next_sibling"], jnp.where(prev >= 0, prev, M), i),
            valid=set_if(nd["valid"], i, True),
        )
        f = dict(f, live=f["live"].at[slot].set(False))
        # Next sibling (same parent and depth, next rank) goes into the freed slot.
        r1 = jnp.minimum(r + 1, K - 1)
        sib_lq = top_lq[d - 1, r1]
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        f = push(f, slot, nd["score"][p] + sib_lq, p, d, r1, i, counter, sib_ok)
        counter = counter + sib_ok
        # First child (the top token one depth deeper) into the first free slot.
        d1 = jnp.minimum(d, L - 1)
        child_lq = top_lq[d1, 0]
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        f = push(f, jnp.argmin(f["live"]), s + child_lq, i, d + 1, 0, -1, counter, child_ok)
        counter = counter + child_ok
        return f, nd, counter

    _, nodes, _ = jax.lax.fori_loop(1, N + 1, pop, (frontier, nodes, jnp.int32(1)))
    return nodes


def chain_draft_tree(draft_logits: jax.Array) -> DraftTree:
    """Linear DFlash: the chain of per-depth argmax tokens, as a ``DraftTree`` with L + 1 slots."""
    return _chain_draft_tree(_check_draft_logits(draft_logits))


@jax.jit
def _chain_draft_tree(draft_logits: jax.Array) -> DraftTree:
    B, L, _ = draft_logits.shape
    lq = draft_logprobs(draft_logits)
    ids = jnp.argmax(lq, axis=-1).astype(jnp.int32)  # [B, L]
    step = jnp.take_along_axis(lq, ids[..., None], axis=-1)[..., 0]
    idx = jnp.arange(L + 1, dtype=jnp.int32)
    bcast = lambda a: jnp.broadcast_to(a, (B, L + 1))
    return DraftTree(
        tokens=jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), ids], axis=1),
        parents=bcast(idx - 1),
        depth=bcast(idx),
        score=jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.cumsum(step, axis=1)], axis=1),
        first_child=bcast(jnp.where(idx < L, idx + 1, -1)),
        next_sibling=jnp.full((B, L + 1), -1, jnp.int32),
        valid=jnp.ones((B, L + 1), bool),
        ancestor_mask=ancestor_mask_from_parents(bcast(idx - 1), jnp.ones((B, L + 1), bool), L),
        draft_len=L,
    )


def root_only_tree(batch: int) -> DraftTree:
    """The tree of autoregressive decoding: just the root (one verify token per request)."""
    neg1 = jnp.full((batch, 1), -1, jnp.int32)
    return DraftTree(
        tokens=neg1, parents=neg1, depth=jnp.zeros((batch, 1), jnp.int32), score=jnp.zeros((batch, 1), jnp.float32),
        first_child=neg1, next_sibling=neg1, valid=jnp.ones((batch, 1), bool),
        ancestor_mask=jnp.ones((batch, 1, 1), bool), draft_len=0,
    )
