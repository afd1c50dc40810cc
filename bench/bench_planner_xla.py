"""The capacity planner's transient terms against what XLA's GPU compiler itself allocates for the
serving engine's programs, without a GPU: the engine's round (``serving._device.rounds_and_harvest``)
and prefill chunk (``serving._device.prefill_chunk``) compiled ahead of time for an H200 (a
compile-only device from a GPU target description) on abstract weights and state, and each
executable's ``memory_analysis().temp_size_in_bytes`` beside the planner's phases.

    pip install "jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')"   # no GPU needed
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false JAX_PLATFORMS=cpu python bench/bench_planner_xla.py
    ... python bench/bench_planner_xla.py --mesh expert=8 --layers 3 --int4 --max-model-len 8192 --prefill-batch 8

The programs take the GPU's code paths (the Pallas kernels compiled for sm_90, the Hopper
attention kernel, cuDNN's attention for long prefill blocks), as the engine runs them on an H200.
No GPU is there to autotune on, so XLA picks its GEMM algorithms by heuristics (the temporaries do
not depend on the choice). ``--xla_gpu_enable_triton_gemm=false``: jax 0.10's deviceless compile
fails to tile one of the absorbed attention's products as a Triton GEMM; cuBLAS takes it instead.
Docs: docs/capacity.md ("Against XLA"). Results: ``planner_xla_h200_<date>.{json,md}`` under
``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

GIB = 2**30

H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""
"""An H200's GPU target description (``stream_executor.GpuTargetConfigProto``, text format):
what XLA needs to compile for the device without one attached."""


def compile_only_devices(n: int):
    """``n`` compile-only H200 devices of one host."""
    from jax.experimental import topologies

    return topologies.get_topology_desc("h200", "cuda", target_config=H200, topology=f"1x1x{n}").devices


def as_hopper() -> None:
    """The device checks the models make at trace time answer as an attached H200 would: the
    Hopper attention kernel runs, and cuDNN takes head dims up to 256."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn_attention

    import ddtree_jax.models.latent_attention as latent_attention

    latent_attention._hopper_gpu = lambda: True
    cudnn_attention.check_compute_capability = lambda c: tuple(map(int, c.split("."))) <= (9, 0)
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: c == "9.0"


def placed(model, mesh, mesh_axes, device):
    """``model`` (abstract) with every parameter an abstract array placed as loading places it."""
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from ddtree_jax.checkpoints import _sharding

    def spec(v):
        sharding = SingleDeviceSharding(device) if mesh is None else _sharding(v, mesh, mesh_axes)
        return v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding))

    graph, state = nnx.split(model)
    model = nnx.merge(graph, jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    if mesh is not None and hasattr(model, "_learn_placement"):
        model._learn_placement(mesh, mesh_axes)
    return model


def abstract_state(target, drafter, plan, config, cache_len, mesh, mesh_axes, device):
    """The engine's state (abstract), placed as ``serving.sharding.state_sharding`` places it."""
    import types

    from jax.sharding import SingleDeviceSharding

    import ddtree_jax.rows as rows_module
    from ddtree_jax.serving import _device
    from ddtree_jax.serving.sharding import state_sharding

    state = jax.eval_shape(lambda: _device.empty_state(target, drafter, plan, config.slots, cache_len,
                                                       config.max_model_len - 1, 1))
    place = None if mesh is None else state_sharding(mesh, mesh_axes)
    if place is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)),
                            state)
    real = rows_module.jax
    rows_module.jax = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    rows_module.jax.device_put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    try:
        return place(state)
    finally:
        rows_module.jax = real


