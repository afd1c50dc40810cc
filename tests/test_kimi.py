"""Kimi/DeepSeek-V3 target: parity with transformers, MoE kernels, and the cached forward modes."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ddtree_jax.checkpoints import load_target, save_checkpoint
from ddtree_jax.config import ExecutionConfig
from ddtree_jax.models import KimiConfig
from tests._model_fixtures import (
    VOCAB,
    commit,
    forward_uncached,
    path_to,
    prefill,
    random_tree,
    tiny_kimi,
    tiny_kimi_config,
    verify,
)

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0}


def hf_model(seed, *, q_lora_rank, n_group, topk_group, yarn, rope_interleave=True):
    """A random tiny transformers DeepseekV3ForCausalLM with non-trivial norms and router biases."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, first_k_dense_replace=1,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        rope_scaling=dict(YARN) if yarn else None, max_position_embeddings=256, routed_scaling_factor=2.5,
        rope_interleave=rope_interleave, rms_norm_eps=1e-5)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(cfg.n_routed_experts))
    return model


@pytest.mark.parametrize("q_lora_rank,n_group,topk_group,yarn,interleave", [
    (None, 1, 1, False, True),
    (24, 2, 1, True, True),
    (24, 4, 2, True, True),
    (None, 4, 3, True, False),
])
def test_parity_with_transformers(tmp_path, q_lora_rank, n_group, topk_group, yarn, interleave):
    ref = hf_model(0, q_lora_rank=q_lora_rank, n_group=n_group, topk_group=topk_group, yarn=yarn,
                   rope_interleave=interleave)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    model = load_target(str(tmp_path), dtype=jnp.float32)
    logits, hidden = forward_uncached(model, jnp.asarray(ids.numpy()), hidden_layer_ids=(0, 1))
    want = out.logits.numpy()
    chex.assert_shape(logits, want.shape)
    assert np.abs(np.asarray(logits) - want).max() / np.abs(want).max() < 1e-4
    for layer, h in zip((0, 1), hidden, strict=False):  # HF convention: hidden_states[layer + 1]
        want_h = out.hidden_states[layer + 1].numpy()
        assert np.abs(np.asarray(h) - want_h).max() / np.abs(want_h).max() < 1e-4


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    model = tiny_kimi(3)
    save_checkpoint(model, str(tmp_path))
    ref = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
    with torch.no_grad():
        want = ref(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(forward_uncached(model, jnp.asarray(ids))[0])
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_grouped_matmul_moe_equals_dense_experts():
    model = tiny_kimi(1, n_group=4, topk_group=2, num_experts_per_tok=3)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (3, 10)))
    fast, _ = nnx.jit(lambda m, x: m.forward_uncached(x))(model, ids)
    slow, _ = nnx.jit(lambda m, x: m.forward_uncached(x, dense_experts=True))(model, ids)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5)


