"""The accept walk as a small Pallas Triton kernel, one program per request.

``accept_walk(tokens, parents, valid, node_samples [B, M], draft_len=L)`` -> ``(path [B, L+1],
num_accepted [B], bonus [B], committed [B, L+1])``. Contract (reference:
``ddtree_jax.accept.accept_path(impl="reference")``; the tests compare both): from the root
(node 0), while the target's draw at the current node is the token of one of its valid children,
move to that child (the lowest-index match; children carry distinct tokens, so there is at most
one); the first draw that matches no child is the bonus. Design: docs/kernels.md, "Accept walk".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["accept_walk"]

_BIG = 2**30


def _walk_kernel(tok_ref, par_ref, val_ref, smp_ref, path_ref, nacc_ref, bonus_ref, com_ref, *, M, Mp, L):
    b = pl.program_id(0)
    iota = jnp.arange(Mp, dtype=jnp.int32)
    inb = iota < M
    tok = plgpu.load(tok_ref.at[b, pl.ds(0, Mp)], mask=inb, other=-1)
    par = plgpu.load(par_ref.at[b, pl.ds(0, Mp)], mask=inb, other=-2)
    val = plgpu.load(val_ref.at[b, pl.ds(0, Mp)], mask=inb, other=0)
    smp = plgpu.load(smp_ref.at[b, pl.ds(0, Mp)], mask=inb, other=-1)
    path_ref[b, 0] = b * 0
    zero = b * 0

    def step(d, c):
        cur, done, nacc = c
        x = jnp.sum(jnp.where(iota == cur, smp, 0))
        match = (val != 0) & (par == cur) & (tok == x)
        child = jnp.min(jnp.where(match, iota, _BIG))
        found = (child < _BIG) & ~done
        path_ref[b, d + 1] = jnp.where(found, child, -1)
        com_ref[b, d] = jnp.where(found, x, -1)
        return jnp.where(found, child, cur), done | ~found, nacc + found.astype(jnp.int32)

    cur, _, nacc = jax.lax.fori_loop(0, L, step, (zero, zero > 0, zero))
    bonus = jnp.sum(jnp.where(iota == cur, smp, 0))
    com_ref[b, L] = zero - 1
    com_ref[b, nacc] = bonus
    nacc_ref[b] = nacc
    bonus_ref[b] = bonus


@functools.partial(jax.jit, static_argnames=("draft_len", "interpret"))
def accept_walk(tokens: jax.Array, parents: jax.Array, valid: jax.Array, node_samples: jax.Array, *, draft_len: int,
                interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Walk ``B`` trees of ``M`` node slots with the target's per-node draws.

    Args:
      tokens, parents: i32 ``[B, M]`` node tokens and parent indices (-1 for the root / unused).
      valid: bool ``[B, M]``.
      node_samples: i32 ``[B, M]``, the target's draw at every node.
      draft_len: L, the deepest depth (the walk takes at most L steps).

    Returns:
      ``(path [B, L+1], num_accepted [B], bonus [B], committed [B, L+1])``, all i32: the node
      indices from the root (-1 padded), the accepted draft tokens count, the bonus draw, and the
      accepted tokens followed by the bonus (-1 padded).
    """
    B, M = tokens.shape
    L = draft_len
    Mp = pl.next_power_of_2(M)
    i32 = jnp.int32
    sd = jax.ShapeDtypeStruct
    spec = pl.BlockSpec(memory_space=pl.ANY)
    return tuple(pl.pallas_call(
        functools.partial(_walk_kernel, M=M, Mp=Mp, L=L),
        grid=(B,),
        in_specs=[spec] * 4,
        out_specs=[spec] * 4,
        out_shape=[sd((B, L + 1), i32), sd((B,), i32), sd((B,), i32), sd((B, L + 1), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ddtree_accept_walk",
    )(tokens.astype(i32), parents.astype(i32), valid.astype(i32), node_samples.astype(i32)))
