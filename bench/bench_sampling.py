"""Fused sampling kernel on the GPU: correctness checks, then timings against the plain-JAX
reference, a sort-based plain-JAX pipeline, a PyTorch serving-style pipeline and (when importable)
FlashInfer's sort-free samplers.

Run on the H200 (results JSON + markdown under $OUT, or bench/results/ by default):

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/bench_sampling.py [--quick]

V = 163840, rows R in {16, 64, 512, 2048}, bf16 logits; configurations greedy, T=0.7,
T=0.7 + top_k=50 + top_p=0.9, T=0.6 + top_p=0.95, T=1 + min_p=0.1, T=0.7 + top_k=1000; Gaussian
rows and "realistic" rows (log-probs ~ -a log(rank) under a random permutation: a few high logits,
a long tail). For each configuration the kernel's mean full-row passes / rejection rounds per row
(``fused_sample_debug``) are recorded, and the rows that take the pivot-rejection path are also
timed with ``max_rounds=0`` (the previous full-row bisections) for comparison.

FlashInfer (``import flashinfer`` inside a try; skipped when absent): float32 logits (the bf16 ->
f32 cast is timed apart, ``fi_cast_ms``), temperature applied by a division, then
``sampling_from_logits`` (T only), ``top_k_top_p_sampling_from_logits`` (top-k + top-p, top-k
first as our law), or ``softmax`` + ``top_p_sampling_from_probs`` / ``min_p_sampling_from_probs``
/ ``top_k_sampling_from_probs``; greedy is torch's argmax. Timed by CUDA events over a loop of
calls. ``x fi`` = our device time (kernel dev ms) / FlashInfer's time (< 1: ours faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import time_it
from ddtree_jax.sampling import SamplingBatch, reference_sample, target_logprobs
from pallas_kernels.triton import fused_sample as fs

V = 163840
ROWS = [16, 64, 512, 2048]  # (--rows / --configs select subsets)
CONFIGS = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    "T0.7": dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0),
    "T0.7_k50_p0.9": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.0),
    "T0.6_p0.95": dict(temperature=0.6, top_k=0, top_p=0.95, min_p=0.0),
    "T1_minp0.1": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "T0.7_k1000": dict(temperature=0.7, top_k=1000, top_p=1.0, min_p=0.0),
}
# configurations whose rows take the pivot-rejection path (also timed with max_rounds=0)
REJECT_CONFIGS = ("T0.6_p0.95", "T1_minp0.1", "T0.7_k1000")


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_logits(kind: str, R: int, V: int, seed: int, dtype=jnp.bfloat16):
    key = jax.random.key(seed)
    if kind == "gaussian":
        return (jax.random.normal(key, (R, V), jnp.float32) * 2.0).astype(dtype)
    # realistic: logit of rank r is -a*log(r+1) (a ~ 1.1..1.6), randomly permuted per row
    k1, k2 = jax.random.split(key)
    a = jax.random.uniform(k1, (R, 1), minval=1.1, maxval=1.6)
    base = -a * jnp.log(jnp.arange(1, V + 1, dtype=jnp.float32))[None, :]
    perm = jax.vmap(lambda k: jax.random.permutation(k, V))(jax.random.split(k2, R))
    return (jnp.take_along_axis(base, perm, axis=1) + 5.0).astype(dtype)


def batch_params(R, temperature, top_k, top_p, min_p=0.0):
    return SamplingBatch(
        temperature=jnp.full((R,), temperature, jnp.float32),
        top_k=jnp.full((R,), top_k, jnp.int32),
        top_p=jnp.full((R,), top_p, jnp.float32),
        min_p=jnp.full((R,), min_p, jnp.float32),
        seed=jnp.zeros((R,), jnp.uint32),
        has_seed=jnp.zeros((R,), bool),
    )


def seeds_for(R, s):
    return jax.random.randint(jax.random.key(s), (R, 2), 0, 2**31 - 1).astype(jnp.uint32)


def kernel_fn(**kw):
    return jax.jit(lambda x, p, seeds: fs.fused_sample(x, p.temperature, p.top_k, p.top_p, p.min_p, seeds, **kw))


DEV_N = 20


def kernel_dev_fn(n=DEV_N, module=fs, **kw):
    """``n`` kernel calls inside one jit (lax.fori_loop; the seeds change every call so nothing is
    hoisted): timing it and dividing by n gives the device time per call without the per-call
    host dispatch (the ~0.08 ms fixed cost of the host loop). ``module``: the kernel module (another
    version's file for a same-run comparison)."""

    @jax.jit
    def loop(x, p, seeds):
        def body(i, acc):
            s = seeds + i.astype(jnp.uint32)
            tok = module.fused_sample(x, p.temperature, p.top_k, p.top_p, p.min_p, s, **kw)
            return acc + tok[0]

        return jax.lax.fori_loop(0, n, body, jnp.int32(0))

    return loop


ref_fn = jax.jit(lambda x, p, key: reference_sample(x, p, key))


@jax.jit
def sort_pipeline(x, p, key):
    """Sort-based plain JAX, the usual way: sort once, top-k mask, top-p by cumsum, min-p, categorical."""
    z = x.astype(jnp.float32) / jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    order = jnp.argsort(-z, axis=-1)
    zs = jnp.take_along_axis(z, order, axis=-1)
    rank = jnp.arange(z.shape[-1])[None, :]
    k = jnp.where(p.top_k > 0, p.top_k, z.shape[-1])[:, None]
    zs = jnp.where(rank < k, zs, -jnp.inf)
    probs = jax.nn.softmax(zs, axis=-1)
    excl = jnp.cumsum(probs, axis=-1) - probs
    keep = (excl < p.top_p[:, None]) & (probs >= p.min_p[:, None] * probs[:, :1])  # (sorted: max first)
    zs = jnp.where(keep, zs, -jnp.inf)
    pick = jax.random.categorical(key, zs, axis=-1)
    tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(p.temperature > 0, tok, jnp.argmax(x, axis=-1)).astype(jnp.int32)


def copy_bandwidth():
    """bytes read + written per second of a large device-to-device copy (JAX), and torch's."""
    x = jax.random.normal(jax.random.key(0), (2048, V), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = time_it(f, [(x,)], iters=20)
    bw_jax = 2 * x.size * 2 / t
    bw_torch = None
    try:
        import torch

        a = torch.empty(2048 * V, dtype=torch.bfloat16, device="cuda").normal_()
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        bw_torch = 2 * a.numel() * 2 / (e0.elapsed_time(e1) / 1e3 / 20)
        del a, b
    except Exception as e:  # noqa: BLE001
        log("torch copy failed:", e)
    return bw_jax, bw_torch


def torch_pipeline_timer():
    import torch

    def sample(logits, T, k, p, m=0.0):
        # serving engines: softmax -> top-k renormalise -> top-p renormalise -> min-p -> multinomial
        if T == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / T, dim=-1)
        if k > 0:
            v, i = probs.topk(k, dim=-1)
            probs = torch.zeros_like(probs).scatter_(-1, i, v)
            probs = probs / probs.sum(-1, keepdim=True)
        if p < 1.0:
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(-1)
            sp = torch.where(cum - sp < p, sp, torch.zeros_like(sp))
            probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            probs = probs / probs.sum(-1, keepdim=True)
        if m > 0:
            probs = torch.where(probs >= m * probs.max(-1, keepdim=True).values, probs, torch.zeros_like(probs))
        return torch.multinomial(probs, 1)[:, 0]

    def run(xs, T, k, p, m=0.0, iters=10, repeats=3):
        """Seconds per call (CUDA events)."""
        return cuda_events_ms(lambda x: sample(x, T, k, p, m), xs, iters=iters, repeats=repeats) / 1e3

    return run


def cuda_events_ms(fn, xs, iters=20, repeats=3):
    """Median over ``repeats`` of the mean time (ms) of ``iters`` calls ``fn(xs[i % len(xs)])``,
    CUDA events, after one warm-up call."""
    import torch

    fn(xs[0])
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(iters):
            fn(xs[i % len(xs)])
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / iters)
    return float(np.median(ts))


