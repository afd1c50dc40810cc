"""generate() with the target and drafter sharded over a device mesh (8 CPU devices: expert x
tensor axes, and expert=8 with data-parallel attention) gives the same tokens as the unsharded
models, greedy and seeded sampling; the compiled round on the data-parallel layout exchanges
only the MoE's tokens; the MoE kernel path runs expert-parallel without gathering weights, with
rows over data or over data and expert; the per-head prefill too; a drafter loaded on a mesh
attends through the plain path, not its one-device kernel.

Every check runs in one subprocess (8 host devices: one JAX start-up for the file), on one pair of
checkpoints (``tests/_model_fixtures.tiny_pair``: a two-layer target, 1 dense + 1 MoE layer, and a
one-layer drafter). Each test reads its own check's outcome."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, re, sys, traceback
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import ddtree_jax as dt
from ddtree_jax.serving.sharding import make_mesh
from tests._mesh_check import check_round_collectives
from tests._model_fixtures import tiny_pair
from tests.test_moe_kernel import _tree_inputs
assert len(jax.devices()) == 8
path = sys.argv[1]
target, drafter = tiny_pair()
dt.save_checkpoint(target, path + "/target")
dt.save_checkpoint(drafter, path + "/drafter")


def sharded_generate():
    mesh = jax.make_mesh((4, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
    sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
    assert len(st.model.layers[1].mlp.experts.gate_up_proj[...].sharding.device_set) == 8
    pt = dt.load_target(path + "/target", dtype=jnp.float32)
    pd = dt.load_drafter(path + "/drafter", pt)
    # the drafter's attention kernel runs on one device; loaded on a mesh, the plain path (XLA partitions it)
    kernels = dt.ExecutionConfig(impl="pallas")
    on_mesh = dt.load_drafter(path + "/drafter", st, mesh=mesh, execution=kernels)
    alone = dt.load_drafter(path + "/drafter", pt, execution=kernels)
    backends = lambda d: {layer.self_attn.attention_backend.kernels for layer in d.layers}  # noqa: E731
    assert backends(on_mesh) == {False} and backends(alone) == {True}, (backends(on_mesh), backends(alone))
    # the per-head prefill (heads over the tensor axis, in a shard_map) on the 5-token prompt; the
    # sharded model made by with_execution keeps its placement; a greedy and a seeded row
    st, pt = (m.with_execution(dt.ExecutionConfig(per_head_prefill_min_tokens=4)) for m in (st, pt))
    assert st.model.layers[0].self_attn.attention_mesh is not None
    prompts = [[1, 2, 3, 4, 5], [7]]
    sampling = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.9, top_p=0.9, seed=5)]
    kw = dict(method="ddtree", budget=6, max_new_tokens=8, sampling=sampling)
    sharded, plain = dt.generate(st, sd, prompts, **kw), dt.generate(pt, pd, prompts, **kw)
    assert sharded.tokens == plain.tokens, (sharded.tokens, plain.tokens)
    # expert=8 with data-parallel attention: 8 prompts, one per device; then the compiled round's
    # collectives (tests/_mesh_check.py)
    mesh = make_mesh("expert=8")
    st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
    sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
    assert st.row_mesh.axes == ("expert",)
    eight = [[1, 2, 3, 4, 5], [7], [9, 10], [3] * 7, [4, 5], [6], [11, 12, 13], [2, 2]]
    mixed = [dt.SamplingParams(temperature=0.0)] * 4 + [
        dt.SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in range(4)]  # greedy and seeded rows
    kw = dict(method="ddtree", budget=6, max_new_tokens=8, sampling=mixed)
    sharded, plain = dt.generate(st, sd, eight, **kw), dt.generate(pt, pd, eight, **kw)
    assert sharded.tokens == plain.tokens, ("dp", sharded.tokens, plain.tokens)
    check_round_collectives(st, sd)


def kernel_paths():
    S = 40
    plain = dt.load_target(path + "/target", dtype=jnp.float32, impl="reference")

    def lines(hlo, op):
        return [l for l in hlo.splitlines() if re.search(r"= \S+ " + op + r"(-start)?\(", l)]

    # (mesh, batch, the all-gathers it may keep, its reductions). On data x expert with 2 rows the
    # rows split over data only: token-sized routing arrays (N = 16 tokens) and one psum of the
    # MoE's [N/2, H]; with 8 rows they split over data and expert too (data-parallel attention):
    # each device gathers its expert group's 32 tokens and a psum_scatter hands its rows back. (GSPMD
    # alone also gathers each layer's cache rows and ``start`` around the attention kernel, or
    # every expert's weights around the MoE kernel.) On expert x tensor (rows over expert) the
    # expert group's tokens and the local experts' weights over tensor (the stacked gate/up layout;
    # GSPMD alone also gathers the heads-split queries around the attention kernel).
    cases = [("data=2,expert=4", 2, r"\[16[,\]]", ("all-reduce",)),
             ("data=2,expert=4", 8, r"\[32[,\]]", ("reduce-scatter",)),
             ("expert=2,tensor=4", 2, r"f32\[4,(32|64),64\]|\[16[,\]]", None)]
    for spec, b, ok, reductions in cases:
        tokens, depths, mask, valid = _tree_inputs(b, 8, 3)
        f = nnx.jit(lambda m, *a, valid=valid: m.verify(*a, valid=valid)[0])
        args = (tokens, depths, mask)
        want = f(plain, *args, plain.init_cache(b, S))
        v = np.asarray(valid)
        mesh = make_mesh(spec)
        sharded = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32, impl="pallas")
        cache = sharded.init_cache(b, S)
        rows = sharded.row_mesh.split(b) if sharded.row_mesh is not None else ()
        if rows:  # the serving state's placement: cache rows over the row axes
            cache = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P(rows))), cache)
        with jax.set_mesh(mesh):
            hlo = f.lower(sharded, *args, cache).compile().as_text()
            got = f(sharded, *args, cache)
        gathers = lines(hlo, "all-gather")
        bad = [l for l in gathers if not re.search(ok, l.split("=", 1)[1].split("all-gather")[0])]  # result shape
        assert not bad, (spec, b, bad)
        if reductions is not None:  # the one MoE layer's reduction, nothing else
            found = {op: len(lines(hlo, op)) for op in ("all-reduce", "reduce-scatter")}
            assert found == {op: int(op in reductions) for op in found}, (spec, b, found)
        err = np.abs(np.asarray(got) - np.asarray(want))[v].max()
        assert err <= 2e-5 * np.abs(np.asarray(want)).max(), (spec, b, err)


for check in (sharded_generate, kernel_paths):
    try:
        check()
        error = None
    except Exception:
        error = traceback.format_exc()
    print("CHECK", json.dumps({"name": check.__name__, "error": error}), flush=True)
"""


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """Runs ``SCRIPT`` once on 8 CPU devices: ``({check name: None if it passed, else its
    traceback}, the end of the subprocess's stderr)``; a check missing from the dict did not run
    to its end (the subprocess died)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("mesh"))], env=env,
                            capture_output=True, text=True, timeout=1200, cwd=root)
    runs = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("CHECK ")]
    return {r["name"]: r["error"] for r in runs}, result.stdout[-2000:] + result.stderr[-3000:]


def _passed(checks, name):
    errors, tail = checks
    assert name in errors, f"{name} did not finish: {tail}"
    assert errors[name] is None, f"{name} failed:\n{errors[name]}"


def test_sharded_generate_matches_unsharded(checks):
    """generate() on expert=4 x tensor=2 (2 rows that do not split over the rows' axis; the per-head
    prefill) and on expert=8 with data-parallel attention (8 rows) equals the unsharded models'
    tokens, greedy and seeded rows; the drafter on a mesh takes the plain attention path; the
    compiled round's collectives (``tests/_mesh_check.check_round_collectives``)."""
    _passed(checks, "sharded_generate")


def test_kernel_paths_on_meshes_of_8_devices(checks):
    """The kernel paths (impl="pallas", interpret) on meshes of 8 CPU devices: verify logits equal
    one device's reference (float32) on data=2 x expert=4 (2 rows: cache rows over data; 8 rows:
    over data and expert, data-parallel attention) and expert=2 x tensor=4 (heads over tensor). In
    the compiled program: no all-gather of the caches, of ``start`` or of the heads-split queries
    (the attention kernel runs in a shard_map: GSPMD alone gathers them around the pallas_call),
    none of the experts' weights over the expert axis, and on data x expert exactly one reduction
    per MoE layer (the expert-parallel shard_map's psum of [N, H], or with rows over the expert
    axis its psum_scatter)."""
    _passed(checks, "kernel_paths")
