"""The host's cost to launch one dispatch of the engine's rounds, and what it is made of.

    python bench/bench_launch.py --default [--batches 64] [--methods ar ddtree] [--budget 16]
        [--xla-variants default no_command_buffers]
    python bench/bench_launch.py --smoke          # batch 4, a few calls: checks the pipeline

At ``sync_every=1`` the engine launches one compiled call per round; when launching takes longer
than the device's round, the engine runs at the launcher's pace. For each method and batch (the
engine's slots, all running: ``Engine._scratch_activation``), medians of ``--calls`` calls on a
state the device has finished with:

* ``call``: the compiled call alone (``Engine._rounds``);
* ``call copy``: the call, then the start of the harvest's copy to the host before the rounds
  ran (``copy_to_host_async``);
* ``launch``: the engine's launch (``Engine._launch_rounds``);
* ``launch busy``: the launch right after the launch of the dispatch before it (the device
  busy with that dispatch's rounds, whose state this one's takes over);
* ``pipelined``: ``--calls`` launches back to back, then one wait: wall time per dispatch (the
  larger of the launch and the device's round when they overlap);
* calls with the same arguments that do (almost) nothing, which isolate the cost of passing the
  buffers: ``noop all`` (both models' parameters, the donated state, the key: the round's
  signature), ``noop state`` (the donated state alone), ``noop params`` (the parameters alone),
  ``noop 1`` (one small array).

A synthetic program isolates what the addresses of a call's buffers cost: ``--kernels`` small
kernels in a chain (one per step, kept apart by optimisation barriers) over a donated state of
8 arrays, returning a harvest that is a fresh array every call (``synthetic fresh``), the same
donated array written in place and passed back (``synthetic same``), or one of two donated
arrays in turn (``synthetic alternate``: the engine's case, whose harvest of the dispatch before
is still being read). XLA's command buffers (CUDA graphs) are recorded against buffer addresses;
if a call whose addresses changed costs much more than one whose did not, the launch's cost is
the graph's update, not the kernels' number.

Each ``--xla-variants`` entry runs in its own process with its ``XLA_FLAGS`` (command buffers as
XLA builds them by default, or none). Every variant also runs the same 8 dispatches from the same start
(sampled at temperature 1 with fixed seeds) and the parent checks that their tokens equal the
first variant's. Writes ``bench/results/launch_<device>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VARIANTS = {
    "default": "",
    "no_command_buffers": "--xla_gpu_enable_command_buffer=",
}


def _median_us(fn, n: int, ready) -> float:
    from bench._timing import host_call_median

    return 1e6 * host_call_median(fn, ready, n)


def _case(target, drafter, method: str, B: int, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.config import DecodeConfig, EngineConfig
    from ddtree_jax.serving import Engine, _device

    eng = Engine(target, drafter, EngineConfig(slots=B, max_model_len=args.max_model_len, decode=DecodeConfig(
        method=method, budget=args.budget if method == "ddtree" else 1, sync_every=1)))
    start = _device.activate(eng._state, eng._scratch_activation())
    jax.block_until_ready(start)
    eng._state = start
    plan = eng.plan

    # The same dispatches from the same start in every variant: their tokens must agree.
    snapshot = jax.tree.map(jnp.copy, start)
    digest = hashlib.sha256(b"".join(np.asarray(eng._launch_rounds([], plan)).tobytes() for _ in range(8)))
    digest = digest.hexdigest()
    eng._state = snapshot

    for _ in range(3):  # compiled and warm
        eng._launch_rounds([], plan)
    ready = lambda: eng._state
    row = dict(method=method if method != "ddtree" else f"ddtree@{args.budget}", batch=B,
               params=len(jax.tree.leaves(eng._tparams)) + len(jax.tree.leaves(eng._dparams)),
               state_leaves=len(jax.tree.leaves(eng._state)))

    def call():
        eng._state, _ = eng._rounds(plan, eng._state, 1)

    def call_copy():
        eng._state, packed = eng._rounds(plan, eng._state, 1)
        packed.copy_to_host_async()

    row["call_us"] = _median_us(call, args.calls, ready)
    row["call_copy_us"] = _median_us(call_copy, args.calls, ready)
    row["launch_us"] = _median_us(lambda: eng._launch_rounds([], plan), args.calls, ready)
    busy = []
    for _ in range(args.calls):  # the launch of a dispatch right after the one before it
        jax.block_until_ready(eng._state)
        eng._launch_rounds([], plan)
        t0 = time.perf_counter()
        eng._launch_rounds([], plan)
        busy.append(time.perf_counter() - t0)
    row["launch_busy_us"] = 1e6 * float(np.median(busy))
    jax.block_until_ready(eng._state)
    t0 = time.perf_counter()
    for _ in range(args.calls):
        packed = eng._launch_rounds([], plan)
    jax.block_until_ready((eng._state, packed))
    row["pipelined_us"] = 1e6 * (time.perf_counter() - t0) / args.calls

    H = 8
    noop_all = jax.jit(lambda tp, dp, state, key: (state, jnp.zeros((B, H), jnp.int32)), donate_argnums=(2,))
    noop_state = jax.jit(lambda state: (state, jnp.zeros((B, H), jnp.int32)), donate_argnums=(0,))
    noop_params = jax.jit(lambda tp, dp: jnp.zeros((B, H), jnp.int32))
    small = jnp.zeros((B, H), jnp.int32)
    noop_1 = jax.jit(lambda x: x + 1)

    def all_():
        eng._state, _ = noop_all(eng._tparams, eng._dparams, eng._state, eng._base_key)

    def state_():
        eng._state, _ = noop_state(eng._state)

    for fn in (all_, state_, lambda: noop_params(eng._tparams, eng._dparams), lambda: noop_1(small)):
        fn()  # compile
    row["noop_all_us"] = _median_us(all_, args.calls, ready)
    row["noop_state_us"] = _median_us(state_, args.calls, ready)
    row["noop_params_us"] = _median_us(lambda: noop_params(eng._tparams, eng._dparams), args.calls, ready)
    row["noop_1_us"] = _median_us(lambda: noop_1(small), args.calls, ready)
    row["digest"] = digest
    return row


def _synthetic(args) -> dict:
    """Median host microseconds per call of the synthetic chain (module doc), per harvest kind."""
    import jax
    import jax.numpy as jnp

    shape, n = (64, 128), args.kernels

    def chain(state, harvest):
        state = list(state)
        for i in range(n):
            j = i % len(state)
            state[j] = jax.lax.optimization_barrier(jnp.sin(state[j]) + 1.0)
        return tuple(state), harvest.at[:, :8].set(state[0][:, :8].astype(jnp.int32))

    def fresh(state, _):
        return chain(state, jnp.zeros((shape[0], 16), jnp.int32))

    run_fresh = jax.jit(fresh, donate_argnums=(0,))
    run_donated = jax.jit(chain, donate_argnums=(0, 1))
    box = {"state": tuple(jnp.full(shape, float(i)) for i in range(8)),
           "h": [jnp.zeros((shape[0], 16), jnp.int32) for _ in range(2)], "turn": 0}

    def call_fresh():
        box["state"], box["out"] = run_fresh(box["state"], None)

    def call_same():
        box["state"], box["h"][0] = run_donated(box["state"], box["h"][0])

    def call_alternate():
        t = box["turn"] = 1 - box["turn"]
        box["state"], box["h"][t] = run_donated(box["state"], box["h"][t])

    def ready():
        jax.block_until_ready(box["state"])

    row = {}
    for name, fn in (("fresh", call_fresh), ("same", call_same), ("alternate", call_alternate)):
        for _ in range(3):
            fn()  # compile, warm the graph
        ready()
        row[f"synthetic_{name}_us"] = _median_us(fn, args.calls, ready)
    return row


def _child(args) -> None:
    from bench._common import log
    from bench.bench_engine import _models

    target, drafter, _ = _models()
    rows = []
    for method in args.methods:
        for B in args.batches:
            log(f"[{args.variant}] {method} batch {B}")
            row = _case(target, drafter, method, B, args)
            log(f"  call {row['call_us']:.0f} us, with the copy {row['call_copy_us']:.0f} us, "
                f"launch {row['launch_us']:.0f} us, busy {row['launch_busy_us']:.0f} us, pipelined "
                f"{row['pipelined_us']:.0f} us, noop all/state/params/1 {row['noop_all_us']:.0f}/"
                f"{row['noop_state_us']:.0f}/{row['noop_params_us']:.0f}/{row['noop_1_us']:.0f} us")
            rows.append(row)
    if args.kernels:
        log(f"[{args.variant}] synthetic chain of {args.kernels} kernels")
        synthetic = _synthetic(args)
        log("  " + ", ".join(f"{k} {v:.0f}" for k, v in synthetic.items()))
        for row in rows:
            row.update(synthetic)
    with open(args.child_json, "w") as f:
        json.dump(rows, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--default", action="store_true", help="the shipped pair (the default)")
    p.add_argument("--smoke", action="store_true", help="batch 4, a few calls: checks the pipeline")
    p.add_argument("--batches", type=int, nargs="+", default=[64])
    p.add_argument("--methods", nargs="+", default=["ar", "ddtree"], choices=["ar", "dflash", "ddtree"])
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--kernels", type=int, default=280, help="the synthetic chain's kernels (0: no synthetic rows)")
    p.add_argument("--xla-variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.calls, args.max_model_len, args.kernels = [4], 5, 128, min(args.kernels, 16)
    if args.child_json:
        return _child(args)

    from bench._common import Report, log

    report = Report(args, name="launch", title="The host's cost to launch one dispatch of the rounds",
                    sections=["launch"])
    base_flags = os.environ.get("XLA_FLAGS", "")
    report.notes.append(f"XLA_FLAGS before each variant's own: `{base_flags}`" if base_flags else
                        "No XLA_FLAGS beside each variant's own.")
    first: dict = {}
    for variant in args.xla_variants:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--child-json", out,
                   "--batches", *map(str, args.batches), "--methods", *args.methods, "--budget", str(args.budget),
                   "--max-model-len", str(args.max_model_len), "--calls", str(args.calls),
                   "--kernels", str(args.kernels)]
            if args.smoke:
                cmd.append("--smoke")
            env = dict(os.environ, XLA_FLAGS=f"{base_flags} {VARIANTS[variant]}".strip())
            done = subprocess.run(cmd, env=env, cwd=ROOT)
            if done.returncode != 0 or not os.path.exists(out):
                log(f"[{variant}] failed with exit code {done.returncode}")
                report.notes.append(f"Variant `{variant}` (`{VARIANTS[variant]}`) failed: exit code {done.returncode}.")
                report.write()
                continue
            with open(out) as f:
                rows = json.load(f)
        for row in rows:
            key = (row["method"], row["batch"])
            first.setdefault(key, row["digest"])
            row["same_tokens_as_first"] = "yes" if row.pop("digest") == first[key] else "NO"
            report.add("launch", dict(variant=variant, xla_flags=VARIANTS[variant] or "-", **row))
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
