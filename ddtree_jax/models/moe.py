"""Routed experts of a MoE layer as pure functions: routing metadata, two plain-JAX paths and the
Pallas kernel path, chosen by a ``Backend``.

Shapes: ``N`` tokens, ``k`` experts per token, ``E`` experts, ``H`` hidden, ``I`` expert
intermediate size; ``gate_up [E, H, 2I]`` (gate columns, then up), ``down [E, I, H]``.

* ``experts_reference``: every expert on every token, weighted by a dense ``[N, E]`` routing
  matrix (slow, obviously correct; tests and benchmarks).
* ``experts_ragged_dot``: ``jax.lax.ragged_dot`` over token copies sorted by expert (exact; the
  CPU default; on the GPU XLA lowers it through a ``[E, N*k, I]`` masked copy).
* ``experts_grouped_matmul``: ``pallas_kernels.triton.moe_grouped_matmul`` over the same sorted
  copies, then a fixed-order sum of each token's k outputs.

INT4 experts (``gate_up`` and ``down`` given as ``ddtree_jax.models.int4.PackedWeight``): the
kernel path runs ``moe_grouped_matmul_int4`` (dequantisation in registers); the two plain-JAX
paths dequantise the layer's experts in plain JAX on every call (``int4.dequantize``: a transient
dense copy of one layer's experts) and run as above. The kernel's reference is therefore the
dense path on the dequantised weights.

Tokens with ``valid == False`` (unused tree slots) route to no expert: their copies sort last, no
path computes them, and their routed output is zero.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddtree_jax.backend import Backend, has_kernel
from ddtree_jax.models._layers import silu_glu
from ddtree_jax.models.int4 import PackedWeight, dequantize

__all__ = [
    "ExpertRouting",
    "experts_expert_parallel",
    "experts_grouped_matmul",
    "experts_ragged_dot",
    "experts_reference",
    "route_tokens",
    "dense_weights",
    "routed_experts",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertRouting:
    """Token copies sorted by expert (stable: token order within an expert), computed once per layer.

    ``R = N*k`` copies; ``Rp = R + block_m`` sorted rows (the tail pads the last row tile).

    Attributes:
      sorted_token: i32 ``[Rp]`` token of each sorted copy (0 in the padding).
      sorted_weight: f32 ``[Rp]`` its routing weight (0 for invalid copies and the padding).
      group_sizes: i32 ``[E]`` copies per expert (invalid copies counted nowhere).
      slot_row: i32 ``[N, k]`` the sorted row of copy ``(n, j)``.
      slot_valid: bool ``[N, k]`` the copy routes to an expert (its token is valid).
      tile_expert, tile_start, tile_end: i32 ``[T]`` row tiles of at most ``block_m`` sorted rows
        of one expert (``T = max_row_tiles``; the unused tail has ``start == end``).
    """

    sorted_token: jax.Array
    sorted_weight: jax.Array
    group_sizes: jax.Array
    slot_row: jax.Array
    slot_valid: jax.Array
    tile_expert: jax.Array
    tile_start: jax.Array
    tile_end: jax.Array


def route_tokens(weights: jax.Array, ids: jax.Array, num_experts: int, *, valid: jax.Array | None = None,
                 block_m: int = 16) -> ExpertRouting:
    """Sort the copies ``ids [N, k]`` (weights ``[N, k]``) by expert; invalid copies (``valid``:
    bool ``[N]`` per token or ``[N, k]`` per copy; None: all valid) sort last."""
    from pallas_kernels.triton.moe_grouped_matmul import max_row_tiles

    n, k = ids.shape
    r, e = n * k, num_experts
    chex.assert_shape(weights, (n, k))
    if valid is None:
        slot_valid = jnp.ones((n, k), bool)
    else:
        slot_valid = jnp.broadcast_to(valid.reshape(n, -1), (n, k))
    flat = jnp.where(slot_valid, ids, e).reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sorted_valid = slot_valid.reshape(-1)[order]
    weight = jnp.where(sorted_valid, weights.reshape(-1)[order].astype(jnp.float32), 0.0)
    pad = jnp.zeros((block_m,), jnp.int32)
    group_sizes = jnp.bincount(flat, length=e + 1)[:e].astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = (group_sizes + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles)
    t = jnp.arange(max_row_tiles(r, e, block_m), dtype=jnp.int32)
    # One fused compare-and-count ([tiles, E] compares), not the default method's loop of
    # binary-search steps, which took about three times as long (docs/kernels.md, "MoE experts").
    tile_expert = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right", method="compare_all"),
                              e - 1).astype(jnp.int32)
    tile_start = starts[tile_expert] + (t - (tiles_end - tiles)[tile_expert]) * block_m
    tile_end = jnp.where(t < tiles_end[-1], jnp.minimum(tile_start + block_m, ends[tile_expert]), tile_start)
    return ExpertRouting(
        sorted_token=jnp.concatenate([order // k, pad]),
        sorted_weight=jnp.concatenate([weight, pad.astype(jnp.float32)]),
        group_sizes=group_sizes,
        slot_row=jnp.zeros((r,), jnp.int32).at[order].set(jnp.arange(r, dtype=jnp.int32)).reshape(n, k),
        slot_valid=slot_valid,
        tile_expert=tile_expert,
        tile_start=tile_start.astype(jnp.int32),
        tile_end=tile_end.astype(jnp.int32),
    )


def dense_weights(w, dtype):
    """``w`` as a dense ``[E, K, N]`` array: a ``PackedWeight`` dequantised to ``dtype`` (plain JAX),
    an array as it is."""
    return dequantize(w, dtype) if isinstance(w, PackedWeight) else w


def experts_reference(x, gate_up, down, weights, ids, valid=None) -> jax.Array:
    """Every expert run densely on every token: ``x [N,H]``, ``weights/ids [N,k]`` -> ``[N,H]``
    (INT4 weights dequantised to x's dtype first)."""
    gate_up, down = dense_weights(gate_up, x.dtype), dense_weights(down, x.dtype)
    n = x.shape[0]
    if valid is not None:
        weights = jnp.where(valid[:, None], weights, 0.0)
    dense_w = jnp.zeros((n, gate_up.shape[0]), jnp.float32).at[jnp.arange(n)[:, None], ids].add(weights)
    gate, up = jnp.split(jnp.einsum("nh,ehi->eni", x, gate_up), 2, axis=-1)
    out = jnp.einsum("eni,eih->enh", silu_glu(gate, up), down)
    return jnp.einsum("enh,ne->nh", out, dense_w.astype(out.dtype))


def experts_ragged_dot(x, gate_up, down, routing: ExpertRouting) -> jax.Array:
    """``jax.lax.ragged_dot`` over the sorted copies, then each token's k rows summed in float32 in
    copy order (a gather, not a scatter-add: a GPU scatter-add adds with atomics in no fixed order,
    so replicas of one computation could disagree). INT4 weights are dequantised to x's dtype first."""
    gate_up, down = dense_weights(gate_up, x.dtype), dense_weights(down, x.dtype)
    n, k = routing.slot_row.shape
    token = routing.sorted_token[: n * k]
    gate_up_rows = jax.lax.ragged_dot(x[token], gate_up, routing.group_sizes)
    gate, up = jnp.split(gate_up_rows, 2, axis=-1)
    out = jax.lax.ragged_dot(silu_glu(gate, up), down, routing.group_sizes)
    return combine_copies(out.astype(jnp.float32) * routing.sorted_weight[: n * k, None], routing, x.dtype)


def combine_copies(rows: jax.Array, routing: ExpertRouting, out_dtype) -> jax.Array:
    """Each token's k expert outputs (``rows [R, H]`` float32 in sorted-copy order) summed in
    float32, copy 0 first, then 1, ...: a gather and a fixed chain of adds (a GPU scatter-add or
    reduction may add in no fixed order, and replicas of one computation could then disagree)."""
    picked = jnp.where(routing.slot_valid[..., None], rows[routing.slot_row], 0.0)  # [N, k, H]
    total = picked[:, 0]
    for j in range(1, picked.shape[1]):
        total = total + picked[:, j]
    return total.astype(out_dtype)


def experts_grouped_matmul(x, gate_up, down, routing: ExpertRouting, blocks, *, interpret: bool = False,
                           out_dtype=None) -> jax.Array:
    """The Pallas grouped-matmul kernel over the sorted copies (``moe_grouped_matmul_int4`` for
    ``PackedWeight`` experts), then each token's k rows summed (in float32, in copy order; cast to
    ``out_dtype``, default x's)."""
    from pallas_kernels.triton.moe_grouped_matmul import moe_grouped_matmul, moe_grouped_matmul_int4

    meta = (routing.sorted_token, routing.sorted_weight, routing.tile_expert, routing.tile_start, routing.tile_end)
    if isinstance(gate_up, PackedWeight) != isinstance(down, PackedWeight):
        raise ValueError("experts_grouped_matmul: gate_up and down must both be INT4 (PackedWeight) or both dense")
    if isinstance(gate_up, PackedWeight):
        y = moe_grouped_matmul_int4(x, gate_up.packed, gate_up.scale, down.packed, down.scale, *meta,
                                    gate_up_zero=gate_up.zero, down_zero=down.zero, blocks=blocks,
                                    interpret=interpret)
    else:
        y = moe_grouped_matmul(x, gate_up, down, *meta, blocks=blocks, interpret=interpret)
    return combine_copies(y, routing, out_dtype or x.dtype)


def routed_experts(x: jax.Array, gate_up: jax.Array, down: jax.Array, weights: jax.Array, ids: jax.Array, *,
                   backend: Backend, valid: jax.Array | None = None,
                   expert_mesh: tuple[Mesh, str] | None = None, blocks=None) -> jax.Array:
    """The routed experts' combined output ``[N, H]`` (``valid [N]`` bool or None: all valid).
    ``gate_up`` / ``down``: dense arrays or INT4 ``PackedWeight`` (see the module docstring).

    ``expert_mesh = (mesh, axis)``: the weights' expert dim is sharded over ``axis`` of ``mesh``;
    the kernel path then runs ``experts_expert_parallel`` (the ragged_dot path leaves it to GSPMD,
    which partitions ragged_dot by expert without gathering the weights).
    ``blocks``: the kernel's ``MoEBlocks`` pinned (``None``: ``choose_blocks`` by the number of
    token copies). A row's arithmetic depends on the blocks (the hidden dim's chunking
    ``block_k`` and the MMA shape ``block_m`` x ``num_warps`` pick), never on the other rows:
    pinned blocks make the routed experts batch-invariant at any N (see docs/kernels.md)."""
    kernel = has_kernel(backend, "moe_grouped_matmul")  # Triton only so far: TPUs run ragged_dot
    if kernel and expert_mesh is not None and expert_mesh[0].shape[expert_mesh[1]] > 1:
        return experts_expert_parallel(x, gate_up, down, weights, ids, valid, *expert_mesh, backend=backend,
                                       blocks=blocks)
    if kernel:
        return _experts_kernel(x, gate_up, down, weights, ids, valid, backend, blocks=blocks)
    return experts_ragged_dot(x, gate_up, down, route_tokens(weights, ids, gate_up.shape[0], valid=valid))


def _experts_kernel(x, gate_up, down, weights, ids, valid, backend: Backend, out_dtype=None, blocks=None) -> jax.Array:
    from pallas_kernels.triton.moe_grouped_matmul import choose_blocks

    n, k = ids.shape
    e = gate_up.shape[0]
    blocks = blocks or choose_blocks(n * k, e, int4=isinstance(gate_up, PackedWeight), act_bytes=x.dtype.itemsize)
    routing = route_tokens(weights, ids, e, valid=valid, block_m=blocks.block_m)
    return experts_grouped_matmul(x, gate_up, down, routing, blocks, interpret=backend.interpret,
                                  out_dtype=out_dtype)


def experts_expert_parallel(x, gate_up, down, weights, ids, valid, mesh: Mesh, axis: str, *,
                            backend: Backend, blocks=None) -> jax.Array:
    """Expert parallelism without moving weights: each device of ``axis`` runs the kernel for its
    own ``E / devices`` experts on all (its data shard's) tokens, copies routed elsewhere count as
    invalid there, and one float32 ``psum`` over ``axis`` adds the partial outputs.

    The weights (each array of a ``PackedWeight`` alike) enter the ``shard_map`` split over
    ``axis`` only: a weight also split over
    another axis (``tensor``) is gathered over it first, because ``gate_up``'s gate and up
    halves would land on different tensor shards (a limitation of the stacked layout).
    Tokens stay split over ``data`` when the mesh has it and it divides N; else replicated.
    """
    n, k = ids.shape
    e = gate_up.shape[0]
    ep = mesh.shape[axis]
    if e % ep:
        raise ValueError(f"expert parallelism: {e} experts do not split over {ep} devices of {axis!r}")
    e_local = e // ep
    data = "data" if "data" in mesh.axis_names and mesh.shape["data"] > 1 and n % mesh.shape["data"] == 0 else None
    valid = jnp.ones((n,), bool) if valid is None else valid

    def local(x, weights, ids, valid, gate_up, down):
        local_ids = ids - jax.lax.axis_index(axis) * e_local
        mine = valid[:, None] & (local_ids >= 0) & (local_ids < e_local)
        out = _experts_kernel(x, gate_up, down, weights, jnp.where(mine, local_ids, 0), mine, backend,
                              out_dtype=jnp.float32, blocks=blocks)
        return jax.lax.psum(out, axis).astype(x.dtype)

    tok = P(data)
    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, tok, P(axis), P(axis)), out_specs=tok,
                         check_vma=False)(x, weights, ids, valid, gate_up, down)
