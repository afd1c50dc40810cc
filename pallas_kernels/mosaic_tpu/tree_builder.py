"""On-device DDTree best-first pop loop for TPUs (Pallas Mosaic TPU), one program per request.

``build_tree`` and ``supports`` with the Triton version's contract
(``pallas_kernels.triton.tree_builder``; reference ``ddtree_jax.tree.build_draft_tree(impl=
"reference")``, bit for bit): pop ``budget`` nodes best first from per-depth top-K tables, equal
scores in creation order, a node's next sibling pushed before its first child, ``-inf``/NaN
entries never pushed, scores single float32 additions. The frontier and node arrays are
lane-dense ``(1, Mp)`` vectors updated by one-hot selects; the request's ``[L, K]`` table sits in
VMEM. Checked in TPU interpret mode only. Design: docs/kernels.md, "TPU kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["build_tree", "supports"]

_BIG = 2**30
LANES = 128


def _builder_kernel(lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, val_ref,
                    *, L, K, Mp, N, pbits, rbits):
    """One request's pop loop; the frontier fields as in the Triton version (``ordslot`` = order *
    Mp + slot, packed ``metaA`` = parent | depth << pbits, ``metaB`` = rank | (prev + 1) << rbits,
    the parent's score)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, Mp), 1)
    lane_k = jax.lax.broadcasted_iota(jnp.int32, (1, lq_ref.shape[1]), 1)
    neg1 = jnp.full((1, Mp), -1, jnp.int32)
    pmask = (1 << pbits) - 1
    rmask = (1 << rbits) - 1

    def entry(ref, d, r):
        """``ref[d, r]``: the depth's row (a dynamic sublane slice), then a one-hot lane sum."""
        row = ref[pl.ds(d, 1), :]
        return jnp.sum(jnp.where(lane_k == r, row, jnp.zeros_like(row)))

    lq00 = entry(lq_ref, 0, 0)
    root = iota == 0
    f = dict(
        live=root & (lq00 > -jnp.inf),
        score=jnp.where(root, lq00, -jnp.inf),
        ordslot=jnp.zeros((1, Mp), jnp.int32),
        metaA=jnp.full((1, Mp), 1 << pbits, jnp.int32),  # parent 0, depth 1
        metaB=jnp.zeros((1, Mp), jnp.int32),  # rank 0, prev -1
        pscore=jnp.zeros((1, Mp), jnp.float32),
    )
    nd = dict(
        tokens=neg1,
        parents=neg1,
        depth=jnp.zeros((1, Mp), jnp.int32),
        score=jnp.where(root, 0.0, -jnp.inf),
        first_child=neg1,
        next_sibling=neg1,
        valid=root.astype(jnp.int32),
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
        tok = entry(ids_ref, dm1, jnp.clip(r, 0, K - 1))
        sib_lq = entry(lq_ref, dm1, r1)
        child_lq = entry(lq_ref, jnp.clip(d, 0, L - 1), 0)
        hit = (iota == i) & ok
        nd = dict(
            tokens=jnp.where(hit, tok, nd["tokens"]),
            parents=jnp.where(hit, p, nd["parents"]),
            depth=jnp.where(hit, d, nd["depth"]),
            score=jnp.where(hit, s, nd["score"]),
            first_child=jnp.where((iota == p) & ok & (prev < 0), i, nd["first_child"]),
            next_sibling=jnp.where((iota == prev) & ok & (prev >= 0), i, nd["next_sibling"]),
            valid=jnp.where(hit, 1, nd["valid"]),
        )
        f = dict(f, live=f["live"] & ~onehot)
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        f = push(f, slot, sib_ok, score=score_p + sib_lq, ordslot=counter * Mp + slot, metaA=A,
                 metaB=r1 | ((i + 1) << rbits), pscore=score_p)
        counter = counter + sib_ok.astype(jnp.int32)
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        cslot = jnp.where(sib_ok, fresh, slot)
        f = push(f, cslot, child_ok, score=s + child_lq, ordslot=counter * Mp + cslot,
                 metaA=i | ((d + 1) << pbits), metaB=jnp.int32(0), pscore=s)
        counter = counter + child_ok.astype(jnp.int32)
        fresh = fresh + (sib_ok & child_ok).astype(jnp.int32)
        return f, nd, counter, fresh

    _, nd, _, _ = jax.lax.fori_loop(1, N + 1, pop, (f, nd, jnp.int32(1), jnp.int32(1)))
    for ref, key in ((tok_ref, "tokens"), (par_ref, "parents"), (dep_ref, "depth"), (sc_ref, "score"),
                     (fc_ref, "first_child"), (ns_ref, "next_sibling"), (val_ref, "valid")):
        ref[...] = nd[key]


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


def _padded(M: int) -> int:
    """Node slots as a power of two (``ordslot & (Mp - 1)`` is the slot) and at least one lane row."""
    return max(LANES, pl.next_power_of_2(M))


def supports(budget: int, draft_len: int, k: int) -> bool:
    """Whether the packed frontier fields fit int32 for this size (as the Triton version: budgets
    up to 16,383); larger trees fall back to the reference build (``ddtree_jax.tree``)."""
    M = budget + 1
    Mp = _padded(M)
    return _bits(M - 1) + _bits(draft_len) <= 31 and _bits(k - 1) + _bits(M) <= 31 and (2 * budget + 2) * Mp < _BIG


@functools.partial(jax.jit, static_argnames=("budget", "interpret"))
def build_tree(top_lq: jax.Array, top_ids: jax.Array, *, budget: int, interpret: bool = False):
    """Pop ``budget`` nodes best first from per-depth top-K tables (the Triton version's contract).

    Args:
      top_lq: f32 ``[B, L, K]`` draft log-probabilities per depth, sorted descending.
      top_ids: i32 ``[B, L, K]`` their token ids.
      budget: N non-root nodes (``supports(N, L, K)`` must hold).
      interpret: run in Pallas' TPU interpret mode (off a TPU).

    Returns:
      ``(tokens, parents, depth, score, first_child, next_sibling, valid)``, each ``[B, N + 1]``
      (i32; ``score`` f32; ``valid`` bool), node 0 the root, nodes in creation order.
    """
    B, L, K = top_lq.shape
    if not supports(budget, L, K):
        raise ValueError(f"build_tree: budget={budget} with L={L}, K={K} overflows the packed int32 frontier")
    M, N = budget + 1, budget
    Mp = _padded(M)
    Kp = pl.cdiv(K, LANES) * LANES
    lq = jnp.pad(top_lq.astype(jnp.float32), ((0, 0), (0, 0), (0, Kp - K)), constant_values=-jnp.inf)
    ids = jnp.pad(top_ids.astype(jnp.int32), ((0, 0), (0, 0), (0, Kp - K)), constant_values=-1)
    body = functools.partial(_builder_kernel, L=L, K=K, Mp=Mp, N=N, pbits=_bits(M - 1), rbits=_bits(K - 1))
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    table = pl.BlockSpec((None, L, Kp), lambda b: (b, 0, 0))
    out = pl.BlockSpec((None, 1, Mp), lambda b: (b, 0, 0))
    res = pl.pallas_call(
        body,
        grid=(B,),
        in_specs=[table, table],
        out_specs=[out] * 7,
        out_shape=[sd((B, 1, Mp), t) for t in (i32, i32, i32, jnp.float32, i32, i32, i32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ddtree_tpu_build_tree",
    )(lq, ids)
    tok, par, dep, sc, fc, ns, val = (a[:, 0, :M] for a in res)
    return tok, par, dep, sc, fc, ns, val != 0
