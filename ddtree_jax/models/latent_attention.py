"""MLA attention core in the absorbed form: a block's queries against the latent cache.

``latent_attention`` dispatches on the ``Backend``: on an sm_90 GPU the Hopper kernel
(``pallas_kernels.mosaic_gpu.mla_prefix`` through ``prefix_block_attention``), else the Triton
kernel (``pallas_kernels.triton.mla_attention``; both use an online softmax and read each row's
cache only up to its current length), or ``latent_attention_reference`` (the dense computation:
scores over the whole cache under the dense ``[B,T,S]`` mask). ``W_UK`` is applied before and ``W_UV``/``o_proj`` after,
by ``ddtree_jax.models.kimi.MLAttention``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddtree_jax.backend import Backend, has_kernel
from ddtree_jax.config import SEGMENT_GROUP, SEGMENT_KEYS
from ddtree_jax.models._layers import masked_softmax
from ddtree_jax.models.tree_cache import BlockMask
from ddtree_jax.rows import RowMesh

__all__ = [
    "CACHE_SLOT_MULTIPLE",
    "HOPPER_MAX_BLOCK",
    "cache_slots",
    "SEGMENT_GROUP",
    "SEGMENT_KEYS",
    "AttentionMesh",
    "hopper_runs",
    "latent_attention",
    "latent_attention_reference",
    "per_head_causal_attention",
    "prefix_block_attention",
    "PER_HEAD_PAD",
]


def latent_attention_reference(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                               mask: BlockMask, *, scale: float) -> jax.Array:
    """``q_latent [B,T,H,r]``, ``q_rope [B,T,H,dr]`` over ``latent [B,S,r]``, ``k_rope [B,S,dr]``
    -> ``[B,T,H,r]`` in ``q_latent``'s dtype; softmax in float32 over the dense mask."""
    b, t = q_latent.shape[:2]
    dense = mask.dense(t, latent.shape[1])
    dtype = q_latent.dtype
    scores = jnp.einsum("btnr,bsr->bnts", q_latent, latent.astype(dtype)) + jnp.einsum(
        "btnd,bsd->bnts", q_rope, k_rope.astype(q_rope.dtype)
    )
    probs = masked_softmax(scores * scale, dense[:, None]).astype(dtype)
    return jnp.einsum("bnts,bsr->btnr", probs, latent.astype(dtype))


def per_head_causal_attention(q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array,
                              w_k: jax.Array, w_v: jax.Array, *, scale: float, implementation: str | None,
                              mesh: AttentionMesh | None = None) -> jax.Array:
    """A causal block that starts at slot 0 in the per-head (not absorbed) form: keys and values
    up-projected from the block's latents, then standard causal attention. ``q_nope [B,T,H,dn]``,
    ``q_rope [B,T,H,dr]``, ``latent [B,T,r]``, ``k_rope [B,T,dr]`` (the block's own slots),
    ``w_k [r,H,dn]``, ``w_v [r,H,dv]`` -> ``[B,T,H,dv]``. Per (query, key) pair it does
    ``2 H (dn + dr + dv)`` flops against the absorbed form's ``2 H (2r + dr)`` (a third at K2
    shapes), which is what a long prefill wants. ``implementation``: ``jax.nn.dot_product_attention``'s
    (``"cudnn"`` on the GPU: its flash attention never builds the ``[B,H,T,T]`` scores; ``"xla"``
    builds them). The values are zero-padded to the key width (the function takes one head dim), and
    the block to a multiple of ``PER_HEAD_PAD`` tokens (padding after the last query is invisible to
    every query under the causal mask; flash kernels favour whole tiles). ``mesh``: run in a
    ``shard_map`` with batch rows over ``mesh.rows`` and heads over ``mesh.tensor`` (each head is
    independent), so no partitioner has to split the attention call."""
    data, tensor = _split_axes(mesh, q_nope.shape[0], q_nope.shape[2])
    local = functools.partial(_per_head_local, scale=scale, implementation=implementation)
    if data is None and tensor is None:
        return local(q_nope, q_rope, latent, k_rope, w_k, w_v)
    q, rows, w = P(data, None, tensor, None), P(data), P(None, tensor, None)
    return jax.shard_map(local, mesh=mesh.mesh, in_specs=(q, q, rows, rows, w, w), out_specs=q,
                         check_vma=False)(q_nope, q_rope, latent, k_rope, w_k, w_v)


