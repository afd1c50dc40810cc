"""Times build_draft_tree (jit-compiled, fixed shapes) against a plain heapq builder.

    python bench/bench_tree.py [--batch 16 --budget 256 --depth 15 --vocab 163840 --repeats 5]

Both builders get the same float32 draft log-probabilities; the heapq side includes its own
per-depth top-k (numpy argpartition) so both do the whole job. Writes JSON + markdown to
bench/results/tree_<device>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import itertools
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ddtree_jax as dt


def heapq_build(logq: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Plain best-first DDTree build for one request: [(token, parent)] in creation order."""
    L, V = logq.shape
    K = min(budget, V)
    part = np.argpartition(-logq, K - 1, axis=1)[:, :K]
    order = np.argsort(-np.take_along_axis(logq, part, 1), axis=1, kind="stable")
    ids = np.take_along_axis(part, order, 1)
    top = np.take_along_axis(logq, ids, 1)
    nodes, scores, heap, counter = [(-1, -1)], [0.0], [], itertools.count()
    heapq.heappush(heap, (-top[0, 0], next(counter), 0, 1, 0))
    while heap and len(nodes) <= budget:
        neg, _, parent, d, r = heapq.heappop(heap)
        node = len(nodes)
        nodes.append((int(ids[d - 1, r]), parent))
        scores.append(-neg)
        if r + 1 < K:
            heapq.heappush(heap, (-(scores[parent] + top[d - 1, r + 1]), next(counter), parent, d, r + 1))
        if d < L:
            heapq.heappush(heap, (neg - top[d, 0], next(counter), node, d + 1, 0))
    return nodes


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = ap.parse_args()

    B, N, L, V = args.batch, args.budget, args.depth, args.vocab
    rng = np.random.default_rng(0)
    # Realistic-ish drafter rows: a few confident tokens and a long tail.
    logits = (rng.standard_normal((B, L, V)) * 2.0).astype(np.float32)
    logits[:, :, rng.integers(0, V, 8)] += 8.0
    logits_dev = jnp.asarray(logits)
    logq = np.asarray(dt.draft_logprobs(logits_dev))

    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"[bench_tree] device={device} B={B} budget={N} L={L} V={V}", flush=True)

    t0 = time.perf_counter()
    jax.block_until_ready(dt.build_draft_tree(logits_dev, N))
    compile_s = time.perf_counter() - t0
    print(f"[bench_tree] compiled in {compile_s:.2f}s", flush=True)
    jit_med, jit_min = timed(lambda: jax.block_until_ready(dt.build_draft_tree(logits_dev, N)), args.repeats)
    print(f"[bench_tree] build_draft_tree (jit): median {jit_med * 1e3:.2f} ms", flush=True)
    # The jit builder's top-k alone, to show where its time goes.
    topk = jax.jit(lambda x: jax.lax.top_k(dt.draft_logprobs(x), min(N, V)))
    jax.block_until_ready(topk(logits_dev))
    topk_med, _ = timed(lambda: jax.block_until_ready(topk(logits_dev)), args.repeats)
    heap_med, heap_min = timed(lambda: [heapq_build(logq[b], N) for b in range(B)], args.repeats)
    print(f"[bench_tree] heapq (numpy top-k + heapq, per batch): median {heap_med * 1e3:.2f} ms", flush=True)

    # Same trees?
    tree = dt.build_draft_tree(logits_dev, N)
    ref = heapq_build(logq[0], N)
    same = [int(t) for t in np.asarray(tree.tokens[0, 1:])] == [t for t, _ in ref[1:]]

    now = datetime.datetime.now(datetime.UTC)
    result = dict(
        bench="build_draft_tree",
        device=device,
        host=platform.node(),
        date=now.isoformat(timespec="seconds"),
        command="python " + " ".join(sys.argv),
        jax=jax.__version__,
        shape=dict(batch=B, budget=N, depth=L, vocab=V),
        jit_ms=dict(median=jit_med * 1e3, min=jit_min * 1e3, compile_s=compile_s),
        jit_topk_only_ms=topk_med * 1e3,
        heapq_ms=dict(median=heap_med * 1e3, min=heap_min * 1e3),
        speedup_jit_over_heapq=heap_med / jit_med,
        trees_equal_request0=same,
    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tree_{jax.default_backend()}_{now.strftime('%Y%m%d')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# build_draft_tree benchmark ({now.date()}, {device})",
        "",
        f"`{result['command']}`, jax {jax.__version__}; B={B}, budget={N}, L={L}, V={V}; median of {args.repeats}.",
        "",
        "| builder | median ms / round (whole batch) | min ms |",
        "|---|---|---|",
        f"| `build_draft_tree` (jit) | {jit_med * 1e3:.2f} | {jit_min * 1e3:.2f} |",
        f"| of which log-softmax + top-k | {topk_med * 1e3:.2f} | |",
        f"| numpy top-k + Python heapq | {heap_med * 1e3:.2f} | {heap_min * 1e3:.2f} |",
        "",
        f"jit / heapq speedup: {heap_med / jit_med:.2f}x; request 0 trees identical: {same}.",
    ]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