def test_config_round_trip_and_validation():
    cfg = tiny_kimi_config()
    assert KimiConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    hf = DeepseekV3Config(n_group=2, topk_group=1, rope_scaling=dict(YARN)).to_dict()
    parsed = KimiConfig.from_hf_dict(hf)
    assert parsed.rope_scaling.factor == 4.0 and parsed.rope_scaling.mscale == 0.8
    with pytest.raises(ValueError, match="n_group"):
        tiny_kimi_config(n_group=3)
    with pytest.raises(ValueError, match="model_type"):
        KimiConfig.from_hf_dict({**cfg.to_hf_dict(), "model_type": "llama"})
    with pytest.raises(ValueError, match="scoring_func"):
        KimiConfig.from_hf_dict({**cfg.to_hf_dict(), "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        KimiConfig.from_hf_dict({k: v for k, v in cfg.to_hf_dict().items() if k != "kv_lora_rank"})


def _last_logits(model, seqs, pad_to=24, rows=8):
    """Cache-free logits after each sequence in ``seqs``, and layer 1's hidden states.

    Sequences are right-padded into one ``[rows, pad_to]`` batch so that one compilation serves
    every call (padding after a token cannot change it: the forward is causal).
    """
    batch = np.zeros((rows, pad_to), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    logits, (hidden,) = forward_uncached(model, jnp.asarray(batch), hidden_layer_ids=(1,))
    return np.stack([np.asarray(logits)[i, len(seq) - 1] for i, seq in enumerate(seqs)]), np.asarray(hidden)


def test_prefill_verify_commit_match_uncached_decoding():
    """Tree verify gives every node the logits of its ancestor path; commit keeps exactly the path."""
    model = tiny_kimi(2)
    rng = np.random.default_rng(2)
    b, t, max_len = 2, 7, 40
    prompt_lens = np.array([9, 5])
    prompts = rng.integers(0, VOCAB, (b, 9))
    cache = model.init_cache(b, max_len)
    logits, hidden, cache = prefill(model, jnp.asarray(prompts), jnp.asarray(prompt_lens), cache,
                                    hidden_layer_ids=(1,))
    np.testing.assert_array_equal(cache.lengths, prompt_lens)
    assert len(cache.latent) == len(cache.k_rope) == 3  # one buffer per layer
    # latent, not heads
    chex.assert_shape([*cache.latent, *cache.k_rope], [(b, max_len, 16)] * 3 + [(b, max_len, 4)] * 3)
    want, want_hidden = _last_logits(model, [list(prompts[r, :prompt_lens[r]]) for r in range(b)])
    for r in range(b):
        np.testing.assert_allclose(logits[r, prompt_lens[r] - 1], want[r], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(hidden[0][r, :prompt_lens[r]], want_hidden[r, :prompt_lens[r]],
                                   rtol=1e-4, atol=1e-4)

    trees = [random_tree(rng, t) for _ in range(b)]
    tokens = rng.integers(0, VOCAB, (b, t))
    depths = np.stack([tr[1] for tr in trees])
    masks = np.stack([tr[2] for tr in trees])
    logits, _, cache = verify(model, jnp.asarray(tokens), jnp.asarray(depths), jnp.asarray(masks), cache)
    np.testing.assert_array_equal(cache.lengths, prompt_lens)  # verify does not commit
    for r in range(b):
        seqs = [list(prompts[r, :prompt_lens[r]]) + [tokens[r, j] for j in path_to(trees[r][0], node)]
                for node in range(t)]
        np.testing.assert_allclose(logits[r], _last_logits(model, seqs)[0], rtol=1e-4, atol=1e-4)

    # accept the path to the deepest node in row 0, only the root in row 1
    deepest = int(np.argmax(depths[0]))
    paths = [path_to(trees[0][0], deepest), [0]]
    accepted = np.full((b, t), -1)
    for r, p in enumerate(paths):
        accepted[r, :len(p)] = p
    counts = np.array([len(p) for p in paths])
    cache = commit(cache, jnp.asarray(accepted), jnp.asarray(counts))
    np.testing.assert_array_equal(cache.lengths, prompt_lens + counts)

    seqs = [list(prompts[r, :prompt_lens[r]]) + [tokens[r, j] for j in paths[r]] for r in range(b)]
    for _ in range(3):  # decode one token at a time after the commit
        nxt = rng.integers(0, VOCAB, (b, 1))
        logits, _, cache = prefill(model, jnp.asarray(nxt), jnp.ones((b,), jnp.int32), cache)
        for r in range(b):
            seqs[r].append(nxt[r, 0])
        np.testing.assert_allclose(logits[:, 0], _last_logits(model, seqs)[0], rtol=1e-4, atol=1e-4)


def test_per_head_prefill_equals_the_absorbed_form():
    """A prefill from slot 0 in the per-head form (keys and values up-projected, standard causal
    attention; XLA's implementation on the CPU) gives the absorbed form's logits (float32), and a
    chunk after a committed prefix keeps the absorbed form (the same logits as without the option)."""
    rng = np.random.default_rng(4)
    b, max_len = 2, 40
    prompts = jnp.asarray(rng.integers(0, VOCAB, (b, 12)))
    lens = jnp.asarray([12, 7])
    absorbed = tiny_kimi(3, execution=ExecutionConfig(per_head_prefill_min_tokens=0))
    per_head = absorbed.with_execution(ExecutionConfig(per_head_prefill_min_tokens=4))
    want, _, _ = prefill(absorbed, prompts, lens, absorbed.init_cache(b, max_len))
    got, _, cache = prefill(per_head, prompts, lens, per_head.init_cache(b, max_len))
    for r in range(b):
        n = int(lens[r])
        np.testing.assert_allclose(got[r, :n], want[r, :n], rtol=1e-5, atol=1e-5)
    # a chunk after the prefix: the absorbed form either way, the same bits from the same cache
    more = [prefill(m, prompts[:, :6], jnp.asarray([6, 6]), cache)[0] for m in (absorbed, per_head)]
    np.testing.assert_array_equal(np.asarray(more[1]), np.asarray(more[0]))
