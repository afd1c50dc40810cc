"""On-device DDTree best-first pop loop, the whole loop in one Pallas Triton program per request.

``build_tree(top_lq [B, L, K] f32, top_ids [B, L, K] i32, budget=N)`` -> the tree's node arrays
``[B, N + 1]`` (node 0 the root, nodes in creation order); ``supports`` says which sizes it takes
(larger trees use the reference). Contract (``ddtree_jax.tree.build_draft_tree(impl="reference")``,
bit for bit): given each depth's top-K draft log-probabilities (sorted descending) and token ids,
pop ``budget`` nodes best first; equal scores pop in creation order, a pop pushes the new node's
next sibling before its first child, ``-inf``/NaN entries are never pushed, and scores are single
float32 additions (sibling = score(parent) + lq[d, r+1], child = score(node) + lq[d+1, 0]).
The frontier is one int32 key vector in push order (its argmax is best first with the FIFO tie
rule); entries' other fields go through a by-slot scratch by scalar stores and loads, ordered by
the argmax's block barrier, so ``num_warps >= 2``. Design and measurements: docs/kernels.md,
"Tree builder".
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
    lq_ref, ids_ref, tok_ref, par_ref, dep_ref, sc_ref, fc_ref, ns_ref, slot_ref, *, L, K, M, Mp, F, S, N, pbits, rbits
):
    """One request's pop loop (see the module doc). The frontier's keys are one register vector
    (``F`` lanes, push order); entry ``j``'s fields sit in ``slot_ref[b, :, j]``:
    ``parent | depth << pbits``, ``rank | (prev + 1) << rbits`` (zeroed up front, so a first
    child, rank 0 with no previous sibling, stores no word there) and its parent's score as int32
    bits."""
    b = pl.program_id(0)
    it = jnp.arange(F, dtype=jnp.int32)
    iota = jnp.arange(Mp, dtype=jnp.int32)
    zi = b * 0
    pmask = (1 << pbits) - 1
    rmask = (1 << rbits) - 1
    f32_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    lq00 = lq_ref[b, 0, 0]
    key = jnp.where((it == 0) & (lq00 > -jnp.inf), _key(lq00), _DEAD)
    live = (lq00 > -jnp.inf).astype(jnp.int32)
    slot_ref[b, 0, 0] = zi + (1 << pbits)  # the root's first child: parent 0, depth 1
    slot_ref[b, 2, 0] = zi  # its parent's score, +0.0
    slot_ref[b, 1, pl.ds(0, S)] = jnp.zeros((S,), jnp.int32)
    neg1 = jnp.full((Mp,), -1, jnp.int32)
    plgpu.store(fc_ref.at[b, pl.ds(0, Mp)], neg1, mask=iota < M)
    plgpu.store(ns_ref.at[b, pl.ds(0, Mp)], neg1, mask=iota < M)
    tok_ref[b, 0] = zi - 1
    par_ref[b, 0] = zi - 1
    dep_ref[b, 0] = zi
    sc_ref[b, 0] = jnp.float32(0.0)

    def pop(i, carry):
        key, count, live = carry
        slot = jnp.argmax(key).astype(jnp.int32)
        ok = live > 0  # the frontier is empty iff no entry is live
        A = slot_ref[b, 0, slot]
        Bm = slot_ref[b, 1, slot]
        d = A >> pbits
        p = A & pmask
        r = Bm & rmask
        prev = (Bm >> rbits) - 1
        dm1 = jnp.clip(d - 1, 0, L - 1)
        rc = jnp.clip(r, 0, K - 1)
        r1 = jnp.minimum(r + 1, K - 1)
        ps = jax.lax.bitcast_convert_type(slot_ref[b, 2, slot], jnp.float32)
        tok = ids_ref[b, dm1, rc]
        s = ps + lq_ref[b, dm1, rc]
        sib_lq = lq_ref[b, dm1, r1]
        child_lq = lq_ref[b, jnp.clip(d, 0, L - 1), 0]
        # Node i is written once, here (unused slots get the empty-node values).
        tok_ref[b, i] = jnp.where(ok, tok, -1)
        par_ref[b, i] = jnp.where(ok, p, -1)
        dep_ref[b, i] = jnp.where(ok, d, 0)
        sc_ref[b, i] = jnp.where(ok, s, -jnp.inf)
        plgpu.store(fc_ref.at[b, jnp.clip(p, 0, M - 1)], i, mask=ok & (prev < 0))
        plgpu.store(ns_ref.at[b, jnp.clip(prev, 0, M - 1)], i, mask=ok & (prev >= 0))
        sib_ok = ok & (r + 1 < K) & (sib_lq > -jnp.inf)
        child_ok = ok & (d < L) & (child_lq > -jnp.inf)
        c2 = count + sib_ok.astype(jnp.int32)
        key = jnp.where((it == c2) & child_ok, _key(s + child_lq), key)
        key = jnp.where(it == slot, _DEAD, jnp.where((it == count) & sib_ok, _key(ps + sib_lq), key))
        plgpu.store(slot_ref.at[b, zi, count], A, mask=sib_ok)  # traced field index: masked stores take no int
        plgpu.store(slot_ref.at[b, zi + 1, count], r1 | ((i + 1) << rbits), mask=sib_ok)
        plgpu.store(slot_ref.at[b, zi, c2], i | ((d + 1) << pbits), mask=child_ok)
        plgpu.store(slot_ref.at[b, zi + 2, count], f32_bits(ps), mask=sib_ok)
        plgpu.store(slot_ref.at[b, zi + 2, c2], f32_bits(s), mask=child_ok)
        pushed = sib_ok.astype(jnp.int32) + child_ok.astype(jnp.int32)
        return key, count + pushed, live - ok.astype(jnp.int32) + pushed

    jax.lax.fori_loop(1, N + 1, pop, (key, zi + 1, live))


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
    if num_warps < 2:
        raise ValueError(f"build_tree: num_warps={num_warps}; the loop needs the block barrier of >= 2 warps")
    if not supports(budget, L, K):
        raise ValueError(f"build_tree: budget={budget} with L={L}, K={K} overflows the packed int32 frontier")
    M, N = budget + 1, budget
    Mp, F = pl.next_power_of_2(M), pl.next_power_of_2(max(2 * N - 1, 2))
    S = pl.next_power_of_2(2 * N + 2)  # the last pop's pushes land at slots up to 2N
    body = functools.partial(_builder_kernel, L=L, K=K, M=M, Mp=Mp, F=F, S=S, N=N, pbits=_bits(M - 1),
                             rbits=_bits(K - 1))
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    spec = pl.BlockSpec(memory_space=pl.ANY)
    tok, par, dep, sc, fc, ns, _ = pl.pallas_call(
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
            sd((B, 3, S), i32),  # the frontier entries' fields, by slot (scratch)
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ddtree_build_tree",
    )(top_lq.astype(jnp.float32), top_ids.astype(i32))
    valid = (dep > 0) | (jnp.arange(M) == 0)  # popped nodes have depth >= 1; the root is node 0
    return tok, par, dep, sc, fc, ns, valid
