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
from ddtree_jax.rows import RowMesh, row_spec

__all__ = [
    "ExpertMesh",
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
    # The barrier keeps the prefix sum a kernel of its own: fused into the compare-and-count below,
    # XLA's GPU backend recomputed it for every compare, E steps in each of the few threads (on
    # the H200, 10 us per layer with 16 experts; docs/kernels.md, "MoE experts").
    tiles_end = jax.lax.optimization_barrier(jnp.cumsum(tiles))
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


def experts_ragged_dot(x, gate_up, down, routing: ExpertRouting, out_dtype=None) -> jax.Array:
    """``jax.lax.ragged_dot`` over the sorted copies, then each token's k rows summed in float32 in
    copy order (a gather, not a scatter-add: a GPU scatter-add adds with atomics in no fixed order,
    so replicas of one computation could disagree), cast to ``out_dtype`` (default x's). INT4
    weights are dequantised to x's dtype first."""
    gate_up, down = dense_weights(gate_up, x.dtype), dense_weights(down, x.dtype)
    n, k = routing.slot_row.shape
    token = routing.sorted_token[: n * k]
    gate_up_rows = jax.lax.ragged_dot(x[token], gate_up, routing.group_sizes)
    gate, up = jnp.split(gate_up_rows, 2, axis=-1)
    out = jax.lax.ragged_dot(silu_glu(gate, up), down, routing.group_sizes)
    return combine_copies(out.astype(jnp.float32) * routing.sorted_weight[: n * k, None], routing,
                          out_dtype or x.dtype)


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
                   expert_mesh: ExpertMesh | None = None, blocks=None, batch: int | None = None) -> jax.Array:
    """The routed experts' combined output ``[N, H]`` (``valid [N]`` bool or None: all valid).
    ``batch``: the batch rows the N tokens are (row-major) the flattening of (None: N), which
    ``expert_mesh.rows`` splits as it splits the rest of the model.
    ``gate_up`` / ``down``: dense arrays or INT4 ``PackedWeight`` (see the module docstring).

    ``expert_mesh``: the weights' expert dim is sharded over ``expert_mesh.axis`` (of more than
    one device); both paths then run ``experts_expert_parallel``.
    ``blocks``: the kernel's ``MoEBlocks`` pinned (``None``: ``choose_blocks`` by the number of
    token copies). A row's arithmetic depends on the blocks (the hidden dim's chunking
    ``block_k`` and the MMA shape ``block_m`` x ``num_warps`` pick), never on the other rows:
    pinned blocks make the routed experts batch-invariant at any N (see docs/kernels.md)."""
    kernel = has_kernel(backend, "moe_grouped_matmul")  # Triton only so far: TPUs run ragged_dot
    if expert_mesh is not None and expert_mesh.mesh.shape[expert_mesh.axis] > 1:
        return experts_expert_parallel(x, gate_up, down, weights, ids, valid, expert_mesh, backend=backend,
                                       blocks=blocks, batch=batch)
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


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """Where a MoE layer's experts and tokens live: the experts' dim split over ``axis`` of
    ``mesh``, the tokens' rows over ``rows`` (``None``: every device holds every token)."""

    mesh: Mesh
    axis: str
    rows: RowMesh | None = None


def experts_expert_parallel(x, gate_up, down, weights, ids, valid, expert_mesh: ExpertMesh, *,
                            backend: Backend, blocks=None, batch: int | None = None) -> jax.Array:
    """Expert parallelism without moving weights: each device of the expert axis runs its own
    ``E / devices`` experts (the kernel where ``backend`` has it, else ``ragged_dot``), copies
    routed elsewhere count as invalid there, and the float32 partial outputs are summed over the
    axis.

    The tokens enter split as their ``batch`` rows split (``RowMesh.split``; ``batch`` None: N
    rows of one token). Where that
    includes the expert axis (data-parallel attention: each device holds its own rows), each
    device gathers the tokens of its expert group (``all_gather``), runs its experts on all of
    them, and a ``psum_scatter`` sums the partial outputs and hands each device its own rows back;
    otherwise every device of the axis holds the same tokens and one ``psum`` adds the partials.

    The weights (each array of a ``PackedWeight`` alike) enter the ``shard_map`` split over
    the expert axis only: a weight also split over another axis (``tensor``) is gathered over it
    first, because ``gate_up``'s gate and up halves would land on different tensor shards (a
    limitation of the stacked layout).
    """
    mesh, axis = expert_mesh.mesh, expert_mesh.axis
    n, k = ids.shape
    e = gate_up.shape[0]
    ep = mesh.shape[axis]
    if e % ep:
        raise ValueError(f"expert parallelism: {e} experts do not split over {ep} devices of {axis!r}")
    e_local = e // ep
    rows = expert_mesh.rows.split(n if batch is None else batch) if expert_mesh.rows is not None else ()
    gathered = axis in rows
    valid = jnp.ones((n,), bool) if valid is None else valid

    def local(x, weights, ids, valid, gate_up, down):
        if gathered:
            x, weights, ids, valid = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x, weights, ids, valid))
        local_ids = ids - jax.lax.axis_index(axis) * e_local
        mine = valid[:, None] & (local_ids >= 0) & (local_ids < e_local)
        local_ids = jnp.where(mine, local_ids, 0)
        if has_kernel(backend, "moe_grouped_matmul"):
            out = _experts_kernel(x, gate_up, down, weights, local_ids, mine, backend, out_dtype=jnp.float32,
                                  blocks=blocks)
        else:
            out = experts_ragged_dot(x, gate_up, down, route_tokens(weights, local_ids, e_local, valid=mine),
                                     out_dtype=jnp.float32)
        if gathered:
            return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True).astype(x.dtype)
        return jax.lax.psum(out, axis).astype(x.dtype)

    tok = row_spec(rows)
    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, tok, P(axis), P(axis)), out_specs=tok,
                         check_vma=False)(x, weights, ids, valid, gate_up, down)
