"""The serving engine on a mesh of 8 CPU devices (data=2 x expert=2 x tensor=2: slots split over
data, experts and tensors as the models declare) gives the same tokens as on one device, greedy
and seeded, with one prompt long enough for chunked prefill.

The sharded engine runs in a subprocess (8 host devices); the one-device reference runs here
meanwhile, with the shapes of test_serving_engine.py (shared compilations in a full run)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ddtree_jax as dt
from ddtree_jax.serving import Engine
from tests._model_fixtures import tiny_dflash, tiny_kimi

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(20, 45)), [9, 10, 11]]
SAMPLING = [dict(temperature=0.0)] * 3 + [dict(temperature=0.9, top_p=0.9, seed=5)]
SHAPE = dict(method="ddtree", budget=6, slots=2, max_model_len=64, prefill_chunk=16, prefill_batch=2)

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    import ddtree_jax as dt
    from ddtree_jax.serving import Engine
    from ddtree_jax.serving.sharding import make_mesh, state_sharding
    from tests._model_fixtures import tiny_dflash, tiny_kimi
    assert len(jax.devices()) == 8
    path, prompts, sampling, shape = sys.argv[1], *map(json.loads, sys.argv[2:5])
    target = tiny_kimi(0)
    dt.save_checkpoint(target, path + "/target")
    dt.save_checkpoint(tiny_dflash(target, 1), path + "/drafter")
    mesh = make_mesh("data=2,expert=2,tensor=2")
    st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
    sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
    assert len(st.model.layers[1].mlp.experts.gate_up_proj[...].sharding.device_set) == 8
    eng = Engine(st, sd, shard_state=state_sharding(mesh), **shape)
    tokens = [r.tokens for r in eng.generate(prompts, [dt.SamplingParams(**s) for s in sampling], max_tokens=10)]
    for leaf in (eng._state.target_cache.latent, eng._state.draft_cache.k, eng._state.out):
        assert "data" in str(leaf.sharding.spec), leaf.sharding  # the slots stay split over data
    print("SHARDED_TOKENS", json.dumps(tokens))
""")


def test_engine_on_a_mesh_matches_one_device(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(PROMPTS), json.dumps(SAMPLING),
                             json.dumps(SHAPE)], env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        target = tiny_kimi(0)
        eng = Engine(target, tiny_dflash(target, 1), **SHAPE)
        plain = [r.tokens for r in eng.generate(PROMPTS, [dt.SamplingParams(**s) for s in SAMPLING], max_tokens=10)]
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in out.splitlines() if line.startswith("SHARDED_TOKENS ")]
    assert lines, err[-3000:]
    assert json.loads(lines[0].split(" ", 1)[1]) == plain


def test_mesh_specs():
    from ddtree_jax.serving.sharding import parse_mesh_spec

    assert parse_mesh_spec("expert=4, tensor=2") == {"expert": 4, "tensor": 2}
    assert parse_mesh_spec("data=-1,expert=8") == {"data": -1, "expert": 8}
    for bad, match in [("experts=4", "axis"), ("expert=x", "integer"), ("expert=0", ">= 1"),
                       ("expert=2,expert=2", "twice"), ("data=-1,expert=-1", "at most one")]:
        with pytest.raises(ValueError, match=match):
            parse_mesh_spec(bad)
