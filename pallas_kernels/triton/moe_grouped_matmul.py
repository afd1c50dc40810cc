"""Routed MoE experts as two grouped matmuls over token copies sorted by expert (Pallas Triton):
bf16/f32 weights (``moe_grouped_matmul``) or INT4 W4A16 weights (``moe_grouped_matmul_int4``).

Contract (references ``ddtree_jax.models.moe.experts_reference`` and ``experts_ragged_dot``;
tests/test_moe_kernel.py): given the copies sorted by expert (``sorted_token``, ``sorted_weight``
``[R]``) and row tiles (``tile_expert``, ``tile_start``, ``tile_end``: at most ``block_m`` rows of
one expert each, empty past the real count), every sorted row r inside a tile gets, in float32,
``y[r] = sorted_weight[r] * (silu(x[tok] @ Wg[e]) * (x[tok] @ Wu[e])) @ Wd[e]``; rows outside
every tile are unspecified. Two launches: gate/up (``silu(gate) * up`` into ``h [R, I]``), then
down (into ``y [R, H]``); a program reads only its tile's expert. Routing (``route_tokens``) and
the combine (a fixed-order sum of a token's k rows) are the caller's. A row's arithmetic depends
on ``block_m`` and ``block_k``, never on other rows. Design and measurements: docs/kernels.md,
"MoE experts (grouped matmul)" and "INT4 experts (W4A16)".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["MoEBlocks", "choose_blocks", "max_row_tiles", "moe_grouped_matmul", "moe_grouped_matmul_int4"]

# float32 operands multiply in IEEE float32 (the Triton lowering's DEFAULT precision is tf32, about
# 1e-3 relative); bf16 operands are unaffected (bf16 MMA, float32 accumulation).
_IEEE = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
_INT4_OFFSET = 8  # a packed nibble u stands for the integer u - 8
_MAGIC, _MAGIC_BITS = 8388608.0, 0x4B000000  # the float 2^23 and its bits


@dataclasses.dataclass(frozen=True)
class MoEBlocks:
    """Tile sizes (powers of two, >= 16) and Triton launch parameters of the two launches."""

    block_m: int = 16
    block_n_gate_up: int = 64
    block_n_down: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def choose_blocks(num_rows: int, num_experts: int, *, int4: bool = False, act_bytes: int = 2) -> MoEBlocks:
    """Blocks for ``num_rows`` token copies (tokens x top-k) over ``num_experts`` experts, with
    activations of ``act_bytes`` bytes.
    ``int4``: for ``moe_grouped_matmul_int4``; with 16-row tiles, and 32-row tiles of 2-byte
    activations (decode and tree verify), its column blocks are twice as wide (128 for gate/up, 256
    for down): a K-chunk's words then cover as many bytes as a bf16 chunk's. Other tiles keep the
    bf16 widths (with float32 activations the wide blocks exceed a GPU's shared memory). The
    column blocks never change a row's arithmetic (``block_k`` and ``block_m`` do)."""
    per_expert = num_rows / num_experts
    if per_expert <= 16:
        blocks = MoEBlocks(block_m=16, num_warps=4)
    elif per_expert <= 32:
        blocks = MoEBlocks(block_m=32, num_warps=4)
    elif per_expert <= 64:
        blocks = MoEBlocks(block_m=64, block_k=64, num_warps=4)
    else:
        blocks = MoEBlocks(block_m=128, block_k=64, num_warps=8)
    if int4 and (blocks.block_m == 16 or (blocks.block_m == 32 and act_bytes <= 2)):
        blocks = dataclasses.replace(blocks, block_n_gate_up=2 * blocks.block_n_gate_up,
                                     block_n_down=2 * blocks.block_n_down)
    return blocks


def max_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on ``sum_e ceil(count_e / block_m)`` over counts summing to <= num_rows."""
    return max(1, min(num_experts, num_rows) + num_rows // block_m)


def _block(dim: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides ``dim`` (>= 16: checked by the caller)."""
    b = want
    while dim % b:
        b //= 2
    return b


def _on_live_tile(ex_ref, ts_ref, te_ref, *, bm, bn, body):
    """The common prologue of both kernels: program (t, j) runs ``body(e, start, rows, live, n0)``
    for row tile t (expert ``e``, sorted rows ``rows = start + [0, bm)``, ``live`` those inside the
    tile) and output columns ``[n0, n0 + bn)``, ``n0 = j * bn``; programs past the real tiles exit."""
    t = pl.program_id(0)
    n0 = pl.program_id(1) * bn  # read outside pl.when: interpret mode has no program_id inside a branch
    start, end = ts_ref[t], te_ref[t]
    rows = start + jnp.arange(bm, dtype=jnp.int32)

    @pl.when(start < end)
    def _():
        body(ex_ref[t], start, rows, rows < end, n0)


def _chunk_cols(k0, bk, group):
    """The activation columns of one K-chunk, one contiguous ``(first, width)`` range per dot: the
    ``bk`` columns (dense weights), or for packed weights
    eight ranges of ``bk / 8``: nibble p's inputs ``k0 + 8j + p``, which ``_nibble_major`` moved to
    columns ``k0 + p * bk/8 + j``."""
    if group is None:
        return [(k0, bk)]
    words = bk // 8
    return [(pl.multiple_of(k0 + p * words, words), words) for p in range(8)]


def _nibble_major(a: jax.Array, bk: int) -> jax.Array:
    """``a [M, K]`` with the columns of each ``bk``-chunk reordered from ``8j + p`` to
    ``p * bk/8 + j``: the inputs of packed word row j's nibble p, for all j, become one contiguous
    run (a plain load in the kernel, where the original order needs a stride-8 gather)."""
    m, k = a.shape
    return a.reshape(m, k // bk, bk // 8, 8).swapaxes(-1, -2).reshape(m, k)


def _bf16_dequant_ptx(p: int) -> str:
    """PTX for ``elementwise_inline_asm`` with ``pack=2``: nibble p of two packed words ($1, $2)
    with their two bf16 scales ($3, one register) -> one register of two bf16 weights ($0),
    ``(nibble - 8) * scale`` rounded once to bf16.

    Two weights per instruction: ``prmt`` puts byte p // 2 of both words in bytes 0 and 2 (a shift
    by 4 brings an odd nibble down); ``(. & 0x000F000F) | 0x43004300`` (one ``lop3``, the LUT of
    ``(a & b) | c``) is the bf16 pair ``128 + nibble``; one ``fma.rn.bf16x2`` subtracts 136 (exact:
    small integers), a second multiplies by the scales (the exact product rounded once; -0.0 as
    the addend keeps a zero product's sign). 2.25 instructions per weight, against about 5 for
    the float32 path. One call per nibble: the Pallas Triton lowering takes one result per call."""
    b = p // 2
    lines = ["{", ".reg .b32 t, one, m136, nz;", "mov.b32 one, 0x3F803F80;", "mov.b32 m136, 0xC308C308;",
             "mov.b32 nz, 0x80008000;", f"prmt.b32 t, $1, $2, 0x{4 + b:x}{4 + b:x}{b:x}{b:x};"]
    if p % 2:
        lines.append("shr.u32 t, t, 4;")
    lines += ["lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;", "fma.rn.bf16x2 t, t, one, m136;",
              "fma.rn.bf16x2 $0, t, $3, nz;", "}"]
    return "\n".join(lines)


def _dequant_words(wp, scale, zero, dtype, asm):
    """The eight ``[W, bn]`` weight tiles (nibble p of each word) of a ``[W, bn]`` int32 tile of
    packed words, with ``scale`` (and ``zero``: int8 or None) per word: ``(nibble - 8 - zero) *
    scale`` rounded once to ``dtype``. ``asm``: bf16 scales and ``dtype``, no zero points, on the
    GPU: the packed-bf16 PTX above, bit for bit the same weights as the float32 path."""
    if asm:
        return [plgpu.elementwise_inline_asm(
            _bf16_dequant_ptx(p), args=[wp, scale], constraints="=r,r,r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(wp.shape, jnp.bfloat16)])[0] for p in range(8)]
    # A nibble n becomes a float without an integer convert (a quarter-rate instruction on the
    # GPU, once per weight): the bits 0x4B000000 | n are the float 2^23 + n, and subtracting
    # 2^23 + 8 + zero leaves n - 8 - zero exactly (integers below 2^24). The product with the
    # scale then rounds once, as after an integer convert: the same bits.
    offset = jnp.float32(_MAGIC + _INT4_OFFSET)
    if zero is not None:  # one convert per (word row, column), shared by the row's eight nibbles
        offset = offset + zero.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    # int32 >> is arithmetic (the top nibble comes sign-extended); the mask keeps its 4 bits
    return [((jax.lax.bitcast_convert_type((jnp.right_shift(wp, sh) & 0xF) | _MAGIC_BITS, jnp.float32)
              - offset) * scale).astype(dtype) for sh in range(0, 32, 4)]


def _chunk_weights(w_refs, e, k0, n0, *, K, bk, bn, group, dtype, asm=False):
    """The weight tiles that go with ``_chunk_cols``: the dense ``[bk, bn]`` slab of expert e, or
    eight ``[bk/8, bn]`` tiles dequantised in registers (``_dequant_words``) from one
    ``[bk/8, bn]`` tile of words. Every input of word row j lies in group ``(k0 + 8j) // group``
    (group sizes are multiples of 8), so one gathered row of scales (and zero points) serves all
    eight nibbles of that row."""
    if group is None:
        (w_ref,) = w_refs
        return [w_ref[e, pl.ds(k0, bk), pl.ds(n0, bn)]]
    packed_ref, scale_ref, *zero_ref = w_refs
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    words = bk // 8
    wp = packed_ref[e, pl.ds(pl.multiple_of(k0 // 8, words), words), pl.ds(n0, bn)]
    rows = e * (K // group) + (k0 + 8 * jnp.arange(words, dtype=jnp.int32)) // group  # [E*K/G, N] rows
    scale = plgpu.load(scale_ref.at[rows[:, None], cols[None, :]])
    zero = plgpu.load(zero_ref[0].at[rows[:, None], cols[None, :]]) if zero_ref else None
    return _dequant_words(wp, scale, zero, dtype, asm)


def _gate_up_kernel(x_ref, *refs, nw, H, inter, bm, bn, bk, group, asm):
    w_refs, (tok_ref, ex_ref, ts_ref, te_ref, h_ref) = refs[:nw], refs[nw:]

    def tile(e, start, rows, live, n0):
        tok = plgpu.load(tok_ref.at[pl.ds(start, bm)], mask=live, other=0)
        tiles = functools.partial(_chunk_weights, w_refs, e, K=H, bk=bk, bn=bn, group=group, dtype=x_ref.dtype,
                                  asm=asm)

        def body(kk, acc):
            g, u = acc
            k0 = pl.multiple_of(kk * bk, bk)
            for (c0, width), wg, wu in zip(_chunk_cols(k0, bk, group), tiles(k0, n0),
                                           tiles(k0, inter + n0), strict=True):
                # a row gather: two index arrays (interpret mode cannot mix an index array and a slice)
                cols = c0 + jnp.arange(width, dtype=jnp.int32)
                xb = plgpu.load(x_ref.at[tok[:, None], cols[None, :]], mask=live[:, None], other=0)
                g = g + jnp.dot(xb, wg, preferred_element_type=jnp.float32, precision=_IEEE)
                u = u + jnp.dot(xb, wu, preferred_element_type=jnp.float32, precision=_IEEE)
            return g, u

        zero = jnp.zeros((bm, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, H // bk, body, (zero, zero))
        h = g / (1.0 + jnp.exp(-g)) * u
        plgpu.store(h_ref.at[pl.ds(start, bm), pl.ds(n0, bn)], h.astype(h_ref.dtype), mask=live[:, None])

    _on_live_tile(ex_ref, ts_ref, te_ref, bm=bm, bn=bn, body=tile)


def _down_kernel(h_ref, *refs, nw, inter, bm, bn, bk, group, asm):
    w_refs, (wt_ref, ex_ref, ts_ref, te_ref, y_ref) = refs[:nw], refs[nw:]

    def tile(e, start, rows, live, n0):
        def body(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            tiles = _chunk_weights(w_refs, e, k0, n0, K=inter, bk=bk, bn=bn, group=group, dtype=h_ref.dtype,
                                   asm=asm)
            for (c0, width), wd in zip(_chunk_cols(k0, bk, group), tiles, strict=True):
                hb = plgpu.load(h_ref.at[pl.ds(start, bm), pl.ds(c0, width)], mask=live[:, None], other=0)
                acc = acc + jnp.dot(hb, wd, preferred_element_type=jnp.float32, precision=_IEEE)
            return acc

        acc = jax.lax.fori_loop(0, inter // bk, body, jnp.zeros((bm, bn), jnp.float32))
        wt = plgpu.load(wt_ref.at[pl.ds(start, bm)], mask=live, other=0.0)
        plgpu.store(y_ref.at[pl.ds(start, bm), pl.ds(n0, bn)], acc * wt[:, None], mask=live[:, None])

    _on_live_tile(ex_ref, ts_ref, te_ref, bm=bm, bn=bn, body=tile)


def _use_asm(x, w_refs, group, interpret) -> bool:
    """The packed-bf16 dequantisation (``_bf16_dequant_ptx``) applies: compiled, INT4 weights with
    bf16 scales and no zero points, bf16 activations."""
    return (not interpret and group is not None and len(w_refs) == 2 and x.dtype == jnp.bfloat16
            and w_refs[1].dtype == jnp.bfloat16)


def _launch(x, gate_up_refs, down_refs, sorted_token, sorted_weight, meta, *, inter, groups, blocks, interpret,
            min_block_k=16):
    """Both launches; ``*_refs``: the dense weight, or (packed words, scales as ``[E*K/G, N]``[,
    zero points likewise]) with ``groups`` their group sizes (None: dense)."""
    (R,) = sorted_token.shape
    (T,) = meta[0].shape
    H = x.shape[1]
    bm = blocks.block_m
    bn1, bn2 = _block(inter, blocks.block_n_gate_up), _block(H, blocks.block_n_down)
    bk1, bk2 = _block(H, max(blocks.block_k, min_block_k)), _block(inter, max(blocks.block_k, min_block_k))
    if not interpret and min(bk1, bk2) < min_block_k:
        raise ValueError(f"moe_grouped_matmul: hidden ({H}) and intermediate ({inter}) sizes must be multiples of "
                         f"{min_block_k} on the GPU")
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    if groups[0] is not None:
        x = _nibble_major(x, bk1)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, nw=len(gate_up_refs), H=H, inter=inter, bm=bm, bn=bn1, bk=bk1,
                          group=groups[0], asm=_use_asm(x, gate_up_refs, groups[0], interpret)),
        grid=(T, inter // bn1),
        in_specs=[any_spec] * (5 + len(gate_up_refs)),
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((R, inter), x.dtype),
        compiler_params=params,
        interpret=interpret,
        name="ddtree_moe_gate_up" if groups[0] is None else "ddtree_moe_gate_up_int4",
    )(x, *gate_up_refs, sorted_token.astype(jnp.int32), *meta)
    if groups[1] is not None:
        h = _nibble_major(h, bk2)
    return pl.pallas_call(
        functools.partial(_down_kernel, nw=len(down_refs), inter=inter, bm=bm, bn=bn2, bk=bk2, group=groups[1],
                          asm=_use_asm(x, down_refs, groups[1], interpret)),
        grid=(T, H // bn2),
        in_specs=[any_spec] * (5 + len(down_refs)),
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((R, H), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="ddtree_moe_down" if groups[1] is None else "ddtree_moe_down_int4",
    )(h, *down_refs, sorted_weight.astype(jnp.float32), *meta)


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
    meta = (tile_expert.astype(jnp.int32), tile_start.astype(jnp.int32), tile_end.astype(jnp.int32))
    return _launch(x, (gate_up,), (down,), sorted_token, sorted_weight, meta, inter=inter, groups=(None, None),
                   blocks=blocks, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def moe_grouped_matmul_int4(
    x: jax.Array,
    gate_up_packed: jax.Array,
    gate_up_scale: jax.Array,
    down_packed: jax.Array,
    down_scale: jax.Array,
    sorted_token: jax.Array,
    sorted_weight: jax.Array,
    tile_expert: jax.Array,
    tile_start: jax.Array,
    tile_end: jax.Array,
    *,
    gate_up_zero: jax.Array | None = None,
    down_zero: jax.Array | None = None,
    blocks: MoEBlocks,
    interpret: bool = False,
) -> jax.Array:
    """``moe_grouped_matmul`` with INT4 weights dequantised in registers (W4A16): the same
    routing arguments, result and rows; the weights packed along their contraction dim.

    Args:
      gate_up_packed: int32 ``[E, H/8, 2I]``: word ``[e, j, n]`` holds inputs ``8j .. 8j+7`` of
        column n, input ``8j + p`` in bits ``4p .. 4p+3`` as the unsigned nibble ``q + 8``;
        ``down_packed``: int32 ``[E, I/8, H]`` likewise.
      gate_up_scale: ``[E, H/G, 2I]``, one scale per group of G inputs (G a multiple of 8 that
        divides H); ``down_scale``: ``[E, I/G', H]``. Any float dtype (used in float32).
      gate_up_zero, down_zero: int8 zero points shaped like the scales, or None (symmetric).
      The weight is ``((q - zero) * scale)`` rounded to x's dtype, then multiplied as in
      ``moe_grouped_matmul``. Each K-chunk of ``block_k`` (at least 128) inputs is eight dots of
      K = ``block_k / 8`` (nibble p against the x columns ``8j + p``): on the GPU H and I must be
      multiples of 128, so that each dot has K >= 16.
    """
    N, H = x.shape
    E, inter = down_packed.shape[0], 8 * down_packed.shape[1]
    if gate_up_packed.shape != (E, H // 8, 2 * inter) or down_packed.shape != (E, inter // 8, H) or H % 16 \
            or inter % 16:
        raise ValueError(f"moe_grouped_matmul_int4: packed gate_up {gate_up_packed.shape} / down {down_packed.shape} "
                         f"do not match x {x.shape}")
    groups = []
    flat = []
    for name, scale, zero, k, n in (("gate_up", gate_up_scale, gate_up_zero, H, 2 * inter),
                                    ("down", down_scale, down_zero, inter, H)):
        if scale.ndim != 3 or scale.shape[0] != E or scale.shape[2] != n or k % scale.shape[1] or (
                k // scale.shape[1]) % 8:
            raise ValueError(f"moe_grouped_matmul_int4: {name} scales {scale.shape} do not fit [{E}, {k}/G, {n}] "
                             f"with G a multiple of 8")
        if zero is not None and zero.shape != scale.shape:
            raise ValueError(f"moe_grouped_matmul_int4: {name} zero points {zero.shape} differ from its scales "
                             f"{scale.shape}")
        groups.append(k // scale.shape[1])
        flat.append((scale.reshape(-1, n),) + (() if zero is None else (zero.reshape(-1, n),)))
    meta = (tile_expert.astype(jnp.int32), tile_start.astype(jnp.int32), tile_end.astype(jnp.int32))
    return _launch(x, (gate_up_packed, *flat[0]), (down_packed, *flat[1]), sorted_token, sorted_weight, meta,
                   inter=inter, groups=tuple(groups), blocks=blocks, interpret=interpret, min_block_k=128)
