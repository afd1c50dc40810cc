"""The accept walk for TPUs (Pallas Mosaic TPU), one program per request.

``accept_walk`` with the Triton version's contract (``pallas_kernels.triton.accept_walk``;
reference ``ddtree_jax.accept.accept_path(impl="reference")``): from the root (node 0), while the
target's draw at the current node is the token of one of its valid children, move to that child
(the lowest-index match); the first draw that matches no child is the bonus. Node arrays are
lane-dense ``(1, Mp)`` rows (``Mp``: the node count rounded up to a multiple of 128, padded with
non-matching values); the path and the committed tokens are built as vectors and stored once.
Checked in TPU interpret mode only. Design: docs/kernels.md, "TPU kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["accept_walk"]

_BIG = 2**30
LANES = 128


def _walk_kernel(tok_ref, par_ref, val_ref, smp_ref, path_ref, nacc_ref, bonus_ref, com_ref, *, L):
    tok, par, val, smp = tok_ref[...], par_ref[...], val_ref[...], smp_ref[...]
    iota = jax.lax.broadcasted_iota(jnp.int32, tok.shape, 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, path_ref.shape, 1)

    def step(d, c):
        cur, done, nacc, path, com = c
        x = jnp.sum(jnp.where(iota == cur, smp, 0))
        match = (val != 0) & (par == cur) & (tok == x)
        child = jnp.min(jnp.where(match, iota, _BIG))
        found = (child < _BIG) & ~done
        path = jnp.where(lane == d + 1, jnp.where(found, child, -1), path)
        com = jnp.where(lane == d, jnp.where(found, x, -1), com)
        return jnp.where(found, child, cur), done | ~found, nacc + found.astype(jnp.int32), path, com

    init = (jnp.int32(0), jnp.bool_(False), jnp.int32(0), jnp.where(lane == 0, 0, -1), jnp.full(lane.shape, -1))
    cur, _, nacc, path, com = jax.lax.fori_loop(0, L, step, init)
    bonus = jnp.sum(jnp.where(iota == cur, smp, 0))
    path_ref[...] = path
    com_ref[...] = jnp.where(lane == nacc, bonus, com)
    nacc_ref[...] = jnp.full(nacc_ref.shape, nacc)
    bonus_ref[...] = jnp.full(bonus_ref.shape, bonus)


@functools.partial(jax.jit, static_argnames=("draft_len", "interpret"))
def accept_walk(tokens: jax.Array, parents: jax.Array, valid: jax.Array, node_samples: jax.Array, *, draft_len: int,
                interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Walk ``B`` trees of ``M`` node slots with the target's per-node draws (the Triton version's
    contract).

    Args:
      tokens, parents: i32 ``[B, M]`` node tokens and parent indices (-1 for the root / unused).
      valid: bool ``[B, M]``.
      node_samples: i32 ``[B, M]``, the target's draw at every node.
      draft_len: L, the deepest depth (the walk takes at most L steps).
      interpret: run in Pallas' TPU interpret mode (off a TPU).

    Returns:
      ``(path [B, L+1], num_accepted [B], bonus [B], committed [B, L+1])``, all i32.
    """
    B, M = tokens.shape
    L = draft_len
    Mp = pl.cdiv(M, LANES) * LANES
    Lp = pl.cdiv(L + 1, LANES) * LANES
    i32 = jnp.int32

    def row(a, fill):
        return jnp.pad(a.astype(i32), ((0, 0), (0, Mp - M)), constant_values=fill)[:, None, :]

    sd = jax.ShapeDtypeStruct
    spec = lambda n: pl.BlockSpec((None, 1, n), lambda b: (b, 0, 0))  # noqa: E731
    path, nacc, bonus, com = pl.pallas_call(
        functools.partial(_walk_kernel, L=L),
        grid=(B,),
        in_specs=[spec(Mp)] * 4,
        out_specs=[spec(Lp), spec(LANES), spec(LANES), spec(Lp)],
        out_shape=[sd((B, 1, Lp), i32), sd((B, 1, LANES), i32), sd((B, 1, LANES), i32), sd((B, 1, Lp), i32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ddtree_tpu_accept_walk",
    )(row(tokens, -1), row(parents, -2), row(valid, 0), row(node_samples, -1))
    return path[:, 0, : L + 1], nacc[:, 0, 0], bonus[:, 0, 0], com[:, 0, : L + 1]
