"""DFlash drafter against independently computed expectations (issue 9).

* Last-layer target features: transformers' ``output_hidden_states`` of a DeepseekV3 target
  (``hidden_states[id + 1]``; its last entry is the normed final state).
* Sliding-window drafter layers: a float64 numpy drafter with a hand-built band mask.
* RoPE scaling: the same numpy drafter with cos/sin from transformers' ``Qwen3RotaryEmbedding``
  (the reference drafter's RoPE) for linear and yarn configs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ddtree_jax.checkpoints import load_target
from ddtree_jax.models import DFlashConfig
from tests._model_fixtures import VOCAB, forward_uncached, prefill, tiny_dflash, tiny_dflash_config, tiny_kimi
from tests.test_kimi import hf_model

draft_uncached = nnx.jit(lambda drafter, target, ctx, last: drafter(target, ctx, last))
propose = nnx.jit(lambda drafter, target, cache, last: drafter.propose(target, cache, last))
append = nnx.jit(lambda drafter, cache, hidden, counts: drafter.append_context(cache, hidden, counts))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---- a plain float64 numpy DFlash drafter (written from the published architecture) ----


def _np(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _rms(x, w, eps):
    return _np(w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rotate(x, cos, sin):
    """HF ``x * cos + rotate_half(x) * sin`` with ``cos/sin [S, d]`` (both halves repeated)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rot * sin[:, None]


