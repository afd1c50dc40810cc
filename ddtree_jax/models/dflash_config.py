"""``DFlashConfig``: a DFlash drafter's architecture, read from and written to its ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ddtree_jax.models._config import require
from ddtree_jax.models.rope import default_inv_freq

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
    """Drafter architecture; field names follow the published drafters' ``config.json``."""

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
    max_position_embeddings: int = 40960
    vocab_size: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_target_layers"):
            require(getattr(self, name) > 0, self, name, "must be a positive integer")
        require(self.block_size >= 2, self, "block_size", "must be >= 2")
        require(self.head_dim % 2 == 0, self, "head_dim", "must be even (RoPE)")
        require(self.num_attention_heads % self.num_key_value_heads == 0, self, "num_key_value_heads",
                "must divide num_attention_heads")
        require(len(self.target_layer_ids) > 0 and all(0 <= i < self.num_target_layers for i in self.target_layer_ids),
                self, "target_layer_ids", f"must be non-empty ids in [0, {self.num_target_layers})")
        require(len(self.layer_types) == self.num_hidden_layers, self, "layer_types",
                f"needs one entry per layer ({self.num_hidden_layers})")
        require(set(self.layer_types) <= {"full_attention", "sliding_attention"}, self, "layer_types",
                "entries must be 'full_attention' or 'sliding_attention'")
        require("sliding_attention" not in self.layer_types or (self.sliding_window or 0) > 0, self,
                "sliding_window", "sliding_attention layers need a positive sliding_window")
        require(self.mask_token_id >= 0, self, "mask_token_id", "must be >= 0")

    def layer_is_causal(self, layer: int) -> bool:
        """Whether block tokens see only earlier block tokens in ``layer``. Upstream z-lab/dflash:
        ``is_causal`` when the config sets it, else causal exactly in sliding-window layers (so
        the published drafters, all full attention, are non-causal)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """Read a DFlash ``config.json`` dict (``dflash_config`` holds mask/target-layer fields)."""
        for field, ok in (("hidden_act", ("silu",)), ("attention_bias", (False,))):
            if field in d and d[field] not in ok:
                raise ValueError(f"DFlashConfig.{field}: unsupported value {d[field]!r} (supported: {ok})")
        extra = d.get("dflash_config") or {}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"DFlashConfig.rope_scaling: only default RoPE is supported, got {rope}")

        def get(name, default=dataclasses.MISSING):
            value = extra.get(name, d.get(name, default))
            if value is dataclasses.MISSING:
                raise ValueError(f"DFlashConfig: config.json lacks required field {name!r}")
            return value

        layers, target_layers = get("num_hidden_layers"), get("num_target_layers")
        ids = get("target_layer_ids", None)
        return cls(
            hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_hidden_layers=layers, num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads", d.get("num_attention_heads")),
            head_dim=get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            num_target_layers=target_layers, block_size=get("block_size", 16),
            mask_token_id=get("mask_token_id"),
            target_layer_ids=tuple(ids) if ids is not None else default_target_layer_ids(target_layers, layers),
            layer_types=tuple(get("layer_types", None) or ("full_attention",) * layers),
            sliding_window=get("sliding_window", None), is_causal=get("is_causal", None),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=get("max_position_embeddings", 40960), vocab_size=get("vocab_size", None))

    @classmethod
    def from_json(cls, path: str) -> "DFlashConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["dflash_config"] = {"mask_token_id": d.pop("mask_token_id"),
                              "target_layer_ids": list(d.pop("target_layer_ids"))}
        d["layer_types"] = list(self.layer_types)
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **d, "hidden_act": "silu",
                "attention_bias": False, "use_sliding_window": "sliding_attention" in self.layer_types,
                "tie_word_embeddings": False}

    def rope_inv_freq(self) -> np.ndarray:
        """Qwen3 default RoPE inverse frequencies ``[head_dim/2]`` float32."""
        return default_inv_freq(self.head_dim, self.rope_theta)
