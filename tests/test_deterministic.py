"""The deterministic mode (``EngineConfig.deterministic``, ``ExecutionConfig.batch_invariant`` on the
target and the drafter), on the CPU in bf16 with the Triton kernels in interpret mode: seeded
requests under concurrency equal their solo runs, greedy DDTree equals greedy autoregressive
decoding, the drafter's products leave XLA, and the impossible combinations are named.

A tiny bf16 pair (one MoE target layer, one drafter layer) keeps the interpret-mode compilation
short.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ddtree_jax as dt
from ddtree_jax.config import ConfigError, EngineConfig, ExecutionConfig
from ddtree_jax.serving import Engine
from pallas_kernels.triton.moe_grouped_matmul import choose_blocks
from tests._model_fixtures import tiny_dflash_config, tiny_kimi_config
from tests.test_dense_matmul import _xla_dots

KERNELS = ExecutionConfig(impl="pallas")
FIXED = ExecutionConfig(impl="pallas", batch_invariant=True)


@pytest.fixture(scope="module")
def pair():
    """A random bf16 target (one MoE layer) and a one-layer drafter, on the kernels."""
    cfg = tiny_kimi_config(num_hidden_layers=1, first_k_dense_replace=0)
    target = dt.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, execution=KERNELS)
    rng = np.random.default_rng(0)
    for layer in target.model.layers:  # routing that depends on the biases
        if hasattr(layer.mlp, "gate"):
            bias = layer.mlp.gate.e_score_correction_bias
            bias[...] = jnp.asarray(rng.normal(0, 0.5, bias.shape), jnp.float32)
    dcfg = tiny_dflash_config(cfg, num_hidden_layers=1, layer_types=("full_attention",), target_layer_ids=(0,))
    drafter = dt.DFlashDrafter(dcfg, rngs=nnx.Rngs(1), dtype=jnp.bfloat16, execution=KERNELS)
    return target, drafter


def test_seeded_requests_under_concurrency_equal_their_solo_runs(pair):
    """4 slots, 12 concurrent requests (greedy, unseeded and seeded sampling, prompts of 3 to 37
    tokens: prefilled 1 or 2 rows at a time, in one to three 16-token chunks): every seeded
    request's tokens equal its run alone on the same engine, and again in another slot order."""
    rng = np.random.default_rng(0)
    vocab = pair[0].config.vocab_size
    prompts = [rng.integers(1, vocab - 1, int(n)).tolist() for n in rng.integers(3, 38, 12)]
    prompts[0] = rng.integers(1, vocab - 1, 37).tolist()  # a seeded request over three chunks
    seeded = [0, 3, 6, 9, 10]
    params = [dt.SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=100 + i) if i in seeded
              else dt.SamplingParams(temperature=1.0, top_p=0.9) if i % 2 else dt.SamplingParams(temperature=0.0)
              for i in range(12)]
    config = EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=4), slots=4, max_model_len=48,
                          prefill_chunk=16, prefill_batch=2, deterministic=True)
    eng = Engine(*pair, config)
    assert eng._target.execution.batch_invariant and eng._drafter.execution.batch_invariant
    assert not pair[0].execution.batch_invariant  # the models given are left as they are
    mixed = [r.tokens for r in eng.generate(prompts, params, max_tokens=10)]
    for i in seeded:
        assert eng.generate([prompts[i]], [params[i]], max_tokens=10)[0].tokens == mixed[i], f"request {i}"
    order = seeded[::-1] + [i for i in range(12) if i not in seeded]
    again = eng.generate([prompts[i] for i in order], [params[i] for i in order], max_tokens=10)
    assert [r.tokens for r, i in zip(again, order, strict=True) if i in seeded] == [mixed[i] for i in seeded[::-1]]


def test_greedy_ddtree_equals_greedy_ar_in_bf16(pair):
    """In the mode a verify computes a node's row as a one-token decode step does, so greedy DDTree
    commits greedy autoregressive decoding's tokens in bf16, every row."""
    target, drafter = (m.with_execution(FIXED) for m in pair)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, target.config.vocab_size - 1, n).tolist() for n in (5, 11, 3)]
    kw = dict(max_new_tokens=16, max_len=48)
    ar = dt.generate(target, None, prompts, method="ar", **kw).tokens
    tree = dt.generate(target, drafter, prompts, method="ddtree", budget=6, **kw)
    assert tree.tokens == ar and tree.mean_tau > 1


def test_drafter_batch_invariant_mode(pair):
    """The drafter in the mode: no XLA ``dot_general`` left in a block draft or a context append
    (every product in the fixed-order kernel; the plain kernel path has them), logits equal to the
    plain path's to bf16 rounding, a row's draft the same bits alone and among 4 rows, and the
    drafter it was made from unchanged."""
    target, drafter = pair
    fixed_target, fixed = target.with_execution(FIXED), drafter.with_execution(FIXED)
    cache = drafter.init_cache(4, 32)
    feats = jnp.asarray(np.random.default_rng(2).standard_normal((4, 9, target.config.hidden_size)), jnp.bfloat16)
    roots = jnp.array([3, 9, 27, 81], jnp.int32)

    def draft(t, d, rows):
        c = d.append_context(jax.tree.map(lambda a: a[:rows], cache), feats[:rows], jnp.full((rows,), 7))
        return d.propose(t, c, roots[:rows])

    def dots(t, d):
        return _xla_dots(jax.make_jaxpr(lambda: draft(t, d, 4))().jaxpr)

    assert len(dots(target, drafter)) > 0 and dots(fixed_target, fixed) == []
    plain, got = draft(target, drafter, 4), draft(fixed_target, fixed, 4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=0.1 * float(jnp.abs(plain).max()))
    alone = jax.jit(lambda: draft(fixed_target, fixed, 1))()
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(jax.jit(lambda: draft(fixed_target, fixed, 4))()[0]))
    assert not drafter.execution.batch_invariant and drafter.fc.fixed_order is None


def test_impossible_combinations_are_named(pair):
    """The mode needs the Triton kernels (CPU: ``impl="pallas"``): the reference models are refused
    with the field named, from the drafter and from the engine; the switch itself is a bool."""
    target, drafter = pair
    with pytest.raises(ConfigError, match="ExecutionConfig.batch_invariant: needs the Triton kernels") as e:
        drafter.with_execution(ExecutionConfig(impl="reference", batch_invariant=True))
    assert e.value.field == "batch_invariant"
    reference = EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=4), slots=2, max_model_len=32,
                             deterministic=True)
    with pytest.raises(ConfigError, match="ExecutionConfig.batch_invariant"):
        Engine(target.with_execution(ExecutionConfig(impl="reference")), drafter, reference)
    with pytest.raises(ConfigError, match="EngineConfig.deterministic: must be True or False"):
        dataclasses.replace(reference, deterministic=1)


def test_the_mode_pins_the_moe_blocks(pair):
    """Without ``moe_blocks`` the mode pins the decode step's MoE blocks (a row's expert arithmetic
    then does not change with the token count, e.g. in a long prefill); the plain path leaves them
    to ``choose_blocks``."""
    def blocks(model):
        return [layer.mlp.experts.blocks for layer in model.model.layers if hasattr(layer.mlp, "experts")]

    target = pair[0]
    assert blocks(target) == [None]
    assert blocks(target.with_execution(FIXED)) == [choose_blocks(1, target.config.n_routed_experts)]
