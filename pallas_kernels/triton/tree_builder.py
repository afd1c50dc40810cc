"""On-device DDTree best-first pop loop: the whole loop in ONE Pallas program per request.

Contract (the plain-JAX reference is ``ddtree_jax.tree.build_draft_tree(impl="reference")``; the
tests compare both on random inputs): given each depth's top-K draft log-probabilities (sorted
descending) and their token ids, pop ``budget`` nodes best first. Equal scores pop in creation
order (first pushed, first popped), a pop pushes the new node's next sibling before its first
child, ``-inf``/NaN entries are never pushed, and scores are single float32 additions
(sibling = score(parent) + lq[d, r+1], child = score(node) + lq[d+1, 0]), so the reference
reproduces them bit for bit.

How: the kernel keeps the frontier (``budget + 1`` slots) and the node arrays as loop-carried
register vectors, updated with one-hot ``where`` (no dynamic scatters, no launch per node). The
loop is a chain of dependent reductions, so their number per pop sets its time; this version
does 5 per pop (max score; min of ``order * Mp + slot`` among the tied, which gives the FIFO
tie-break and the slot at once; three one-hot gathers of packed ``parent|depth``,
``rank|prev+1`` and the parent's score) plus 3 independent scalar loads from the ``[L, K]``
table (token, sibling and child log-probs), and finds the child's frontier slot without a
search. An earlier version with ~17 reductions per pop measured 407 us at B=16, N=256, L=15 on
the H200 (bench/results/tree_gpu_h200_20261129.md).

Backend: Pallas Triton lowering. The loop is a chain of small dependent reductions; Triton gives
the reductions and dynamic loops directly; Mosaic GPU's warpgroup model has no benefit for
512-wide vectors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["build_tree", "supports"]

_BIG = 2**30


def _builder_kernel(
    lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, val_ref, *, L, K, M, Mp, N, pbits, rbits
):
    """One request's pop loop (see the module doc).

    The frontier entry carries ``ordslot = order * Mp + slot`` (orders are unique among live
    entries, so one min gives both the FIFO tie-break and the slot), the packed ints
    ``metaA = parent | depth << pbits`` and ``metaB = rank | (prev + 1) << rbits`` and its parent's
    score; the popped score is the max itself; token, sibling and child log-probs are scalar loads
    from the (L1-resident) top-K table; the child's frontier slot needs no search (the popped slot
    if the sibling is not pushed, else the next never-used slot: at most one new slot per pop, so
    at most N + 1 = M slots). Slots never decide anything (ties are broken by the unique order),
    so the output is identical to the reference."""
    b = pl.program_id(0)
    iota = jnp.arange(Mp, dtype=jnp.int32)
    zi = b * 0
    neg1 = jnp.full((Mp,), -1, jnp.int32)
    pmask = (1 << pbits) - 1
    rmask = (1 << rbits) - 1
    lq00 = lq_ref[b, 0, 0]
    root = iota == 0
    f = dict(
        live=root & (lq00 > -jnp.inf),
        score=jnp.where(root, lq00, -jnp.inf),
        ordslot=iota * 0,
        metaA=jnp.full((Mp,), 1 << pbits, jnp.int32),  # parent 0, depth 1
        metaB=iota * 0,  # rank 0, prev -1
        pscore=jnp.zeros((Mp,), jnp.float32),
    )
    nd = dict(
        tokens=neg1,
        parents=neg1,
        depth=jnp.zeros((Mp,), jnp.int32),
        score=jnp.where(root, 0.0, -jnp.inf),
        first_child=neg1,
        next_sibling=neg1,
        valid=root,
    )

    def push(f, slot, ok, **row):
        hit = (iota == slot) & ok
        out = dict(f, live=f["live"] | hit)
        for k_, v in row.items():
            out[k_] = jnp.where(hit, v, f[k_])
        return out

    def pop(i, carry):
        f, nd, counter, fresh = carry
        best = jnp.max(jnp.where(f["live"], f["score"], -jnp.inf))
        tied = f["live"] & (f["score"] == best)
        os_ = jnp.min(jnp.where(tied, f["ordslot"], _BIG))
        ok = os_ < _BIG
        slot = jnp.where(ok, os_ & (Mp - 1), 0)
        onehot = iota == slot
        A = jnp.sum(jnp.where(onehot, f["metaA"], 0))
        Bm = jnp.sum(jnp.where(onehot, f["metaB"], 0))
        score_p = jnp.sum(jnp.where(onehot, f["pscore"], 0.0))
        s = best
        p = A & pmask
        d = jnp.where(ok, A >> pbits, 1)
        r = Bm & rmask
        prev = (Bm >> rbits) - 1
        dm1 = jnp.clip(d - 1, 0, L - 1)
        r1 = jnp.minimum(r + 1, K - 1)
        d1 = jnp.clip(d, 0, L - 1)
        tok = ids_ref[b, dm1, jnp.clip(r, 0, K - 1)]
        sib_lq = lq_ref[b, dm1, r1]
        child_lq = lq_ref[b, d1, 0]
        hit = (iota == i) & ok
        nd = dict(
            tokens=jnp.where(hit, tok, nd["tokens"]),
            parents=jnp.where(hit, p, nd["parents"]),
            depth=jnp.where(hit, d, nd["depth"]),
            score=jnp.where(hit, s, nd["score"]),
            first_child=jnp.where((iota == p) & ok & (prev < 0), i, nd["first_child"]),
            next_sibling=jnp.where((iota == prev) & ok & (prev >= 0), i, nd["next_sibling"]),
            valid=nd["valid"] | hit,
        )
        f = dict(f, live=f["live"] & ~onehot)
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        f = push(
            f,
            slot,
            sib_ok,
            score=score_p + sib_lq,
            ordslot=counter * Mp + slot,
            metaA=A,
            metaB=r1 | ((i + 1) << rbits),
            pscore=score_p,
        )
        counter = counter + sib_ok.astype(jnp.int32)
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        cslot = jnp.where(sib_ok, fresh, slot)
        f = push(
            f,
            cslot,
            child_ok,
            score=s + child_lq,
            ordslot=counter * Mp + cslot,
            metaA=i | ((d + 1) << pbits),
            metaB=zi,
            pscore=s,
        )
        counter = counter + child_ok.astype(jnp.int32)
        fresh = fresh + (sib_ok & child_ok).astype(jnp.int32)
        return f, nd, counter, fresh

    _, nd, _, _ = jax.lax.fori_loop(1, N + 1, pop, (f, nd, zi + 1, zi + 1))
    inb = iota < M
    for ref, key in (
        (tok_ref, "tokens"),
        (par_ref, "parents"),
        (dep_ref, "depth"),
        (sc_ref, "score"),
        (fc_ref, "first_child"),
        (ns_ref, "next_sibling"),
    ):
        plgpu.store(ref.at[b, pl.ds(0, Mp)], nd[key], mask=inb)
    plgpu.store(val_ref.at[b, pl.ds(0, Mp)], nd["valid"].astype(jnp.int32), mask=inb)


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


def supports(budget: int, draft_len: int, k: int) -> bool:
    """Whether the packed frontier fields fit int32 for this size (budgets up to 16,383); larger trees
    fall back to the reference build (``ddtree_jax.tree``)."""
    M, Mp = budget + 1, pl.next_power_of_2(budget + 1)
    return _bits(M - 1) + _bits(draft_len) <= 31 and _bits(k - 1) + _bits(M) <= 31 and (2 * budget + 2) * Mp < _BIG


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps"))
def build_tree(top_lq: jax.Array, top_ids: jax.Array, *, budget: int, interpret: bool = False, num_warps: int = 4):
    """Pop ``budget`` nodes best first from per-depth top-K tables.

    Args:
      top_lq: f32 ``[B, L, K]`` draft log-probabilities per depth, sorted descending.
      top_ids: i32 ``[B, L, K]`` their token ids.
      budget: N non-root nodes (``supports(N, L, K)`` must hold).

    Returns:
      ``(tokens, parents, depth, score, first_child, next_sibling, valid)``, each ``[B, N + 1]``
      (i32; ``score`` f32; ``valid`` bool), node 0 the root, nodes in creation order.
    """
    B, L, K = top_lq.shape
    if not supports(budget, L, K):
        raise ValueError(f"build_tree: budget={budget} with L={L}, K={K} overflows the packed int32 frontier")
    M, N = budget + 1, budget
    Mp = pl.next_power_of_2(M)
    body = functools.partial(_builder_kernel, L=L, K=K, M=M, Mp=Mp, N=N, pbits=_bits(M - 1), rbits=_bits(K - 1))
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    spec = pl.BlockSpec(memory_space=pl.ANY)
    tok, par, dep, sc, fc, ns, val = pl.pallas_call(
        body,
        grid=(B,),
        in_specs=[spec] * 2,
        out_specs=[spec] * 7,
        out_shape=[
            sd((B, M), i32),
            sd((B, M), i32),
            sd((B, M), i32),
            sd((B, M), jnp.float32),
            sd((B, M), i32),
            sd((B, M), i32),
            sd((B, M), i32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_build_tree",
    )(top_lq.astype(jnp.float32), top_ids.astype(i32))
    return tok, par, dep, sc, fc, ns, val != 0
