"""Host-side timing shared by the GPU benchmarks."""

import time

import jax
import numpy as np


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