def _per_head_local(q_nope, q_rope, latent, k_rope, w_k, w_v, *, scale, implementation):
    b, t, h, dn = q_nope.shape
    dv = w_v.shape[-1]
    dtype = q_nope.dtype
    tp = -(-t // PER_HEAD_PAD) * PER_HEAD_PAD
    pad_t = ((0, 0), (0, tp - t))
    latent, k_rope = jnp.pad(latent, pad_t + ((0, 0),)), jnp.pad(k_rope, pad_t + ((0, 0),))
    q_nope, q_rope = jnp.pad(q_nope, pad_t + ((0, 0), (0, 0))), jnp.pad(q_rope, pad_t + ((0, 0), (0, 0)))
    k_nope = jnp.einsum("bsr,rnd->bsnd", latent.astype(dtype), w_k.astype(dtype))
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope.astype(dtype)[:, :, None], (b, tp, h, k_rope.shape[-1]))], -1)
    q = jnp.concatenate([q_nope, q_rope.astype(dtype)], -1)
    v = jnp.einsum("bsr,rnd->bsnd", latent.astype(dtype), w_v.astype(dtype))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k.shape[-1] - dv)))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    return out[:, :t, :, :dv]


# ``per_head_causal_attention`` pads its block to a multiple of this many tokens.
PER_HEAD_PAD = 128

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class AttentionMesh:
    """Where a model's attention inputs live: ``mesh`` with batch rows (caches, ``start``) split
    over ``rows`` (``ddtree_jax.rows.RowMesh``) and heads over ``tensor`` (either ``None``: not
    split)."""

    mesh: Mesh
    rows: RowMesh | None = None
    tensor: str | None = None

    @classmethod
    def of(cls, mesh: Mesh | None, mesh_axes: dict) -> AttentionMesh | None:
        """From a mesh and the checkpoints' logical -> mesh axis map (``None`` without a mesh)."""
        if mesh is None:
            return None
        rows = RowMesh.of(mesh, mesh_axes)
        tensor = mesh_axes.get("tensor")
        tensor = tensor if tensor in mesh.axis_names and mesh.shape[tensor] > 1 else None
        return cls(mesh, rows, tensor) if rows or tensor else None


def _split_axes(mesh: AttentionMesh | None, b: int, h: int):
    """The mesh axes a ``shard_map`` splits batch rows (``RowMesh.split``: the row axes that divide
    ``b``, as one ``PartitionSpec`` entry) and heads (``tensor``, when it divides ``h``) over;
    ``None`` where not split."""
    if mesh is None:
        return None, None
    axes = mesh.rows.split(b) if mesh.rows is not None else ()
    data = (axes if len(axes) > 1 else axes[0]) if axes else None
    tensor = mesh.tensor if mesh.tensor and h % mesh.mesh.shape[mesh.tensor] == 0 else None
    return data, tensor


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, mask: BlockMask,
                     *, scale: float, backend: Backend, mesh: AttentionMesh | None = None,
                     segment_keys: int | None = SEGMENT_KEYS, segment_group: int = SEGMENT_GROUP,
                     hopper: bool = True) -> jax.Array:
    """Absorbed MLA attention (see ``latent_attention_reference`` for the shapes), by ``backend``.

    Kernels: with ``hopper`` and where ``hopper_runs`` says so (compiled on an sm_90 GPU, bf16
    caches, shapes the kernel takes, blocks of at most ``HOPPER_MAX_BLOCK`` tokens),
    ``prefix_block_attention`` (the Mosaic GPU kernel; its speed against the Triton kernel:
    docs/performance.md, "Kernels"); otherwise the Triton kernel with its fixed segments (bitwise the same
    for a row whatever the batch: the batch-invariant mode passes ``hopper=False``).

    The block's own latents must already be in ``latent``/``k_rope`` at ``[start, start+T)``.
    ``mesh``: the kernel runs in a ``shard_map``, batch rows split over ``mesh.rows`` (the axes
    that divide B) and heads over ``mesh.tensor`` (when it divides H), so that GSPMD never gathers
    the caches or the heads around the kernel; the reference is left to GSPMD.
    ``segment_keys``, ``segment_group``: the kernel's fixed reduction segments and their groups
    (``None``/0: the older layout-dependent splits, ``auto_split_keys`` alone).
    """
    b, t, h, r = q_latent.shape
    s = latent.shape[1]
    chex.assert_shape([q_latent, latent, mask.start], [(b, t, h, r), (b, s, r), (b,)])
    if not has_kernel(backend, "mla_attention"):  # no kernel for this family (TPU): the reference
        return latent_attention_reference(q_latent, q_rope, latent, k_rope, mask, scale=scale)
    if hopper and hopper_runs(backend, t, h, r, q_rope.shape[-1], latent.dtype, s):
        def kernel(q_latent, q_rope, latent, k_rope, start, within=None):
            return prefix_block_attention(q_latent, q_rope, latent, k_rope, start, within, scale=float(scale))
    else:
        kernel = functools.partial(_kernel, scale=float(scale), causal=mask.causal, interpret=backend.interpret,
                                   segment_keys=segment_keys or 0, segment_group=segment_group)
    data, tensor = _split_axes(mesh, b, h)
    args = (q_latent, q_rope, latent, k_rope, mask.start) + (() if mask.causal else (mask.within,))
    if data is None and tensor is None:
        return kernel(*args)
    q, rows = P(data, None, tensor, None), P(data)
    specs = (q, q, rows, rows, rows, rows)[: len(args)]
    return jax.shard_map(kernel, mesh=mesh.mesh, in_specs=specs, out_specs=q, check_vma=False)(*args)


