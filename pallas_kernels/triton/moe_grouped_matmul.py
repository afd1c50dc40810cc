"""Routed MoE experts as two grouped matmuls over token copies sorted by expert.

Contract (the plain-JAX references are ``ddtree_jax.models.moe.experts_reference`` (every expert
dense, masked) and ``experts_ragged_dot``; tests/test_moe_kernel.py compares): given the token
copies sorted by expert (``sorted_token [R]``: which row of ``x`` the r-th copy reads,
``sorted_weight [R]`` its routing weight) and a list of row tiles (``tile_expert``,
``tile_start``, ``tile_end``: tile t covers sorted rows ``[tile_start[t], tile_end[t])``, all
routed to expert ``tile_expert[t]``; at most ``block_m`` rows, empty for the unused tail of the
list), return for every sorted row r inside a tile

    y[r] = sorted_weight[r] * (silu(x[tok] @ Wg[e]) * (x[tok] @ Wu[e])) @ Wd[e],  tok = sorted_token[r]

in float32. Rows outside every tile are left unwritten (the caller masks them: invalid tokens and
the padding rows). The routing metadata is computed once per layer by the caller
(``ddtree_jax.models.moe.route_tokens``); the combine (the k copies of a token summed back into
its row) is a gather and a sum of k rows in plain JAX, in a fixed order (no atomics, so the result
does not depend on scheduling).

Backend: the Pallas Triton lowering. The kernel needs per-tile dynamic expert ids (scalar loads
that select a weight slab), row gathers of ``x`` by token index, and early exit for the unused
tail of a static grid; Triton has all three and its ``dot`` runs bf16 MMA with float32
accumulation. Mosaic GPU (wgmma, TMA) would be the route to the last fraction of Hopper's matmul
rate in prefill, but its TMA loads cannot gather rows by index; not built.

Algorithm (two launches; grid = (row tiles upper bound, output column blocks)):

1. ``_gate_up_kernel``: program (t, j) gathers the ``block_m`` token rows of tile t chunk by chunk
   along the hidden dim, multiplies them by the gate AND up columns ``[j*bn, (j+1)*bn)`` of its
   expert (``gate_up [E, H, 2I]``: gate columns first, then up), and stores
   ``silu(gate) * up`` (the activation dtype) into ``h [R, I]`` at the tile's sorted rows.
2. ``_down_kernel``: program (t, j) reads the tile's rows of ``h`` and the down columns
   ``[j*bn, (j+1)*bn)`` of its expert, scales each row by its routing weight and stores float32
   into ``y [R, H]``.

Every program of tile t reads only its expert's weights, so an expert that received no token is
never read, and an expert's weights are read once per row tile of its tokens (decode: one tile
per touched expert). The grid is static: ``min(E, R) + R // block_m`` row tiles bound the real
count ``sum_e ceil(count_e / block_m)``; programs past the real count exit at once. Nothing of
size ``[E, R, ...]`` is materialised; the intermediates are ``h [R, I]`` and ``y [R, H]``.

Block sizes (``choose_blocks``): ``block_m`` follows the expected copies per expert
(``R / E``): 16 (Triton's smallest MMA tile) for decode and tree verify, where a touched expert
gets about one token and the pass is bound by reading the weights; up to 128 for prefill, where
the MMA rate matters and larger M tiles re-read each expert's weights fewer times. The column
blocks stay small enough (64 for gate/up, which keeps two accumulators; 128 for down) that a
decode step with 8 touched experts still launches hundreds of programs to fill the GPU's SMs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["MoEBlocks", "choose_blocks", "max_row_tiles", "moe_grouped_matmul"]

# float32 operands multiply in IEEE float32 (the Triton lowering's DEFAULT precision is tf32, about
# 1e-3 relative); bf16 operands are unaffected (bf16 MMA, float32 accumulation).
_IEEE = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class MoEBlocks:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters of the two launches."""

    block_m: int = 16
    block_n_gate_up: int = 64
    block_n_down: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def choose_blocks(num_rows: int, num_experts: int) -> MoEBlocks:
    """Blocks for ``num_rows`` token copies (tokens x top-k) over ``num_experts`` experts."""
    per_expert = num_rows / num_experts
    if per_expert <= 16:
        return MoEBlocks(block_m=16, num_warps=4)
    if per_expert <= 32:
        return MoEBlocks(block_m=32, num_warps=4)
    if per_expert <= 64:
        return MoEBlocks(block_m=64, block_k=64, num_warps=4)
    return MoEBlocks(block_m=128, block_k=64, num_warps=8)


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on ``sum_e ceil(count_e / block_m)`` over counts summing to <= num_rows."""
    return max(1, min(num_experts, num_rows) + num_rows // block_m)


def _block(dim: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides ``dim`` (>= 16: checked by the caller)."""
    b = want
    while dim % b:
        b //= 2
    return b


def _tile_rows(ts_ref, te_ref, t, bm):
    start = ts_ref[t]
    end = te_ref[t]
    rows = start + jnp.arange(bm, dtype=jnp.int32)
    return start, end, rows < end


