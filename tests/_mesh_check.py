"""The serving engine on meshes against one device, shared by the CPU-device test
(tests/test_serving_sharded.py, 8 host devices in a subprocess) and the GPU test (tests/test_gpu.py,
every local GPU).

Expert and data parallelism do not change any sum, so their tokens must equal one device's
exactly. Tensor parallelism sums partial results in another order, so a divergence is allowed only
where the sharded and the unsharded target's logits for the common prefix differ by at most
``LOGIT_TOL`` (float32 rounding, not a wrong model); and on every mesh each device's copy of the
committed tokens must be identical (no shard commits a different token). Greedy and seeded
sampling; one prompt long enough for chunked prefill."""

from __future__ import annotations

from ddtree_jax.config import DecodeConfig, EngineConfig

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(20, 45)), [9, 10, 11]]
SAMPLING = [dict(temperature=0.0)] * 3 + [dict(temperature=0.9, top_p=0.9, seed=5)]
CONFIG = EngineConfig(decode=DecodeConfig(method="ddtree", budget=6), slots=2, max_model_len=64, prefill_chunk=16,
                      prefill_batch=2)
MAX_TOKENS = 10
LOGIT_TOL = 1e-4


def one_device_tokens() -> list[list[int]]:
    import ddtree_jax as dt
    from ddtree_jax.serving import Engine
    from tests._model_fixtures import tiny_dflash, tiny_kimi

    target = tiny_kimi(0)
    eng = Engine(target, tiny_dflash(target, 1), CONFIG)
    return [r.tokens for r in eng.generate(PROMPTS, [dt.SamplingParams(**s) for s in SAMPLING], max_tokens=MAX_TOKENS)]


def mesh_runs(path: str, meshes: list[str], plain: list[list[int]]) -> list[dict]:
    """Decode ``PROMPTS`` on each mesh of ``meshes`` (over every device JAX sees) from checkpoints
    written under ``path``; one record per mesh: tokens equal to ``plain``, replicas consistent,
    the logit gap at each divergence."""
    import jax.numpy as jnp
    import numpy as np

    import ddtree_jax as dt
    from ddtree_jax.serving import Engine
    from ddtree_jax.serving.sharding import make_mesh, state_sharding
    from tests._model_fixtures import tiny_dflash, tiny_kimi

    target = tiny_kimi(0)
    dt.save_checkpoint(target, path + "/target")
    dt.save_checkpoint(tiny_dflash(target, 1), path + "/drafter")
    ref = dt.load_target(path + "/target", dtype=jnp.float32)
    runs = []
    for spec in meshes:
        mesh = make_mesh(spec)
        st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
        sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
        eng = Engine(st, sd, CONFIG, shard_state=state_sharding(mesh))
        params = [dt.SamplingParams(**s) for s in SAMPLING]
        tokens = [r.tokens for r in eng.generate(PROMPTS, params, max_tokens=MAX_TOKENS)]
        copies = {}
        for shard in eng._state.out.addressable_shards:
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        consistent = all(all((c == cs[0]).all() for c in cs) for cs in copies.values())
        diffs = []
        for prompt, got, want in zip(PROMPTS, tokens, plain, strict=True):
            j = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            if j is not None:
                ids = jnp.asarray([prompt + got[:j]])
                diffs.append(float(jnp.max(jnp.abs(st(ids)[0, -1] - ref(ids)[0, -1]))))
        runs.append(dict(spec=spec, equal=tokens == plain, consistent=consistent, logit_diffs=diffs))
    return runs


def check_runs(runs: list[dict], meshes: list[str]) -> None:
    assert [r["spec"] for r in runs] == meshes, runs
    for r in runs:
        assert r["consistent"], f"{r['spec']}: devices hold different committed tokens"
        if "tensor" not in r["spec"] or "tensor=1" in r["spec"]:
            assert r["equal"], f"{r['spec']}: expert/data parallelism changed the tokens"
        else:
            assert all(d <= LOGIT_TOL for d in r["logit_diffs"]), r
