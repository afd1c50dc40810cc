"""The serving engine against ``generate()`` at the same batch, in one process.

    python bench/bench_engine.py --default [--batches 1 16 64] [--methods ar ddtree] [--budget 16]
    python bench/bench_engine.py --k2-slice 2 [--batches 16 64]   # a random Kimi K2-shaped target of 2 layers
    python bench/bench_engine.py --smoke          # the shipped pair at tiny sizes on the CPU: checks the pipeline

For each method and batch ``B`` (the engine's slots), ``--requests-per-slot * B`` requests of
``--prompt-len`` random prompt tokens and ``--new`` new tokens each (greedy, no stop tokens):

* ``generate()``: the requests in batches of ``B`` (prefill included), tokens/s;
* the ``Engine`` with ``B`` slots, ``sync_every="auto"`` (``--sync-every``: rounds per dispatch,
  each value in turn, ``auto`` the engine's choice per dispatch; ``--admit-group``: its
  ``admit_group``, each value in turn; ``--freeze-gc``: its ``freeze_gc``, on by default, or off, or both in turn),
  driven by its background thread (the emitter on the engine thread; the shipped tokenizer, whose
  text nobody reads here, so that none is decoded), every request submitted at once (or, with
  ``--streams N``, from N closed-loop clients, each submitting its next request when its last one
  is done: the load of an HTTP benchmark with N requests in flight, without the HTTP):
  tokens/s, engine steps, and the engine thread's host time per step (its time in ``step()``
  outside the waits for the device) beside its wait time per step, and three parts of a step:
  preparing the prefill, the launch of the step's programs (on the launcher thread, beside the
  rest; in brackets its part before the rounds: prefill chunks, activations, releases) and the
  emitter;
* the host's time to launch one dispatch of the rounds (the engine's compiled call, on a state
  the device is done with: median of 30), which the engine overlaps with reading back and
  streaming the dispatch before;
* the compiled round's device time per round, from a ``generate()`` run at batch ``B``
  (wall time of the decoding rounds / rounds, with ``profile`` off: an upper bound).

With ``--k2-slice L`` the target is a random Kimi K2-shaped model of ``L`` layers (bf16, the device's
kernels) and the drafter a random one-layer DFlash drafter (about one token accepted per round, so
every round runs), without a tokenizer: what it shows is whether the engine's host work per
round hides behind a large target's round.

With ``--paged on`` (or ``both``: each case twice) ``generate()`` and the engine run on paged caches
of ``--page-size`` positions per page (``EngineConfig.page_size``: a pool of the slots' memory).

Before the timed passes the engine compiles the prefill of every power-of-two number of rows up
to ``B`` at the workload's chunk (the shapes its admissions form), so that no prefill compiles in
the background during a timed pass (the row reports the seconds that still did). With
``--repeats N`` both are timed N times, in turn, and the median passes are reported, with
the range of engine / generate over every pairing of passes in brackets. Every shape runs once
untimed first (compilation). The engine's greedy tokens are checked against
``generate()``'s. Writes ``bench/results/engine_<device>_<date>.{json,md}`` with the command (and
``XLA_FLAGS`` when set).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import platform
import sys
import time

import jax
import numpy as np

from bench._timing import host_call_median
from ddtree_jax.config import DecodeConfig, EngineConfig
from ddtree_jax.generation import generate
from ddtree_jax.sampling import SamplingParams
from ddtree_jax.serving import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def _models():
    from tokenizers import Tokenizer

    import ddtree_jax as dt

    pair = os.path.join(os.path.dirname(dt.__file__), "default_pair")
    target = dt.load_target(os.path.join(pair, "target"))
    drafter = dt.load_drafter(os.path.join(pair, "drafter"), target)
    return target, drafter, Tokenizer.from_file(os.path.join(pair, "tokenizer.json"))


def _k2_models(layers: int, smoke: bool):
    from bench._common import k2_models

    return (*k2_models(layers, smoke=smoke), None)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(n, length)).tolist()


def _generate(target, drafter, prompts, B, method, budget, new, page_size=None):
    t0 = time.perf_counter()
    tokens, rounds = [], 0
    for i in range(0, len(prompts), B):
        out = generate(target, drafter, prompts[i : i + B], method=method, budget=budget, max_new_tokens=new,
                       sync_every=8, compact=False, max_len=len(prompts[0]) + new + 64, page_size=page_size)
        tokens += out.tokens
        rounds += max(len(r.acceptance_lengths) for r in out.requests)
    return time.perf_counter() - t0, tokens, rounds


def _engine_run(eng: Engine, prompts, new, streams: int = 0):
    """The workload through the running engine: every request submitted at once (``streams`` 0), or
    ``streams`` closed-loop clients, each submitting its next request once its last one is done
    (the load an HTTP benchmark with that many requests in flight puts on a server)."""
    m0 = eng.metrics.snapshot()
    t0 = time.perf_counter()
    submit = lambda p: eng.submit(p, SamplingParams(temperature=0.0), max_tokens=new, ignore_eos=True)
    if streams:
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            results = list(pool.map(lambda p: submit(p).result(timeout=3600), prompts))
    else:
        results = [h.result(timeout=3600) for h in [submit(p) for p in prompts]]
    dt_ = time.perf_counter() - t0
    m1 = eng.metrics.snapshot()
    steps = m1["engine_steps"] - m0["engine_steps"]
    sizes = {k: n - m0["dispatches"].get(k, 0) for k, n in m1["dispatches"].items()}
    return dict(seconds=dt_, tokens=[r.tokens for r in results], steps=steps,
                dispatches=" ".join(f"{k}:{n}" for k, n in sorted(sizes.items(), key=lambda kv: int(kv[0])) if n),
                **{f"{k}_ms_per_step": 1e3 * (m1[f"{k}_seconds"] - m0[f"{k}_seconds"]) / max(steps, 1)
                   for k in ("host", "wait", "prefill", "launch", "state_ops", "emit")})


def _launch_ms(eng: Engine, n: int = 30) -> float:
    """The host's time to launch one dispatch of the engine's rounds (``Engine._launch_rounds``:
    the compiled call and the harvest's copy to the host, not the rounds themselves), median of
    ``n`` launches each on a state the device has finished with."""
    return 1e3 * host_call_median(lambda: eng._launch_rounds([], eng.plan), lambda: eng._state, n)


class _Timeline:
    """Spans of the engine's steps, launches and read-backs (wrapped methods, perf_counter), for
    the medians per step of a timed pass: when a dispatch's launch starts and ends after its
    step's start, and when its read-back (one step later) has its harvest."""

    def __init__(self, eng: Engine):
        self.spans: dict[str, list[tuple[float, float]]] = {"step": [], "launch": [], "read": []}
        self.on = False
        for name, attr in (("step", "step"), ("launch", "_launch_rounds"), ("read", "_read_back")):
            setattr(eng, attr, self._wrap(name, getattr(eng, attr)))

    def _wrap(self, name, fn):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if self.on:
                    self.spans[name].append((t0, time.perf_counter()))
        return wrapped

    def summary(self) -> dict:
        """Medians, in ms: step length, launch length, launch end after its step's start, a
        read-back's length, and from a launch's end to its read-back's end (its rounds on the device,
        the wait included)."""
        med = lambda xs: 1e3 * float(np.median(xs)) if len(xs) else float("nan")
        steps = np.array(sorted(s for s, _ in self.spans["step"]))
        step_of = lambda t: int(np.searchsorted(steps, t, "right")) - 1
        launches, reads = self.spans["launch"], self.spans["read"]
        after = [b - steps[i] for a, b in launches if (i := step_of(a)) >= 0]
        # A step reads back the dispatch launched by the step before it.
        launch_end = {step_of(a): b for a, b in launches}
        to_read = [b - launch_end[i - 1] for a, b in reads if (i := step_of(a)) - 1 in launch_end]
        return dict(step=med([b - a for a, b in self.spans["step"]]), launch=med([b - a for a, b in launches]),
                    launch_end_after_step_start=med(after), read=med([b - a for a, b in reads]),
                    launch_end_to_read_end=med(to_read))


def run_case(target, drafter, tokenizer, method, B, args, page_size=None, admit_group=None, freeze_gc=True,
             launcher="thread", sync_every="auto", streams: int = 0, read_lag=None) -> dict:
    budget = args.budget if method == "ddtree" else 1  # (only DDTree reads it)
    n = max(args.requests_per_slot * B, 2)
    prompts = _prompts(n, args.prompt_len, target.config.vocab_size, seed=B)
    warm = prompts[: min(B, n)]
    _generate(target, drafter, warm, B, method, budget, args.new, page_size)  # compile
    config = EngineConfig(decode=DecodeConfig(method=method, budget=budget, sync_every=sync_every), slots=B,
                          max_model_len=args.prompt_len + args.new + 1,
                          prefill_chunk=max(16, 1 << (args.prompt_len - 1).bit_length()), page_size=page_size,
                          admit_group=admit_group, freeze_gc=freeze_gc, read_lag=read_lag)
    eng = Engine(target, drafter if method != "ar" else None, config, tokenizer=tokenizer)
    if launcher == "inline":
        eng._launcher = None  # each step launches on the engine thread, before reading back
    timeline = _Timeline(eng) if args.timeline else None
    eng.warmup()
    rows = 1
    while rows <= eng.slots:  # every prefill batch this workload can form, at its chunk: steady state
        eng._prefill.warm(rows, eng.prefill_chunk)
        rows *= 2
    eng.start()
    gens, runs = [], []
    try:
        _engine_run(eng, prompts, args.new)  # the same workload untimed first: its admission shapes compile
        eng.wait_compiled()  # (those compiling in the background: the timed runs use them)
        compiled = eng._prefill.compile_seconds
        for _ in range(args.repeats):  # generate() and the engine in turn, so that drifts hit both
            gens.append(_generate(target, drafter, prompts, B, method, budget, args.new, page_size))
            if timeline is not None:
                timeline.on = True
            runs.append(_engine_run(eng, prompts, args.new, streams))
            if timeline is not None:
                timeline.on = False
        compiled = eng._prefill.compile_seconds - compiled
    finally:
        eng.stop()
        gc.unfreeze()  # (the next case starts as Python does; a frozen heap is this case's setting)
    g_s, g_tokens, g_rounds = sorted(gens, key=lambda g: g[0])[len(gens) // 2]  # the median passes
    e = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    launch_ms = _launch_ms(eng)
    total = n * args.new
    same = sum(a == b for a, b in zip(e["tokens"], g_tokens, strict=True))
    row = dict(method=method, budget=budget if method == "ddtree" else 0, batch=B, page_size=page_size,
               admit_group=eng.admit_group, freeze_gc=freeze_gc, streams=streams, launcher=launcher,
               sync_every=sync_every, read_lag=eng.read_lag,
               switch_interval_ms=1e3 * sys.getswitchinterval(),
               timeline_ms=None if timeline is None else timeline.summary(),
               requests=n, new=args.new,
               generate_tok_s=total / g_s, engine_tok_s=total / e["seconds"],
               engine_over_generate=g_s / e["seconds"], engine_steps=e["steps"], dispatches=e["dispatches"],
               **{k: e[k] for k in e if k.endswith("_ms_per_step")},
               generate_ms_per_round=1e3 * g_s / max(g_rounds, 1), launch_ms=launch_ms, repeats=args.repeats,
               prefill_compile_s_in_timed_passes=compiled,
               ratio_range=[min(g[0] for g in gens) / max(r["seconds"] for r in runs),
                            max(g[0] for g in gens) / min(r["seconds"] for r in runs)],
               greedy_equal=f"{same}/{n}")
    log(json.dumps(row))
    return row


def _range(row: dict) -> str:
    lo, hi = row.get("ratio_range", (0, 0))
    return f" ({lo:.2f}-{hi:.2f})" if row.get("repeats", 1) > 1 else ""


def _markdown(report: dict) -> str:
    flags = f" with `XLA_FLAGS={report['xla_flags']}`" if report.get("xla_flags") else ""
    lines = [f"# Engine vs generate(), {report['device']}, {report['date']}", "", f"`{report['command']}`{flags}", "",
             "| method | batch | admit group | generate tok/s | engine tok/s | engine / generate | host ms / step | "
             "wait ms / step | prefill / launch (state programs) / emit ms per step | launch ms (state ready) | "
             "generate ms / round | greedy equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        name = r["method"] + (f"@{r['budget']}" if r["method"] == "ddtree" else "")
        name += f", pages of {r['page_size']}" if r.get("page_size") else ""
        name += f", {r['sync_every']} rounds per dispatch" if r.get("sync_every", 1) != 1 else ""
        name += f" {r['dispatches']}" if r.get("sync_every") == "auto" else ""
        lag = r.get("read_lag", 1)
        name += (", read back 2 steps late after several rounds" if lag == "auto" else
                 f", read back {lag} steps late" if lag != 1 else "")
        name += ", gc not frozen" if r.get("freeze_gc") is False else ""
        name += ", launched inline" if r.get("launcher") == "inline" else ""
        name += f", switch interval {r['switch_interval_ms']:g} ms" if r.get("switch_interval_ms", 5) != 5 else ""
        name += f", {r['streams']} closed-loop streams" if r.get("streams") else ""
        lines.append(f"| {name} | {r['batch']} | {r.get('admit_group', 1)} | {r['generate_tok_s']:,.0f} | "
                     f"{r['engine_tok_s']:,.0f} | {r['engine_over_generate']:.2f}x{_range(r)} | "
                     f"{r['host_ms_per_step']:.2f} | {r['wait_ms_per_step']:.2f} "
                     f"| {r['prefill_ms_per_step']:.2f} / {r['launch_ms_per_step']:.2f} "
                     f"({r['state_ops_ms_per_step']:.2f}) / {r['emit_ms_per_step']:.2f} "
                     f"| {r['launch_ms']:.2f} | {r['generate_ms_per_round']:.2f} | {r['greedy_equal']} |")
    timed = [r for r in report["rows"] if r.get("timeline_ms")]
    if timed:
        keys = list(timed[0]["timeline_ms"])
        lines += ["", "Timeline of the timed passes, medians in ms (`--timeline`):", "",
                  "| case | " + " | ".join(k.replace("_", " ") for k in keys) + " |", "|---|" + "---|" * len(keys)]
        for r in timed:
            name = r["method"] + (f"@{r['budget']}" if r["method"] == "ddtree" else "") + f", {r['launcher']}"
            name += f", switch {r['switch_interval_ms']:g} ms"
            lines.append(f"| {name} | " + " | ".join(f"{r['timeline_ms'][k]:.3f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the shipped pair (ddtree_jax/default_pair)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    ap.add_argument("--k2-slice", type=int, metavar="LAYERS", help="a random Kimi K2-shaped target of LAYERS layers")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16 64 (smoke: 1 2)")
    ap.add_argument("--methods", nargs="+", default=["ar", "ddtree"], choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--paged", choices=("off", "on", "both"), default="off",
                    help="paged caches (--page-size; generate() and the engine alike), contiguous ones, or both "
                         "in turn for each case")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes of generate() and of the engine, in turn; the medians are reported")
    ap.add_argument("--admit-group", type=int, nargs="+", default=[0], metavar="N",
                    help="the engine's admit_group (each in turn; 0: the engine's default, slots / 8)")
    ap.add_argument("--freeze-gc", choices=("on", "off", "both"), default="on",
                    help="EngineConfig.freeze_gc (both: off, then on, for each case)")
    ap.add_argument("--launcher", nargs="+", choices=("thread", "inline"), default=["thread"],
                    help="the engine's launches on its launcher thread (as it runs), or on the engine thread "
                         "before each step's read-back (each in turn)")
    ap.add_argument("--switch-interval", type=float, nargs="+", default=[None], metavar="MS",
                    help="the interpreter's thread switch interval during the engine's passes, in ms "
                         "(each in turn; default: as Python starts, 5 ms)")
    ap.add_argument("--timeline", action="store_true",
                    help="also report the medians of the engine's step, launch and read-back spans")
    ap.add_argument("--sync-every", type=lambda v: v if v == "auto" else int(v), nargs="+", default=["auto"],
                    metavar="K",
                    help="the engine's rounds per dispatch (DecodeConfig.sync_every), each value in turn")
    ap.add_argument("--read-lag", type=int, nargs="+", choices=(1, 2), default=[None], metavar="L",
                    help="EngineConfig.read_lag: engine steps from a dispatch to its read-back, each value in turn "
                         "(default: the engine's)")
    ap.add_argument("--streams", type=int, nargs="+", default=[0], metavar="N",
                    help="the engine's load, each value in turn: 0 submits every request at once; N > 0 runs N "
                         "closed-loop clients (each submits its next request when its last one is done)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--json", metavar="PATH", help="also write the report's JSON here (smoke runs too)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.new, args.prompt_len, args.requests_per_slot = 8, 8, 2
    elif not (args.default or args.k2_slice):
        ap.error("pass --default (the shipped pair), --k2-slice LAYERS or --smoke")
    args.batches = args.batches or ([1, 2] if args.smoke else [1, 16, 64])
    target, drafter, tokenizer = _k2_models(args.k2_slice, args.smoke) if args.k2_slice else _models()
    device = jax.devices()[0].device_kind.replace(" ", "_")
    report = dict(device=device, date=datetime.date.today().isoformat(), host=platform.node(),
                  command="python bench/bench_engine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[])
    name = f"engine_k2_slice{args.k2_slice}" if args.k2_slice else "engine"
    name += "_paged" if args.paged != "off" else ""
    stem = os.path.join(args.out, f"{name}_{device.lower()}_{report['date'].replace('-', '')}")
    sizes = {"off": [None], "on": [args.page_size], "both": [None, args.page_size]}[args.paged]
    for method in args.methods:
        for B in args.batches:
            freezes = {"on": [True], "off": [False], "both": [False, True]}[args.freeze_gc]
            cases = [(p, g, f, la, si, k, st, lag) for p in sizes for g in args.admit_group for f in freezes
                     for la in args.launcher for si in args.switch_interval for k in args.sync_every
                     for st in args.streams for lag in args.read_lag]
            for page_size, group, freeze, launcher, interval, k, streams, lag in cases:
                pages = f" pages of {page_size}" if page_size else ""
                log(f"{method} batch {B}{pages} admit_group {group or 'default'} freeze_gc {freeze} "
                    f"launcher {launcher} switch interval {interval or 'default'} sync_every {k} "
                    f"streams {streams or 'all at once'} read_lag {lag or 'default'} ...")
                before = sys.getswitchinterval()
                if interval:
                    sys.setswitchinterval(interval / 1e3)
                try:
                    report["rows"].append(run_case(target, drafter, tokenizer, method, B, args, page_size,
                                                   group or None, freeze, launcher, k, streams, lag))
                finally:
                    sys.setswitchinterval(before)
                if not args.smoke:  # after every case: a run cut short keeps what it measured
                    os.makedirs(args.out, exist_ok=True)
                    with open(stem + ".json", "w") as f:
                        json.dump(report, f, indent=1)
                    with open(stem + ".md", "w") as f:
                        f.write(_markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(_markdown(report))
    return report


if __name__ == "__main__":
    main()
