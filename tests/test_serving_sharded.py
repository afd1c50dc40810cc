"""The serving engine on meshes of 8 CPU devices gives the same tokens as on one device.

Meshes: expert-parallel (expert=8), data x expert x tensor (2x2x2: slots split over data),
expert x tensor (2x4) and tensor-parallel (tensor=8). Expert and data parallelism do not change
any sum, so their tokens must equal one device's exactly. Tensor parallelism sums partial results
in another order, so a divergence is allowed only where the sharded and the unsharded target's
logits for the common prefix differ by at most ``LOGIT_TOL`` (float32 rounding, not a wrong
model); and on every mesh each device's copy of the committed tokens must be identical (no
shard commits a different token). Greedy and seeded sampling; one prompt long enough for
chunked prefill.

The sharded engines run in a subprocess (8 host devices) fed the one-device tokens computed here
(with the shapes of test_serving_engine.py: shared compilations in a full run)."""

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

LOGIT_TOL = 1e-4
MESHES = ["expert=8", "data=2,expert=2,tensor=2", "expert=2,tensor=4", "tensor=8"]

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import ddtree_jax as dt
    from ddtree_jax.serving import Engine
    from ddtree_jax.serving.sharding import make_mesh, state_sharding
    from tests._model_fixtures import tiny_dflash, tiny_kimi
    assert len(jax.devices()) == 8
    path, prompts, sampling, shape, meshes, plain = sys.argv[1], *map(json.loads, sys.argv[2:7])
    target = tiny_kimi(0)
    dt.save_checkpoint(target, path + "/target")
    dt.save_checkpoint(tiny_dflash(target, 1), path + "/drafter")
    ref = dt.load_target(path + "/target", dtype=jnp.float32)
    for spec in meshes:
        mesh = make_mesh(spec)
        st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
        sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
        eng = Engine(st, sd, shard_state=state_sharding(mesh), **shape)
        params = [dt.SamplingParams(**s) for s in sampling]
        tokens = [r.tokens for r in eng.generate(prompts, params, max_tokens=10)]
        # Every device's copy of the committed tokens is the same (replicas agree).
        out = eng._state.out
        copies = {}
        for shard in out.addressable_shards:
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        consistent = all(all((c == cs[0]).all() for c in cs) for cs in copies.values())
        diffs = []
        for prompt, got, want in zip(prompts, tokens, plain):
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if j is not None:
                ids = jnp.asarray([prompt + got[:j]])
                diffs.append(float(jnp.max(jnp.abs(st(ids)[0, -1] - ref(ids)[0, -1]))))
        print("MESH", json.dumps(dict(spec=spec, equal=tokens == plain, consistent=consistent, logit_diffs=diffs)))
""")


def test_engine_on_meshes_matches_one_device(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = tiny_kimi(0)
    eng = Engine(target, tiny_dflash(target, 1), **SHAPE)
    plain = [r.tokens for r in eng.generate(PROMPTS, [dt.SamplingParams(**s) for s in SAMPLING], max_tokens=10)]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [json.dumps(x) for x in (PROMPTS, SAMPLING, SHAPE, MESHES, plain)]
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *args], env=env, cwd=root,
                            capture_output=True, text=True, timeout=900)
    runs = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("MESH ")]
    assert [r["spec"] for r in runs] == MESHES, result.stderr[-3000:]
    for r in runs:
        assert r["consistent"], f"{r['spec']}: devices hold different committed tokens"
        if "tensor" not in r["spec"] or "tensor=1" in r["spec"]:
            assert r["equal"], f"{r['spec']}: expert/data parallelism changed the tokens"
        else:
            assert all(d <= LOGIT_TOL for d in r["logit_diffs"]), r


def test_mesh_specs():
    from ddtree_jax.serving.sharding import parse_mesh_spec

    assert parse_mesh_spec("expert=4, tensor=2") == {"expert": 4, "tensor": 2}
    assert parse_mesh_spec("data=-1,expert=8") == {"data": -1, "expert": 8}
    for bad, match in [("experts=4", "axis"), ("expert=x", "integer"), ("expert=0", ">= 1"),
                       ("expert=2,expert=2", "twice"), ("data=-1,expert=-1", "at most one")]:
        with pytest.raises(ValueError, match=match):
            parse_mesh_spec(bad)
