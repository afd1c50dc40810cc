"""Rotary position embeddings: the tables, their application, and linear / yarn scaling.

Yarn follows transformers' ``_compute_yarn_parameters`` / ``yarn_get_mscale`` exactly (the
target's parity tests check it through the whole model); linear scaling follows
``_compute_linear_scaling_rope_parameters`` (``inv_freq / factor``, i.e. positions divided by
``factor``). ``rope_tables`` turns any of them into ``(inv_freq, cos/sin scale)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LinearScaling",
    "YarnScaling",
    "apply_rope",
    "default_inv_freq",
    "parse_rope_scaling",
    "rope_cos_sin",
    "rope_tables",
    "yarn_inv_freq",
    "yarn_mscale",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """Yarn RoPE scaling parameters (HF ``rope_scaling``/``rope_parameters`` with type ``yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "type": "yarn",
            "rope_type": "yarn",
            **{k: v for k, v in dataclasses.asdict(self).items() if v is not None},
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearScaling:
    """Linear RoPE scaling (HF type ``linear``): positions divided by ``factor``."""

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"LinearScaling.factor={self.factor!r}: must be > 0")

    def to_hf_dict(self) -> dict[str, Any]:
        return {"type": "linear", "rope_type": "linear", "factor": self.factor}


def rope_section(d: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict of an HF config: transformers 5's ``rope_parameters`` or 4.x's ``rope_scaling``."""
    return dict(d.get("rope_parameters") or d.get("rope_scaling") or {})


def rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def parse_yarn(rope: dict[str, Any], max_position_embeddings: int | None) -> YarnScaling:
    """A ``YarnScaling`` from an HF RoPE dict of type ``yarn``."""
    original = rope.get("original_max_position_embeddings", max_position_embeddings or 4096)
    factor = rope.get("factor") or (max_position_embeddings or original) / original
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def parse_rope_scaling(d: dict[str, Any], owner: str, supported: tuple[str, ...], default_theta: float = 10000.0):
    """``(rope_theta, scaling)`` from an HF config dict; ``scaling`` is ``None`` (default RoPE), a
    ``LinearScaling`` or a ``YarnScaling``. Any type outside ``supported`` raises a ``ValueError``
    naming ``owner``."""
    rope = rope_section(d)
    kind = rope_type(rope)
    if kind not in supported:
        raise ValueError(f"{owner}.rope_scaling: unsupported rope type {kind!r} (supported: {supported})")
    theta = float(rope.get("rope_theta", d.get("rope_theta", default_theta)))
    if kind == "yarn":
        return theta, parse_yarn(rope, d.get("max_position_embeddings"))
    if kind == "linear":
        if rope.get("factor") is None:
            raise ValueError(f"{owner}.rope_scaling: linear RoPE scaling needs a 'factor', got {rope}")
        return theta, LinearScaling(factor=float(rope["factor"]))
    return theta, None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def default_inv_freq(dim: int, base: float) -> np.ndarray:
    """Unscaled inverse frequencies ``[dim/2]`` float32: ``base ** (-2i/dim)``."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (1.0 / np.float32(base) ** exponents).astype(np.float32)


def yarn_inv_freq(dim: int, base: float, y: YarnScaling) -> tuple[np.ndarray, float]:
    """Yarn-scaled ``(inv_freq [dim/2] float32, cos/sin scale)``."""
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(y.factor)

    def correction_dim(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(dim: int, base: float, scaling: LinearScaling | YarnScaling | None) -> tuple[np.ndarray, float]:
    """``(inv_freq [dim/2] float32, cos/sin scale)`` of default, linear or yarn RoPE (transformers'
    ``ROPE_INIT_FUNCTIONS``; the scale is their ``attention_scaling``, 1 except under yarn)."""
    if scaling is None:
        return default_inv_freq(dim, base), 1.0
    if isinstance(scaling, LinearScaling):
        return (default_inv_freq(dim, base) / np.float32(scaling.factor)).astype(np.float32), 1.0
    if isinstance(scaling, YarnScaling):
        return yarn_inv_freq(dim, base, scaling)
    raise TypeError(f"unknown RoPE scaling {scaling!r}")


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0):
    """cos/sin tables for integer ``positions [...]``: two float32 arrays ``[..., len(inv_freq)]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate ``x [..., d]`` by per-pair angles (``cos``/``sin`` broadcast to ``[..., d/2]``).

    ``interleaved`` pairs dims ``(0,1), (2,3), ...`` (DeepSeek's layout); otherwise pairs
    ``(i, i + d/2)`` (HF ``rotate_half``). Either way the output is ``[x1 c - x2 s ; x2 c + x1 s]``,
    i.e. an interleaved input comes out de-interleaved, exactly as transformers does it: scores are
    unchanged because queries and keys get the same permutation.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
