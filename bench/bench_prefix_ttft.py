"""Time to first token of a request whose prompt prefix is cached (a hit) against one whose is not
(a miss), on the paged engine, beside the contiguous engine, in one run.

    PYTHONUNBUFFERED=1 python bench/bench_prefix_ttft.py            # a Kimi K2-shaped slice (GPU)
    python bench/bench_prefix_ttft.py --smoke --out /tmp/bench     # tiny shapes on the CPU

For each prefix length of ``--prefix`` and each of ``--trials`` fresh random prefixes of that
length: request A (the prefix and a ``--suffix``-token tail) arrives alone on an idle engine and
decodes ``--new`` tokens (its prefix is not cached: a miss); once it has finished, request B (the
same prefix, another tail) arrives alone (a hit: the paged engine matches the prefix's full pages
and prefills only the rest). Time to first token is from ``submit`` to the first streamed token,
stepping the engine in this thread. The contiguous engine runs the same A and B. Reported: median
TTFT per case and the ratio miss / hit, per prefix length, once the first trial's prefill chunk
shapes have compiled (the engine runs a chunk of a shape still compiling on a larger compiled one:
the steady state is timed, not the first minutes of a fresh engine). The target is a random K2-shaped slice
of ``--layers`` layers (bf16) with a random one-layer drafter, DDTree budget ``--budget``, prefill
chunks of ``--prefill-chunk``. ``--methods ddtree ar`` adds autoregressive engines (rows ``... ar``):
both draw the first token in the prefill, so the difference is the drafter's share of the prefill
(its context) and of the engine's host work; ``--layouts paged`` leaves the contiguous engines out.
``--profile`` then traces one more miss and hit per engine (JAX's profiler) and reports, for
each, where its time to first token went: before the device's first kernel (the engine's host
work: admission, prefix match, page table, launch), the device's busy time and span, and after
the last kernel (the read-back and the stream), with the kernels that took the most time.
Results: ``prefix_ttft_<device>_<date>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import statistics
import tempfile
import time

import jax
import numpy as np

import ddtree_jax as dt
from bench._common import Report, k2_models, log
from ddtree_jax import compilation_cache
from ddtree_jax.serving import Engine


def ttft(eng: Engine, prompt: list[int], new: int) -> float:
    """Seconds from submitting ``prompt`` to its first streamed token (the request then finishes),
    on an idle engine: the dispatch the engine launched ahead for the request before (rounds of
    rows that turned out to have ended, up to a round of device time) is read back first, so that
    a miss and a hit start alike."""
    eng.drain()
    return ttft_from(eng, prompt, new, time.perf_counter_ns()) / 1e9


MARK = "prefix_ttft_submit"


def traced_ttft(eng: Engine, prompt: list[int], new: int, top: int = 10) -> dict:
    """``ttft`` under JAX's profiler: the wall time to the first token split into the host's lead
    (submit to the device's first kernel), the device's span (first kernel start to last kernel
    end) and busy time (the kernels' union), and the tail (last kernel end to the first token),
    in milliseconds, with the ``top`` kernels by total time: kernels that started before the first
    token, cut there (the rounds launched behind the first token's programs run on). Without GPU
    streams in the trace (the CPU) only the wall time is reported."""
    eng.drain()
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        with jax.profiler.TraceAnnotation(MARK):  # the trace's clock at submit
            t0 = time.perf_counter_ns()
        first = ttft_from(eng, prompt, new, t0)
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    events, start = [], None
    for plane in data.planes:
        for line in plane.lines:
            if plane.name.startswith("/host") and start is None:
                start = next((ev.start_ns for ev in line.events if ev.name == MARK), None)
            if plane.name.startswith("/device:GPU") and line.name.startswith("Stream"):
                events += [(ev.start_ns, ev.end_ns, ev.name) for ev in line.events]
    row = dict(ttft_ms=first / 1e6)
    if start is None:
        return row
    end = start + first
    # the kernels before the first token, cut there (the rounds launched behind it run on)
    spans, per_kernel = [], collections.defaultdict(float)
    for a, b, name in sorted(events):
        if a < end:
            spans.append((a, min(b, end)))
            per_kernel[name] += min(b, end) - a
    if spans:
        busy, cur = 0, spans[0]
        for a, b in spans[1:]:
            if a > cur[1]:
                busy, cur = busy + cur[1] - cur[0], (a, b)
            else:
                cur = (cur[0], max(cur[1], b))
        busy += cur[1] - cur[0]
        last = max(b for _, b in spans)
        row.update(host_lead_ms=(spans[0][0] - start) / 1e6, device_span_ms=(last - spans[0][0]) / 1e6,
                   device_busy_ms=busy / 1e6, tail_ms=(end - last) / 1e6, kernels=len(spans),
                   top=", ".join(f"{k} {v / 1e6:.2f}" for k, v in
                                 sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]))
    return row


def ttft_from(eng: Engine, prompt: list[int], new: int, t0: int) -> int:
    """Nanoseconds from ``t0`` (``perf_counter_ns``) to ``prompt``'s first streamed token; steps
    the engine until the request finishes."""
    handle = eng.submit(prompt, max_tokens=new, ignore_eos=True)
    first = None
    while not handle.done:
        eng.step()
        if first is None and any(c.token_ids for c in handle._chunks):
            first = time.perf_counter_ns() - t0
    return first if first is not None else time.perf_counter_ns() - t0


def _hit_tokens(eng: Engine) -> int:
    """Prompt tokens the engine has found in its prefix cache so far (0 without paged caches)."""
    return (eng.metrics.snapshot()["kv_pages"] or {}).get("prefix_hit_tokens", 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefix", type=int, nargs="+", default=[2048], help="prefix lengths, each its own row")
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--methods", nargs="+", choices=("ddtree", "ar"), default=["ddtree"],
                    help="engine methods (ar: the first token costs a plain target step, not a DDTree round: "
                         "the difference is what the first round adds to the time to first token)")
    ap.add_argument("--layouts", nargs="+", choices=("paged", "contiguous"), default=["paged", "contiguous"],
                    help="cache layouts (each an engine per method; contiguous engines cache no prefix: their hit "
                         "is a second miss)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the longest prefix and tail and the new tokens, rounded up to a power of two")
    ap.add_argument("--profile", action="store_true",
                    help="then trace a miss and a hit per engine: host lead, device busy time and span, tail, "
                         "top kernels")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                    help="JAX's on-disk cache of compiled programs: a second run loads the engines' programs "
                         "instead of compiling them (default: the process's setting)")
    args = ap.parse_args(argv)
    if args.compilation_cache is not None:
        compilation_cache.enable(compilation_cache.resolve(args.compilation_cache))
    if args.smoke:
        args.prefix, args.suffix, args.trials, args.prefill_chunk, args.max_model_len = [256], 16, 2, 64, 512
        args.page_size = 16
    need = max(args.prefix) + args.suffix + args.new + 1
    args.max_model_len = args.max_model_len or 1 << (need - 1).bit_length()
    if args.max_model_len < need:
        ap.error(f"--max-model-len {args.max_model_len} cannot hold a prefix of {max(args.prefix)}, a tail of "
                 f"{args.suffix} and {args.new} new tokens")

    log(f"building a K2-shaped slice of {args.layers} layers ...")
    target, drafter = k2_models(args.layers, smoke=args.smoke)
    vocab = target.config.vocab_size
    engines = {}
    for method in args.methods:
        decode = dt.DecodeConfig(method=method, budget=args.budget) if method == "ddtree" else \
            dt.DecodeConfig(method="ar")
        base = dt.EngineConfig(decode=decode, slots=4, max_model_len=args.max_model_len,
                               prefill_chunk=args.prefill_chunk)
        pair = (target, drafter if method == "ddtree" else None)
        suffix = "" if method == "ddtree" else f" {method}"
        if "paged" in args.layouts:
            engines["paged" + suffix] = Engine(*pair, dataclasses.replace(base, page_size=args.page_size))
        if "contiguous" in args.layouts:
            engines["contiguous" + suffix] = Engine(*pair, base)
    for name, eng in engines.items():
        log(f"warming up the {name} engine (compiles) ...")
        eng.warmup()
    report = Report(args, name="prefix_ttft", title="Time to first token: cached prefix against none",
                    sections=("ttft", "profile"))
    report.notes.append(f"Prefixes of {', '.join(map(str, args.prefix))} tokens + tail {args.suffix}, {args.new} new "
                        f"tokens, {args.trials} trials (medians), pages of {args.page_size}, prefill chunks of "
                        f"{args.prefill_chunk}, max_model_len {args.max_model_len}, DDTree budget {args.budget} "
                        f"(engines named ... ar: autoregressive), a "
                        f"random K2-shaped slice of {args.layers} layers. cached_per_hit: prompt tokens the hit "
                        "found in the prefix cache.")
    rng = np.random.default_rng(0)
    for length in args.prefix:
        times: dict[str, list[float]] = {f"{name} {case}": [] for name in engines for case in ("miss", "hit")}
        cached: dict[str, list[int]] = {name: [] for name in engines}
        for trial in range(args.trials + 1):  # the first trial compiles what warmup() left: not counted
            prefix = rng.integers(1, vocab, length).tolist()
            tails = [rng.integers(1, vocab, args.suffix).tolist() for _ in range(2)]
            for name, eng in engines.items():
                miss = ttft(eng, prefix + tails[0], args.new)
                before = _hit_tokens(eng)
                hit = ttft(eng, prefix + tails[1], args.new)
                if trial:
                    times[f"{name} miss"].append(miss)
                    times[f"{name} hit"].append(hit)
                    cached[name].append(_hit_tokens(eng) - before)
            if not trial:  # the chunk shapes it met compile in the background: the trials time them
                t0 = time.perf_counter()
                for eng in engines.values():
                    eng.wait_compiled()
                log(f"prefix {length}: waited {time.perf_counter() - t0:.1f} s for the prefill shapes the first "
                    "trial met to compile")
            log(f"prefix {length}, trial {trial}: " + (", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items())
                                                        if trial else "compiled what the warm-up left (not counted)"))
        for name in engines:
            miss, hit = (statistics.median(times[f"{name} {c}"]) for c in ("miss", "hit"))
            report.add("ttft", dict(prefix=length, engine=name, miss_ms=miss * 1e3, hit_ms=hit * 1e3,
                                    miss_over_hit=miss / hit, cached_per_hit=statistics.median(cached[name])))
        if args.profile:
            prefix = rng.integers(1, vocab, length).tolist()
            tails = [rng.integers(1, vocab, args.suffix).tolist() for _ in range(2)]
            for name, eng in engines.items():
                for case, tail in zip(("miss", "hit"), tails, strict=True):
                    row = traced_ttft(eng, prefix + tail, args.new)
                    log(f"prefix {length}, {name} {case} traced: " +
                        ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "top"))
                    report.add("profile", dict(prefix=length, engine=name, case=case, **row))
    for eng in engines.values():
        eng.stop()
    log(f"wrote {report.stem}.md")
    return report


if __name__ == "__main__":
    main()
