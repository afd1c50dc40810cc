"""The engine thread's host work per step, without a device: reading a step's harvest back and
streaming it (``Engine._read_back`` and the ``Emitter``), at a number of running slots.

    python bench/bench_engine_host.py [--slots 1 16 64] [--tokens 1 4] [--stop-strings]
    python bench/bench_engine_host.py --smoke     # a few steps: checks the pipeline

A step of the engine dispatches rounds and, while the device runs them, reads the previous
dispatch back and streams its tokens. That host work grows with the running slots; once it
outlasts a round, the engine runs at the host's pace, not the device's (bench_engine.py shows the
result end to end). This bench times exactly that part, on a synthetic harvest (every slot
commits ``--tokens`` random tokens per step, nobody finishes), each request streaming its chunks
to its handle (with the shipped tokenizer; without stop strings a chunk's text is decoded by its
reader, and nothing reads here), so that it can be measured and improved on any machine.
``--stop-strings`` gives every request a stop string that never appears (the path that
detokenises on the engine thread and holds back text). ``--freeze-gc`` first freezes the heap
(``gc.freeze``, as ``Engine.start`` does with ``EngineConfig.freeze_gc``): without it the garbage
collector's collections, triggered by the per-step objects, also scan the loaded model's and
JAX's objects. Reported: microseconds per step and per slot, the best of ``--repeats`` runs of
``--steps`` steps. Writes ``engine_host_<device>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gc
import os
import platform
import time

import numpy as np

from bench._common import Report, log


def _host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _done(packed: np.ndarray) -> concurrent.futures.Future:
    """A launch that has finished with ``packed`` as its harvest (``Engine._read_back``'s input)."""
    future = concurrent.futures.Future()
    future.set_result(packed)
    return future


@functools.cache
def _loaded():
    """The shipped tokenizer and target, loaded once per process."""
    from tokenizers import Tokenizer

    import ddtree_jax as dt
    from ddtree_jax.default_model import SHIPPED_DIR

    return (Tokenizer.from_file(os.path.join(SHIPPED_DIR, "tokenizer.json")),
            dt.load_target(os.path.join(SHIPPED_DIR, "target")))


def run(slots: int, tokens: int, steps: int, repeats: int, stop: tuple[str, ...]) -> float:
    """Seconds per step (best of ``repeats``) of ``_read_back`` + ``Emitter.submit`` at ``slots``
    running requests committing ``tokens`` tokens each per step."""

    import ddtree_jax as dt
    from ddtree_jax.serving import Engine, _device
    from ddtree_jax.serving.engine import RequestHandle, _Request
    from ddtree_jax.serving.text import TextStream

    tok, target = _loaded()
    config = dt.EngineConfig(decode=dt.DecodeConfig(method="ar", sync_every=1), slots=slots, max_model_len=64)
    eng = Engine(target, None, config, tokenizer=tok)
    eng.tokens_per_round = tokens  # the harvest's token columns per round, as a tree round's
    T = eng.sync_every * tokens + 1  # (+ the column of a new request's first token)
    width = _device.HARVEST_FIELDS + T + eng.sync_every
    rng = np.random.default_rng(0)
    best = float("inf")
    for _ in range(repeats):
        reqs = []
        for i in range(slots):
            r = _Request(handle=RequestHandle(eng, i), prompt=np.arange(8, dtype=np.int32),
                         sampling=dt.SamplingParams(), max_tokens=1 << 30, stop_ids=[],
                         text=TextStream(tok, stop, deferred=True), submitted=time.perf_counter(), slot=i, running=True)
            eng._slot[i] = r
            reqs.append(r)
        harvests = []
        for _ in range(steps):
            packed = np.zeros((slots, width), np.int32)
            packed[:, 0], packed[:, 1], packed[:, 2] = tokens, 1, 0  # new tokens, rounds, RUNNING
            packed[:, _device.HARVEST_FIELDS : _device.HARVEST_FIELDS + tokens] = rng.integers(1, 4000, (slots, tokens))
            packed[:, _device.HARVEST_FIELDS + T] = tokens  # the round's acceptance length
            harvests.append(packed)
        t0 = time.perf_counter()
        for packed in harvests:
            eng._emitter.submit(eng._read_back(_done(packed), list(reqs)), time.perf_counter())
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="tokens per slot per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stop-strings", action="store_true", help="every request has a stop string (never found)")
    ap.add_argument("--freeze-gc", action="store_true", help="gc.freeze() once the pipeline is loaded (Engine.start's)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.slots, args.tokens, args.steps, args.repeats = [2], [1], 5, 1
    stop = ("<never/>",) if args.stop_strings else ()
    report = Report(args, name="engine_host", title="The engine thread's host work per step (no device)",
                    sections=("steps",),
                    suffix=("_stop" if args.stop_strings else "") + ("_frozen_gc" if args.freeze_gc else ""))
    report.notes.append(f"Host CPU: {_host_cpu()}; shipped tokenizer; {args.steps} steps, best of {args.repeats}; "
                        f"stop strings: {'one per request' if stop else 'none'}; garbage collector: "
                        f"{'heap frozen once loaded' if args.freeze_gc else 'as Python starts it'}.")
    if args.freeze_gc:
        run(1, 1, 2, 1, stop)  # load everything the timed runs use, then freeze it
        gc.collect()
        gc.freeze()
    for tokens in args.tokens:
        for slots in args.slots:
            sec = run(slots, tokens, args.steps, args.repeats, stop)
            report.add("steps", dict(slots=slots, tokens_per_slot=tokens, us_per_step=sec * 1e6,
                                     us_per_slot=sec * 1e6 / slots))
            log(f"{slots} slots x {tokens} tokens: {sec * 1e6:.0f} us per step ({sec * 1e6 / slots:.2f} per slot)")
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
