"""On-device DDTree best-first pop loop: the whole loop in ONE Pallas program per request.

Contract (the plain-JAX reference is ``ddtree_jax.tree.build_draft_tree(impl="reference")``; the
tests compare both on random inputs): given each depth's top-K draft log-probabilities (sorted
descending) and their token ids, pop ``budget`` nodes best first. Equal scores pop in creation
order (first pushed, first popped), a pop pushes the new node's next sibling before its first
child, ``-inf``/NaN entries are never pushed, and scores are single float32 additions
(sibling = score(parent) + lq[d, r+1], child = score(node) + lq[d+1, 0]), so the reference
reproduces them bit for bit.

How: the kernel keeps the frontier and the nodes' links (first child, next sibling) as
loop-carried register vectors, updated with one-hot ``where`` (no dynamic scatters, no launch per
node); node ``i``'s own fields are stored once, by scalar stores, when it is popped. The loop is a
chain of dependent reductions, so their number per pop sets its time. Per pop:

1. one two-operand reduction, ``argmax`` over int32 keys. Frontier entries sit in push order
   (entry ``j`` is the ``j``-th pushed; a popped slot is never reused), so the lowest index among
   equal keys is the FIFO tie rule with no separate tie-break pass. The key is the float32 score
   mapped to an int32 that orders like the float (``-0.0`` folded into ``+0.0``); popped and unused
   slots hold the smallest int32, which no score maps to.
2. three independent one-hot gathers of the popped entry's packed ``parent | depth``,
   ``rank | prev + 1`` and its parent's score (the bits of a float32, summed as int32: exact).
3. four independent scalar loads from the (L1-resident) ``[L, K]`` tables: the token, the entry's
   own log-prob (its score is recomputed as ``parent score + log-prob``, the very addition that
   made it), the next sibling's and the first child's.

The entries that can still be popped are the root and the pushes of pops ``1..N-1``: at most
``2N - 1`` slots. Slots never decide anything beyond the FIFO order they encode, so the output is
identical to the reference. Measured on the H200 at B=16, N=256, L=15 (device time): ~17
reductions per pop, 407 us (bench/results/tree_gpu_h200_20261129.md); 5 dependent reductions in 3
stages with reused slots, 188 us; this loop with the nodes as register vectors, 161 us; as here,
157 us (bench/results/tree_gpu_h200_20261130.md, the earlier versions timed in the same run).

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

__all__ = ["MAX_BUDGET", "build_tree", "supports"]

MAX_BUDGET = 16383  # the frontier is a register vector of next_pow2(2 * budget - 1) lanes
_DEAD = -(2**31)  # the key of popped and unused frontier slots; no float32 maps to it


def _key(s):
    """float32 -> int32 with the same order (``-0.0`` and ``+0.0`` equal; NaN never reaches here:
    tables hold log-probabilities, never ``+inf``, so no score is NaN)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(s == 0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))