def _gate_up_kernel(x_ref, w_ref, tok_ref, ex_ref, ts_ref, te_ref, h_ref, *, H, inter, bm, bn, bk):
    t = pl.program_id(0)
    j = pl.program_id(1)
    start, end, live = _tile_rows(ts_ref, te_ref, t, bm)

    @pl.when(start < end)
    def _():
        e = ex_ref[t]
        tok = plgpu.load(tok_ref.at[pl.ds(start, bm)], mask=live, other=0)
        n0 = j * bn

        def body(kk, acc):
            g, u = acc
            k0 = pl.multiple_of(kk * bk, bk)
            cols = k0 + jnp.arange(bk, dtype=jnp.int32)
            # a row gather: two index arrays (interpret mode cannot mix an index array and a slice)
            xb = plgpu.load(x_ref.at[tok[:, None], cols[None, :]], mask=live[:, None], other=0)
            wg = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)]
            wu = w_ref[e, pl.ds(k0, bk), pl.ds(inter + n0, bn)]
            g = g + jnp.dot(xb, wg, preferred_element_type=jnp.float32, precision=_IEEE)
            u = u + jnp.dot(xb, wu, preferred_element_type=jnp.float32, precision=_IEEE)
            return g, u

        zero = jnp.zeros((bm, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, H // bk, body, (zero, zero))
        h = g / (1.0 + jnp.exp(-g)) * u
        plgpu.store(h_ref.at[pl.ds(start, bm), pl.ds(n0, bn)], h.astype(h_ref.dtype), mask=live[:, None])


def _down_kernel(h_ref, w_ref, wt_ref, ex_ref, ts_ref, te_ref, y_ref, *, inter, bm, bn, bk):
    t = pl.program_id(0)
    j = pl.program_id(1)
    start, end, live = _tile_rows(ts_ref, te_ref, t, bm)

    @pl.when(start < end)
    def _():
        e = ex_ref[t]
        n0 = j * bn

        def body(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            hb = plgpu.load(h_ref.at[pl.ds(start, bm), pl.ds(k0, bk)], mask=live[:, None], other=0)
            wd = w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)]
            return acc + jnp.dot(hb, wd, preferred_element_type=jnp.float32, precision=_IEEE)

        acc = jax.lax.fori_loop(0, inter // bk, body, jnp.zeros((bm, bn), jnp.float32))
        wt = plgpu.load(wt_ref.at[pl.ds(start, bm)], mask=live, other=0.0)
        plgpu.store(y_ref.at[pl.ds(start, bm), pl.ds(n0, bn)], acc * wt[:, None], mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def moe_grouped_matmul(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    sorted_token: jax.Array,
    sorted_weight: jax.Array,
    tile_expert: jax.Array,
    tile_start: jax.Array,
    tile_end: jax.Array,
    *,
    blocks: MoEBlocks,
    interpret: bool = False,
) -> jax.Array:
    """The routed experts' weighted outputs for every sorted token copy (see the module docstring).

    Args:
      x: ``[N, H]`` tokens (float32 or bfloat16).
      gate_up: ``[E, H, 2I]`` gate columns then up columns; ``down``: ``[E, I, H]``; x's dtype.
      sorted_token: i32 ``[R]`` row of ``x`` for each sorted copy; ``R >= max(tile_end) +
        blocks.block_m`` (the tail is padding so that every tile's row block is in bounds).
      sorted_weight: f32 ``[R]`` routing weight of each sorted copy.
      tile_expert, tile_start, tile_end: i32 ``[T]`` per row tile (``start == end``: unused).
      blocks: tile sizes; ``blocks.block_m`` must be the tile height the tiles were built with.
        H and I must be multiples of 16.

    Returns:
      f32 ``[R, H]``; rows outside every tile are unspecified.
    """
    N, H = x.shape
    E, inter = down.shape[0], down.shape[1]
    (R,) = sorted_token.shape
    (T,) = tile_expert.shape
    if H % 16 or inter % 16:
        raise ValueError(f"moe_grouped_matmul: hidden ({H}) and intermediate ({inter}) sizes must be multiples of 16")
    if gate_up.shape != (E, H, 2 * inter) or down.shape != (E, inter, H):
        raise ValueError(f"moe_grouped_matmul: gate_up {gate_up.shape} / down {down.shape} do not match x {x.shape}")
    bm = blocks.block_m
    bn1, bn2 = _block(inter, blocks.block_n_gate_up), _block(H, blocks.block_n_down)
    bk1, bk2 = _block(H, blocks.block_k), _block(inter, blocks.block_k)
    i32 = jnp.int32
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    meta = (tile_expert.astype(i32), tile_start.astype(i32), tile_end.astype(i32))
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, H=H, inter=inter, bm=bm, bn=bn1, bk=bk1),
        grid=(T, inter // bn1),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((R, inter), x.dtype),
        compiler_params=params,
        interpret=interpret,
        name="ddtree_moe_gate_up",
    )(x, gate_up, sorted_token.astype(i32), *meta)
    return pl.pallas_call(
        functools.partial(_down_kernel, inter=inter, bm=bm, bn=bn2, bk=bk2),
        grid=(T, H // bn2),
        in_specs=[any_spec] * 6,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((R, H), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="ddtree_moe_down",
    )(h, down, sorted_weight.astype(jnp.float32), *meta)