def flashinfer_sampler(c: dict):
    """FlashInfer's sampler for configuration ``c`` on float32 logits (torch), or None when
    flashinfer cannot be imported. Greedy: torch argmax (FlashInfer has no greedy sampler)."""
    try:
        import flashinfer
        import torch
    except Exception as e:  # noqa: BLE001
        log("flashinfer unavailable:", type(e).__name__, str(e)[:200])
        return None
    fsm = flashinfer.sampling
    T, k, p, m = c["temperature"], c["top_k"], c["top_p"], c.get("min_p", 0.0)
    if T == 0:
        return lambda x: x.argmax(-1)
    if k > 0 and p < 1.0:
        return lambda x: fsm.top_k_top_p_sampling_from_logits(x / T, k, p)
    if p < 1.0:
        return lambda x: fsm.top_p_sampling_from_probs(torch.softmax(x / T, dim=-1), p)
    if m > 0.0:
        return lambda x: fsm.min_p_sampling_from_probs(torch.softmax(x / T, dim=-1), m)
    if k > 0:
        return lambda x: fsm.top_k_sampling_from_probs(torch.softmax(x / T, dim=-1), k)
    return lambda x: fsm.sampling_from_logits(x / T)


# ----------------------------------------------------------------------------- checks


def checks(quick: bool) -> dict:
    """Kernel vs reference on the GPU: greedy bit-equal, kept sets equal, draws in support,
    invalid rows, a chi-square test of the law. Returns a dict of results."""
    res = {}
    rng = np.random.default_rng(1)
    for V_, R_, dtype in [
        (163840, 64, jnp.bfloat16),
        (50000, 48, jnp.float32),
        (1000, 64, jnp.float32),
        (37, 16, jnp.float32),
    ]:
        x = np.array(
            make_logits("gaussian" if V_ % 2 else "realistic", R_, V_, int(rng.integers(1 << 30)), dtype).astype(
                jnp.float32
            )
        )
        x[0, 3] = np.nan
        x[1, :] = -np.inf
        x[2, 5] = np.inf
        x[3, : V_ // 2] = -np.inf
        temp = rng.choice([0.0, 0.5, 0.7, 1.0, 1.5], R_).astype(np.float32)
        topk = rng.choice([0, 0, 1, 5, 50, 128, 200, 1000], R_).astype(np.int32)
        topp = rng.choice([1.0, 0.9, 0.5, 0.95], R_).astype(np.float32)
        minp = rng.choice([0.0, 0.0, 0.05], R_).astype(np.float32)
        xd = jnp.asarray(x).astype(dtype)
        pb = SamplingBatch(
            jnp.asarray(temp),
            jnp.asarray(topk),
            jnp.asarray(topp),
            jnp.asarray(minp),
            jnp.zeros(R_, jnp.uint32),
            jnp.zeros(R_, bool),
        )
        out = jax.tree.map(
            np.asarray, fs.fused_sample_debug(xd, pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds_for(R_, 3))
        )
        lp = np.asarray(target_logprobs(xd[:, None], pb))[:, 0]
        xf = np.asarray(xd.astype(jnp.float32))
        bad = []
        for r in range(R_):
            if np.isnan(lp[r]).any():
                if out["token"][r] != -1:
                    bad.append((r, "invalid row gave", int(out["token"][r])))
                continue
            if temp[r] == 0:
                if out["token"][r] != int(np.argmax(xf[r])):
                    bad.append((r, "greedy", int(out["token"][r]), int(np.argmax(xf[r]))))
                continue
            ref_keep = lp[r] > -np.inf
            z = (xf[r] - xf[r].max()).astype(np.float32) / np.float32(temp[r])  # IEEE, as the kernel's div.rn
            with np.errstate(all="ignore"):
                q = np.exp(z.astype(np.float64)) / out["norm"][r]
                kk = (z >= out["tau"][r]) & (z > -np.inf) & (q >= out["q_thr"][r])
                # the boundary element has q == q_thr in the kernel's float32: ignore a 1e-5 band
                band = np.abs(q - out["q_thr"][r]) <= 1e-5 * out["q_thr"][r]
            # pivot rejection (path 4): the thresholds describe a superset of the kept set
            differs = (ref_keep & ~kk) if out["path"][r] == fs.PATH_REJECT else (kk != ref_keep)
            if differs[~band].any():
                bad.append(
                    (
                        r,
                        "kept differs",
                        int(kk.sum()),
                        int(ref_keep.sum()),
                        int(out["path"][r]),
                        float(temp[r]),
                        int(topk[r]),
                        float(topp[r]),
                        float(minp[r]),
                    )
                )
            if not ref_keep[out["token"][r]]:
                bad.append((r, "draw outside support", int(out["token"][r])))
        paths = np.bincount(out["path"], minlength=5).tolist()
        # the other candidate listing (one reduction per chunk) gives identical outputs
        sc = jax.tree.map(
            np.asarray,
            fs.fused_sample_debug(xd, pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds_for(R_, 3), compact="loop"),
        )
        scatter_diff = [k for k in out if not np.array_equal(out[k], sc[k], equal_nan=True)]
        res[f"V{V_}_{np.dtype(dtype).name}"] = dict(
            rows=R_,
            mismatches=bad[:10],
            n_bad=len(bad),
            paths=paths,
            compact_scatter_vs_loop=scatter_diff or "identical",
        )
        log(f"check V={V_} {np.dtype(dtype).name}: {len(bad)} mismatches, paths {paths}", bad[:3])
    # chi-square: one row repeated with different seeds, V = 40, three parameter sets
    from scipy import stats

    n = 20000 if quick else 100000
    bases = {40: rng.standard_normal(40).astype(np.float32) * 1.5, 300: rng.standard_normal(300).astype(np.float32)}
    chi = {}
    for name, (V_, T, k, p, m) in {
        "T1": (40, 1.0, 0, 1.0, 0.0),
        "T0.7_k10_p0.9": (40, 0.7, 10, 0.9, 0.0),
        "T1.3_p0.8_minp": (40, 1.3, 0, 0.8, 0.05),
        "T0.6_p0.95": (40, 0.6, 0, 0.95, 0.0),
        "T1_minp0.1": (40, 1.0, 0, 1.0, 0.1),
        "V300_T0.7_k150": (300, 0.7, 150, 1.0, 0.0),
        "V300_T0.7_k150_p0.9": (300, 0.7, 150, 0.9, 0.0),
    }.items():
        base = bases[V_]
        xs = jnp.broadcast_to(jnp.asarray(base), (n, V_))
        pb = batch_params(n, T, k, p, m)
        tok = np.asarray(fs.fused_sample(xs, pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds_for(n, 11)))
        prob = np.exp(
            np.asarray(target_logprobs(jnp.asarray(base)[None, None], batch_params(1, T, k, p, m)))[0, 0].astype(
                np.float64
            )
        )
        counts = np.bincount(tok, minlength=V_)
        sup = prob > 0
        outside = int(counts[~sup].sum())
        st = stats.chisquare(counts[sup], prob[sup] / prob[sup].sum() * n)
        chi[name] = dict(
            n=n, outside_support=outside, chi2=float(st.statistic), p_value=float(st.pvalue), support=int(sup.sum())
        )
        log(f"chi-square {name}: p={st.pvalue:.3g}, outside support {outside}")
    res["chi_square"] = chi
    return res


# ----------------------------------------------------------------------------- timings


def timings(quick: bool, bw: float) -> list[dict]:
    rows = []
    torch_run = None
    fi_ok = flashinfer_sampler(dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)) is not None
    try:
        import torch  # noqa: F401

        torch_run = torch_pipeline_timer()
    except Exception as e:  # noqa: BLE001
        log("torch unavailable:", e)
    kern = kernel_fn()
    kern_dev = kernel_dev_fn()
    kern_dev_old = kernel_dev_fn(max_rounds=0)  # the previous full-row bisections
    debug = jax.jit(lambda x, p, seeds: fs.fused_sample_debug(x, p.temperature, p.top_k, p.top_p, p.min_p, seeds))
    for kind in ("gaussian", "realistic"):
        for R in ROWS:
            nsets = 3
            xs = [make_logits(kind, R, V, 100 + i) for i in range(nsets)]
            nbytes = R * V * 2
            for cname, c in CONFIGS.items():
                p = batch_params(R, **c)
                entry = dict(logits=kind, R=R, config=cname, bytes=nbytes)
                variants = {
                    "kernel": (kern, [(x, p, seeds_for(R, i)) for i, x in enumerate(xs)], 20),
                    "kernel_dev": (kern_dev, [(x, p, seeds_for(R, i)) for i, x in enumerate(xs)], 3),
                    "jax_reference": (ref_fn, [(x, p, jax.random.key(i)) for i, x in enumerate(xs)], 3),
                    "jax_sort": (sort_pipeline, [(x, p, jax.random.key(i)) for i, x in enumerate(xs)], 3),
                }
                if cname in REJECT_CONFIGS:
                    variants["kernel_dev_bisect"] = (kern_dev_old, variants["kernel_dev"][1], 1)
                if quick and R == 2048:
                    variants.pop("jax_reference")
                try:  # full-row passes / rejection rounds per row after the stats launch
                    d = jax.tree.map(np.asarray, debug(xs[0], p, seeds_for(R, 0)))
                    entry["paths"] = np.bincount(d["path"], minlength=5).tolist()
                    entry["mean_passes"] = float(d["passes"].mean())
                    entry["max_passes"] = int(d["passes"].max())
                    entry["mean_rounds"] = float(d["rounds"].mean())
                except Exception as e:  # noqa: BLE001
                    log(f"debug failed: {type(e).__name__}: {str(e)[:300]}")
                for vname, (fn, args, iters) in variants.items():
                    try:
                        t = time_it(fn, args, iters=iters, repeats=3 if iters < 10 else 5)
                        entry[vname + "_ms"] = t * 1e3
                    except Exception as e:  # noqa: BLE001
                        entry[vname + "_ms"] = None
                        log(f"{vname} failed: {type(e).__name__}: {str(e)[:300]}")
                if torch_run is not None:
                    try:
                        import torch

                        txs = [torch.utils.dlpack.from_dlpack(x) for x in xs]
                        entry["torch_ms"] = torch_run(txs, c["temperature"], c["top_k"], c["top_p"], c["min_p"]) * 1e3
                    except Exception as e:  # noqa: BLE001
                        entry["torch_ms"] = None
                        log(f"torch failed: {type(e).__name__}: {str(e)[:300]}")
                fi = flashinfer_sampler(c) if fi_ok else None
                if fi is not None:
                    try:
                        import torch

                        txs = [torch.utils.dlpack.from_dlpack(x) for x in xs]
                        entry["fi_cast_ms"] = cuda_events_ms(lambda t: t.float(), txs)
                        fxs = [t.float() for t in txs]
                        entry["flashinfer_ms"] = cuda_events_ms(fi, fxs)
                        del fxs
                    except Exception as e:  # noqa: BLE001
                        entry["flashinfer_ms"] = None
                        log(f"flashinfer failed: {type(e).__name__}: {str(e)[:300]}")
                if entry.get("kernel_dev_bisect_ms"):
                    entry["kernel_dev_bisect_ms"] /= DEV_N
                if entry.get("kernel_dev_ms"):
                    entry["kernel_dev_ms"] /= DEV_N
                    if entry.get("flashinfer_ms"):
                        entry["ratio_vs_flashinfer"] = entry["kernel_dev_ms"] / entry["flashinfer_ms"]
                        entry["ratio_vs_flashinfer_with_cast"] = entry["kernel_dev_ms"] / (
                            entry["flashinfer_ms"] + entry["fi_cast_ms"]
                        )
                    entry["kernel_dev_frac_copy_bw"] = nbytes / (entry["kernel_dev_ms"] / 1e3) / bw
                    for o in ("jax_sort", "torch"):
                        if entry.get(o + "_ms"):
                            entry[f"dev_speedup_vs_{o}"] = entry[o + "_ms"] / entry["kernel_dev_ms"]
                if entry.get("kernel_ms"):
                    entry["kernel_GBps"] = nbytes / (entry["kernel_ms"] / 1e3) / 1e9
                    entry["kernel_frac_copy_bw"] = nbytes / (entry["kernel_ms"] / 1e3) / bw
                    for o in ("jax_reference", "jax_sort", "torch"):
                        if entry.get(o + "_ms"):
                            entry[f"speedup_vs_{o}"] = entry[o + "_ms"] / entry["kernel_ms"]
                rows.append(entry)
                log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()}))
            del xs
    return rows