def _builder_kernel(
    lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, val_ref, *, L, K, M, Mp, F, N, pbits, rbits
):
    """One request's pop loop (see the module doc). Frontier vectors (``F`` lanes, push order):
    ``key``, ``metaA = parent | depth << pbits``, ``metaB = rank | (prev + 1) << rbits`` and
    ``pbits_`` (the parent's score as int32 bits). Node ``i``'s token, parent, depth, score and
    validity are stored once, by scalar stores, at pop ``i``; only the links (first child, next
    sibling), which later pops set, are register vectors (``Mp`` lanes, node ``i`` at lane ``i``)
    stored at the end. No address is written twice, so no ordering between threads is needed."""
    b = pl.program_id(0)
    it = jnp.arange(F, dtype=jnp.int32)
    iota = jnp.arange(Mp, dtype=jnp.int32)
    zi = b * 0
    neg1 = jnp.full((Mp,), -1, jnp.int32)
    pmask = (1 << pbits) - 1
    rmask = (1 << rbits) - 1
    f32_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    lq00 = lq_ref[b, 0, 0]
    head = it == 0
    f = dict(
        key=jnp.where(head & (lq00 > -jnp.inf), _key(lq00), _DEAD),
        metaA=jnp.where(head, 1 << pbits, 0),  # parent 0, depth 1
        metaB=it * 0,  # rank 0, prev -1
        pbits_=it * 0,  # the root's score, +0.0
    )
    links = dict(first_child=neg1, next_sibling=neg1)
    tok_ref[b, 0] = zi - 1
    par_ref[b, 0] = zi - 1
    dep_ref[b, 0] = zi
    sc_ref[b, 0] = jnp.float32(0.0)
    val_ref[b, 0] = zi + 1

    def push(f, slot, ok, score, **row):
        hit = (it == slot) & ok
        out = {k_: jnp.where(hit, v, f[k_]) for k_, v in row.items()}
        out["key"] = jnp.where(hit, _key(score), f["key"])
        return out

    def pop(i, carry):
        f, links, count = carry
        slot = jnp.argmax(f["key"]).astype(jnp.int32)
        sel = (it == slot) & (f["key"] > _DEAD)
        A = jnp.sum(jnp.where(sel, f["metaA"], 0))
        Bm = jnp.sum(jnp.where(sel, f["metaB"], 0))
        ps = jax.lax.bitcast_convert_type(jnp.sum(jnp.where(sel, f["pbits_"], 0)), jnp.float32)
        d = A >> pbits  # 0 iff the frontier is empty (every entry has depth >= 1)
        ok = d > 0
        p = A & pmask
        r = Bm & rmask
        prev = (Bm >> rbits) - 1
        dm1 = jnp.clip(d - 1, 0, L - 1)
        rc = jnp.clip(r, 0, K - 1)
        r1 = jnp.minimum(r + 1, K - 1)
        tok = ids_ref[b, dm1, rc]
        s = ps + lq_ref[b, dm1, rc]
        sib_lq = lq_ref[b, dm1, r1]
        child_lq = lq_ref[b, jnp.clip(d, 0, L - 1), 0]
        # Node i is written once, here (unused slots get the empty-node values).
        tok_ref[b, i] = jnp.where(ok, tok, -1)
        par_ref[b, i] = jnp.where(ok, p, -1)
        dep_ref[b, i] = jnp.where(ok, d, 0)
        sc_ref[b, i] = jnp.where(ok, s, -jnp.inf)
        val_ref[b, i] = ok.astype(jnp.int32)
        links = dict(
            first_child=jnp.where((iota == p) & ok & (prev < 0), i, links["first_child"]),
            next_sibling=jnp.where((iota == prev) & ok & (prev >= 0), i, links["next_sibling"]),
        )
        f = dict(f, key=jnp.where(it == slot, _DEAD, f["key"]))
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        f = push(f, count, sib_ok, ps + sib_lq, metaA=A, metaB=r1 | ((i + 1) << rbits), pbits_=f32_bits(ps))
        count = count + sib_ok.astype(jnp.int32)
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        f = push(f, count, child_ok, s + child_lq, metaA=i | ((d + 1) << pbits), metaB=zi, pbits_=f32_bits(s))
        count = count + child_ok.astype(jnp.int32)
        return f, links, count

    _, links, _ = jax.lax.fori_loop(1, N + 1, pop, (f, links, zi + 1))
    inb = iota < M
    plgpu.store(fc_ref.at[b, pl.ds(0, Mp)], links["first_child"], mask=inb)
    plgpu.store(ns_ref.at[b, pl.ds(0, Mp)], links["next_sibling"], mask=inb)


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


def supports(budget: int, draft_len: int, k: int) -> bool:
    """Whether the kernel takes this size: budgets up to ``MAX_BUDGET`` whose packed frontier fields
    fit int32; larger trees fall back to the reference build (``ddtree_jax.tree``)."""
    M = budget + 1
    return budget <= MAX_BUDGET and _bits(M - 1) + _bits(draft_len) <= 31 and _bits(k - 1) + _bits(M) <= 31


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps"))
def build_tree(top_lq: jax.Array, top_ids: jax.Array, *, budget: int, interpret: bool = False, num_warps: int = 4):
    """Pop ``budget`` nodes best first from per-depth top-K tables.

    Args:
      top_lq: f32 ``[B, L, K]`` draft log-probabilities per depth, sorted descending (finite,
        ``-inf`` or NaN; never ``+inf``).
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
    Mp, F = pl.next_power_of_2(M), pl.next_power_of_2(max(2 * N - 1, 2))
    body = functools.partial(_builder_kernel, L=L, K=K, M=M, Mp=Mp, F=F, N=N, pbits=_bits(M - 1),
                             rbits=_bits(K - 1))
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
