"""The runtime configs (``ddtree_jax.config``): every field's bad value is refused by name, the
checks against the models, the defaults, and ``KimiForCausalLM.with_execution`` (a new model on
the same weights; the original as it was). Importing the module without JAX: tests/test_package.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.backend import REFERENCE
from ddtree_jax.config import (
    PER_HEAD_PREFILL,
    SEGMENT_GROUP,
    SEGMENT_KEYS,
    ConfigError,
    DecodeConfig,
    EngineConfig,
    ExecutionConfig,
    execution_of,
    is_int,
    token_id_problem,
)
from ddtree_jax.models.kimi import Experts, KimiForCausalLM, MLAttention
from pallas_kernels.triton.moe_grouped_matmul import MoEBlocks
from tests._model_fixtures import forward_uncached, tiny_kimi, tiny_kimi_config

# (config class, field, a bad value); every field of every config appears
BAD = [
    (DecodeConfig, "method", "beam"),
    (DecodeConfig, "budget", 0),
    (DecodeConfig, "sync_every", 0),
    (DecodeConfig, "seed", 2**32),
    (DecodeConfig, "stop_token_ids", [3, -1]),
    (DecodeConfig, "impl", "triton"),
    (DecodeConfig, "auto_max_budget", 0),
    (DecodeConfig, "auto_costs", (1.0,)),
    (DecodeConfig, "auto_restart", -1.0),
    (DecodeConfig, "auto_probe_every", 0),
    (EngineConfig, "decode", {"method": "ar"}),
    (EngineConfig, "slots", 0),
    (EngineConfig, "max_model_len", 1),
    (EngineConfig, "max_output_tokens", 0),
    (EngineConfig, "max_queue", 0),
    (EngineConfig, "prefill_chunk", 0),
    (EngineConfig, "prefill_batch", 0),
    (EngineConfig, "admit_group", 0),
    (EngineConfig, "admit_wait", -1),
    (EngineConfig, "max_stop_ids", 0),
    (EngineConfig, "max_logprobs", -1),
    (EngineConfig, "page_size", 24),
    (EngineConfig, "kv_pages", 0),
    (EngineConfig, "deterministic", "yes"),
    (EngineConfig, "freeze_gc", 1),
    (EngineConfig, "read_lag", 3),
    (ExecutionConfig, "impl", "cuda"),
    (ExecutionConfig, "batch_invariant", 1),
    (ExecutionConfig, "moe_blocks", (16, 64)),
    (ExecutionConfig, "attention_segment_keys", -1),
    (ExecutionConfig, "attention_segment_group", 0),
    (ExecutionConfig, "hopper_attention", "yes"),
    (ExecutionConfig, "per_head_prefill_min_tokens", -1),
    (ExecutionConfig, "per_head_prefill_impl", "flash"),
]


def test_every_field_has_a_bad_value_case():
    covered = {(cls, name) for cls, name, _ in BAD}
    assert covered == {(cls, f.name) for cls in (DecodeConfig, EngineConfig, ExecutionConfig)
                       for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls,field,value", BAD, ids=[f"{c.__name__}.{f}" for c, f, _ in BAD])
def test_a_bad_value_is_refused_naming_its_field(cls, field, value):
    with pytest.raises(ConfigError) as err:
        cls(**{field: value})
    assert err.value.field == field and str(err.value).startswith(f"{cls.__name__}.{field}: ")


def test_more_bad_values():
    for bad in (True, 1.0, "2"):  # bools, floats and strings are not integers
        with pytest.raises(ConfigError, match="budget"):
            DecodeConfig(budget=bad)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        DecodeConfig(stop_token_ids="12")
    for lag in (0, 1.0, True):
        with pytest.raises(ConfigError, match=r"EngineConfig.read_lag: must be None, 1 or 2"):
            EngineConfig(read_lag=lag)
    with pytest.raises(ConfigError, match=r"stop_token_ids: 1\.5 is not an integer token id"):
        DecodeConfig(stop_token_ids=[1.5])


def test_good_values_and_defaults():
    d = DecodeConfig(stop_token_ids=[np.int64(5), 2], impl=REFERENCE, sync_every=None)
    assert d.stop_token_ids == (5, 2) and type(d.stop_token_ids[0]) is int and d.uses_drafter
    assert not DecodeConfig(method="ar").uses_drafter
    assert (d.method, d.budget, d.seed) == ("ddtree", 64, 0)
    e = EngineConfig()
    assert e.decode == DecodeConfig() and e.max_model_len is None and e.prefill_batch is None
    x = ExecutionConfig(moe_blocks=MoEBlocks(block_m=16), attention_segment_keys=0)
    assert x.attention_segment_group == SEGMENT_GROUP
    default = ExecutionConfig()
    assert (default.impl, default.batch_invariant, default.moe_blocks, default.hopper_attention) == (
        "auto", False, None, True)
    assert (default.attention_segment_keys, default.per_head_prefill_min_tokens, default.per_head_prefill_impl) == (
        SEGMENT_KEYS, PER_HEAD_PREFILL, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.budget = 3


def test_checks_against_the_models():
    d = DecodeConfig(stop_token_ids=[0, 127])
    d.check_for(128, has_drafter=True)
    d.check_for(None, has_drafter=True)  # vocabulary not known yet
    with pytest.raises(ConfigError, match=r"DecodeConfig.stop_token_ids: 127 is outside the vocabulary \[0, 100\)"):
        d.check_for(100, has_drafter=True)
    with pytest.raises(ConfigError, match="DecodeConfig.method: 'dflash' needs a drafter"):
        DecodeConfig(method="dflash").check_for(100, has_drafter=False)
    DecodeConfig(method="ar").check_for(100, has_drafter=False)
    EngineConfig(max_model_len=256).check_for(128, True, context=256)
    with pytest.raises(ConfigError, match=r"EngineConfig.max_model_len: must be in \[2, 200\]"):
        EngineConfig(max_model_len=256).check_for(128, True, context=200)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        EngineConfig(decode=d).check_for(100, True, context=256)


def test_shared_checks():
    assert is_int(3) and is_int(np.int32(3)) and not is_int(True) and not is_int(3.0)
    assert token_id_problem(4, 5) is None and token_id_problem(5, None) is None
    assert token_id_problem(5, 5) == "5 is outside the vocabulary [0, 5)"
    assert "negative" in token_id_problem(-1, None) and "integer" in token_id_problem("1", 5)


def test_impl_shorthand():
    assert execution_of(None, None) == ExecutionConfig()
    assert execution_of(None, "reference") == ExecutionConfig(impl="reference")
    with pytest.raises(ValueError, match="not both"):
        execution_of(ExecutionConfig(), "reference")
    with pytest.raises(ValueError, match="not both"):
        KimiForCausalLM(tiny_kimi_config(), rngs=nnx.Rngs(0), execution=ExecutionConfig(), impl="pallas")
    model = nnx.eval_shape(lambda: KimiForCausalLM(tiny_kimi_config(), rngs=nnx.Rngs(0), impl="pallas"))
    assert model.execution == ExecutionConfig(impl="pallas") and model.backend.kernels


def _settings(model):
    """Every submodule's static execution settings."""
    return [(type(m).__name__, getattr(m, "fixed_order", None), getattr(m, "execution", None),
             getattr(m, "blocks", None)) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]


