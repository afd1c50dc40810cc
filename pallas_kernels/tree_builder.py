"""On-device DDTree builder: the whole best-first pop loop in ONE Pallas program per request.

Reference: ``ddtree_jax.tree.build_draft_tree`` (plain-JAX jit loop ``_build_draft_tree``). The
output is identical: same tie rule (equal scores pop in creation order, the sibling pushed
before the child), -inf/NaN entries never pushed, the same float32 score additions
(sibling = score(parent) + lq[d, r+1], child = score(node) + lq[d+1, 0]) and the same frontier
slot policy.

How: the per-depth top-K (``exact_top_k``, K = min(budget, V)) is taken in plain JAX; the
kernel keeps the frontier (``budget + 1`` slots) and the node arrays as loop-carried register
vectors, updated with one-hot ``where`` (no dynamic scatters, no launch per node). The loop is a
chain of dependent reductions, so their number per pop sets its time: ``_builder_kernel`` (v2,
default) does 5 per pop (max score; min of ``order * Mp + slot`` among the tied, which gives the
FIFO tie-break and the slot at once; three one-hot gathers of packed ``parent|depth``,
``rank|prev+1`` and the parent's score) plus 3 independent scalar loads from the ``[L, K]``
table (token, sibling and child log-probs), and finds the child's slot without a search. The
first version ``_builder_kernel_v1`` (kernel="v1") did ~17 (Triton IR of the kernel: 18
``tt.reduce`` ops against 5 for v2); it measured 407 us at B=16, N=256, L=15 on the H200. v2 is
identical on every test and GPU-bench input in interpret mode and lowers to Triton IR; it has
not been timed on the GPU yet (bench/bench_tree_gpu.py times both). The verify attention mask
(``ancestor_mask``) is then built in plain JAX by following parent pointers L times, or by
boolean matrix squaring (``mask="squaring"``).

Backend: Pallas Triton lowering. The loop is a chain of small dependent reductions; Triton
gives the reductions and dynamic loops directly; Mosaic GPU's warpgroup model has no benefit
for 512-wide vectors. See bench/results/tree_gpu_* for the measured time against the jit loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.tree import DraftTree, _build_draft_tree, draft_logprobs

__all__ = ["build_draft_tree_pallas", "reference_build_draft_tree", "ancestor_mask_from_parents", "ancestor_mask_by_squaring", "exact_top_k"]

reference_build_draft_tree = _build_draft_tree
_BIG = 2**30


def _builder_kernel_v1(lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, val_ref, *, L, K, Lp, Kp, M, Mp, N):
    b = pl.program_id(0)
    il = jnp.arange(Lp, dtype=jnp.int32)[:, None]
    ik = jnp.arange(Kp, dtype=jnp.int32)[None, :]
    tmask = (il < L) & (ik < K)
    LQ = plgpu.load(lq_ref.at[b, pl.ds(0, Lp), pl.ds(0, Kp)], mask=tmask, other=-jnp.inf)
    IDS = plgpu.load(ids_ref.at[b, pl.ds(0, Lp), pl.ds(0, Kp)], mask=tmask, other=0)
    ikv = jnp.arange(Kp, dtype=jnp.int32)
    ilv = jnp.arange(Lp, dtype=jnp.int32)
    lq0 = jnp.sum(jnp.where(ik == 0, LQ, 0.0), axis=1)  # [Lp] lq[d, 0]
    iota = jnp.arange(Mp, dtype=jnp.int32)
    zi = b * 0
    neg1 = jnp.full((Mp,), -1, jnp.int32)
    lq00 = jnp.sum(jnp.where(ilv == 0, lq0, 0.0))

    f = dict(
        live=(iota == 0) & (lq00 > -jnp.inf),
        score=jnp.where(iota == 0, lq00, -jnp.inf),
        parent=jnp.zeros((Mp,), jnp.int32),
        depth=jnp.ones((Mp,), jnp.int32),
        rank=jnp.zeros((Mp,), jnp.int32),
        prev=neg1,
        order=jnp.zeros((Mp,), jnp.int32),
    )
    nd = dict(
        tokens=neg1,
        parents=neg1,
        depth=jnp.zeros((Mp,), jnp.int32),
        score=jnp.where(iota == 0, 0.0, -jnp.inf),
        first_child=neg1,
        next_sibling=neg1,
        valid=iota == 0,
    )

    def at(vec, idx):  # vec[idx] for an int vector
        return jnp.sum(jnp.where(iota == idx, vec, 0))

    def push(f, slot, ok, **row):
        hit = (iota == slot) & ok
        out = dict(f, live=f["live"] | hit)
        for k_, v in row.items():
            out[k_] = jnp.where(hit, v, f[k_])
        return out

    def pop(i, carry):
        f, nd, counter = carry
        best = jnp.max(jnp.where(f["live"], f["score"], -jnp.inf))
        tied = f["live"] & (f["score"] == best)
        omin = jnp.min(jnp.where(tied, f["order"], _BIG))
        slot = jnp.min(jnp.where(tied & (f["order"] == omin), iota, _BIG))
        ok = jnp.max(jnp.where(f["live"], 1, 0)) > 0
        slot = jnp.where(ok, slot, 0)
        onehot = iota == slot
        s = jnp.max(jnp.where(onehot, f["score"], -jnp.inf))
        p, d, r, prev = (at(f[k_], slot) for k_ in ("parent", "depth", "rank", "prev"))
        lqrow = jnp.sum(jnp.where(il == d - 1, LQ, 0.0), axis=0)  # [Kp]
        idrow = jnp.sum(jnp.where(il == d - 1, IDS, 0), axis=0)
        tok = jnp.sum(jnp.where(ikv == r, idrow, 0))
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
        r1 = jnp.minimum(r + 1, K - 1)
        sib_lq = jnp.sum(jnp.where(ikv == r1, lqrow, 0.0))
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        score_p = jnp.max(jnp.where(iota == p, nd["score"], -jnp.inf))
        f = push(f, slot, sib_ok, score=score_p + sib_lq, parent=p, depth=d, rank=r1, prev=i, order=counter)
        counter = counter + sib_ok.astype(jnp.int32)
        d1 = jnp.minimum(d, L - 1)
        child_lq = jnp.sum(jnp.where(ilv == d1, lq0, 0.0))
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        free = jnp.min(jnp.where(~f["live"] & (iota < M), iota, _BIG))
        free = jnp.where(free < _BIG, free, 0)
        f = push(f, free, child_ok, score=s + child_lq, parent=i, depth=d + 1, rank=zi, prev=zi - 1, order=counter)
        counter = counter + child_ok.astype(jnp.int32)
        return f, nd, counter

    _, nd, _ = jax.lax.fori_loop(1, N + 1, pop, (f, nd, zi + 1))
    inb = iota < M
    for ref, key in ((tok_ref, "tokens"), (par_ref, "parents"), (dep_ref, "depth"), (sc_ref, "score"),
                     (fc_ref, "first_child"), (ns_ref, "next_sibling")):
        plgpu.store(ref.at[b, pl.ds(0, Mp)], nd[key], mask=inb)
    plgpu.store(val_ref.at[b, pl.ds(0, Mp)], nd["valid"].astype(jnp.int32), mask=inb)



def _builder_kernel(lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, val_ref, *, L, K, Lp, Kp, M, Mp, N, pbits, rbits):
    """Same loop as ``_builder_kernel_v1`` with fewer dependent reductions per pop (5 instead of
    ~17): the frontier entry carries ``ordslot = order * Mp + slot`` (orders are unique among live
    entries, so one min gives both the FIFO tie-break and the slot), the packed ints
    ``metaA = parent | depth << pbits`` and ``metaB = rank | (prev + 1) << rbits`` and its parent's
    score; the popped score is the max itself; token, sibling and child log-probs are scalar loads
    from the (L1-resident) top-K table; the child's frontier slot needs no search (the popped slot
    if the sibling is not pushed, else the next never-used slot: at most one new slot per pop, so
    at most N + 1 = M slots). Slots never decide anything (ties are broken by the unique order),
    so the output is identical to v1 and to the reference."""
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
        f = push(f, slot, sib_ok, score=score_p + sib_lq, ordslot=counter * Mp + slot,
                 metaA=A, metaB=r1 | ((i + 1) << rbits), pscore=score_p)
        counter = counter + sib_ok.astype(jnp.int32)
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        cslot = jnp.where(sib_ok, fresh, slot)
        f = push(f, cslot, child_ok, score=s + child_lq, ordslot=counter * Mp + cslot,
                 metaA=i | ((d + 1) << pbits), metaB=zi, pscore=s)
        counter = counter + child_ok.astype(jnp.int32)
        fresh = fresh + (sib_ok & child_ok).astype(jnp.int32)
        return f, nd, counter, fresh

    _, nd, _, _ = jax.lax.fori_loop(1, N + 1, pop, (f, nd, zi + 1, zi + 1))
    inb = iota < M
    for ref, key in ((tok_ref, "tokens"), (par_ref, "parents"), (dep_ref, "depth"), (sc_ref, "score"),
                     (fc_ref, "first_child"), (ns_ref, "next_sibling")):
        plgpu.store(ref.at[b, pl.ds(0, Mp)], nd[key], mask=inb)
    plgpu.store(val_ref.at[b, pl.ds(0, Mp)], nd["valid"].astype(jnp.int32), mask=inb)


def ancestor_mask_from_parents(parents: jax.Array, valid: jax.Array, draft_len: int) -> jax.Array:
    """``[B, M]`` parents -> ``[B, M, M]`` reflexive ancestor mask, by following pointers."""
    B, M = parents.shape
    idx = jnp.arange(M, dtype=jnp.int32)
    cur = jnp.broadcast_to(idx, (B, M))
    mask = cur[..., None] == idx
    for _ in range(draft_len):
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
        mask = mask | (cur[..., None] == idx)
    return mask & valid[..., None]


def ancestor_mask_by_squaring(parents: jax.Array, valid: jax.Array, draft_len: int) -> jax.Array:
    """Same mask as ``ancestor_mask_from_parents`` (identical booleans): the reflexive closure of
    the parent relation by ``ceil(log2(draft_len + 1))`` boolean matrix squarings (bf16 0/1
    inputs, f32 accumulation: sums of non-negative integers, so ``> 0`` is exact) instead of
    ``draft_len`` dependent gathers. Depth <= draft_len, so 2^s >= draft_len + 1 hops suffice."""
    B, M = parents.shape
    idx = jnp.arange(M, dtype=jnp.int32)
    a = (parents[..., None] == idx) | (idx[:, None] == idx)[None]
    hops = 1
    while hops < draft_len + 1:
        ab = a.astype(jnp.bfloat16)
        a = jnp.einsum("bij,bjk->bik", ab, ab, preferred_element_type=jnp.float32) > 0
        hops *= 2
    return a & valid[..., None]


def exact_top_k(x: jax.Array, k: int, *, chunk: int = 32, extra: int = 32) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` exactly (values descending, ties lowest index first), through chunk
    maxima: the ``k + extra`` chunks (of ``chunk`` columns) with the largest maxima are gathered
    in column order and ``lax.top_k`` runs on those few columns. If some unselected chunk could
    hold a value >= the k-th found (``>=`` the (k+extra+1)-th chunk maximum, or NaN), the row set
    falls back to ``lax.top_k`` on everything (one ``lax.cond``), so the result is always exact.
    XLA's GPU top-k sorts whole rows for large k: on V=163840 this is the bulk of the build."""
    *lead, V = x.shape
    nc, kc = V // chunk, k + extra
    if V % chunk or nc <= kc + 1:
        return jax.lax.top_k(x, k)
    xr = x.reshape(-1, nc, chunk)
    cmax, cidx = jax.lax.top_k(jnp.max(xr, axis=-1), kc + 1)
    sel = jnp.sort(cidx[:, :kc], axis=-1)  # column order, so top_k's tie rule sees columns in order
    cand = jnp.take_along_axis(xr, sel[..., None], axis=1).reshape(-1, kc * chunk)
    cols = (sel[..., None] * chunk + jnp.arange(chunk, dtype=sel.dtype)).reshape(-1, kc * chunk)
    vals, pos = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(cols, pos, axis=-1)
    ok = jnp.all(cmax[:, kc] < vals[:, k - 1])
    vals, ids = jax.lax.cond(ok, lambda: (vals, ids), lambda: tuple(jax.lax.top_k(x.reshape(-1, V), k)))
    return vals.reshape(*lead, k), ids.reshape(*lead, k)


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps", "topk", "kernel", "mask"))
def build_draft_tree_pallas(
    draft_logits: jax.Array, budget: int, *, interpret: bool = False, num_warps: int = 4, topk: str = "chunked",
    kernel: str = "v2", mask: str = "pointers",
) -> DraftTree:
    """Same contract as ``ddtree_jax.tree.build_draft_tree`` (inputs already validated).
    ``topk``: "chunked" (``exact_top_k``) or "lax" (``lax.top_k``); ``kernel``: "v2" (5
    reductions per pop) or "v1" (the first version, ~17); ``mask``: "pointers" (L dependent
    gathers, measured 53 us at B=16 N=256 L=15) or "squaring" (ceil(log2(L+1)) boolean matrix
    squarings; not yet timed on a GPU). All variants give identical outputs."""
    B, L, V = draft_logits.shape
    K = min(budget, V)
    lq = draft_logprobs(draft_logits)
    top_lq, top_ids = exact_top_k(lq, K) if topk == "chunked" else jax.lax.top_k(lq, K)
    return _build_from_topk(top_lq, top_ids.astype(jnp.int32), budget=budget, V=V, interpret=interpret,
                            num_warps=num_warps, kernel=kernel, mask=mask)


