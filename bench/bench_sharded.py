"""The sharded target and drafter over every local GPU: equality with one GPU, then the speed.

    PYTHONUNBUFFERED=1 python bench/bench_sharded.py                       # all local GPUs
    python bench/bench_sharded.py --smoke --out /tmp/bench                 # tiny, 4 CPU devices

Kimi K2 layer shapes (hidden 7168, MLA, 384 experts x 2048, top-8 + 1 shared, vocabulary 163,840,
bf16, random weights made straight into their shardings by ``ddtree_jax.init_on_mesh``, which
gives the same weights on one device and on any mesh) and a one-layer DFlash drafter.

Parts (``--parts``, default all, in this order):

* ``equal``: a slice of ``--layers-one`` layers (fits one GPU) decoded by the serving engine
  (``ddtree_jax.serving.Engine``, the mesh and state placement of the serving scripts) on GPU 0
  and on each mesh of ``--meshes`` (``:nodp``: without data-parallel attention, docs/sharding.md);
  greedy and seeded-sampled requests mixed, with prompts of several lengths, and the caches' bytes
  per GPU. Reports, per mesh, the share of tokens equal to one GPU's and, at each
  divergence, the largest gap between the two targets' logits for the common prefix. Then the
  scaling point: DDTree tokens/s on the mesh at ``--scale-batch`` rows against one GPU at
  ``--scale-batch / n_gpus`` rows (same per-GPU load, same model).
* ``passes``: the largest slice that fits ``--mem-fraction`` of the mesh (first of ``--meshes``)
  or ``--layers``: a decode step and tree verifies (``--budgets``) at each of ``--batches`` after a
  prefill of ``--prompt`` tokens, each against the per-GPU weight-read floor (the bytes of this
  GPU's share of the weights that the pass must read: all dense weights and the routed experts
  that uniformly routed tokens are expected to touch, at the copy bandwidth measured in the same
  run). Collectives: counted from the compiled HLO (kind, number, bytes) and, where the profiler
  works, their measured time in the pass (NCCL kernels in a trace).
* ``rounds``: ``generate`` on the same slice at each of ``--batches`` for autoregressive, linear
  DFlash and DDTree (``--round-budgets``): tokens/s, mean acceptance, ms per round. The drafter
  is random (it rarely agrees with the random target), so the round time, not tau, is the point.

Each configuration is compiled by a warm-up call; timings exclude compilation. Results are
written after every configuration (a run cut short keeps what it measured):
``sharded_<device>x<n>_<date>.{json,md}`` under ``--out``. ``--deadline`` (seconds) skips the
configurations that would start after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import (
    Report,
    copy_bandwidth,
    k2_slice,
    log,
    one_layer_drafter_config,
    past_deadline,
    random_tree,
    time_call,
    weight_read_bytes,
)
from ddtree_jax.compiled import CompiledFn
from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES, NO_DP_ATTENTION
from ddtree_jax.serving import Engine
from ddtree_jax.serving.sharding import make_mesh, state_sharding

if "--smoke" in sys.argv:  # four CPU devices (set before JAX starts a backend)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def target_config(args, layers: int) -> dt.KimiConfig:
    return k2_slice(layers, args.experts, smoke=args.smoke)


def mesh_of(spec: str):
    """``(mesh, mesh_axes)`` of a ``--meshes`` entry: a mesh spec, with ``:nodp`` for the layout
    without data-parallel attention (slots split over ``data`` only)."""
    spec, _, option = spec.partition(":")
    if option not in ("", "nodp"):
        raise SystemExit(f"--meshes: unknown option {option!r} (only ':nodp')")
    return make_mesh(spec), (NO_DP_ATTENTION if option else DEFAULT_MESH_AXES)


def make_models(tcfg, mesh, dtype, impl, mesh_axes=DEFAULT_MESH_AXES):
    target = dt.init_on_mesh(lambda: dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype, impl=impl), mesh,
                             mesh_axes=mesh_axes)
    dcfg = one_layer_drafter_config(tcfg)
    drafter = dt.init_on_mesh(lambda: dt.DFlashDrafter(dcfg, rngs=nnx.Rngs(1), dtype=dtype), mesh,
                              mesh_axes=mesh_axes)
    return target, drafter


def cache_bytes_per_device(state) -> int:
    """Bytes of the decoding state's two caches held by the first device."""
    dev = jax.devices()[0]
    leaves = jax.tree.leaves((state.target_cache, state.draft_cache))
    return sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == dev)


