"""INT4 routed-expert weights (W4A16): the packed layout, unpacking, dequantisation and a
round-to-nearest quantiser.

Checkpoint format (compressed-tensors ``pack-quantized``, 4-bit integers, ``strategy: group``;
read and written by ``ddtree_jax.checkpoints``), per expert projection (a torch Linear
``[out, in]``):

* ``weight_packed`` int32 ``[out, in/8]``: input ``8j + p`` of row ``o`` is nibble ``p`` (bits
  ``4p .. 4p+3``, least significant first) of word ``[o, j]``, stored with an offset of 8: the
  unsigned nibble ``u`` in ``[0, 15]`` is the integer ``q = u - 8`` in ``[-8, 7]``;
* ``weight_scale`` ``[out, in/G]`` (float): one scale per group of ``G`` consecutive inputs;
* ``weight_zero_point`` int32 ``[ceil(out/8), in/G]`` (asymmetric schemes only): int4 zero points
  with the same offset, packed eight to a word along ``out`` (the first dim);
* ``weight_shape`` ``[2]``: ``(out, in)``.

The weight is ``w[o, i] = (q[o, i] - z[o, i // G]) * s[o, i // G]`` (``z = 0`` when symmetric).

In memory (``PackedWeight``), stacked over experts in the model's ``[in, out]`` orientation
(``gate_up [E, H, 2I]``, ``down [E, I, H]``: K = in is the contraction dim, N = out):

* ``packed`` int32 ``[E, K/8, N]``: each expert's checkpoint words transposed, bits untouched:
  word ``[e, j, n]`` holds inputs ``8j .. 8j+7`` of output column ``n``. Packing runs along the
  contraction dim, so a chunk of ``8m`` inputs is ``m`` whole rows of words, and nibble ``p`` of
  those rows is the inputs ``8j + p``;
* ``scale`` ``[E, K/G, N]`` in the model's dtype;
* ``zero`` int8 ``[E, K/G, N]`` (the signed zero points, unpacked) or ``None`` (symmetric).

Dequantised value (``dequantize``, the kernel's registers and the checkpoint alike): ``((q - z)
* s)`` computed in float32 (exact for a bf16 scale: a 5-bit integer times an 8-bit mantissa) and
rounded once to the model's dtype, which is what compressed-tensors' own decompression gives in
that dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "Int4Format",
    "PackedWeight",
    "dequantize",
    "pack_int4",
    "quantize_int4",
    "random_packed_weight",
    "unpack_int4",
    "unpack_int4_np",
]

_OFFSET = 8  # nibble u stands for u - 8
_SHIFTS = 4 * np.arange(8, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """How a model's routed experts are stored: 4-bit integers in groups of ``group_size``
    inputs with one scale each, and a zero point per group unless ``symmetric``."""

    group_size: int = 32
    symmetric: bool = True

    def check(self, hidden: int, intermediate: int) -> None:
        """``ValueError`` unless the group size suits the packing and the expert shapes."""
        g = self.group_size
        if g <= 0 or g % 8:
            raise ValueError(f"Int4Format.group_size={g}: must be a positive multiple of 8 (eight inputs per word)")
        for name, dim in (("hidden_size", hidden), ("moe_intermediate_size", intermediate)):
            if dim % g:
                raise ValueError(f"Int4Format.group_size={g} does not divide {name}={dim}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A stack of INT4 expert matrices ``[E, K, N]`` in the layout of the module docstring."""

    packed: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense ``[E, K, N]`` it stands for."""
        e, words, n = self.packed.shape
        return e, 8 * words, n

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def dtype(self):
        """The dtype it dequantises to (the scales')."""
        return self.scale.dtype


def unpack_int4(packed: jax.Array) -> jax.Array:
    """``int32 [..., K/8, N]`` -> the signed integers ``int8 [..., K, N]`` (plain JAX)."""
    # an arithmetic shift of int32 sign-extends the top nibble; the mask keeps the 4 bits wanted
    nib = jnp.right_shift(packed[..., :, None, :], jnp.asarray(_SHIFTS)[:, None]) & 0xF
    shape = packed.shape[:-2] + (8 * packed.shape[-2], packed.shape[-1])
    return (nib - _OFFSET).astype(jnp.int8).reshape(shape)


def dequantize(w: PackedWeight, dtype=None) -> jax.Array:
    """``[E, K, N]`` in ``dtype`` (default the scales'): ``(q - z) * s`` in float32, rounded once."""
    q = unpack_int4(w.packed).astype(jnp.int32)
    e, k, n = w.shape
    g = w.group_size
    q = q.reshape(e, k // g, g, n)
    if w.zero is not None:
        q = q - w.zero.astype(jnp.int32)[:, :, None, :]
    out = q.astype(jnp.float32) * w.scale.astype(jnp.float32)[:, :, None, :]
    return out.reshape(e, k, n).astype(dtype or w.dtype)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed 4-bit integers ``[..., n]`` -> int32 words ``[..., ceil(n/8)]`` packed along the last
    axis (value ``8j + p`` in nibble ``p`` of word ``j``, offset 8; numpy, for checkpoints)."""
    q = np.asarray(q)
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"pack_int4: values outside [-8, 7] (min {q.min()}, max {q.max()})")
    n = q.shape[-1]
    words = -(-n // 8)
    u = np.zeros(q.shape[:-1] + (8 * words,), np.uint32)
    u[..., :n] = (q.astype(np.int64) + _OFFSET).astype(np.uint32)
    u = u.reshape(q.shape[:-1] + (words, 8)) << _SHIFTS.astype(np.uint32)
    return np.bitwise_or.reduce(u, axis=-1).view(np.int32)


def unpack_int4_np(words: np.ndarray, n: int) -> np.ndarray:
    """Inverse of ``pack_int4``: int32 ``[..., ceil(n/8)]`` -> int8 ``[..., n]`` (numpy)."""
    u = (np.asarray(words).view(np.uint32)[..., None] >> _SHIFTS.astype(np.uint32)) & 0xF
    return (u.reshape(words.shape[:-1] + (-1,))[..., :n].astype(np.int16) - _OFFSET).astype(np.int8)


def quantize_int4(w, fmt: Int4Format, dtype=None) -> PackedWeight:
    """Round-to-nearest INT4 of ``w [E, K, N]`` (numpy or JAX, groups of ``fmt.group_size`` along
    K) with scales in ``dtype`` (default w's): for making INT4 test and benchmark models from
    dense ones. Symmetric: ``s = max|w| / 7``, ``q = round(w / s)``; asymmetric: ``s = (max - min)
    / 15``, ``z = round(-8 - min / s)``, ``q = round(w / s) + z``; clipped to ``[-8, 7]``."""
    dtype = np.dtype(dtype or np.asarray(w).dtype)
    w = np.asarray(w, np.float32)
    e, k, n = w.shape
    g = fmt.group_size
    grouped = w.reshape(e, k // g, g, n)
    if fmt.symmetric:
        scale = np.abs(grouped).max(axis=2) / 7.0
        zero = None
    else:
        lo, hi = np.minimum(grouped.min(axis=2), 0), np.maximum(grouped.max(axis=2), 0)
        scale = (hi - lo) / 15.0
    scale = np.where(scale == 0, 1.0, scale).astype(dtype)  # rounded to the stored dtype first
    s32 = scale.astype(np.float32)
    if not fmt.symmetric:
        zero = np.clip(np.round(-8 - lo / s32), -8, 7).astype(np.int8)
    q = np.round(grouped / s32[:, :, None, :])
    if zero is not None:
        q = q + zero[:, :, None, :]
    q = np.clip(q, -8, 7).reshape(e, k, n).astype(np.int8)
    packed = pack_int4(np.swapaxes(q, 1, 2)).swapaxes(1, 2)  # along K
    return PackedWeight(jnp.asarray(np.ascontiguousarray(packed)), jnp.asarray(scale),
                        None if zero is None else jnp.asarray(zero))


def random_packed_weight(rngs: nnx.Rngs, shape: tuple[int, int, int], fmt: Int4Format, dtype) -> PackedWeight:
    """Random INT4 weights standing for ``[E, K, N]``: uniform nibbles, scales uniform in
    ``[0.5, 1.5] / (4.6 sqrt(K))`` (so the dequantised weights have about the spread of
    ``normal_init``'s), zero points uniform in ``[-2, 2]``. Like ``normal_init``: drawn on the host
    when eager, with ``jax.random`` under tracing (``init_on_mesh`` builds large models so)."""
    e, k, n = shape
    groups = k // fmt.group_size
    key = rngs.params()
    if not isinstance(key, jax.core.Tracer):
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
        packed = jnp.asarray(rng.integers(0, 2**32, (e, k // 8, n), np.uint32).view(np.int32))
        scale = rng.uniform(0.5, 1.5, (e, groups, n)).astype(np.float32) / (4.6 * math.sqrt(k))
        zero = None if fmt.symmetric else jnp.asarray(rng.integers(-2, 3, (e, groups, n), np.int8))
        return PackedWeight(packed, jnp.asarray(scale.astype(dtype)), zero)
    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.lax.bitcast_convert_type(jax.random.bits(k1, (e, k // 8, n), jnp.uint32), jnp.int32)
    scale = jax.random.uniform(k2, (e, groups, n), jnp.float32, 0.5, 1.5) / (4.6 * math.sqrt(k))
    zero = None
    if not fmt.symmetric:
        zero = jax.random.randint(k3, (e, groups, n), -2, 3, jnp.int32).astype(jnp.int8)
    return PackedWeight(packed, scale.astype(dtype), zero)
