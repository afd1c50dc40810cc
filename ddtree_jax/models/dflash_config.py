"""``DFlashConfig``: a DFlash drafter's architecture, read from and written to its ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ddtree_jax.models._config import require
from ddtree_jax.models.rope import LinearScaling, YarnScaling, parse_rope_scaling, rope_tables

__all__ = ["DFlashConfig", "default_target_layer_ids"]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's rule: one draft layer -> the middle target layer; otherwise evenly spaced, rounded,
    from 1 to ``num_target_layers - 3`` (36 target, 5 draft layers -> (1, 9, 17, 25, 33))."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Drafter architecture; field names follow the published drafters' ``config.json``.

    Attention pattern (z-lab/dflash ``Qwen3DFlashAttention``, the revision with
    ``self.is_causal = False``): block queries attend to ``[context ; block]`` NON-causally in every
    layer. A ``sliding_attention`` layer with a ``sliding_window`` w restricts that to the
    symmetric band ``|query position - key position| < w`` over the whole key set (what the
    reference's flash-attention path computes with ``window_size = (w - 1, w - 1)``; its sdpa path
    ignores the window). ``is_causal=True`` additionally hides later positions (key position <=
    query position) in every layer; ``None``/``False`` = non-causal. A later reference revision
    (the one that adds ``DFlash2DraftModel``) makes sliding layers causal when ``is_causal`` is
    unset; configs that set ``is_causal`` explicitly mean the same thing under both.

    ``sliding_window`` is the EFFECTIVE window, as ``Qwen3Config`` resolves it: ``None`` unless
    the ``config.json`` sets ``use_sliding_window``; a ``sliding_attention`` layer without a window
    attends like a full one. ``rope_scaling``: ``None`` (default RoPE), ``LinearScaling`` or
    ``YarnScaling`` (transformers' Qwen3 RoPE; yarn's attention factor scales cos and sin).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: LinearScaling | YarnScaling | None = None
    max_position_embeddings: int = 40960
    vocab_size: int | None = None

    def __post_init__(self):
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_target_layers",
        ):
            require(getattr(self, name) > 0, self, name, "must be a positive integer")
        require(self.block_size >= 2, self, "block_size", "must be >= 2")
        require(self.head_dim % 2 == 0, self, "head_dim", "must be even (RoPE)")
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            self,
            "num_key_value_heads",
            "must divide num_attention_heads",
        )
        require(
            len(self.target_layer_ids) > 0 and all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
            self,
            "target_layer_ids",
            f"must be non-empty ids in [0, {self.num_target_layers})",
        )
        require(
            len(self.layer_types) == self.num_hidden_layers,
            self,
            "layer_types",
            f"needs one entry per layer ({self.num_hidden_layers})",
        )
        require(
            set(self.layer_types) <= {"full_attention", "sliding_attention"},
            self,
            "layer_types",
            "entries must be 'full_attention' or 'sliding_attention'",
        )
        require(
            self.sliding_window is None or self.sliding_window > 0,
            self,
            "sliding_window",
            "must be None (no window) or positive",
        )
        require(
            self.rope_scaling is None or isinstance(self.rope_scaling, (LinearScaling, YarnScaling)),
            self,
            "rope_scaling",
            "must be None, LinearScaling or YarnScaling",
        )
        require(self.mask_token_id >= 0, self, "mask_token_id", "must be >= 0")

    def layer_is_causal(self, layer: int) -> bool:
        """Whether block queries see only keys at earlier or equal positions in ``layer``: the
        config's ``is_causal`` if set, else never (the published DFlash drafter's attention is
        non-causal; sliding layers are a symmetric band, see ``layer_window``). A later
        revision of the reference ("DFlash2") makes sliding layers causal when ``is_causal`` is
        unset; its published configs set ``is_causal`` explicitly, which both rules honour."""
        return bool(self.is_causal)

    def layer_window(self, layer: int) -> int | None:
        """The band half-width ``w`` of ``layer`` (keys visible iff ``|offset| < w``), or ``None``."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Read a DFlash ``config.json`` dict (``dflash_config`` holds mask/target-layer fields)."""
        for field, ok in (("hidden_act", ("silu",)), ("attention_bias", (False,))):
            if field in d and d[field] not in ok:
                raise ValueError(f"DFlashConfig.{field}: unsupported value {d[field]!r} (supported: {ok})")
        extra = d.get("dflash_config") or {}
        theta, scaling = parse_rope_scaling(d, "DFlashConfig", ("default", "linear", "yarn"), default_theta=10000.0)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("DFlashConfig: partial_rotary_factor != 1 is not supported")

        def get(name, default=dataclasses.MISSING):
            value = extra.get(name, d.get(name, default))
            if value is dataclasses.MISSING:
                raise ValueError(f"DFlashConfig: config.json lacks required field {name!r}")
            return value

        layers, target_layers = get("num_hidden_layers"), get("num_target_layers")
        ids = get("target_layer_ids", None)
        # Qwen3Config: the window exists only with use_sliding_window (default False, window 4096);
        # without explicit layer_types, layers from max_window_layers (default 28) on slide.
        window = get("sliding_window", 4096) if get("use_sliding_window", False) else None
        layer_types = get("layer_types", None) or tuple(
            "sliding_attention" if window is not None and i >= get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        )
        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads", d.get("num_attention_heads")),
            head_dim=get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            num_target_layers=target_layers,
            block_size=get("block_size", 16),
            mask_token_id=get("mask_token_id"),
            target_layer_ids=tuple(ids) if ids is not None else default_target_layer_ids(target_layers, layers),
            layer_types=tuple(layer_types),
            sliding_window=window,
            is_causal=get("is_causal", None),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=get("max_position_embeddings", 32768),
            vocab_size=get("vocab_size", None),
        )

    @classmethod
    def from_json(cls, path: str) -> DFlashConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["dflash_config"] = {
            "mask_token_id": d.pop("mask_token_id"),
            "target_layer_ids": list(d.pop("target_layer_ids")),
        }
        d["layer_types"] = list(self.layer_types)
        d.pop("rope_scaling")
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **d,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": self.sliding_window is not None,
            "tie_word_embeddings": False,
        }

    def rope_tables(self) -> tuple[np.ndarray, float]:
        """Qwen3 RoPE ``(inv_freq [head_dim/2] float32, cos/sin scale)`` (default, linear or yarn)."""
        return rope_tables(self.head_dim, self.rope_theta, self.rope_scaling)