def numpy_drafter_logits(drafter, target, ctx, last_token, cos, sin, visible):
    """Uncached block logits ``[bs-1, V]`` of one request.

    ``ctx [C, n*H]`` target features at positions ``0..C-1``; the block
    ``[last_token, MASK...]`` sits at ``C..C+bs-1``. ``cos, sin [C+bs, head_dim]`` are the RoPE
    tables of positions ``0..C+bs-1``; ``visible [layers, bs, C+bs]`` bool is the attention mask of
    each layer (query block row, key position).
    """
    cfg = drafter.config
    c, bs, hd = ctx.shape[0], cfg.block_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    eps = cfg.rms_norm_eps
    tokens = [int(last_token)] + [cfg.mask_token_id] * (bs - 1)
    x = _np(target.model.embed_tokens.weight[...])[tokens]
    feats = _rms(_np(ctx) @ _np(drafter.fc.kernel[...]), drafter.hidden_norm.weight[...], eps)
    for i, layer in enumerate(drafter.layers):
        att = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight[...], eps)
        q = _rms((h @ _np(att.q_proj.kernel[...])).reshape(bs, nh, hd), att.q_norm.weight[...], eps)
        q = _rotate(q, cos[c:], sin[c:])
        kv_in = np.concatenate([feats, h], axis=0)
        k = _rms((kv_in @ _np(att.k_proj.kernel[...])).reshape(c + bs, nkv, hd), att.k_norm.weight[...], eps)
        k = _rotate(k, cos, sin)
        v = (kv_in @ _np(att.v_proj.kernel[...])).reshape(c + bs, nkv, hd)
        kv_head = np.arange(nh) // (nh // nkv)
        scores = np.einsum("tnd,snd->nts", q, k[:, kv_head]) / np.sqrt(hd)
        scores = np.where(visible[i][None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("nts,snd->tnd", p, v[:, kv_head]).reshape(bs, nh * hd)
        x = x + out @ _np(att.o_proj.kernel[...])
        h = _rms(x, layer.post_attention_layernorm.weight[...], eps)
        gate, up = h @ _np(layer.mlp.gate_proj.kernel[...]), h @ _np(layer.mlp.up_proj.kernel[...])
        x = x + (gate / (1 + np.exp(-gate)) * up) @ _np(layer.mlp.down_proj.kernel[...])
    x = _rms(x, drafter.norm.weight[...], eps)
    return x[1:] @ _np(target.lm_head.kernel[...])


def default_tables(positions, head_dim, theta):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=-1)
    return np.cos(ang), np.sin(ang)


def band_mask(c, bs, window, causal=False):
    """Hand-built: block query at position c+t sees key position s iff |c+t-s| < window
    (and s <= c+t when causal)."""
    q = c + np.arange(bs)[:, None]
    s = np.arange(c + bs)[None, :]
    vis = np.ones((bs, c + bs), bool) if window is None else np.abs(q - s) < window
    return vis & (s <= q) if causal else vis


# ---- 1. features from the target's last layer ----


def test_last_layer_features_are_transformers_hidden_states(tmp_path):
    """``hidden_layer_ids`` naming the last layer returns transformers' ``hidden_states[-1]`` (after
    the final norm), uncached and through ``prefill``; a drafter conditioned on it then gives the
    logits it gives on transformers' features."""
    ref = hf_model(0, q_lora_rank=24, n_group=2, topk_group=1, yarn=True)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    raw = []  # the last decoder layer's own output (before the final norm)
    hook = ref.model.layers[-1].register_forward_hook(
        lambda m, a, out: raw.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states
    hook.remove()
    target = load_target(str(tmp_path), dtype=jnp.float32)
    last = target.config.num_hidden_layers - 1
    layer_ids = (1, last)
    want = [hs[i + 1].numpy() for i in layer_ids]
    torch.testing.assert_close(hs[-1], hs[last + 1])
    _, hidden = forward_uncached(target, jnp.asarray(ids.numpy()), hidden_layer_ids=layer_ids)
    _, cached, _ = prefill(
        target, jnp.asarray(ids.numpy()), jnp.asarray([11, 11]), target.init_cache(2, 16), hidden_layer_ids=layer_ids
    )
    for got_u, got_c, w in zip(hidden, cached, want, strict=True):
        assert rel_err(got_u, w) < 1e-5 and rel_err(got_c, w) < 1e-5
    torch.testing.assert_close(ref.model.norm(raw[0]), hs[-1])
    drafter = tiny_dflash(target, target_layer_ids=layer_ids)
    last_tok = jnp.asarray([5, 9])
    got = draft_uncached(drafter, target, jnp.concatenate(hidden, axis=-1), last_tok)
    expect = draft_uncached(drafter, target, jnp.asarray(np.concatenate(want, axis=-1)), last_tok)
    assert rel_err(got, expect) < 1e-5
    # conditioning on the pre-norm output instead (the old behaviour) is visibly different
    pre_norm = np.concatenate([want[0], raw[0].detach().numpy()], axis=-1)
    assert rel_err(draft_uncached(drafter, target, jnp.asarray(pre_norm), last_tok), expect) > 1e-2


@pytest.fixture(scope="module")
def target():
    return tiny_kimi(5)


def _check_against_numpy(drafter, target, visible, cos, sin, seed):
    """Uncached and cached (context appended in two chunks) drafts vs the numpy drafter."""
    rng = np.random.default_rng(seed)
    c = visible.shape[-1] - drafter.config.block_size
    ctx = rng.normal(size=(c, len(drafter.config.target_layer_ids) * target.config.hidden_size)).astype(np.float32)
    last = int(rng.integers(0, VOCAB - 1))
    want = numpy_drafter_logits(drafter, target, ctx, last, cos, sin, visible)
    got = draft_uncached(drafter, target, jnp.asarray(ctx)[None], jnp.asarray([last]))[0]
    cache = drafter.init_cache(1, c + 4)
    for lo, hi in ((0, c // 2), (c // 2, c)):
        chunk = np.zeros((1, 4 + c // 2, ctx.shape[1]), np.float32)  # junk past the valid rows
        chunk[0, : hi - lo] = ctx[lo:hi]
        cache = append(drafter, cache, jnp.asarray(chunk), jnp.asarray([hi - lo]))
    cached = propose(drafter, target, cache, jnp.asarray([last]))[0]
    return rel_err(got, want), rel_err(cached, want), want


# ---- 2. sliding-window drafter layers ----


@pytest.mark.parametrize(
    "layer_types,window,is_causal",
    [
        (("sliding_attention", "sliding_attention"), 4, None),
        (("sliding_attention", "full_attention"), 3, None),
        (("full_attention", "sliding_attention"), 6, False),
        (("sliding_attention", "sliding_attention"), 4, True),  # explicit is_causal: the causal band
        (("full_attention", "full_attention"), None, True),
    ],
)
def test_sliding_window_layers_are_a_symmetric_band(target, layer_types, window, is_causal):
    """Block queries see ``|q_pos - k_pos| < window`` of ``[context ; block]`` in sliding layers,
    everything in full ones; non-causal unless ``is_causal`` is set (hand-built masks)."""
    drafter = tiny_dflash(target, layer_types=layer_types, sliding_window=window, is_causal=is_causal)
    cfg = drafter.config
    c, bs = 9, cfg.block_size
    visible = np.stack(
        [band_mask(c, bs, window if t == "sliding_attention" else None, causal=bool(is_causal)) for t in layer_types]
    )
    cos, sin = default_tables(np.arange(c + bs), cfg.head_dim, cfg.rope_theta)
    uncached, cached, want = _check_against_numpy(drafter, target, visible, cos, sin, seed=len(layer_types) + c)
    assert uncached < 1e-5 and cached < 1e-5, (uncached, cached)
    if window is not None and not is_causal:  # the causal band (the port's old default) is far off
        causal = np.stack(
            [band_mask(c, bs, window if t == "sliding_attention" else None, causal=True) for t in layer_types]
        )
        rng = np.random.default_rng(len(layer_types) + c)
        ctx = rng.normal(size=(c, 2 * target.config.hidden_size)).astype(np.float32)
        other = numpy_drafter_logits(drafter, target, ctx, int(rng.integers(0, VOCAB - 1)), cos, sin, causal)
        assert rel_err(other, want) > 1e-2


# ---- 3. RoPE scaling ----


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 24,
            "attention_factor": 1.25,
            "truncate": False,
        },
    ],
    ids=["linear", "yarn", "yarn-mscale", "yarn-attention-factor"],
)
def test_rope_scaling_matches_transformers_qwen3(target, rope):
    """A drafter whose ``config.json`` names linear/yarn RoPE loads, and drafts what a drafter
    with transformers' Qwen3 RoPE tables (its ``inv_freq`` and ``attention_scaling``) drafts."""
    base = tiny_dflash_config(target.config).to_hf_dict() | {"max_position_embeddings": 128, "rope_theta": 1e4}
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4.x and 5.x spellings
        cfg = DFlashConfig.from_hf_dict(base | {key: dict(rope)})
        assert DFlashConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    drafter = tiny_dflash(
        target,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    hf = Qwen3Config(
        hidden_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=128,
        rope_parameters={**rope, "rope_theta": 1e4},
    )
    emb = Qwen3RotaryEmbedding(hf)
    inv_freq, scale = emb.inv_freq.double().numpy(), float(emb.attention_scaling)
    np.testing.assert_allclose(cfg.rope_tables()[0], inv_freq, rtol=1e-6)
    assert cfg.rope_tables()[1] == pytest.approx(scale, rel=1e-12)
    c, bs = 21, drafter.config.block_size
    ang = np.concatenate([np.outer(np.arange(c + bs), inv_freq)] * 2, axis=-1)
    visible = np.ones((2, bs, c + bs), bool)
    uncached, cached, want = _check_against_numpy(
        drafter, target, visible, np.cos(ang) * scale, np.sin(ang) * scale, seed=c
    )
    assert uncached < 1e-5 and cached < 1e-5, (uncached, cached)
    cos0, sin0 = default_tables(np.arange(c + bs), 16, 1e4)
    rng = np.random.default_rng(c)
    ctx = rng.normal(size=(c, 2 * target.config.hidden_size)).astype(np.float32)
    unscaled = numpy_drafter_logits(drafter, target, ctx, int(rng.integers(0, VOCAB - 1)), cos0, sin0, visible)
    assert rel_err(unscaled, want) > 1e-3  # the scaling matters at these positions