def test_with_execution_makes_a_new_model_on_the_same_weights():
    base = tiny_kimi(1)
    before, settings = nnx.graphdef(base), _settings(base)
    tokens = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
    want = np.asarray(forward_uncached(base, tokens)[0])
    new = ExecutionConfig(impl="pallas", moe_blocks=MoEBlocks(block_m=16), attention_segment_keys=64,
                          attention_segment_group=2, hopper_attention=False, per_head_prefill_min_tokens=2,
                          per_head_prefill_impl="xla")
    other = base.with_execution(new)
    # the original as it was: the same graph (every static setting), its execution, its backend
    assert nnx.graphdef(base) == before and _settings(base) == settings
    assert base.execution == ExecutionConfig() and base.backend == REFERENCE
    # the new one computes as told, down to every submodule
    assert other is not base and other.execution == new and other.backend.kernels
    attention = [m for _, m in nnx.iter_graph(other) if isinstance(m, MLAttention)]
    experts = [m for _, m in nnx.iter_graph(other) if isinstance(m, Experts)]
    assert attention and all(m.execution == new for m in attention)
    assert experts and all(m.blocks == MoEBlocks(block_m=16) for m in experts)
    # the same arrays, in variables of its own
    base_leaves, other_leaves = jax.tree.leaves(nnx.state(base)), jax.tree.leaves(nnx.state(other))
    assert len(base_leaves) == len(other_leaves) and all(a is b for a, b in zip(base_leaves, other_leaves, strict=True))
    other.lm_head.kernel[...] = jnp.zeros_like(other.lm_head.kernel[...])
    assert float(jnp.abs(base.lm_head.kernel[...]).max()) > 0
    np.testing.assert_array_equal(np.asarray(forward_uncached(base, tokens)[0]), want)
    # a model made from `other` has its (zeroed) LM head
    assert float(jnp.abs(forward_uncached(other.with_execution(ExecutionConfig()), tokens)[0]).max()) == 0.0


def test_with_execution_checks_against_the_backend():
    base = tiny_kimi(1)
    with pytest.raises(ConfigError, match="ExecutionConfig.batch_invariant: needs the Triton kernels"):
        base.with_execution(ExecutionConfig(impl="reference", batch_invariant=True))
    with pytest.raises(TypeError, match="ExecutionConfig"):
        base.with_execution({"impl": "pallas"})
    assert base.execution == ExecutionConfig()