STATS_VARIANTS = {
    "default": {},
    "s2": dict(num_stages=2),
    "w16": dict(num_warps=16),
}
SELECT_VARIANTS = {
    "default": {},
    "sel_s2": dict(select_stages=2),
    "sel_w8": dict(select_warps=8),
    "compact_loop": dict(compact="loop"),
}


def sweep(bw: float, rows=(2048,)) -> list[dict]:
    """Device time of kernel variants (stats-launch knobs for greedy / temperature-only rows,
    select-launch knobs for filtered rows), Gaussian rows."""
    out = []
    for R in rows:
        x = make_logits("gaussian", R, V, 7)
        for cname, c in CONFIGS.items():
            p = batch_params(R, **c)
            filtered = c["top_k"] or c["top_p"] < 1 or c["min_p"] > 0
            vs = SELECT_VARIANTS if filtered else STATS_VARIANTS
            for vname, kw in vs.items():
                try:
                    t = time_it(kernel_dev_fn(**kw), [(x, p, seeds_for(R, 1))], iters=2, repeats=3) / DEV_N
                    e = dict(R=R, config=cname, variant=vname, dev_ms=t * 1e3, frac=R * V * 2 / t / bw)
                except Exception as ex:  # noqa: BLE001
                    e = dict(R=R, config=cname, variant=vname, error=f"{type(ex).__name__}: {str(ex)[:200]}")
                out.append(e)
                log("sweep", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()}))
        del x
    return out


