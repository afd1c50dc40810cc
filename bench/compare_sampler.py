"""Device time of the fused sampler against baseline copies of its kernel file, in one process on
the same logits (the way to measure a kernel change: same run, same machine state).

    git show main:pallas_kernels/triton/fused_sample.py > /tmp/fused_sample_main.py
    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/compare_sampler.py \\
        --baseline main=/tmp/fused_sample_main.py --rows 16,64,512,2048

Each variant: ``fused_sample`` called 20 times inside one jit (bench_sampling's ``kernel_dev_fn``),
timed by ``_timing.time_it`` and divided by 20 (device time without per-call
dispatch). Variants: ``current`` (this checkout's kernel), each ``--baseline NAME=FILE``, and
``current`` with each ``--knobs NAME=k=v,...`` (the kernel's static tuning arguments). Gaussian
rows at every R, "realistic" rows (bench_sampling's) at R <= 64. ``--smoke`` checks the script on
the CPU (interpret mode, tiny rows). Writes ``sampler_compare_<device>_<date>{tag}.json`` and
``.md`` to ``--out``; progress on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time

import jax

from bench._timing import time_it
from bench.bench_sampling import CONFIGS, DEV_N, V, batch_params, kernel_dev_fn, make_logits, seeds_for
from pallas_kernels.triton import fused_sample as current


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def load_kernel(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_knobs(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        out[k] = v if not v.lstrip("-").isdigit() else int(v)
    return out


def device_us(mod, x, p, R, iters, repeats, **kw):
    loop = kernel_dev_fn(module=mod, **kw)
    return time_it(loop, [(x, p, seeds_for(R, 1))], iters=iters, repeats=repeats) / DEV_N * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", action="append", default=[], metavar="NAME=FILE")
    ap.add_argument("--knobs", action="append", default=[], metavar="NAME=k=v,...")
    ap.add_argument("--rows", default="16,64,512,2048")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: interpret mode, V=1000, 4 rows")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args()
    vocab, extra = V, {}
    if a.smoke:
        vocab, extra, a.rows, a.iters, a.repeats = 1000, dict(interpret=True), "4", 1, 1
    variants = [("current", current, dict(extra))]
    for b in a.baseline:
        name, path = b.split("=", 1)
        variants.append((name, load_kernel(name, path), dict(extra)))
    for k in a.knobs:
        name, knobs = k.split("=", 1)
        variants.append((name, current, parse_knobs(knobs) | extra))
    dev = jax.devices()[0]
    log("device", dev.device_kind, "jax", jax.__version__, "variants", [v[0] for v in variants])
    res = []
    for R in map(int, a.rows.split(",")):
        for kind in ("gaussian", "realistic") if R <= 64 else ("gaussian",):
            x = make_logits(kind, R, vocab, 7)
            for cname in a.configs.split(","):
                p = batch_params(R, **CONFIGS[cname])
                e = dict(R=R, logits=kind, config=cname)
                for name, mod, kw in variants:
                    try:
                        e[name] = device_us(mod, x, p, R, a.iters, a.repeats, **kw)
                    except Exception as ex:  # noqa: BLE001  (a failing variant is reported; the rest runs)
                        e[name + "_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                res.append(e)
                log(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in e.items()}))
            del x
    os.makedirs(a.out, exist_ok=True)
    stem = f"sampler_compare_{dev.device_kind.lower().replace(' ', '_')}_{datetime.date.today():%Y%m%d}{a.tag}"
    meta = dict(device=dev.device_kind, jax=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(),
                command="python3 " + " ".join(sys.argv), variants=[v[0] for v in variants])
    with open(os.path.join(a.out, stem + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=res), f, indent=1)
    names = [v[0] for v in variants]
    md = [f"# Fused sampler variants, {meta['device']}, {meta['date']}", "", f"Command: `{meta['command']}`", "",
          f"Device us per call (20 calls in one jit); % copy BW of `current` at 4.21 TB/s; jax {meta['jax']}.", "",
          "| logits | R | config | " + " | ".join(f"{n} us" for n in names) + " | current % copy BW |",
          "|---|---|---|" + "---|" * (len(names) + 1)]
    for e in res:
        cells = [f"{e[n]:.1f}" if n in e else "error" for n in names]
        frac = e["R"] * vocab * 2 / (e["current"] * 1e-6) / 4.21e12 * 100 if "current" in e else float("nan")
        md.append(f"| {e['logits']} | {e['R']} | {e['config']} | " + " | ".join(cells) + f" | {frac:.0f} |")
    with open(os.path.join(a.out, stem + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    log("wrote", os.path.join(a.out, stem + ".md"))


if __name__ == "__main__":
    main()
