"""DFlash drafter: cached vs cache-free drafting, non-causal block, context growth, save/load."""

from __future__ import annotations

import json

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.checkpoints import load_drafter, save_checkpoint
from ddtree_jax.models import DFlashConfig, default_target_layer_ids
from tests._model_fixtures import VOCAB, tiny_dflash, tiny_kimi

H = 64


@pytest.fixture(scope="module")
def target():
    return tiny_kimi(5)


propose = nnx.jit(lambda drafter, target, cache, last: drafter.propose(target, cache, last))
draft_uncached = nnx.jit(lambda drafter, target, ctx, last: drafter(target, ctx, last))
append = nnx.jit(lambda drafter, cache, hidden, counts: drafter.append_context(cache, hidden, counts))


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(61, 3) == (1, 30, 58)


def test_config_from_published_style_json():
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "layer_types": ["full_attention"] * 5,
        "sliding_window": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": 151936,
    }
    cfg = DFlashConfig.from_hf_dict(raw)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.block_size == 16 and cfg.mask_token_id == 151669
    assert DFlashConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    no_ids = {**raw, "dflash_config": {"mask_token_id": 7}}
    assert DFlashConfig.from_hf_dict(no_ids).target_layer_ids == (1, 9, 17, 25, 33)
    with pytest.raises(ValueError, match="layer_types"):
        DFlashConfig.from_hf_dict({**raw, "layer_types": ["full_attention"] * 4})
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_hf_dict({**raw, "dflash_config": {"mask_token_id": 7, "target_layer_ids": [40]}})


@pytest.mark.parametrize(
    "layer_types,window",
    [
        (("full_attention", "full_attention"), None),
        (("sliding_attention", "full_attention"), 6),
    ],
)
def test_cached_context_equals_uncached_and_grows_by_accepted_only(target, layer_types, window):
    drafter = tiny_dflash(target, layer_types=layer_types, sliding_window=window)
    rng = np.random.default_rng(0)
    b, n_feat = 2, len(drafter.config.target_layer_ids) * H
    cache = drafter.init_cache(b, 32)
    accepted = [[], []]
    for counts in ([7, 4], [3, 5], [1, 2]):  # rounds of accepted tokens; the rest of each chunk is junk
        chunk = rng.normal(size=(b, 5 if max(counts) <= 5 else 7, n_feat)).astype(np.float32)
        old = np.asarray(cache.lengths)
        cache = append(drafter, cache, jnp.asarray(chunk), jnp.asarray(counts))
        np.testing.assert_array_equal(cache.lengths, old + np.array(counts))
        for r in range(b):
            accepted[r].extend(chunk[r, : counts[r]])
    last = jnp.asarray(rng.integers(0, VOCAB - 1, (b,)))
    logits = propose(drafter, target, cache, last)
    chex.assert_shape(logits, (b, drafter.config.block_size - 1, VOCAB))
    for r in range(b):
        want = draft_uncached(drafter, target, jnp.asarray(np.stack(accepted[r]))[None], last[r : r + 1])
        np.testing.assert_allclose(logits[r], want[0], rtol=1e-4, atol=1e-4)


class _ShiftLastBlockEmbedding(nnx.Module):
    """A target whose embedding of the LAST block position is shifted: tests non-causality."""

    def __init__(self, target):
        self.target = target

    def embed(self, tokens):
        return self.target.embed(tokens).at[:, -1].add(1.0)

    def lm_logits(self, hidden):
        return self.target.lm_logits(hidden)


@pytest.mark.parametrize("is_causal,sliding", [(None, False), (True, False), (None, True)])
def test_block_attention_is_non_causal(target, is_causal, sliding):
    """Non-causal unless ``is_causal``: sliding-window layers too (a symmetric band, here wider
    than the block)."""
    kw = dict(layer_types=("sliding_attention",) * 2, sliding_window=8) if sliding else {}
    drafter = tiny_dflash(target, is_causal=is_causal, **kw)
    ctx = jnp.asarray(np.random.default_rng(1).normal(size=(1, 6, 2 * H)), jnp.float32)
    last = jnp.asarray([3])
    base = draft_uncached(drafter, target, ctx, last)
    shifted = draft_uncached(drafter, _ShiftLastBlockEmbedding(target), ctx, last)
    # depth 1 sits before the changed last position: non-causal attention sees the change
    change = np.abs(np.asarray(base[0, 0] - shifted[0, 0])).max()
    assert change > 1e-3 if is_causal is None else change == 0
    assert np.abs(np.asarray(base[0, -1] - shifted[0, -1])).max() > 1e-3