def segmented_split(split: int, segment_keys: int, segment_group: int, block_k: int) -> tuple[int, int]:
    """``(split_keys, segment_keys)`` for ``mla_attention`` with fixed segments: ``segment_keys``
    rounded up to whole key tiles, and the heuristic's split moved onto a group (``split >=`` a
    group) or segment boundary (0 stays 0: one program). ``segment_keys`` 0: no segments, the
    split as it is."""
    if not segment_keys:
        return split, 0
    segment_keys = -(-segment_keys // block_k) * block_k
    group = segment_keys * segment_group
    return (0 if not split else group if split >= group else segment_keys), segment_keys


def _kernel(q_latent, q_rope, latent, k_rope, start, within=None, *, scale, causal, interpret, segment_keys,
            segment_group):
    """The Pallas kernel on (local) arrays; the parallel split follows the local shapes."""
    from pallas_kernels.triton.mla_attention import auto_split_keys, default_tiles, mla_attention

    b, t, h, _ = q_latent.shape
    s = latent.shape[1]
    tiles = default_tiles(latent.dtype)
    split, segment_keys = segmented_split(auto_split_keys(b, t * h, s, block_m=tiles["block_m"],
                                                          block_k=tiles["block_k"]),
                                          segment_keys, segment_group, tiles["block_k"])
    out = mla_attention(
        q_latent.astype(latent.dtype),
        q_rope.astype(k_rope.dtype),
        latent,
        k_rope,
        start,
        within,
        scale=scale,
        causal=causal,
        split_keys=split,
        segment_keys=segment_keys,
        segment_group=segment_group,
        interpret=interpret,
    )
    return out.astype(q_latent.dtype)


# The Hopper path's block part builds ``[B, T*H, T]`` float32 scores in XLA: blocks up to this
# many tokens (tree verifies, decode steps, short chunks) take it, longer ones the Triton kernel.
HOPPER_MAX_BLOCK = 512
# The Hopper kernel's TMA copies tile the cache by this many slots: caches are allocated in whole
# multiples (``cache_slots``), so that any ``max_len`` a caller asks for can take the kernel.
CACHE_SLOT_MULTIPLE = 8


def cache_slots(max_len: int) -> int:
    """The slots a latent cache of ``max_len`` tokens is allocated with: ``max_len`` rounded up to
    a multiple of ``CACHE_SLOT_MULTIPLE`` (the extra slots are scratch, like every slot past a
    row's length)."""
    return -(-int(max_len) // CACHE_SLOT_MULTIPLE) * CACHE_SLOT_MULTIPLE


@functools.cache
def _hopper_gpu() -> bool:
    """Whether this process's GPUs are Hopper (sm_90: the kernel's ``wgmma`` and TMA)."""
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    return bool(devices) and all(str(getattr(d, "compute_capability", "")).startswith("9.") for d in devices)


def hopper_runs(backend: Backend, t: int, h: int, r: int, dr: int, dtype, cache_len: int,
                page_size: int | None = None) -> bool:
    """Whether ``latent_attention`` runs the Hopper kernel for a block of ``t`` tokens, ``h``
    heads, ranks ``r``/``dr`` over a ``dtype`` cache of ``cache_len`` slots under ``backend``
    (``page_size``: a paged cache of pages of that many positions, which must hold whole key
    tiles; ``paged_latent_attention``)."""
    if not (backend.kernels and backend.family == "triton" and not backend.interpret) or t > HOPPER_MAX_BLOCK:
        return False
    from pallas_kernels.mosaic_gpu.mla_prefix import KEY_TILE, supports

    if not (supports(t * h, r, dr, dtype) and _hopper_gpu()):
        return False
    if cache_len < KEY_TILE:  # shorter than one key tile
        return False
    if page_size is not None:
        return page_size % KEY_TILE == 0
    tiled = cache_len % CACHE_SLOT_MULTIPLE == 0
    if not tiled:  # a cache not allocated by init_cache
        warnings.warn(f"latent_attention: a cache of {cache_len} slots takes the Triton kernel, not the Hopper one "
                      f"(it needs a multiple of {CACHE_SLOT_MULTIPLE} slots; KimiForCausalLM.init_cache allocates "
                      "so)", stacklevel=2)
    return tiled


def prefix_block_attention(q_latent, q_rope, latent, k_rope, start, within=None, *, scale, n_split=None, block_k=64,
                           stages=2, interpret=False, page_table=None):
    """Absorbed MLA attention as the Hopper kernel's key splits plus the block's own keys.

    ``pallas_kernels.mosaic_gpu.mla_prefix.prefix_attention`` reads the committed prefix
    ``[0, start)`` in ``n_split`` key splits (``None``: ``auto_splits``; the split length follows
    the longest row, ``split_size``); a block of one token (a decode step) is read there too
    (``[0, start + 1)``: it sees every key). A longer block's keys ``[start, start + T)`` are few
    and run here in float32 under ``within`` (or causal). The splits and the block part are merged
    by their base-2 log-sum-exps. Shapes as ``latent_attention``; returns ``[B,T,H,r]`` in
    ``q_latent``'s dtype. ``interpret``: ``False``, or Mosaic GPU interpreter params (tests).
    ``page_table [B, pages]``: ``latent``/``k_rope`` are pools ``[N, P, *]`` read through it
    (``paged_cache``; ``P`` a multiple of ``block_k``).
    """
    from ddtree_jax.models.paged_cache import read_tokens
    from pallas_kernels.mosaic_gpu.mla_prefix import auto_splits, prefix_attention, split_size

    b, t, h, r = q_latent.shape
    dr = q_rope.shape[-1]
    dt, f32 = latent.dtype, jnp.float32
    qn, qr = q_latent.reshape(b, t * h, r).astype(dt), q_rope.reshape(b, t * h, dr).astype(dt)
    slots = latent.shape[1] if page_table is None else page_table.shape[1] * latent.shape[1]
    n = n_split or auto_splits(b, t * h, slots)
    end = start + 1 if t == 1 else start
    split = split_size(end, n, block_k=block_k)
    o, lse = prefix_attention(qn, qr, latent, k_rope, end, split, page_table, scale=scale, n_split=n,
                              block_k=block_k, stages=stages, interpret=interpret)
    # only the splits a row's end reached were written
    written = (jnp.arange(n)[None, :] * split < end[:, None])[:, :, None]  # [B, n, 1]
    lse = jnp.where(written, lse, -jnp.inf)
    lse_parts = [lse]
    if t > 1:
        positions = start[:, None] + jnp.arange(t)
        if page_table is None:
            lat_blk = jnp.take_along_axis(latent, positions[..., None], axis=1)  # [B,T,r]
            kr_blk = jnp.take_along_axis(k_rope, positions[..., None], axis=1)
        else:
            lat_blk, kr_blk = read_tokens(latent, page_table, positions), read_tokens(k_rope, page_table, positions)
        s = (jnp.einsum("bqr,bkr->bqk", qn, lat_blk, preferred_element_type=f32)
             + jnp.einsum("bqd,bkd->bqk", qr, kr_blk, preferred_element_type=f32)) * (scale * _LOG2E)
        vis = jnp.tril(jnp.ones((t, t), bool))[None] if within is None else within
        s = jnp.where(jnp.broadcast_to(vis[:, :, None, :], (b, t, h, t)).reshape(b, t * h, t), s, -jnp.inf)
        m_blk = s.max(-1)
        p = jnp.exp2(s - m_blk[..., None])
        den_blk = p.sum(-1)
        # float32 probabilities in an IEEE product (XLA's default on a GPU would round them to tf32)
        o_blk = jnp.einsum("bqk,bkr->bqr", p, lat_blk.astype(f32), precision=jax.lax.Precision.HIGHEST) / den_blk[
            ..., None]
        lse_parts.append((m_blk + jnp.log2(den_blk))[:, None])
    lse_all = jnp.concatenate(lse_parts, axis=1)  # [B, n (+1), R]
    w = jnp.exp2(lse_all - lse_all.max(1, keepdims=True))
    # a weighted sum over the splits (elementwise float32: a reduction, never a tf32 product);
    # unwritten splits hold garbage, zeroed before the weights (0 * NaN would be NaN)
    total = (w[:, :n, :, None] * jnp.where(written[..., None], o, 0.0)).sum(1)
    if t > 1:
        total = total + w[:, n, :, None] * o_blk
    out = total / w.sum(1)[..., None]
    return out.reshape(b, t, h, r).astype(q_latent.dtype)