def markdown(meta, res, rows) -> str:
    L = [
        f"# Fused sampling kernel, {meta['device']}, {meta['date']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Copy bandwidth (read+write, bf16, 671 MB): JAX {meta['copy_bw_jax'] / 1e12:.2f} TB/s, torch "
        f"{(meta['copy_bw_torch'] or 0) / 1e12:.2f} TB/s; fractions below use the larger.",
        "",
        "kernel ms: host loop of single calls (one jit dispatch each, as before); kernel dev ms: 20 calls inside "
        "one jit (lax.fori_loop), time / 20 (device time without the per-call dispatch). x sort / x torch use "
        "the host-loop time; dev x sort / dev x torch the device time. JAX/torch pipelines: host loop / CUDA events.",
        "passes / rounds: mean full-row passes / pivot-rejection rounds per row after the one-pass stats launch "
        "(the check launch's first pass included); bisect dev ms: the same rows with max_rounds=0 "
        "(the previous full-row bisections). "
        "FlashInfer: float32 logits, CUDA events; cast ms = bf16 -> f32 cast (apart); "
        "x fi = kernel dev ms / FlashInfer ms (< 1: ours faster), x fi+cast = kernel dev ms / (FlashInfer + cast).",
        "",
        "| logits | R | config | kernel ms | GB/s | % copy BW | kernel dev ms | dev % copy BW | JAX reference ms "
        "| JAX sort ms | torch ms | x ref | x sort | x torch | dev x sort | dev x torch "
        "| passes | rounds | bisect dev ms | FlashInfer ms | cast ms | x fi | x fi+cast |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for e in rows:
        L.append(
            f"| {e['logits']} | {e['R']} | {e['config']} | {f(e.get('kernel_ms'))} | {f(e.get('kernel_GBps'), 0)} | "
            f"{f(100 * e['kernel_frac_copy_bw'] if e.get('kernel_frac_copy_bw') else None, 0)} | "
            f"{f(e.get('kernel_dev_ms'))} | "
            f"{f(100 * e['kernel_dev_frac_copy_bw'] if e.get('kernel_dev_frac_copy_bw') else None, 0)} | "
            f"{f(e.get('jax_reference_ms'))} | "
            f"{f(e.get('jax_sort_ms'))} | {f(e.get('torch_ms'))} | {f(e.get('speedup_vs_jax_reference'), 1)} | "
            f"{f(e.get('speedup_vs_jax_sort'), 1)} | {f(e.get('speedup_vs_torch'), 1)} | "
            f"{f(e.get('dev_speedup_vs_jax_sort'), 1)} | "
            f"{f(e.get('dev_speedup_vs_torch'), 1)} | "
            f"{f(e.get('mean_passes'), 2)} | {f(e.get('mean_rounds'), 2)} | {f(e.get('kernel_dev_bisect_ms'))} | "
            f"{f(e.get('flashinfer_ms'))} | {f(e.get('fi_cast_ms'))} | {f(e.get('ratio_vs_flashinfer'), 2)} | "
            f"{f(e.get('ratio_vs_flashinfer_with_cast'), 2)} |"
        )
    if meta.get("sweep"):
        L += [
            "",
            "Tuning sweep (gaussian rows, device time per call, ms; all variants exact):",
            "",
            "| R | config | variant | dev ms | % copy BW |",
            "|---|---|---|---|---|",
        ]
        for e in meta["sweep"]:
            L.append(
                f"| {e['R']} | {e['config']} | {e['variant']} | {f(e.get('dev_ms'))} | "
                f"{f(100 * e['frac'] if e.get('frac') else None, 0)} |"
            )
    L += ["", "Checks on the GPU:", "", "```", json.dumps(res, indent=1), "```", ""]
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time tuning variants (stats/select knobs)")
    ap.add_argument("--sweep-rows", default="2048", help="comma-separated row counts of the tuning sweep")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts to time")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configurations to time")
    args = ap.parse_args()
    rows_sel = tuple(int(r) for r in args.rows.split(","))
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    ROWS[:] = rows_sel
    for name in [c for c in CONFIGS if c not in args.configs.split(",")]:
        del CONFIGS[name]
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(
        device=getattr(dev, "device_kind", str(dev)),
        jax=jax.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command="PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 " + " ".join(sys.argv),
    )
    log("device", meta["device"], "jax", jax.__version__)
    res = {}
    if not args.skip_checks:
        try:
            res = checks(args.quick)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
    bw_jax, bw_torch = copy_bandwidth()
    meta.update(copy_bw_jax=bw_jax, copy_bw_torch=bw_torch)
    log(f"copy bandwidth: jax {bw_jax / 1e12:.2f} TB/s, torch {(bw_torch or 0) / 1e12:.2f} TB/s")
    if args.sweep:
        meta["sweep"] = sweep(max(bw_jax, bw_torch or 0), tuple(int(r) for r in args.sweep_rows.split(",")))
    rows = timings(args.quick, max(bw_jax, bw_torch or 0))
    stamp = datetime.datetime.now().strftime("%Y%m%d")
    with open(os.path.join(args.out, f"sampling_h200_{stamp}.json"), "w") as fh:
        json.dump(dict(meta=meta, checks=res, rows=rows), fh, indent=1)
    md = markdown(meta, res, rows)
    with open(os.path.join(args.out, f"sampling_h200_{stamp}.md"), "w") as fh:
        fh.write(md)
    print(md)


if __name__ == "__main__":
    main()
