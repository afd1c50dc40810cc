"""serving.direct_call.DirectCall: the engine's rounds called with flat buffers give exactly the
jit call's outputs (state and harvest, over chained calls that donate the state), for the
autoregressive and the DDTree rounds on fresh random rows; argument checks name the bad leaf;
programs it cannot call directly (host callbacks, arguments on several devices) fall back."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.decode_state import NO_STOP
from ddtree_jax.sampling import SamplingBatch
from ddtree_jax.serving import Engine, _device
from ddtree_jax.serving.direct_call import DirectCall

SLOTS = 3


def _running_state(eng: Engine, seed: int):
    """The engine's empty state with every slot running from a random root, sampled at random
    temperatures, every other row with its own seed (the others draw from the engine's key)."""
    rng = np.random.default_rng(seed)
    rows = np.arange(SLOTS, dtype=np.int32)
    sampling = SamplingBatch(temperature=rng.uniform(0.0, 1.5, SLOTS).astype(np.float32),
                             top_k=np.zeros((SLOTS,), np.int32), top_p=np.ones((SLOTS,), np.float32),
                             min_p=np.zeros((SLOTS,), np.float32),
                             seed=rng.integers(0, 2**31, SLOTS).astype(np.uint32), has_seed=np.arange(SLOTS) % 2 == 0)
    return _device.activate(eng._empty_state(), rows, rng.integers(0, eng.vocab_size, SLOTS).astype(np.int32),
                            np.zeros((SLOTS,), np.int32), np.full((SLOTS,), eng.max_output_tokens, np.int32),
                            np.full((SLOTS, eng.max_stop_ids), NO_STOP, np.int32), sampling, rows,
                            np.zeros((SLOTS,), np.int32))


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_direct_rounds_equal_the_jit_call(models, method):
    config = dt.EngineConfig(decode=dt.DecodeConfig(method=method, budget=5, sync_every=2), slots=SLOTS,
                             max_model_len=48, prefill_chunk=16)
    eng = Engine(*models, config)
    kw = dict(rounds=eng.sync_every, tokens=eng.sync_every * eng.tokens_per_round)
    for seed in (0, 1):
        state = _running_state(eng, seed)
        direct = _device.direct_rounds(eng._models, eng._tparams, eng._dparams, eng.plan, state, eng._base_key, **kw)
        assert direct is not None
        a = jax.tree.map(jnp.copy, state)
        b = state
        for _ in range(3):  # chained: each call donates the state the previous one returned
            a, packed_a = _device.rounds_and_harvest(eng._models, eng._tparams, eng._dparams, eng.plan, a,
                                                     eng._base_key, **kw)
            old = b
            b, packed_b = direct(b, check=True)
            assert old.root.is_deleted()  # donated, as the jit call donates
            np.testing.assert_array_equal(np.asarray(packed_a), np.asarray(packed_b))
            assert (np.asarray(packed_b)[:, 0] > 0).all()  # the rows committed tokens
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checked_call_names_the_bad_leaf(models):
    config = dt.EngineConfig(decode=dt.DecodeConfig(method="ar"), slots=SLOTS, max_model_len=48, prefill_chunk=16)
    eng = Engine(models[0], None, config)
    state = _running_state(eng, 0)
    direct = _device.direct_rounds(eng._models, eng._tparams, eng._dparams, eng.plan, state, eng._base_key,
                                   rounds=1, tokens=1)
    bad = dataclasses.replace(state, generated=state.generated.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"argument leaf \d+ .*float32.*int32"):
        direct(bad, check=True)
    with pytest.raises(ValueError, match="an argument is"):
        direct((state, state), check=True)


def test_programs_it_cannot_call_directly_fall_back():
    def noisy(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1

    assert DirectCall.create(jax.jit(noisy), (jnp.ones(3),)) is None
    direct = DirectCall.create(jax.jit(lambda x, y: x * y, static_argnums=1), (jnp.arange(4.0), 3), static_args=(1,))
    np.testing.assert_array_equal(np.asarray(direct(jnp.arange(4.0))), np.arange(4.0) * 3)


_TWO_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from ddtree_jax.serving.direct_call import DirectCall
devices = jax.devices()
assert len(devices) == 2, devices
mesh = jax.sharding.Mesh(np.array(devices), ("x",))
spread = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
assert DirectCall.create(jax.jit(lambda x: x * 2), (spread,)) is None
one = jax.device_put(jnp.ones(4), devices[1])
assert DirectCall.create(jax.jit(lambda x: x * 2), (one,)) is not None
print("ok")
"""


def test_arguments_on_several_devices_fall_back():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