def test_sliding_window(target):
    """A window wider than every distance changes nothing; a narrow one hides far context."""
    ctx = jnp.asarray(np.random.default_rng(3).normal(size=(1, 12, 2 * H)), jnp.float32)
    last = jnp.asarray([5])
    full = draft_uncached(tiny_dflash(target, is_causal=False), target, ctx, last)
    sliding = ("sliding_attention", "sliding_attention")
    wide = draft_uncached(
        tiny_dflash(target, layer_types=sliding, sliding_window=64, is_causal=False), target, ctx, last
    )
    narrow = draft_uncached(
        tiny_dflash(target, layer_types=sliding, sliding_window=4, is_causal=False), target, ctx, last
    )
    np.testing.assert_array_equal(wide, full)
    assert np.abs(np.asarray(narrow - full)).max() > 1e-3
    # with window 4, context more than 3 positions before the block is invisible
    far_changed = ctx.at[:, :6].add(1.0)
    narrow2 = draft_uncached(
        tiny_dflash(target, layer_types=sliding, sliding_window=4, is_causal=False), target, far_changed, last
    )
    np.testing.assert_array_equal(narrow2, narrow)


def test_sliding_layer_without_a_window_is_full_attention(target):
    """As in ``Qwen3Config`` (window only with ``use_sliding_window``) and the reference."""
    ctx = jnp.asarray(np.random.default_rng(4).normal(size=(1, 12, 2 * H)), jnp.float32)
    last = jnp.asarray([5])
    full = draft_uncached(tiny_dflash(target), target, ctx, last)
    unwindowed = draft_uncached(tiny_dflash(target, layer_types=("sliding_attention",) * 2), target, ctx, last)
    np.testing.assert_array_equal(unwindowed, full)


_QWEN3 = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_target_layers": 12,
    "block_size": 8,
    "dflash_config": {"mask_token_id": 7},
}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"sliding_window": 64},  # no use_sliding_window: no window
        {"use_sliding_window": True, "sliding_window": 64},  # max_window_layers 28 > 4 layers: all full
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {"use_sliding_window": True, "max_window_layers": 0},  # Qwen3Config's default window, 4096
        {
            "use_sliding_window": True,
            "sliding_window": 32,
            "layer_types": ["sliding_attention"] * 4,
            "is_causal": False,
        },
        {"use_sliding_window": False, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ],
)
def test_layer_types_and_window_resolve_as_qwen3config(extra):
    """``layer_types``/``sliding_window`` come out as transformers' ``Qwen3Config`` resolves them
    (the reference drafter builds its attention from that config)."""
    from transformers import Qwen3Config

    raw = _QWEN3 | extra
    cfg = DFlashConfig.from_hf_dict(raw)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert cfg.layer_types == tuple(hf.layer_types) and cfg.sliding_window == hf.sliding_window
    assert cfg.is_causal == extra.get("is_causal") and not any(cfg.layer_is_causal(i) for i in range(4))
    assert DFlashConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_rope_types():
    """default / linear / yarn load and round-trip; other types are refused by name."""
    from ddtree_jax.models.rope import LinearScaling

    assert DFlashConfig.from_hf_dict(_QWEN3).rope_theta == 10000.0  # Qwen3Config's default
    for rope in (
        {"rope_type": "default", "rope_theta": 5e5},
        {"type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 1e6},
    ):
        for key in ("rope_scaling", "rope_parameters"):
            cfg = DFlashConfig.from_hf_dict(_QWEN3 | {key: rope, "rope_theta": 1e6})
            assert DFlashConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
            assert cfg.rope_theta == rope.get("rope_theta", 1e6)
    assert DFlashConfig.from_hf_dict(
        _QWEN3 | {"rope_scaling": {"type": "linear", "factor": 2.0}}
    ).rope_scaling == LinearScaling(factor=2.0)
    for bad in ("dynamic", "llama3", "longrope"):
        with pytest.raises(ValueError, match=f"unsupported rope type '{bad}'"):
            DFlashConfig.from_hf_dict(_QWEN3 | {"rope_scaling": {"rope_type": bad, "factor": 2.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        DFlashConfig.from_hf_dict(_QWEN3 | {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})


def test_parameter_names_are_the_published_ones(target):
    """Tensor names of z-lab/dflash ``DFlashDraftModel`` checkpoints (1 layer shown)."""
    from ddtree_jax.checkpoints import _hf_parts

    drafter = tiny_dflash(target, num_hidden_layers=1, layer_types=("full_attention",))
    layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ] + [f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.0.{n}" for n in layer}
    assert set(_hf_parts(drafter)) == want


def test_save_load_round_trip(tmp_path, target):
    drafter = tiny_dflash(target)
    save_checkpoint(drafter, str(tmp_path))
    loaded = load_drafter(str(tmp_path), target, dtype=jnp.float32)
    assert loaded.config == drafter.config
    ctx = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 2 * H)), jnp.float32)
    last = jnp.asarray([1, 2])
    np.testing.assert_array_equal(draft_uncached(loaded, target, ctx, last), draft_uncached(drafter, target, ctx, last))
    bad = drafter.config.to_hf_dict() | {"num_target_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="num_target_layers"):
        load_drafter(str(tmp_path), target)