def run(args, row: dict, devices) -> dict:
    """Compile the round and the largest prefill chunk of one setup; the XLA and planner bytes."""
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from bench._common import k2_slice
    from ddtree_jax.backend import Backend
    from ddtree_jax.config import DecodeConfig, EngineConfig, ExecutionConfig
    from ddtree_jax.decode_round import DecodePlan, Models
    from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES, NO_DP_ATTENTION
    from ddtree_jax.planner import K2_INT4, abstract_drafter, abstract_target, drafter_config_for, plan_capacity
    from ddtree_jax.serving import _device
    from ddtree_jax.serving.sharding import make_mesh

    kernels = Backend(kernels=True, interpret=False, family="triton")
    mesh_axes = NO_DP_ATTENTION if args.no_dp_attention else DEFAULT_MESH_AXES
    mesh = make_mesh(args.mesh, devices=devices) if args.mesh else None
    tcfg = k2_slice(row["layers"], args.experts, smoke=False)
    dcfg = drafter_config_for(tcfg)
    int4 = K2_INT4 if args.int4 else None
    target = placed(abstract_target(tcfg, int4=int4).with_execution(
        ExecutionConfig(impl=kernels, per_head_prefill_impl="cudnn")), mesh, mesh_axes, devices[0])
    drafter = placed(abstract_drafter(dcfg).with_execution(ExecutionConfig(impl=kernels)), mesh, mesh_axes, devices[0])
    config = EngineConfig(decode=DecodeConfig(budget=row["budget"]), slots=row["slots"],
                          max_model_len=row["max_model_len"], prefill_chunk=row["prefill_chunk"],
                          prefill_batch=row["prefill_batch"])
    cache_len = config.cache_len(config.max_model_len, dcfg.block_size - 1)
    plan = DecodePlan(method="ddtree", budget=row["budget"], backend=kernels,
                      hidden_layer_ids=tuple(dcfg.target_layer_ids))
    models, tparams, dparams = Models.split(target, drafter)
    state = abstract_state(target, drafter, plan, config, cache_len, mesh, mesh_axes, devices[0])
    everywhere = SingleDeviceSharding(devices[0]) if mesh is None else NamedSharding(mesh, P())
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=everywhere)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=everywhere)  # noqa: E731

    planner = plan_capacity(tcfg, dcfg, {} if mesh is None else dict(mesh.shape), slots=config.slots,
                            max_model_len=config.max_model_len, budget=row["budget"], int4=int4,
                            dp_attention=not args.no_dp_attention, prefill_chunk=config.prefill_chunk,
                            prefill_batch=config.prefill_batch, mesh_axes=mesh_axes)
    passes = planner.activation.passes(config.slots)
    rows = planner.activation.prefill_rows(config.slots)
    t0 = time.perf_counter()
    out = dict(row)
    if "round" in args.programs:
        xla = _device.rounds_and_harvest.lower(models, tparams, dparams, plan, state, key, rounds=1,
                                               tokens=dcfg.block_size).compile().memory_analysis().temp_size_in_bytes
        planned = max(passes["verify"], passes["draft"])
        out.update(xla_round_bytes=xla, planner_round_bytes=planned, round_ratio=round(planned / xla, 4),
                   planner_round_phase="verify" if passes["verify"] >= passes["draft"] else "draft")
    if "prefill" in args.programs:
        packed = i32(rows, _device.PREFILL_FIELDS + config.prefill_chunk)
        xla = _device.prefill_chunk.lower(models, tparams, dparams, plan, state,
                                          packed).compile().memory_analysis().temp_size_in_bytes
        out.update(xla_prefill_bytes=xla, planner_prefill_bytes=passes["prefill"],
                   prefill_ratio=round(passes["prefill"] / xla, 4))
    return {**out, "planner_compile_workspace_bytes": planner.bytes["compile_workspace"],
            "compile_seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="", help="mesh spec over compile-only devices (default: one device)")
    ap.add_argument("--no-dp-attention", action="store_true")
    ap.add_argument("--layers", type=int, nargs="+", default=[2])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--int4", action="store_true")
    ap.add_argument("--slots", type=int, nargs="+", default=[64])
    ap.add_argument("--max-model-len", type=int, nargs="+", default=[4096])
    ap.add_argument("--budget", type=int, nargs="+", default=[64])
    ap.add_argument("--prefill-chunk", type=int, nargs="+", default=[512])
    ap.add_argument("--prefill-batch", type=lambda v: None if v == "all" else int(v), nargs="+", default=[8],
                    help="slots per prefill step ('all': every slot)")
    ap.add_argument("--programs", nargs="+", choices=("round", "prefill"), default=["round", "prefill"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    n = 1
    if args.mesh:
        import math

        from ddtree_jax.serving.sharding import parse_mesh_spec

        n = math.prod(parse_mesh_spec(args.mesh).values())
    devices = compile_only_devices(n)
    as_hopper()
    base = dict(layers=args.layers[0], slots=args.slots[0], max_model_len=args.max_model_len[0],
                budget=args.budget[0], prefill_chunk=args.prefill_chunk[0], prefill_batch=args.prefill_batch[0])
    variations = [base] + [{**base, key: v} for key in ("layers", "slots", "max_model_len", "budget", "prefill_chunk",
                                                        "prefill_batch") for v in getattr(args, key)[1:]]
    day = datetime.date.today().strftime("%Y%m%d")
    tag = f"_{args.mesh.replace('=', '')}" if args.mesh else ""
    tag += f"_{args.layers[0]}layers" if args.layers[0] != 2 else ""
    stem = os.path.join(args.out, f"planner_xla_h200{tag}_{day}")
    meta = dict(device=f"NVIDIA H200 x {n} (compile-only)", jax=jax.__version__, mesh=args.mesh or "one device",
                dp_attention=not args.no_dp_attention, experts=args.experts, int4=args.int4,
                date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                command="python " + " ".join(sys.argv), xla_flags=os.environ.get("XLA_FLAGS", ""))
    rows = []
    for row in variations:
        rows.append(run(args, row, devices))
        print(json.dumps(rows[-1]), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        cols = list(dict.fromkeys(k for r in rows for k in r))
        lines = ["# Planner against XLA's H200 compile (temp bytes per device)", ""]
        lines += [f"- {k}: {v}" for k, v in meta.items()] + ["", "| " + " | ".join(cols) + " |",
                                                            "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        with open(stem + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
