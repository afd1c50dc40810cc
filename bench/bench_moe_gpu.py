"""Routed MoE experts on one GPU: the Pallas grouped-matmul kernel against ``jax.lax.ragged_dot``
and the weight-read floor, at Kimi K2 expert shapes, in one run (checks first, then timings).

K2 shapes: hidden 7168, expert intermediate 2048, 384 experts, top-8, bf16, random weights and
uniformly random routing (k distinct experts per token); tokens 1, 16, 64, 256, 1024, 16384.

Checks (bf16 at K2 shapes): the kernel's output for the first <= 64 tokens against the dense
float32 reference on those tokens (``experts_reference``: every expert on every token), bound 2%
of the largest output; and a small float32 case (tight: the Triton dot must run in IEEE float32).

Timings (``jax.block_until_ready``, warm-up call, median of 3 x ``--iters``): the whole routed
experts step of each path (routing metadata + matmuls + combine), the routing metadata alone,
and a few alternative block sizes of the kernel at 1 and 1024 tokens. Floors: weight-read = bytes
of the experts the routing actually touches / 4.2 TB/s; matmul = 6*N*k*H*I FLOPs / the bf16 matmul
rate measured in the same run; the table's floor is the larger. ``ragged_dot`` is skipped above
``--ragged-max`` tokens (XLA's GPU lowering materialises an ``[E, N*k, I]`` copy: out of memory).
Every variant runs in its own try/except: a failure is reported and the rest still runs.

    PYTHONUNBUFFERED=1 python bench/bench_moe_gpu.py                 # H200, ~3 minutes
    python bench/bench_moe_gpu.py --smoke --out /tmp/bench           # tiny shapes, CPU (interpret)

Writes ``moe_<platform>_<date>.json`` and ``.md`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from flax import nnx

from bench._common import device_kernels
from bench._timing import time_it
from ddtree_jax.backend import Backend
from ddtree_jax.models.int4 import Int4Format, PackedWeight, dequantize, random_packed_weight
from ddtree_jax.models.moe import (
    experts_grouped_matmul,
    experts_reference,
    route_tokens,
    routed_experts,
)
from pallas_kernels.triton.moe_grouped_matmul import choose_blocks

COPY_BW = 4.2e12  # bytes/s, measured copy bandwidth of the H200 (docs/kernels.md)
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def random_routing(key, n, e, k):
    """k distinct uniformly random experts per token, sigmoid-like positive weights."""
    kr, kw = jax.random.split(key)
    ids = jax.lax.top_k(jax.random.uniform(kr, (n, e)), k)[1].astype(jnp.int32)
    return jax.random.uniform(kw, (n, k), minval=0.1, maxval=1.0), ids


def gathered_reference(x, w, ids, gate_up, down):
    """float32 experts for a few tokens ``x [m, H]`` from each token's own k expert slabs (no dense
    pass over all experts: at K2 shapes that would copy 100 GB to float32)."""
    g = gate_up[ids].astype(jnp.float32)  # [m, k, H, 2I]
    gate, up = jnp.split(jnp.einsum("mh,mkhi->mki", x, g), 2, axis=-1)
    out = jnp.einsum("mki,mkih->mkh", jax.nn.silu(gate) * up, down[ids].astype(jnp.float32))
    return (out * w[..., None]).sum(1)


def matmul_rate(dtype, interpret):
    """Measured FLOP/s of one large bf16 matmul (the compute floor's denominator)."""
    m, kk, nn = (256, 256, 256) if interpret else (8192, 7168, 4096)
    a = jnp.ones((m, kk), dtype)
    b = jnp.ones((kk, nn), dtype)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * m * kk * nn / time_it(f, [(a, b)], iters=5, repeats=3)


def run_variant(results, name, fn, **info):
    """Run ``fn`` (returns a dict), record it or its failure; never raises."""
    t = time.perf_counter()
    try:
        out = fn()
        results.append(dict(variant=name, ok=True, **info, **out))
        log(f"  {name} {info}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in out.items()) + f" ({time.perf_counter() - t:.1f}s)")
    except Exception as exc:  # noqa: BLE001 - report and carry on (lowering error, OOM, ...)
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        results.append(dict(variant=name, ok=False, error=msg, **info))
        log(f"  {name} {info}: FAILED {msg}")
        traceback.print_exc(limit=3)


INT4 = Int4Format(group_size=32, symmetric=True)  # Kimi K2 Thinking's routed experts
INT4_GROUP = INT4.group_size


def random_packed(seed, e, k, n, dtype):
    """Random INT4 experts ``[e, k, n]`` already packed (the model's own ``random_packed_weight``),
    drawn on the device under ``jit``: quantising 34 GB of bf16 weights on the host would take
    longer than the whole bench."""
    return jax.jit(lambda: random_packed_weight(nnx.Rngs(seed), (e, k, n), INT4, dtype))()


def int4_sweep(args, results, kernel, dtype, interpret, rate):
    """The W4A16 kernel at ``--int4-tokens``: a check against the float32 product with the
    dequantised slabs of the tokens' own experts, then the default blocks and alternatives against
    the INT4 weight-read floor (the touched experts' packed words and scales / copy bandwidth)."""
    e, h, i, k = args.experts, args.hidden, args.inter, args.topk
    kq = jax.random.PRNGKey(4)
    gu4, dn4 = random_packed(40, e, h, 2 * i, dtype), random_packed(41, e, i, h, dtype)
    expert_bytes = (h * 2 * i + i * h) // 2 + (h * 2 * i + i * h) // INT4_GROUP * jnp.dtype(dtype).itemsize
    log(f"INT4 experts ready: {e * expert_bytes / 2**30:.2f} GiB (packed words + scales)")
    label = "int4 bm{0.block_m} bn{0.block_n_gate_up}/{0.block_n_down} bk{0.block_k} w{0.num_warps} s{0.num_stages}"
    small = interpret  # interpret mode: the default blocks only (block_k must divide the tiny shapes)
    for n in args.int4_tokens:
        w, ids = random_routing(jax.random.fold_in(kq, 10 + n), n, e, k)
        xs = [jax.random.normal(jax.random.fold_in(kq, 1000 * n + j), (n, h), dtype) for j in range(2)]
        touched = int(jnp.unique(ids).size)
        read_floor, flop_floor = touched * expert_bytes / COPY_BW, 6 * n * k * h * i / rate
        floor = max(read_floor, flop_floor)
        info = dict(tokens=n, touched_experts=touched, read_floor_ms=read_floor * 1e3, flop_floor_ms=flop_floor * 1e3)
        base = choose_blocks(n * k, e, int4=True)
        changes = [] if small else [
            dict(block_k=256), dict(block_k=512), dict(block_k=256, num_stages=4),
            dict(block_n_gate_up=64, block_n_down=128), dict(block_n_gate_up=256, block_n_down=512),
            dict(block_k=256, num_warps=8), dict(block_m=16, block_n_gate_up=128, block_n_down=256),
            # wider column blocks at 32-row tiles: each program's token tile then serves twice the
            # weight columns (at 1,040 tokens with 64 gate/up columns the token rows a program reads
            # are as many bytes as its INT4 weights)
            dict(block_n_gate_up=128, block_n_down=256), dict(block_n_gate_up=128, block_n_down=256, block_k=256)]
        variants = [base] + [dataclasses.replace(base, **c) for c in changes]
        for blocks in dict.fromkeys(variants):  # distinct, in order
            fn = jax.jit(lambda x, w, ids, gu, dn, blocks=blocks: routed_experts(x, gu, dn, w, ids, backend=kernel,
                                                                                 blocks=blocks))
            if blocks == base:
                def check(fn=fn, n=n, w=w, ids=ids, x=xs[0]):
                    m = min(n, 4)
                    got = fn(x, w, ids, gu4, dn4)[:m].astype(jnp.float32)

                    def slabs(pw, kk, nn):
                        return dequantize(PackedWeight(pw.packed[ids[:m]].reshape(m * k, kk // 8, nn),
                                                       pw.scale[ids[:m]].reshape(m * k, kk // INT4_GROUP, nn)))

                    with jax.default_matmul_precision("highest"):
                        want = gathered_reference(x[:m].astype(jnp.float32), w[:m], jnp.arange(m * k).reshape(m, k),
                                                  slabs(gu4, h, 2 * i), slabs(dn4, i, h))
                    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
                    assert err < 0.02, f"relative error {err:.3g}"
                    return dict(rel_err=err)

                run_variant(results, "check_int4", check, tokens=n)

            def timed(fn=fn, floor=floor, w=w, ids=ids, xs=xs):
                s = time_it(fn, [(x, w, ids, gu4, dn4) for x in xs], iters=args.iters, repeats=3)
                out = dict(ms=s * 1e3, x_floor=s / floor)
                if not interpret:  # the two INT4 launches' own device time (profiler): less noisy than the wall
                    kern, _ = device_kernels(fn, (xs[0], w, ids, gu4, dn4), calls=args.iters)
                    out.update({f"{name.removeprefix('ddtree_moe_')}_ms": ns / 1e6 for name, ns in kern.items()
                                if name.startswith("ddtree_moe_")})
                return out

            run_variant(results, label.format(blocks) + (" (default)" if blocks == base else ""), timed, **info)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 16384])
    parser.add_argument("--ragged-max", type=int, default=1024, help="largest token count timed with ragged_dot")
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[1, 1024], help="block-size sweep at these")
    parser.add_argument("--int4-tokens", type=int, nargs="*", default=[1, 16, 65, 1040],
                        help="INT4 (W4A16) kernel: a check and a block sweep at these token counts (none: skip)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    if args.smoke:
        args.experts, args.hidden, args.inter, args.topk = 8, 64, 32, 2
        args.tokens, args.iters, args.sweep_tokens, args.ragged_max = [1, 16, 64], 2, [16], 64
        args.int4_tokens = [16] if args.int4_tokens else []
    elif interpret:
        sys.exit("no GPU: run with --smoke for the interpret-mode check")
    e, h, i, k = args.experts, args.hidden, args.inter, args.topk
    dtype = jnp.bfloat16
    kernel, ragged = Backend(kernels=True, interpret=interpret), Backend(kernels=False)
    meta = dict(
        device=getattr(dev, "device_kind", str(dev)), platform=dev.platform, jax=jax.__version__,
        python=platform.python_version(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        experts=e, hidden=h, inter=i, topk=k, dtype="bfloat16", iters=args.iters, copy_bandwidth=COPY_BW,
    )
    log(f"device {meta['device']}, jax {jax.__version__}, interpret={interpret}; E={e} H={h} I={i} top-{k}")
    results = []
    key = jax.random.PRNGKey(0)
    kg, kd, kx = jax.random.split(key, 3)
    gate_up = (jax.random.normal(kg, (e, h, 2 * i), dtype) * h**-0.5).astype(dtype)
    down = (jax.random.normal(kd, (e, i, h), dtype) * i**-0.5).astype(dtype)
    expert_bytes = (h * 2 * i + i * h) * jnp.dtype(dtype).itemsize
    log(f"weights ready: {e * expert_bytes / 2**30:.1f} GiB")
    rate = matmul_rate(dtype, interpret)
    meta["matmul_flops_per_s"] = rate
    log(f"bf16 matmul rate {rate / 1e12:.1f} TFLOP/s")

    # The weights are arguments, never closed over: a closure would embed 34 GB of constants.
    kernel_fn = jax.jit(lambda x, w, ids, gu, dn: routed_experts(x, gu, dn, w, ids, backend=kernel))
    ragged_fn = jax.jit(lambda x, w, ids, gu, dn: routed_experts(x, gu, dn, w, ids, backend=ragged))

    # ---- checks ----
    log("checks")

    def check_small_f32():
        kk = jax.random.split(key, 4)
        ee, hh, ii, n = 8, 256, 128, 37
        gu = jax.random.normal(kk[0], (ee, hh, 2 * ii)) * hh**-0.5
        dn = jax.random.normal(kk[1], (ee, ii, hh)) * ii**-0.5
        x = jax.random.normal(kk[2], (n, hh))
        w, ids = random_routing(kk[3], n, ee, 2)
        valid = jnp.arange(n) % 5 != 0
        got = jax.jit(lambda *a: routed_experts(*a, backend=kernel, valid=valid))(x, gu, dn, w, ids)
        with jax.default_matmul_precision("highest"):  # the reference in IEEE float32, not tf32
            want = experts_reference(x, gu, dn, w, ids, valid)
        err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
        assert err < 1e-5, f"float32 relative error {err:.2e} (tf32 dot?)"
        return dict(rel_err=err)

    run_variant(results, "check_f32_small", check_small_f32, tokens=37)
    for n in args.tokens:
        def check(n=n):
            w, ids = random_routing(jax.random.fold_in(kx, n), n, e, k)
            x = jax.random.normal(jax.random.fold_in(kx, 10**6 + n), (n, h), dtype)
            got = kernel_fn(x, w, ids, gate_up, down)
            m = min(n, 8)
            f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
            with jax.default_matmul_precision("highest"):
                want = gathered_reference(f32(x[:m]), w[:m], ids[:m], gate_up, down)
            err = float(jnp.abs(f32(got[:m]) - want).max() / jnp.abs(want).max())
            finite = bool(jnp.isfinite(got.astype(jnp.float32)).all())
            assert finite and err < 0.02, f"relative error {err:.3g}, finite {finite}"
            return dict(rel_err=err)

        run_variant(results, "check_k2", check, tokens=n)

    # ---- timings ----
    log("timings")
    for n in args.tokens:
        w, ids = random_routing(jax.random.fold_in(kx, n), n, e, k)
        xs = [jax.random.normal(jax.random.fold_in(kx, 1000 * n + j), (n, h), dtype) for j in range(2)]
        touched = int(jnp.unique(ids).size)
        read_floor = touched * expert_bytes / COPY_BW
        flop_floor = 6 * n * k * h * i / rate
        floor = max(read_floor, flop_floor)
        info = dict(tokens=n, touched_experts=touched, read_floor_ms=read_floor * 1e3,
                    flop_floor_ms=flop_floor * 1e3)
        call_args = [(x, w, ids, gate_up, down) for x in xs]

        def timed(fn, call_args=call_args, floor=floor):
            s = time_it(fn, call_args, iters=args.iters, repeats=3)
            return dict(ms=s * 1e3, x_floor=s / floor)

        label = ("kernel bm{0.block_m} bn{0.block_n_gate_up}/{0.block_n_down} bk{0.block_k} "
                 "w{0.num_warps} s{0.num_stages}")
        run_variant(results, f"kernel (default: {label.format(choose_blocks(n * k, e))[7:]})",
                    lambda: timed(kernel_fn), **info)
        if n <= args.ragged_max:
            run_variant(results, "ragged_dot", lambda: timed(ragged_fn), **info)
        blocks = choose_blocks(n * k, e)
        route_fn = jax.jit(lambda x, w, ids, gu, dn, bm=blocks.block_m: route_tokens(w, ids, e, block_m=bm))
        run_variant(results, "routing_only", lambda fn=route_fn: timed(fn), **info)
        if n in args.sweep_tokens:
            base = blocks
            alts = [dataclasses.replace(base, block_n_gate_up=32, block_n_down=64),
                    dataclasses.replace(base, block_n_gate_up=128, block_n_down=256, num_warps=8),
                    dataclasses.replace(base, block_k=64 if base.block_k == 128 else 128, num_stages=4)]
            for alt in alts:
                fn = jax.jit(lambda x, w, ids, gu, dn, alt=alt: experts_grouped_matmul(
                    x, gu, dn, route_tokens(w, ids, e, block_m=alt.block_m), alt, interpret=interpret))
                run_variant(results, label.format(alt), lambda fn=fn: timed(fn), **info)

    if args.int4_tokens:
        int4_sweep(args, results, kernel, dtype, interpret, rate)

    os.makedirs(args.out, exist_ok=True)
    stem = f"moe_{'smoke_' if args.smoke else ''}{dev.platform}_{datetime.date.today():%Y%m%d}"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    lines = [
        f"# Routed MoE experts: grouped-matmul kernel vs ragged_dot ({meta['date']}, {meta['device']})",
        "",
        f"`{meta['command']}`, jax {meta['jax']}; {e} experts, hidden {h}, inter {i}, top-{k}, bf16, random "
        f"routing; median of 3 x {args.iters} calls. Floor = max(touched experts' weight bytes / "
        f"{COPY_BW / 1e12:.1f} TB/s, 6 N k H I / {rate / 1e12:.0f} TFLOP/s measured).",
        "",
        "| check | tokens | result |",
        "|---|---|---|",
    ]
    for r in results:
        if r["variant"].startswith("check"):
            result = f"ok, rel err {r['rel_err']:.2e}" if r["ok"] else f"FAILED: {r['error']}"
            lines.append(f"| {r['variant']} | {r['tokens']} | {result} |")
    lines += ["", "| variant | tokens | touched experts | ms | read floor ms | flop floor ms | x floor | "
              "launches (device ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["variant"].startswith("check"):
            continue
        head = f"| {r['variant']} | {r['tokens']} | {r['touched_experts']} | "
        if r["ok"]:
            launches = ", ".join(f"{key.removesuffix('_ms')} {v:.3f}" for key, v in r.items()
                                 if key.startswith(("gate_up", "down")))
            lines.append(head + f"{r['ms']:.3f} | {r['read_floor_ms']:.3f} | {r['flop_floor_ms']:.3f} | "
                         f"{r['x_floor']:.2f} | {launches} |")
        else:
            lines.append(head + f"FAILED: {r['error']} | | | | |")
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wrote {os.path.join(args.out, stem)}.json/.md")


if __name__ == "__main__":
    main()
