"""Where a model pass spends its time on the GPU: the device kernels of a decode step or tree
verify of the Kimi K2-shaped target, from a JAX profiler trace (``jax.profiler.ProfileData``), and
the pass timed two ways (``nnx.jit`` on the module, ``jax.jit`` on its split state).

For each ``--cases`` entry ``B:budget`` (budget 0: the decode step) or ``P:T`` (a prefill of T
tokens, every layer's output returned): the wall time per call,
the device time per call (the sum of the kernels on the GPU's streams: less than the wall time
means the GPU waits for the host), and the kernels that take the most time per call.

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/profile_pass.py --out $OUT
    python bench/profile_pass.py --smoke --out /tmp/bench      # CPU, tiny shapes (no GPU kernels)

Writes ``profile_<device>_<date>.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import (
    Report,
    device_kernels,
    k2_slice,
    log,
    prefill_every_layer,
    random_tree,
    time_call,
)
from ddtree_jax.compiled import CompiledFn

if "--smoke" in sys.argv:  # the CPU (set before JAX starts a backend)
    jax.config.update("jax_platforms", "cpu")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--int4", action="store_true",
                    help="routed experts in INT4 (group 32, symmetric: Kimi K2 Thinking's scheme)")
    ap.add_argument("--cases", nargs="+", default=["1:0", "1:64", "16:64"],
                    help="B:budget (0: the decode step) or P:T (a prefill of T tokens)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--calls", type=int, default=5, help="traced calls per case")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.prompt, args.cases = 16, ["1:0", "2:3", "P:24"]
    cfg = k2_slice(args.layers, args.experts, smoke=args.smoke)
    impl = "pallas" if args.smoke and args.impl == "auto" else args.impl
    report = Report(args, name="profile", title="Kimi K2-shaped target: where a pass spends its time",
                    sections=("passes", "kernels"))
    int4 = dt.Int4Format(group_size=32, symmetric=True) if args.int4 else None
    model = dt.init_on_mesh(lambda: dt.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, impl=impl,
                                                       experts_int4=int4))
    rng = np.random.default_rng(0)
    verify_nnx = nnx.jit(lambda m, tok, dep, anc, c: m.verify(tok, dep, anc, c)[0])
    verify_split = CompiledFn(lambda m, tok, dep, anc, c: m.verify(tok, dep, anc, c)[0], reads=(model,))
    prefill_all = CompiledFn(prefill_every_layer, reads=(model,))
    prefill = CompiledFn(lambda m, ids, n, c: m.prefill(ids, n, c)[2], reads=(model,))
    for case in args.cases:
        kind, size = case.split(":")
        if kind == "P":  # a prefill of ``size`` tokens into an empty row
            t = int(size)
            name, b, fn, nnx_fn = f"prefill {t}", 1, prefill_all, None
            fargs = (jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (1, t)), jnp.int32), jnp.full((1,), t, jnp.int32),
                     model.init_cache(1, t))
        else:
            b, budget = int(kind), int(size)
            ids = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (b, args.prompt)), jnp.int32)
            empty = model.init_cache(b, args.prompt + budget + 8)
            cache = prefill(ids, jnp.full((b,), args.prompt, jnp.int32), empty)
            depths, anc = random_tree(rng, b, budget)
            tok = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (b, budget + 1)), jnp.int32)
            name = "decode step" if budget == 0 else f"verify {budget}"
            fn, nnx_fn, fargs = verify_split, verify_nnx, (tok, depths, anc, cache)
        row = {"pass": name, "B": b, "experts": "int4" if args.int4 else "bf16"}
        if nnx_fn is not None:
            row["nnx.jit ms"] = 1e3 * time_call(nnx_fn, model, *fargs)
        row["jax.jit ms"] = 1e3 * time_call(fn, *fargs)
        kernels, total_ns = device_kernels(fn, fargs, args.calls)
        row["device ms"] = total_ns / 1e6
        log(f"{name} B={b}: " + (f"nnx.jit {row['nnx.jit ms']:.3f} ms, " if nnx_fn else "")
            + f"jax.jit {row['jax.jit ms']:.3f} ms, kernels on the GPU {row['device ms']:.3f} ms per call")
        report.add("passes", row)
        for kname, ns in sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]:
            report.add("kernels", {"pass": name, "B": b, "experts": row["experts"], "kernel": kname[:90],
                                   "us per call": ns / 1e3, "share": ns / max(total_ns, 1)})
            log(f"    {ns / 1e3:10.1f} us  {kname[:110]}")
        report.write()
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
