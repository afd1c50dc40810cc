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
Results: ``prefix_ttft_<device>_<date>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

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
    t0 = time.perf_counter()
    handle = eng.submit(prompt, max_tokens=new, ignore_eos=True)
    first = None
    while not handle.done:
        eng.step()
        if first is None and any(c.token_ids for c in handle._chunks):
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


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
                    sections=("ttft",))
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
    for eng in engines.values():
        eng.stop()
    log(f"wrote {report.stem}.md")
    return report


if __name__ == "__main__":
    main()
