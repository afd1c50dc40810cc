"""generate() with the target and drafter sharded over a device mesh (8 CPU devices, expert x
tensor axes) gives the same tokens as the unsharded models, greedy and seeded sampling; the MoE
kernel path runs expert-parallel without gathering weights; the per-head prefill too."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    import ddtree_jax as dt
    from tests._model_fixtures import tiny_dflash, tiny_kimi
    assert len(jax.devices()) == 8
    path = sys.argv[1]
    target = tiny_kimi(0)
    dt.save_checkpoint(target, path + "/target")
    dt.save_checkpoint(tiny_dflash(target, 1), path + "/drafter")
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
    sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
    assert len(st.model.layers[1].mlp.experts.gate_up_proj[...].sharding.device_set) == 8
    pt = dt.load_target(path + "/target", dtype=jnp.float32)
    pd = dt.load_drafter(path + "/drafter", pt)
    prompts = [[1, 2, 3, 4, 5], [7]]
    for sampling in [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.9, top_p=0.9, seed=5)]:
        kw = dict(method="ddtree", budget=6, max_new_tokens=8, sampling=sampling)
        sharded, plain = dt.generate(st, sd, prompts, **kw), dt.generate(pt, pd, prompts, **kw)
        assert sharded.tokens == plain.tokens, (sharded.tokens, plain.tokens)
    # the per-head prefill (heads over the tensor axis, in a shard_map) on the 5-token prompt; the
    # sharded model made by with_execution keeps its placement
    st, pt = (m.with_execution(dt.ExecutionConfig(per_head_prefill_min_tokens=4)) for m in (st, pt))
    assert st.model.layers[0].self_attn.attention_mesh is not None
    kw = dict(method="ddtree", budget=6, max_new_tokens=8, sampling=dt.SamplingParams(temperature=0.0))
    sharded, plain = dt.generate(st, sd, prompts, **kw), dt.generate(pt, pd, prompts, **kw)
    assert sharded.tokens == plain.tokens, ("per-head", sharded.tokens, plain.tokens)
    print("SHARDED_OK")
""")


def test_sharded_generate_matches_unsharded(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=root)
    assert "SHARDED_OK" in result.stdout, result.stderr[-3000:]


EXPERT_PARALLEL = textwrap.dedent("""
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import ddtree_jax as dt
    from ddtree_jax.serving.sharding import make_mesh
    from tests._model_fixtures import tiny_kimi
    from tests.test_moe_kernel import _tree_inputs
    path, S = sys.argv[1], 40
    dt.save_checkpoint(tiny_kimi(0, num_hidden_layers=2), path)  # 1 dense + 1 MoE layer
    plain = dt.load_target(path, dtype=jnp.float32, impl="reference")
    tokens, depths, mask, valid = _tree_inputs(2, 8, 3)
    f = nnx.jit(lambda m, *a: m.verify(*a, valid=valid)[0])
    args = (tokens, depths, mask)
    want = f(plain, *args, plain.init_cache(2, S))
    v = np.asarray(valid)

    def lines(hlo, op):
        return [l for l in hlo.splitlines() if re.search(r"= \\S+ " + op + r"(-start)?\\(", l)]

    # The all-gathers each mesh may keep: on data x expert only token-sized routing arrays (N = 16
    # tokens; GSPMD alone also gathers each layer's cache rows and ``start`` around the attention
    # kernel, or every expert's weights around the MoE kernel); on expert x tensor only the local
    # experts' weights over tensor (the stacked gate/up layout; GSPMD alone also gathers the
    # heads-split queries around the attention kernel).
    allowed = {"data=2,expert=4": r"\\[16[,\\]]", "expert=2,tensor=4": r"f32\\[4,(32|64),64\\]"}
    for spec, ok in allowed.items():
        mesh = make_mesh(spec)
        sharded = dt.load_target(path, mesh=mesh, dtype=jnp.float32, impl="pallas")
        cache = sharded.init_cache(2, S)
        if "data" in mesh.axis_names:  # the serving state's placement: cache rows over data
            cache = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))), cache)
        with jax.set_mesh(mesh):
            hlo = f.lower(sharded, *args, cache).compile().as_text()
            got = f(sharded, *args, cache)
        gathers, reduces = lines(hlo, "all-gather"), lines(hlo, "all-reduce")
        bad = [l for l in gathers if not re.search(ok, l.split("=", 1)[1].split("all-gather")[0])]  # result shape
        assert not bad, (spec, bad)
        if spec.startswith("data"):
            assert len(reduces) == 1, reduces  # the MoE layer's psum of [N/2, H], nothing else
        err = np.abs(np.asarray(got) - np.asarray(want))[v].max()
        assert err <= 2e-5 * np.abs(np.asarray(want)).max(), (spec, err)
    print("EP_OK")
""")


def test_kernel_paths_on_meshes_of_8_devices(tmp_path):
    """The kernel paths (impl="pallas", interpret) on meshes of 8 CPU devices: verify logits equal
    one device's reference (float32) on data=2 x expert=4 (cache rows over data) and expert=2 x
    tensor=4 (heads over tensor). In the compiled program: no all-gather of the caches, of
    ``start`` or of the heads-split queries (the attention kernel runs in a shard_map: GSPMD alone
    gathers them around the pallas_call), none of the experts' weights over the expert axis, and
    on data x expert exactly one all-reduce per MoE layer (the expert-parallel shard_map's psum of
    [N, H])."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=600, cwd=root)
    assert "EP_OK" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