@functools.partial(jax.jit, static_argnames=("budget", "V", "interpret", "num_warps", "kernel", "mask"))
def _build_from_topk(top_lq, top_ids, *, budget, V, interpret=False, num_warps=4, kernel="v2", mask="pointers") -> DraftTree:
    B, L, K = top_lq.shape
    M, N = budget + 1, budget
    Mp, Lp, Kp = pl.next_power_of_2(M), pl.next_power_of_2(L), pl.next_power_of_2(K)
    pbits, rbits = _bits(M - 1), _bits(K - 1)
    fits = pbits + _bits(L) <= 31 and rbits + _bits(M) <= 31 and (2 * N + 2) * Mp < _BIG
    if kernel == "v2" and fits:
        body = functools.partial(_builder_kernel, L=L, K=K, Lp=Lp, Kp=Kp, M=M, Mp=Mp, N=N, pbits=pbits, rbits=rbits)
    else:
        body = functools.partial(_builder_kernel_v1, L=L, K=K, Lp=Lp, Kp=Kp, M=M, Mp=Mp, N=N)
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    spec = pl.BlockSpec(memory_space=pl.ANY)
    tok, par, dep, sc, fc, ns, val = pl.pallas_call(
        body,
        grid=(B,),
        in_specs=[spec] * 2,
        out_specs=[spec] * 7,
        out_shape=[sd((B, M), i32), sd((B, M), i32), sd((B, M), i32), sd((B, M), jnp.float32),
                   sd((B, M), i32), sd((B, M), i32), sd((B, M), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_build_tree",
    )(top_lq.astype(jnp.float32), top_ids)
    valid = val != 0
    anc = ancestor_mask_by_squaring if mask == "squaring" else ancestor_mask_from_parents
    return DraftTree(
        tokens=tok, parents=par, depth=dep, score=sc, first_child=fc, next_sibling=ns, valid=valid,
        ancestor_mask=anc(par, valid, L), draft_len=L,
    )
