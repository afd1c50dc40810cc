"""MLA attention kernels on the GPU: equality with the dense reference at Kimi K2 shapes, then device
times of decode, tree verify and prefill at contexts of 1k and 32k (the Triton kernel, the Hopper
kernel with ``--hopper``, XLA's dense reference), against the cache-read floor
(bytes of latent + k_rope the kernel must read / copy bandwidth), the FLOP floor (at the measured
bf16 matmul rate) and the dense reference.

K2 attention shapes: H = 64 heads, r = kv_lora_rank 512, dr = qk_rope_head_dim 64, bf16, one
layer's cache of ``max_len`` = 36,864 slots (the reference reads all of them; the kernel reads each
row up to its ``start + T``). A "context" ``C`` is the committed prefix (``start = C``) before the
block of ``T`` tokens.

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/bench_attention_gpu.py
    python3 bench/bench_attention_gpu.py --smoke      # CPU, interpret mode, tiny shapes (~1 min)
    # the Hopper kernel (Mosaic GPU) beside the Triton kernel and XLA, with profiler device times:
    python3 bench/bench_attention_gpu.py --segments --contexts 1024 32768 --verify-t 16 65 \
        --prefill-t 0 --no-sweep --hopper --profile --split-kernels 0

Writes ``attention_<device>_<date>.json`` and ``.md`` to ``--out`` (default bench/results).
Every variant runs in its own try/except: a failure is reported and the rest runs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import _timing
from bench._common import device_kernels
from ddtree_jax.models.latent_attention import (
    SEGMENT_GROUP,
    SEGMENT_KEYS,
    latent_attention_reference,
    prefix_block_attention,
    segmented_split,
)
from ddtree_jax.models.tree_cache import BlockMask, tree_block_mask
from pallas_kernels.mosaic_gpu.mla_prefix import auto_splits
from pallas_kernels.triton.mla_attention import auto_split_keys, default_tiles, mla_attention


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def random_tree_masks(rng, b, t):
    """``[b,t,t]`` ancestor masks (diagonal included) of random trees, parents before children."""
    anc = np.zeros((b, t, t), bool)
    for row in range(b):
        for i in range(1, t):
            p = rng.integers(0, i)
            anc[row, i] = anc[row, p]
            anc[row, i, p] = True
    return tree_block_mask(jnp.asarray(anc))


def dev_time(fn, q, n, rest=(), repeats=3):
    """Device seconds per call of ``fn(q, *rest)``: n calls inside one jit (``lax.fori_loop``) whose
    ``q`` is a carry touched at one element per iteration (nothing is hoisted), timed as one
    dispatch. Arrays go in as arguments (``rest``), not as closed-over constants."""

    @jax.jit
    def loop(q, rest):
        def body(i, c):
            q, acc = c
            out = fn(q, *rest)
            acc = acc + out.reshape(-1)[0].astype(jnp.float32)
            first = q.reshape(-1)[0]
            q = q.at[(0,) * q.ndim].set(jnp.where(acc < -3e38, jnp.zeros_like(first), first))
            return q, acc

        return jax.lax.fori_loop(0, n, body, (q, jnp.float32(0)))[1]

    return _timing.time_it(loop, [(q, tuple(rest))], iters=1, repeats=repeats) / n


def matmul_rate(dtype, n, interpret):
    """Measured dense matmul FLOP/s (n x n x n) on this device."""
    if interpret:
        return float("nan")
    a = jnp.ones((n, n), dtype)
    t = dev_time(lambda x, y: x @ y, a, 10, (a,))
    return 2 * n**3 / t


class Bench:
    def __init__(self, a):
        self.a = a
        self.rng = np.random.default_rng(0)
        self.rows, self.checks, self.errors = [], [], []
        smoke = a.smoke
        self.H, self.r, self.dr = (4, 32, 16) if smoke else (64, 512, 64)
        self.dtype = jnp.bfloat16
        self.scale = 1.81 / np.sqrt(192.0)  # K2: qk_head_dim 192, yarn mscale^2 ~ 1.81
        self.tiles = dict(block_m=16, block_k=16) if smoke else {}
        self.interp = smoke
        self.mgpu_interpret = False  # the Hopper kernel is timed on the GPU only (not at smoke shapes)
        self.n_dev = 2 if smoke else 20

    def arr(self, shape, dtype=None):
        return jnp.asarray(self.rng.standard_normal(shape, np.float32)).astype(dtype or self.dtype)

    def inputs(self, b, t, max_len, start, tree, dtype=None):
        ql, qr = self.arr((b, t, self.H, self.r), dtype), self.arr((b, t, self.H, self.dr), dtype)
        lat, kr = self.arr((b, max_len, self.r), dtype), self.arr((b, max_len, self.dr), dtype)
        within = random_tree_masks(self.rng, b, t) if tree else None
        return ql, qr, lat, kr, jnp.asarray(start, jnp.int32), within

    def kernel_fn(self, causal, split, cfg=None):
        """``f(q_latent, q_rope, latent, k_rope, start, within)`` with this bench's static settings;
        ``--segments``: the model's fixed reduction segments, the split moved onto a segment or group
        boundary as the model does (0 stays 0)."""
        kw = dict(self.tiles, **(cfg or {}))
        if self.a.segments:
            block_k = kw.get("block_k") or default_tiles(self.dtype)["block_k"]
            split, seg = segmented_split(split, SEGMENT_KEYS, SEGMENT_GROUP, block_k)
            kw.update(segment_keys=seg, segment_group=SEGMENT_GROUP)
        return functools.partial(mla_attention, scale=self.scale, causal=causal, split_keys=split,
                                 interpret=self.interp, **kw)

    def hopper_fn(self, n_split=None):
        """``f(q_latent, q_rope, latent, k_rope, start, within)``: the Hopper kernel's splits and
        the block part (``prefix_block_attention``), ``n_split`` splits (``None``: auto)."""
        return functools.partial(prefix_block_attention, scale=self.scale, n_split=n_split,
                                 interpret=self.mgpu_interpret)

    def reference_fn(self):
        def f(ql, qr, lat, kr, start, within):
            return latent_attention_reference(ql, qr, lat, kr, BlockMask(start, within), scale=self.scale)

        return f

    # ---- checks ----

    def check(self, name, b, t, max_len, start, tree, split, dtype, tol, hopper=False):
        try:
            ql, qr, lat, kr, st, within = self.inputs(b, t, max_len, start, tree, dtype)
            fn = self.hopper_fn(split or None) if hopper else self.kernel_fn(within is None, split)
            out = jax.jit(fn)(ql, qr, lat, kr, st, within)
            name = ("hopper " if hopper else "") + name
            f32 = [x.astype(jnp.float32) for x in (ql, qr, lat, kr)]
            with jax.default_matmul_precision("highest"):  # IEEE float32: XLA's default on the GPU is tf32
                ref = latent_attention_reference(*f32, BlockMask(st, within), scale=self.scale)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            ok = bool(err <= tol)
            self.checks.append(dict(name=name, split_keys=split, dtype=jnp.dtype(dtype).name, max_abs_err=err, tol=tol,
                                    ok=ok))
            log(f"check {name} split={split} {jnp.dtype(dtype).name}: max|err| {err:.2e} (tol {tol}) "
                f"{'OK' if ok else 'FAIL'}")
        except Exception as e:  # noqa: BLE001  (report and go on)
            self.fail(f"check {name} split={split}", e)

    def fail(self, what, e):
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        self.errors.append(dict(what=what, error=msg))
        log(f"FAILED {what}: {msg}")
        if self.a.verbose:
            traceback.print_exc()

    # ---- timings ----

    def floors(self, b, t, start):
        """Cache-read floor, memory floor (cache + q in + out) and FLOP floor, in seconds."""
        keys = b * (start + t)
        cache_bytes = keys * (self.r + self.dr) * 2
        io_bytes = b * t * self.H * (2 * self.r + self.dr) * 2
        flops = 2 * b * t * self.H * (start + t) * (2 * self.r + self.dr)
        bw = self.a.bandwidth * 1e12
        return cache_bytes / bw, (cache_bytes + io_bytes) / bw, flops / self.mm_rate

    def case(self, kind, b, t, ctx, max_len, splits=("auto",), cfgs=(None,), reference=True, hopper_splits=()):
        tree = kind == "verify"
        name = f"{kind} B={b} T={t} ctx={ctx}"
        try:
            ql, qr, lat, kr, st, within = self.inputs(b, t, max_len, [ctx] * b, tree)
        except Exception as e:  # noqa: BLE001
            self.fail(name + " inputs", e)
            return
        cache_floor, mem_floor, flop_floor = self.floors(b, t, ctx)
        floor = max(mem_floor, flop_floor) if np.isfinite(flop_floor) else mem_floor
        base = dict(kind=kind, B=b, T=t, ctx=ctx, max_len=max_len, cache_floor_us=cache_floor * 1e6,
                    mem_floor_us=mem_floor * 1e6, flop_floor_us=flop_floor * 1e6)
        ref_us = None
        if reference:
            score_gb = b * self.H * t * max_len * 4 / 1e9
            if score_gb > self.a.ref_max_gb:
                self.rows.append(dict(base, variant="reference", note=f"skipped: f32 scores {score_gb:.0f} GB"))
                log(f"{name} reference skipped (scores {score_gb:.0f} GB)")
            else:
                try:
                    ref_us = dev_time(self.reference_fn(), ql, self.n_dev, (qr, lat, kr, st, within)) * 1e6
                    self.rows.append(dict(base, variant="reference", us=ref_us, x_cache_floor=ref_us / base[
                        "cache_floor_us"], x_floor=ref_us / floor / 1e6))
                    log(f"{name} reference {ref_us:.1f} us")
                except Exception as e:  # noqa: BLE001
                    self.fail(name + " reference", e)
                    self.rows.append(dict(base, variant="reference", note="failed (see errors)"))
        args = (ql, qr, lat, kr, st, within)
        # every split with the default tiles, then every other tile config with the auto split
        for split, cfg in [(sp, None) for sp in splits] + [("auto", c) for c in cfgs if c is not None]:
            tiles = dict(self.tiles, **{k: v for k, v in (cfg or {}).items() if k in ("block_m", "block_k")})
            sk = auto_split_keys(b, t * self.H, max_len, **tiles) if split == "auto" else split
            variant = f"kernel split={split}" + (f"({sk})" if split == "auto" else "") + (
                "" if cfg is None else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))
            self.time_variant(name, variant, lambda sk=sk, cfg=cfg: self.kernel_fn(within is None, sk, cfg), args,
                              base, ref_us, floor, self.triton_launches if ctx >= self.a.split_kernels > 0 else None)
        for n in hopper_splits:
            variant = f"hopper n_split={n}" + (f"({auto_splits(b, t * self.H, max_len)})" if n == "auto" else "")
            self.time_variant(name, variant, lambda n=n: self.hopper_fn(None if n == "auto" else n), args, base,
                              ref_us, floor, self.hopper_launches if self.a.profile else None)

    def time_variant(self, name, variant, make_fn, args, base, ref_us, floor, launches=None):
        """Time ``make_fn()`` on ``args``, append its row (``launches(fn, args, row)``: add a profiler
        trace's per-launch times; skipped in interpret mode) and log it; a failure is reported and
        recorded as the row instead."""
        try:
            fn = make_fn()
            us = dev_time(fn, args[0], self.n_dev, args[1:]) * 1e6
            row = dict(base, variant=variant, us=us, x_cache_floor=us / base["cache_floor_us"],
                       x_floor=us / floor / 1e6)
            if launches is not None and not self.interp:
                launches(fn, args, row)
            if ref_us:
                row["reference_over_kernel"] = ref_us / us
            self.rows.append(row)
            log(f"{name} {variant}: {us:.1f} us, x cache floor {row['x_cache_floor']:.2f}, "
                f"x max(mem, flop) floor {row['x_floor']:.2f}"
                + (f", reference / kernel {ref_us / us:.2f}" if ref_us else ""))
        except Exception as e:  # noqa: BLE001
            self.fail(f"{name} {variant}", e)
            self.rows.append(dict(base, variant=variant, note="failed (see errors)"))

    @staticmethod
    def triton_launches(fn, args, row):
        """Device time of the Triton kernel's attention and merge launches apart (a profiler trace)."""
        per, _ = device_kernels(jax.jit(fn), args, calls=5)
        merge = sum(ns for n, ns in per.items() if n.startswith("mla_attention_merge"))
        row["mla_attention_merge_us"] = merge / 1e3
        row["mla_attention_us"] = (sum(ns for n, ns in per.items() if n.startswith("mla_attention")) - merge) / 1e3

    @staticmethod
    def hopper_launches(fn, args, row):
        """Device time per call from a profiler trace: every kernel of the call, and the Mosaic GPU
        kernel's own (what the loop timing adds on top is launch/loop overhead)."""
        per, total = device_kernels(jax.jit(fn), args, calls=5)
        own = sum(ns for k, ns in per.items() if "prefix" in k.lower() or "mosaic" in k.lower())
        row.update(device_us=total / 1e3, prefix_kernel_us=own / 1e3,
                   kernels={k: round(ns / 1e3, 2) for k, ns in sorted(per.items(), key=lambda x: -x[1])[:6]})
        row["note"] = (f"device {total / 1e3:.1f} us (kernel {own / 1e3:.1f}, x cache floor "
                       f"{own / 1e3 / row['cache_floor_us']:.2f})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    p.add_argument("--bandwidth", type=float, default=4.2, help="copy bandwidth, TB/s (H200 measured ~4.2)")
    p.add_argument("--ref-max-gb", type=float, default=24.0, help="skip the reference above this score size")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile / split sweeps")
    p.add_argument("--split-kernels", type=int, default=32768,
                   help="from this context on, also time the attention and merge launches apart (0: never)")
    p.add_argument("--segments", action="store_true",
                   help="the model's fixed reduction segments (512 keys, groups of 4), as in generate()")
    p.add_argument("--contexts", type=int, nargs="+", help="committed contexts (default 1024 32768)")
    p.add_argument("--verify-t", type=int, nargs="+", help="verify block lengths (default 16 65 257)")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 16)")
    p.add_argument("--prefill-t", type=int, help="prefill block length (default 2048; 0: none)")
    p.add_argument("--tiles", nargs="+", metavar="M,K,W,S",
                   help="sweep these block_m,block_k,num_warps,num_stages instead of the built-in set")
    p.add_argument("--merge-tiles", nargs="+", metavar="R,C", default=[],
                   help="also time decode with these split-merge tiles (rows,columns; the default: merge_block)")
    p.add_argument("--hopper", nargs="*", metavar="N", default=None,
                   help="also time the Hopper kernel (prefix_block_attention): auto splits, and these split "
                        "counts at decode B=1 (a bare --hopper: auto only)")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernel's timings")
    p.add_argument("--profile", action="store_true",
                   help="also trace each Hopper variant: device time per call, its kernel's own time")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--skip-checks", action="store_true",
                   help="timings only (the checks against the float32 reference take about 100 s on an H200)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = jax.devices()[0]
    device = getattr(dev, "device_kind", str(dev))
    command = "python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    meta = dict(device=device, backend=jax.default_backend(), jax=jax.__version__,
                python=platform.python_version(), date=date, command=command, bandwidth_TBps=a.bandwidth)
    log("device", device, "jax", jax.__version__)
    bench = Bench(a)
    t_start = time.time()
    bench.mm_rate = matmul_rate(jnp.bfloat16, 8192, a.smoke)
    meta["bf16_matmul_TFLOPs"] = bench.mm_rate / 1e12
    log(f"bf16 matmul rate {bench.mm_rate / 1e12:.0f} TFLOP/s")

    # -- equality with the reference (bf16 inputs vs a float32 reference on the same inputs) --
    small = a.smoke
    ml = 80 if small else 4096
    st = [0, 37] if small else [0, 2999]
    for split in () if a.skip_checks else (0, 32 if small else 512):
        bench.check("decode", 2, 1, ml, st, False, split, jnp.bfloat16, 2e-2)
        bench.check("verify", 2, 5 if small else 65, ml, st, True, split, jnp.bfloat16, 2e-2)
    if not a.skip_checks:
        bench.check("prefill", 2, 12 if small else 256, ml, [0, 41] if small else [0, 1500], False, 0, jnp.bfloat16,
                    2e-2)
        bench.check("verify-f32", 2, 5 if small else 17, ml, st, True, 0, jnp.float32, 1e-4)
    hopper = a.hopper is not None and not small
    if hopper and not a.skip_checks:
        # the Hopper kernel: decode in the kernel, blocks in the JAX part, a cache not a multiple of
        # 64 slots (its TMA copies need a multiple of 8) with a row ending at its last slot, a block
        # with no prefix
        for name, b, t, mlen, starts, tree in [("decode", 2, 1, ml, st, False), ("verify", 2, 65, ml, st, True),
                                                ("causal", 2, 12, ml, [77, 1], False),
                                                ("decode S=4104", 2, 1, 4104, [4103, 5], False),
                                                ("verify S=4104", 2, 16, 4104, [4088, 0], True)]:
            for n in (0, 7):
                bench.check(name, b, t, mlen, starts, tree, n, jnp.bfloat16, 2e-2, hopper=True)

    # -- timings --
    contexts = a.contexts or ((50,) if small else (1024, 32768))
    max_len = 80 if small else max(36864, max(contexts) + 4096)
    verify_ts = a.verify_t or ((5,) if small else (16, 65, 257))
    batches = a.batches or ((1, 2) if small else (1, 16))
    prefill_t = (8 if small else 2048) if a.prefill_t is None else a.prefill_t
    sweep = not a.no_sweep
    # (block_m, block_k, num_warps, num_stages) besides the defaults, at the longest context:
    # smaller row tiles and more warps hold less of the [block_m, 512] float32 accumulator per thread
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles] if a.tiles else [
        (64, 64, 8, 2), (64, 32, 16, 2), (64, 32, 8, 3), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
        (16, 64, 4, 2), (16, 32, 4, 3)]
    sweep_cfgs = (None,) if small else (None,) + tuple(
        dict(block_m=m, block_k=k, num_warps=w, num_stages=s) for m, k, w, s in tiles)
    for ctx in contexts:
        for b in batches:
            big = ctx == contexts[-1] and sweep
            splits = ("auto", 0)
            if sweep and b == 1:
                splits += (16, 32) if small else (128, 512, 2048)
            merge = tuple(dict(merge_tiles=tuple(int(v) for v in mt.split(","))) for mt in a.merge_tiles)
            hs = (("auto",) + tuple(int(n) for n in a.hopper if b == 1)) if hopper else ()
            if a.no_triton:
                splits, big, merge = (), False, ()
            bench.case("decode", b, 1, ctx, max_len, splits=splits, cfgs=(sweep_cfgs if big else (None,)) + merge,
                       hopper_splits=hs)
        for t in verify_ts:
            for b in batches:
                splits = ("auto", 0) if b == 1 else ("auto",)
                big = ctx == contexts[-1] and sweep and t == verify_ts[0]
                if a.no_triton:
                    splits, big = (), False
                bench.case("verify", b, t, ctx, max_len, splits=splits, cfgs=sweep_cfgs if big else (None,),
                           hopper_splits=("auto",) if hopper else ())
        if prefill_t:
            bench.case("prefill", 1, prefill_t, ctx, max_len)
        log(f"elapsed {time.time() - t_start:.0f} s")

    meta["elapsed_s"] = time.time() - t_start
    stamp = datetime.date.today().strftime("%Y%m%d")
    tag = "cpu_smoke" if a.smoke else device.lower().replace(" ", "_")
    res = dict(meta=meta, checks=bench.checks, rows=bench.rows, errors=bench.errors)
    base = os.path.join(a.out, f"attention_{tag}_{stamp}{a.tag}")
    with open(base + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    md = [f"# MLA attention on {device}, {meta['date']}", "", f"Command: `{command}`", "",
          f"jax {jax.__version__}; H={bench.H}, r={bench.r}, dr={bench.dr}, bf16; bandwidth {a.bandwidth} TB/s; "
          f"bf16 matmul {meta['bf16_matmul_TFLOPs']:.0f} TFLOP/s (measured).", "",
          "Floors: cache = bytes of latent + k_rope up to start+T per row / bandwidth; mem = cache + q in + out; "
          "flop = 2 B T H (start+T)(2r+dr) / matmul rate (counts masked block keys too). "
          f"x floor = time / max(mem, flop). Device time: {bench.n_dev} calls in one jit.", "",
          "## Checks (kernel vs float32 reference)", "", "| check | split_keys | dtype | max abs err | tol | ok |",
          "|---|---|---|---|---|---|"]
    md += [f"| {c['name']} | {c['split_keys']} | {c['dtype']} | {c['max_abs_err']:.2e} | {c['tol']} | {c['ok']} |"
           for c in bench.checks]
    md += ["", "## Times", "", "| case | variant | us | cache floor us | x cache floor | mem floor us | flop floor us "
           "| x floor | ref / kernel | note |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for r_ in bench.rows:
        case = f"{r_['kind']} B={r_['B']} T={r_['T']} ctx={r_['ctx']}"
        md.append(f"| {case} | {r_['variant']} | {f(r_.get('us'), '.1f')} "
                  f"| {r_['cache_floor_us']:.2f} | {f(r_.get('x_cache_floor'), '.2f')} | {r_['mem_floor_us']:.2f} "
                  f"| {f(r_.get('flop_floor_us'), '.2f')} | {f(r_.get('x_floor'), '.2f')} "
                  f"| {f(r_.get('reference_over_kernel'), '.2f')} | {r_.get('note', '')} |")
    if bench.errors:
        md += ["", "## Errors", ""] + [f"- {e['what']}: `{e['error']}`" for e in bench.errors]
    with open(base + ".md", "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    log(f"wrote {base}.json / .md in {time.time() - t_start:.0f} s")
    return 1 if bench.errors or not all(c["ok"] for c in bench.checks) else 0


if __name__ == "__main__":
    sys.exit(main())
