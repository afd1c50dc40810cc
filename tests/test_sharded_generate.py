"""generate() with the target and drafter sharded over a device mesh (8 CPU devices, expert x
tensor axes) gives the same tokens as the unsharded models, greedy and seeded sampling."""

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
    print("SHARDED_OK")
""")


def test_sharded_generate_matches_unsharded(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=root)
    assert "SHARDED_OK" in result.stdout, result.stderr[-3000:]