def param_bytes(tcfg, dtype) -> dict[str, float]:
    """Bytes of the target's weights by kind (from the abstract model: exact)."""
    model = nnx.eval_shape(lambda: dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype, impl="reference"))
    out = {"experts": 0.0, "other": 0.0}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        kind = "experts" if "experts" in path and "shared_experts" not in path else "other"
        out[kind] += np.prod(var.shape) * jnp.dtype(var.dtype).itemsize
    return out


def per_gpu_floor_bytes(target, tcfg, tokens: int) -> float:
    """The per-GPU weight-read bytes of a pass (``bench._common.weight_read_bytes``, whole
    embedding table counted, as in the results this script has written)."""
    return weight_read_bytes(target, tcfg, tokens, embedding="table")


def hlo_collectives(text: str) -> dict[str, dict[str, float]]:
    """Collectives in compiled HLO text: kind -> {count, bytes} (async pairs counted once)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.search(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if not m or "-done" in line.split("=")[1][:80]:
            continue
        nbytes = sum(DTYPE_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                     for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)))
        entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0.0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


def profiled_collective_ms(fn, *args) -> float | None:
    """Mean time per call of the NCCL kernels in a profiler trace of 3 calls (None: no trace)."""
    try:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(fn(*args))
            files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
            if not files:
                return None
            with gzip.open(files[0]) as f:
                events = json.load(f)
            events = events.get("traceEvents", events) if isinstance(events, dict) else events
            total_us = sum(float(e.get("dur", 0)) for e in events
                           if isinstance(e, dict) and "nccl" in str(e.get("name", "")).lower())
            return total_us / 3 / 1e3
    except Exception as e:  # noqa: BLE001 - the profiler is optional; say why it is missing
        log(f"  (no profile: {type(e).__name__}: {str(e)[:120]})")
        return None


def part_equal(args, report, dtype, n_dev):
    tcfg = target_config(args, args.layers_one)
    rng = np.random.default_rng(1)
    lengths = [3, 40, 17, 100][: args.eq_requests] + [9] * max(0, args.eq_requests - 4)
    prompts = [rng.integers(0, tcfg.vocab_size - 1, n).tolist() for n in lengths]
    params = [dt.SamplingParams(temperature=0.0) if i % 2 == 0 else
              dt.SamplingParams(temperature=0.9, top_p=0.95, seed=10 + i) for i in range(len(prompts))]
    shape = dt.EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=args.eq_budget), slots=len(prompts),
                            max_model_len=256, prefill_chunk=64)
    log(f"equal: one GPU, {tcfg.num_hidden_layers} layers")
    one_t, one_d = make_models(tcfg, None, dtype, args.impl)
    want = [r.tokens for r in Engine(one_t, one_d, shape).generate(prompts, params, max_tokens=args.eq_tokens)]
    log(f"  one GPU: {sum(map(len, want))} tokens")
    for spec in args.meshes:
        if past_deadline(args):
            break
        mesh, axes = mesh_of(spec)
        log(f"equal: mesh {spec} = {dict(mesh.shape)}")
        st, sd = make_models(tcfg, mesh, dtype, args.impl, axes)
        rows = st.row_mesh.devices if st.row_mesh is not None else 1
        eng = Engine(st, sd, dataclasses.replace(shape, slots=-(-len(prompts) // rows) * rows),
                     shard_state=state_sharding(mesh, axes))
        got = [r.tokens for r in eng.generate(prompts, params, max_tokens=args.eq_tokens)]
        copies = {}
        for shard in eng._state.out.addressable_shards:
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        consistent = all(all((c == cs[0]).all() for c in cs) for cs in copies.values())
        equal = same = total = 0
        gaps = []
        for prompt, g, w, p in zip(prompts, got, want, params, strict=True):
            j = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
            equal += j is None
            same += min(len(g), len(w)) if j is None else j
            total += len(w)
            if j is not None:
                ids = jnp.asarray([prompt + w[:j]])
                gaps.append(f"{'greedy' if p.temperature == 0 else 'seeded'}@{j}: "
                            f"{float(jnp.max(jnp.abs(st(ids)[0, -1] - one_t(ids)[0, -1]))):.3g}")
        report.add("equal", dict(mesh=spec, layers=tcfg.num_hidden_layers, requests=len(prompts),
                                 slots=eng.slots, requests_equal=equal, tokens_equal_share=same / max(total, 1),
                                 replicas_consistent=consistent, logit_gaps="; ".join(gaps) or "-",
                                 cache_MiB_per_device=cache_bytes_per_device(eng._state) / 2**20))
        log(f"  {equal}/{len(prompts)} requests equal, {same}/{total} tokens before divergence, "
            f"replicas consistent: {consistent}, gaps: {gaps}")
        if spec == args.meshes[0] and not past_deadline(args):
            part_scaling(args, report, tcfg, (one_t, one_d), (st, sd), n_dev)
        del st, sd, eng
        gc.collect()
    del one_t, one_d
    gc.collect()


def part_scaling(args, report, tcfg, one, sharded, n_dev):
    rng = np.random.default_rng(2)
    for name, (t, d), b in (("one GPU", one, max(1, args.scale_batch // n_dev)), ("mesh", sharded, args.scale_batch)):
        prompts = rng.integers(0, tcfg.vocab_size - 1, (b, args.prompt)).tolist()
        kw = dict(method="ddtree", budget=args.eq_budget, max_new_tokens=args.new)
        dt.generate(t, d, prompts, **kw, impl=args.impl)
        out = dt.generate(t, d, prompts, **kw, impl=args.impl)
        sec, toks = out.seconds, out.new_tokens
        report.add("scaling", dict(where=name, rows=b, tokens_per_s=toks / sec, per_gpu_rows=b / (1 if name == "one GPU"
                                   else n_dev), mean_tau=float(out.mean_tau)))
        log(f"scaling {name}: B={b} {toks / sec:,.0f} tok/s")
    rows = report.sections["scaling"][-2:]
    log(f"  mesh / one GPU tokens/s: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f} (n_gpus={n_dev})")


def fit_layers(args, dtype, n_dev) -> int:
    if args.layers:
        return args.layers
    if args.smoke:
        return 3
    probe = {n: param_bytes(target_config(args, n), dtype) for n in (1, 2)}
    per_moe = sum(probe[2].values()) - sum(probe[1].values())
    base = sum(probe[1].values())
    budget = args.mem_fraction * n_dev * jax.devices()[0].memory_stats()["bytes_limit"]
    # Non-expert weights are replicated on every GPU on an expert-only mesh: count them n_dev times.
    layers = 1 + int((budget - base * n_dev) // (probe[2]["experts"] + (per_moe - probe[2]["experts"]) * n_dev))
    return max(2, layers)


def part_passes(args, report, dtype, n_dev, bw):
    layers = fit_layers(args, dtype, n_dev)
    tcfg = target_config(args, layers)
    mesh, axes = mesh_of(args.meshes[0])
    log(f"passes: mesh {args.meshes[0]}, {layers} layers ({sum(param_bytes(tcfg, dtype).values()) / 2**30:.1f} GiB)")
    target, drafter = make_models(tcfg, mesh, dtype, args.impl, axes)
    rng = np.random.default_rng(3)
    max_len = args.prompt + max(args.budgets) + 8
    prefill = CompiledFn(lambda m, ids, n, c: m.prefill(ids, n, c)[2], reads=(target,))
    step = CompiledFn(lambda m, ids, n, c: m.prefill(ids, n, c)[0], reads=(target,))
    verify = CompiledFn(lambda m, tok, dep, anc, c: m.verify(tok, dep, anc, c)[0], reads=(target,))
    for b in args.batches:
        if past_deadline(args):
            break
        ids = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (b, args.prompt)), jnp.int32)
        try:
            cache = prefill(ids, jnp.full((b,), args.prompt, jnp.int32), target.init_cache(b, max_len))
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"  B={b} prefill failed: {type(e).__name__}: {str(e)[:200]}")
            report.add("passes", dict(pass_="prefill", B=b, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        cases = [("decode step", 1, (step, ids[:, :1], jnp.ones((b,), jnp.int32), cache))]
        for budget in args.budgets:
            depths, anc = random_tree(rng, b, budget)
            tok = jnp.asarray(rng.integers(0, tcfg.vocab_size - 1, (b, budget + 1)), jnp.int32)
            cases.append((f"verify {budget}", budget + 1, (verify, tok, depths, anc, cache)))
        for name, per_row, (fn, *fargs) in cases:
            if past_deadline(args):
                break
            row = dict(pass_=name, B=b, tokens=b * per_row)
            try:
                sec = time_call(fn, *fargs)
                floor = per_gpu_floor_bytes(target, tcfg, b * per_row) / bw
                row.update(ms=sec * 1e3, floor_ms=floor * 1e3, x_floor=sec / floor)
                coll = hlo_collectives(fn.lower(*fargs).compile().as_text()) if n_dev > 1 else {}
                row["collectives"] = ", ".join(f"{k} x{int(v['count'])} {v['bytes'] / 2**20:.2f} MiB"
                                               for k, v in coll.items()) or "-"
                if n_dev > 1 and not args.smoke:
                    prof = profiled_collective_ms(fn, *fargs)
                    row["collective_ms"] = prof if prof is not None else "n/a"
                log(f"  {name} B={b}: {sec * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms ({sec / floor:.1f}x); "
                    f"{row['collectives']} {row.get('collective_ms', '')}")
            except Exception as e:  # noqa: BLE001 - one failure (out of memory, say) must not stop the rest
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                log(f"  {name} B={b} failed: {row['error']}")
            report.add("passes", row)
        del cache
        gc.collect()
    if "rounds" in args.parts:
        part_rounds(args, report, tcfg, target, drafter)
    del target, drafter
    gc.collect()


def part_rounds(args, report, tcfg, target, drafter):
    rng = np.random.default_rng(4)
    methods = [("ar", 0), ("dflash", 15)] + [("ddtree", b) for b in args.round_budgets]
    for b in args.batches:
        prompts = rng.integers(0, tcfg.vocab_size - 1, (b, args.prompt)).tolist()
        for method, budget in methods:
            if past_deadline(args):
                return
            kw = dict(method=method, budget=max(budget, 1), max_new_tokens=args.new, impl=args.impl)
            row = dict(method=method, budget=budget, B=b, layers=tcfg.num_hidden_layers)
            try:
                dt.generate(target, None if method == "ar" else drafter, prompts, **kw)
                out = dt.generate(target, None if method == "ar" else drafter, prompts, **kw)
                sec, toks, rounds = out.seconds, out.new_tokens, max(1, out.rounds)
                row.update(tokens_per_s=toks / sec, mean_tau=out.mean_tau, ms_per_round=sec / rounds * 1e3,
                           prefill_ms=out.prefill_seconds * 1e3)
                log(f"rounds {method} budget={budget} B={b}: {toks / sec:,.0f} tok/s, tau {out.mean_tau:.2f}, "
                    f"{sec / rounds * 1e3:.1f} ms/round")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                log(f"rounds {method} B={b} failed: {row['error']}")
            report.add("rounds", row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on 4 CPU devices")
    ap.add_argument("--parts", nargs="+", default=["equal", "passes", "rounds"], choices=("equal", "passes", "rounds"))
    ap.add_argument("--meshes", nargs="+", default=None,
                    help="mesh specs, ':nodp' for slots over data only (default: expert=-1 expert=-1:nodp "
                         "tensor=-1 data=-1)")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--layers-one", type=int, default=2, help="layers of the equality slice (must fit one GPU)")
    ap.add_argument("--layers", type=int, default=0, help="layers of the speed slice (0: what fits)")
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--eq-requests", type=int, default=4)
    ap.add_argument("--eq-tokens", type=int, default=24)
    ap.add_argument("--eq-budget", type=int, default=15)
    ap.add_argument("--scale-batch", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[15, 64, 256])
    ap.add_argument("--round-budgets", type=int, nargs="+", default=[15, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds; later configurations are skipped")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.budgets, args.round_budgets = [1, 4], [3, 8], [4]
        args.prompt, args.new, args.eq_tokens, args.scale_batch = 8, 8, 10, 4
    n_dev = len(jax.devices())
    args.meshes = args.meshes or ["expert=-1", "expert=-1:nodp", "tensor=-1", "data=-1"]
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    if dtype == jnp.float32:
        jax.config.update("jax_default_matmul_precision", "highest")
    report = Report(args, name="sharded", title="Sharded target and drafter", n_dev=n_dev, suffix=f"x{n_dev}",
                    sections=("equal", "scaling", "passes", "rounds"))
    bw = copy_bandwidth()
    report.meta["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    log(f"{report.meta['device']} ({jax.default_backend()}), jax {jax.__version__}, copy {bw / 1e9:,.0f} GB/s")
    if "equal" in args.parts:
        part_equal(args, report, dtype, n_dev)
    if "passes" in args.parts:
        part_passes(args, report, dtype, n_dev, bw)  # runs the rounds on the same slice too
    elif "rounds" in args.parts:
        layers = fit_layers(args, dtype, n_dev)
        tcfg = target_config(args, layers)
        mesh, axes = mesh_of(args.meshes[0])
        part_rounds(args, report, tcfg, *make_models(tcfg, mesh, dtype, args.impl, axes))
    report.write()
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
