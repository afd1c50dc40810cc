"""The capacity planner (``python -m ddtree_jax plan``) against the memory a serving engine really
takes on the GPUs: per mesh, the planner's per-device bytes by kind beside ``memory_stats()``.

    PYTHONUNBUFFERED=1 python bench/bench_planner_memory.py --layers 2 --slots 64 --max-model-len 4096
    python bench/bench_planner_memory.py --smoke --out /tmp/bench        # tiny, CPU devices

For each mesh of ``--meshes`` (default: one GPU, then every local GPU as ``expert=<n>``, with and
without data-parallel attention): a Kimi K2-shaped slice of ``--layers`` layers (bf16, random
weights made straight into their shardings) and a one-layer DFlash drafter are placed, an engine
of ``--slots`` slots of ``--max-model-len`` positions is built and warmed up (every program
compiled and run), and the first device's ``bytes_in_use`` is read after the weights, after the
engine's state, and its ``peak_bytes_in_use`` after the warm-up. Beside them: the planner's
weights, weights + caches + state, and total (with its activation and compile-workspace
estimates), and the ratios. The issue's bar: within 10% of the measured figures.

Devices without ``memory_stats()`` (the CPU) report the planner's side only. Results:
``planner_memory_<device>x<n>_<date>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

if "--smoke" in sys.argv:  # four CPU devices (set before JAX starts a backend)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

import ddtree_jax as dt
from bench._common import Report, k2_slice, log
from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES, NO_DP_ATTENTION
from ddtree_jax.planner import SLOT_KINDS, WEIGHT_KINDS, drafter_config_for, plan_capacity
from ddtree_jax.serving import Engine
from ddtree_jax.serving.sharding import make_mesh, state_sharding

GIB = 2**30


def in_use(key: str = "bytes_in_use") -> int | None:
    """The first device's ``memory_stats()[key]`` (None where the device keeps none)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get(key, 0))


def ratio(planned: int, measured: int | None) -> float | str:
    return planned / measured if measured else "-"


def run_mesh(args, report, spec: str) -> None:
    """Place the models and an engine on ``spec`` (``one``: one device; ``:nodp``: no data-parallel
    attention), measure, and add a row beside the planner's figures."""
    name, _, option = spec.partition(":")
    axes = NO_DP_ATTENTION if option == "nodp" else DEFAULT_MESH_AXES
    mesh = None if name == "one" else make_mesh(name)
    sizes = {} if mesh is None else dict(mesh.shape)
    tcfg = k2_slice(args.layers, args.experts, smoke=args.smoke)
    dcfg = drafter_config_for(tcfg)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    config = dt.EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=args.budget), slots=args.slots,
                             max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk,
                             prefill_batch=args.prefill_batch)
    plan = plan_capacity(tcfg, dcfg, sizes, slots=args.slots, max_model_len=args.max_model_len, budget=args.budget,
                         dtype=dtype, dp_attention=option != "nodp", prefill_chunk=args.prefill_chunk,
                         prefill_batch=args.prefill_batch, mesh_axes=axes)
    planned = plan.bytes
    weights_planned = sum(planned[k] for k in WEIGHT_KINDS)
    state_planned = sum(planned[k] for k in SLOT_KINDS)

    base = in_use()
    log(f"{spec}: placing {tcfg.num_hidden_layers} layers")
    target = dt.init_on_mesh(lambda: dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype), mesh, mesh_axes=axes)
    drafter = dt.init_on_mesh(lambda: dt.DFlashDrafter(dcfg, rngs=nnx.Rngs(1), dtype=dtype), mesh, mesh_axes=axes)
    weights = in_use()
    engine = Engine(target, drafter, config, shard_state=state_sharding(mesh, axes) if mesh is not None else None)
    state = in_use()
    log(f"{spec}: warming up")
    engine.warmup()
    peak = in_use("peak_bytes_in_use")
    measured_weights = None if base is None else weights - base
    measured_state = None if base is None else state - weights
    measured_peak = None if base is None else peak - base
    report.add("memory", dict(
        mesh=spec, slots=args.slots, max_model_len=args.max_model_len,
        planned_weights_GiB=weights_planned / GIB, measured_weights_GiB=(measured_weights or 0) / GIB,
        weights_ratio=ratio(weights_planned, measured_weights),
        planned_state_GiB=state_planned / GIB, measured_state_GiB=(measured_state or 0) / GIB,
        state_ratio=ratio(state_planned, measured_state),
        planned_total_GiB=plan.total / GIB, measured_peak_GiB=(measured_peak or 0) / GIB,
        total_ratio=ratio(plan.total, measured_peak)))
    measured = [None if m is None else round(m / GIB, 2) for m in (measured_weights, measured_state, measured_peak)]
    log(f"{spec}: planned weights {weights_planned / GIB:.2f} GiB, state {state_planned / GIB:.2f} GiB, total "
        f"{plan.total / GIB:.2f} GiB; measured (weights, state, peak) {measured} GiB")
    engine.stop()
    del engine, target, drafter
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on 4 CPU devices")
    ap.add_argument("--meshes", nargs="+", default=None,
                    help="'one' (one device) or mesh specs, ':nodp' for slots over data only (default: one, "
                         "expert=<n>, expert=<n>:nodp)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.slots, args.max_model_len, args.budget, args.prefill_chunk, args.prefill_batch = 8, 64, 6, 16, 2
    n = len(jax.devices())
    args.meshes = args.meshes or ["one"] + ([f"expert={n}", f"expert={n}:nodp"] if n > 1 else [])
    report = Report(args, name="planner_memory", title="Capacity planner against measured memory", n_dev=n,
                    suffix=f"x{n}", sections=("memory",))
    for spec in args.meshes:
        run_mesh(args, report, spec)
    report.write()
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
