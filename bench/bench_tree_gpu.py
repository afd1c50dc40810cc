"""Tree builder and accept walk on the GPU: equality checks, then timings of the Pallas builder
(one program per request) against the plain-JAX jit loop and the CPU heapq builder, and of the
Pallas walk against the plain-JAX walk. B=16, budget 256, L=15, V=163840 (top-k included).

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/bench_tree_gpu.py
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _timing  # noqa: E402  (bench/ is the script's folder)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ddtree_jax as dt  # noqa: E402
from ddtree_jax.topk import exact_top_k  # noqa: E402
from ddtree_jax.tree import ancestor_mask_from_parents, draft_logprobs  # noqa: E402
from pallas_kernels.triton import tree_builder  # noqa: E402

B, BUDGET, L, V = 16, 256, 15, 163840
FIELDS = ["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"]


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


time_it = functools.partial(_timing.time_it, iters=50)


DEV_N = 20


def dev_time(fn, x, n=DEV_N, repeats=5):
    """Device time per call of ``fn(x)``: n calls inside one jit (lax.fori_loop) whose input ``x``
    is a loop carry touched at one element each iteration (in place, data-dependent, so nothing is
    hoisted), timed as one dispatch; per-call dispatch cost is amortised away."""

    @jax.jit
    def loop(x):
        def body(i, c):
            x, acc = c
            out = fn(x)
            leaf = jax.tree.leaves(out)[0]
            acc = acc + leaf.reshape(-1)[0].astype(jnp.float32)
            first = x.reshape(-1)[0]
            x = x.at[(0,) * x.ndim].set(jnp.where(acc < -3e38, jnp.zeros_like(first), first))
            return x, acc

        return jax.lax.fori_loop(0, n, body, (x, jnp.float32(0)))[1]

    return time_it(loop, [(x,)], iters=3, repeats=repeats) / n


def draft_logits(seed, B=B, L=L, V=V):
    k1, k2 = jax.random.split(jax.random.key(seed))
    scale = jax.random.uniform(k1, (B, L, 1), minval=0.5, maxval=4.0)
    return (jax.random.normal(k2, (B, L, V)) * scale).astype(jnp.bfloat16)


def main():
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    dev = jax.devices()[0]
    meta = dict(
        device=getattr(dev, "device_kind", str(dev)),
        jax=jax.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command="PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/bench_tree_gpu.py",
    )
    res = dict(meta=meta, checks={}, times_us={})
    # --- equality on fresh random inputs (incl. odd sizes and ties)
    cases = [
        (B, L, V, BUDGET, 1),
        (B, L, V, BUDGET, -5),
        (3, 7, 1000, 100, 2),
        (2, 5, 37, 300, 3),
        (4, 16, 5000, 1023, 4),
    ]
    for b, depth, v, n, s in cases:
        x = draft_logits(abs(s), b, depth, v)
        if s < 0:  # heavy ties (values on a coarse grid): exercises the tie rules and top-k fallback
            x = (jnp.round(x.astype(jnp.float32) * 2) / 2).astype(jnp.bfloat16)
        ref = dt.build_draft_tree(x, n, impl="reference")
        ker = dt.build_draft_tree(x, n, impl="pallas")
        diff = [f for f in FIELDS if not np.array_equal(np.asarray(getattr(ref, f)), np.asarray(getattr(ker, f)))]
        res["checks"][f"build B{b} L{depth} V{v} N{n}"] = diff or "equal"
        log(f"builder B={b} L={depth} V={v} N={n}:", diff or "equal")
        tree = ref.with_root_tokens(jnp.zeros((b,), jnp.int32))
        tk, fc = np.asarray(tree.tokens), np.asarray(tree.first_child)
        rng = np.random.default_rng(abs(s))
        deep = np.where(fc >= 0, np.take_along_axis(tk, np.maximum(fc, 0), 1), 7)
        smp = jnp.asarray(np.where(rng.random(tk.shape) < 0.85, deep, rng.integers(0, v, tk.shape)).astype(np.int32))
        a, r = dt.accept_path(tree, smp, impl="pallas"), dt.accept_path(tree, smp, impl="reference")
        d2 = [
            f
            for f in ("path", "num_accepted", "bonus", "committed")
            if not np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(r, f)))
        ]
        res["checks"][f"walk B{b} L{depth} N{n}"] = d2 or "equal"
        log(f"walk: {d2 or 'equal'} (accepted {np.asarray(r.num_accepted)[:6]})")
    # --- timings
    xs = [draft_logits(100 + i) for i in range(3)]
    t = res["times_us"]
    t["jax_loop_total"] = 1e6 * time_it(
        lambda x: dt.build_draft_tree(x, BUDGET, impl="reference"), [(x,) for x in xs], iters=10
    )
    log("jax loop", t["jax_loop_total"])
    t["pallas_total"] = 1e6 * time_it(lambda x: dt.build_draft_tree(x, BUDGET, impl="pallas"), [(x,) for x in xs])
    log("pallas total", t["pallas_total"])
    t["pallas_total_dev"] = 1e6 * dev_time(lambda x: dt.build_draft_tree(x, BUDGET, impl="pallas"), xs[0])
    log("pallas total dev", t["pallas_total_dev"])
    t["log_softmax_only"] = 1e6 * time_it(jax.jit(draft_logprobs), [(x,) for x in xs])
    topk = jax.jit(lambda x: jax.lax.top_k(draft_logprobs(x), BUDGET))
    t["topk_lax_incl_log_softmax"] = 1e6 * time_it(topk, [(x,) for x in xs], iters=10)
    t["topk_chunked_incl_log_softmax"] = 1e6 * time_it(
        jax.jit(lambda x: exact_top_k(draft_logprobs(x), BUDGET)), [(x,) for x in xs]
    )
    tops = [(a, i.astype(jnp.int32)) for a, i in (topk(x) for x in xs)]
    for nw in (1, 2, 4, 8):
        t[f"pallas_pop_loop_w{nw}"] = 1e6 * time_it(
            lambda a, i, nw=nw: tree_builder.build_tree(a, i, budget=BUDGET, num_warps=nw), tops
        )
    t["pallas_pop_loop_w4_dev"] = 1e6 * dev_time(
        lambda a: tree_builder.build_tree(a, tops[0][1], budget=BUDGET), tops[0][0]
    )
    tr = dt.build_draft_tree(xs[0], BUDGET, impl="pallas")
    anc = jax.jit(lambda p, v: ancestor_mask_from_parents(p, v, L))
    t["ancestor_mask_only"] = 1e6 * time_it(anc, [(tr.parents, tr.valid)])
    # where exact_top_k's time goes (device time per call)
    lq0 = jax.jit(draft_logprobs)(xs[0])
    nc, kc = V // 32, BUDGET + 32
    t["topk_stage_log_softmax_dev"] = 1e6 * dev_time(draft_logprobs, xs[0])
    t["topk_stage_chunk_max_dev"] = 1e6 * dev_time(lambda q: jnp.max(q.reshape(B, L, nc, 32), axis=-1), lq0)
    cm0 = jnp.max(lq0.reshape(B, L, nc, 32), axis=-1)
    t["topk_stage_topk_of_chunk_maxima_dev"] = 1e6 * dev_time(lambda c: jax.lax.top_k(c, kc + 1), cm0)
    cand0 = lq0[..., : kc * 32]
    t["topk_stage_topk_of_candidates_dev"] = 1e6 * dev_time(lambda c: jax.lax.top_k(c, BUDGET), cand0)
    t["topk_chunked_total_dev"] = 1e6 * dev_time(lambda q: exact_top_k(q, BUDGET), lq0)
    log("parts", {k: round(v, 1) for k, v in t.items()})
    tree = tr.with_root_tokens(jnp.zeros((B,), jnp.int32))
    tk, fc = np.asarray(tree.tokens), np.asarray(tree.first_child)
    smp = jnp.asarray(np.where(fc >= 0, np.take_along_axis(tk, np.maximum(fc, 0), 1), 3).astype(np.int32))
    t["walk_pallas"] = 1e6 * time_it(lambda s: dt.accept_path(tree, s, impl="pallas"), [(smp,)])
    t["walk_jax"] = 1e6 * time_it(lambda s: dt.accept_path(tree, s, impl="reference"), [(smp,)])
    # --- CPU heapq builder (numpy + heapq), for scale
    try:
        from tests._reference import heapq_draft_tree

        logq = np.asarray(draft_logprobs(xs[0]))
        t0 = time.perf_counter()
        for b in range(B):
            heapq_draft_tree(logq[b], BUDGET)
        t["cpu_heapq_excl_transfer"] = 1e6 * (time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001
        log("heapq failed", e)
    log("times_us", json.dumps({k: round(v, 1) for k, v in t.items()}))
    stamp = datetime.datetime.now().strftime("%Y%m%d")
    with open(os.path.join(out_dir, f"tree_gpu_h200_{stamp}.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    md = [
        f"# Tree builder / walk on {meta['device']}, {meta['date']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"B={B}, budget={BUDGET}, L={L}, V={V} (bf16 draft logits; top-k included in totals)",
        "",
        "Host-loop times (one jit dispatch per call) unless the name ends in _dev (20 calls inside one jit, "
        "lax.fori_loop, time / 20: device time without the per-call dispatch). The pop loop does 5 dependent "
        "reductions + 3 scalar loads per pop; the ancestor mask follows parent pointers L times.",
        "",
        "| what | us per round |",
        "|---|---|",
    ] + [f"| {k} | {v:.1f} |" for k, v in t.items()]
    md += ["", "Equality checks (kernel vs plain JAX on the GPU):", ""] + [
        f"- {k}: {v}" for k, v in res["checks"].items()
    ]
    with open(os.path.join(out_dir, f"tree_gpu_h200_{stamp}.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
