"""Host-side timing shared by the GPU benchmarks."""

import time

import jax
import numpy as np

from ddtree_jax.compilation_cache import CompileWatch


def time_it(fn, args_list, iters=20, repeats=5):
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (inputs rotated),
    after one warm-up call."""
    out = fn(*args_list[0])
    jax.block_until_ready(out)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(iters):
            out = fn(*args_list[i % len(args_list)])
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts))


def host_call_median(fn, ready, n: int) -> float:
    """Median host seconds of ``n`` calls of ``fn()``, each made once ``ready()``'s arrays are
    computed (the device idle): the host's share of a call, not the device's work."""
    times = []
    for _ in range(n):
        jax.block_until_ready(ready())
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    jax.block_until_ready(ready())
    return float(np.median(times))


def uncompiled_call(call, retries: int, log, again=None):
    """``call()``'s result from a call that compiled no program (nor loaded one from the persistent
    cache: its time would be the compile's), calling it again up to ``retries`` calls in all (the
    last call's result whatever it compiled). ``again(out)``: a further reason not to keep a call,
    as the line ``log`` gets, or ``None``."""
    for _ in range(retries):
        with CompileWatch() as watch:
            out = call()
        reason = again(out) if again is not None else None
        if reason is None and not watch.compiles:
            return out
        log(reason or f"a timed call compiled {watch.compiles} programs ({watch.seconds:.1f}s): run again")
    return out
