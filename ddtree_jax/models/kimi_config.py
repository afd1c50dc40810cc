"""``KimiConfig``: the architecture of a DeepSeek-V3-family model, read from and written to HF
``config.json`` (``DeepseekV3ForCausalLM``; ``model_type`` ``deepseek_v3`` or ``kimi_k2``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ddtree_jax.models._config import require
from ddtree_jax.models.rope import YarnScaling, default_inv_freq, parse_rope_scaling, yarn_inv_freq, yarn_mscale

__all__ = ["KimiConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KimiConfig:
    """Architecture of a DeepSeek-V3-family model; field names are those of HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            require(getattr(self, name) > 0, self, name, "must be a positive integer")
        require(self.q_lora_rank is None or self.q_lora_rank > 0, self, "q_lora_rank",
                "must be null or positive")
        require(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, self,
                "qk_rope_head_dim", "must be positive and even")
        require(self.n_shared_experts >= 0, self, "n_shared_experts", "must be >= 0")
        require(self.n_routed_experts % self.n_group == 0, self, "n_group",
                f"must divide n_routed_experts={self.n_routed_experts}")
        require(self.topk_group <= self.n_group, self, "topk_group", f"must be <= n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        require(per_group >= 2, self, "n_group", "groups must hold >= 2 experts (group score = top-2 sum)")
        require(self.num_experts_per_tok <= self.topk_group * per_group, self, "num_experts_per_tok",
                "exceeds the experts available in topk_group groups")
        require(0 <= self.first_k_dense_replace <= self.num_hidden_layers, self,
                "first_k_dense_replace", "must be in [0, num_hidden_layers]")
        require(self.model_type in ("deepseek_v3", "kimi_k2"), self, "model_type",
                f"expected 'deepseek_v3' or 'kimi_k2', got {self.model_type!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> KimiConfig:
        """Read an HF ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
        def unsupported(field, ok):
            if field in d and d[field] not in ok:
                raise ValueError(f"KimiConfig.{field}: unsupported value {d[field]!r} (supported: {ok})")

        unsupported("hidden_act", ("silu",))
        unsupported("attention_bias", (False,))
        unsupported("tie_word_embeddings", (False,))
        unsupported("scoring_func", ("sigmoid",))
        unsupported("topk_method", ("noaux_tc",))
        unsupported("moe_layer_freq", (1,))
        if d.get("num_key_value_heads", d.get("num_attention_heads")) != d.get("num_attention_heads"):
            raise ValueError("KimiConfig.num_key_value_heads: MLA needs num_key_value_heads == num_attention_heads")
        theta, yarn = parse_rope_scaling(d, "KimiConfig", ("default", "yarn"))
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta"}
        kwargs = {k: d[k] for k in fields if k in d}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ValueError(f"KimiConfig: config.json lacks required field(s) {missing}")
        return cls(**kwargs, rope_theta=theta, rope_scaling=yarn)

    @classmethod
    def kimi_k2(cls, **overrides) -> KimiConfig:
        """Kimi K2's published architecture (61 layers, 384 experts, vocabulary 163,840), with
        ``overrides`` (e.g. fewer layers or experts for a slice that fits the devices at hand)."""
        fields = dict(
            vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
            num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=131072,
            model_type="kimi_k2",
            rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                     beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def from_json(cls, path: str) -> KimiConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF ``config.json`` dict that transformers' ``DeepseekV3Config`` and ``from_hf_dict`` read."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("rope_scaling")
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return {"architectures": ["DeepseekV3ForCausalLM"], **d, "num_key_value_heads": self.num_attention_heads,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}

    def rope_tables(self) -> tuple[np.ndarray, float]:
        """``(inv_freq [qk_rope_head_dim/2] float32, cos/sin scale)``."""
        if self.rope_scaling is None:
            return default_inv_freq(self.qk_rope_head_dim, self.rope_theta), 1.0
        return yarn_inv_freq(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)

    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` under yarn."""
        scale = self.qk_head_dim ** -0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim:
            scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        return scale

