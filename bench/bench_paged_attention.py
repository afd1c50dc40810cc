"""Decode and verify attention through a page table against the contiguous kernels, in one run.

    PYTHONUNBUFFERED=1 python bench/bench_paged_attention.py [--contexts 4096 32768] [--batches 1 16 64]
    python bench/bench_paged_attention.py --smoke     # CPU, interpret mode, tiny shapes: checks the pipeline

Kimi K2 attention shapes (64 heads, kv_lora_rank 512, rope 64, bf16), one layer. For each context
``C`` (the committed prefix, ``start = C``), batch ``B`` and block of ``T`` tokens (1: a decode
step; 16 and 65: tree verifies of random trees): ``latent_attention`` over a contiguous cache of
``C + 512`` slots (the engine's scratch) and ``paged_latent_attention`` over a pool of pages of
``--page-size`` positions holding the same positions, each row's pages shuffled over the pool (no
two rows' pages adjacent), through the same dispatch (the Hopper kernel where ``latent_attention``
takes it, else the Triton kernel; ``--no-hopper``: the Triton kernel for both). Reports each one's
device time per call (``lax.fori_loop`` of calls in one dispatch), the ratio paged / contiguous,
and whether the outputs are bit for bit equal (they read the same tiles in the same order).

Writes ``paged_attention_<device>_<date>.{json,md}`` to ``--out`` (default bench/results) after
every row.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import Report, log, random_tree
from bench.bench_attention_gpu import dev_time
from ddtree_jax.backend import Backend
from ddtree_jax.models.latent_attention import latent_attention
from ddtree_jax.models.paged_attention import paged_latent_attention
from ddtree_jax.models.paged_cache import gather_positions
from ddtree_jax.models.tree_cache import BlockMask, tree_block_mask

SCRATCH = 512


def inputs(rng, b: int, t: int, h: int, r: int, dr: int, ctx: int, page: int, dtype):
    """Queries, a pool of shuffled pages holding ``ctx + SCRATCH`` positions per row, its table,
    the contiguous view of the same positions, and the block mask (a random tree for ``t > 1``)."""
    pages = -(-(ctx + SCRATCH) // page)
    num = 1 + b * pages  # page 0: the null page
    table = (1 + rng.permutation(b * pages)).reshape(b, pages).astype(np.int32)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    pool_lat, pool_kr = arr(num, page, r), arr(num, page, dr)
    table = jnp.asarray(table)
    s = pages * page
    lat, kr = gather_positions(pool_lat, table, s), gather_positions(pool_kr, table, s)
    start = jnp.full((b,), ctx, jnp.int32)
    within = None if t == 1 else tree_block_mask(random_tree(rng, b, t - 1)[1])
    return arr(b, t, h, r), arr(b, t, h, dr), pool_lat, pool_kr, table, lat, kr, BlockMask(start, within)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 65], help="block lengths T (1: decode)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--no-hopper", action="store_true", help="the Triton kernel on both sides")
    p.add_argument("--calls", type=int, default=50, help="calls per timed dispatch")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    h, r, dr, dtype = 64, 512, 64, jnp.bfloat16
    backend = Backend(kernels=True, interpret=args.smoke)
    if args.smoke:
        args.contexts, args.batches, args.blocks, args.calls = [200], [2], [1, 3], 2
        h, r, dr, dtype = 4, 32, 16, jnp.float32
    hopper = not args.no_hopper
    report = Report(args, name="paged_attention", title="Attention through a page table vs contiguous",
                    sections=["rows"])
    report.notes.append(f"K2 attention shapes (H={h}, r={r}, dr={dr}, {jnp.dtype(dtype).name}), pages of "
                        f"{args.page_size} positions shuffled over the pool, hopper={hopper}; device time per call "
                        f"of {args.calls} calls in one dispatch.")
    rng = np.random.default_rng(0)
    scale = 0.13
    for ctx in args.contexts:
        for b in args.batches:
            for t in args.blocks:
                ql, qr, pool_lat, pool_kr, table, lat, kr, mask = inputs(rng, b, t, h, r, dr, ctx, args.page_size,
                                                                         dtype)

                def contiguous(q, qr, lat, kr, start, within):
                    return latent_attention(q, qr, lat, kr, BlockMask(start, within), scale=scale, backend=backend,
                                            hopper=hopper)

                def paged(q, qr, pool_lat, pool_kr, table, start, within):
                    return paged_latent_attention(q, qr, pool_lat, pool_kr, table, BlockMask(start, within),
                                                  scale=scale, backend=backend, hopper=hopper)

                rest = (mask.start, mask.within)
                want = jax.jit(contiguous)(ql, qr, lat, kr, *rest)
                got = jax.jit(paged)(ql, qr, pool_lat, pool_kr, table, *rest)
                equal = bool(np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)))
                c_s = dev_time(contiguous, ql, args.calls, (qr, lat, kr, *rest))
                p_s = dev_time(paged, ql, args.calls, (qr, pool_lat, pool_kr, table, *rest))
                row = dict(context=ctx, batch=b, block=t, contiguous_us=c_s * 1e6, paged_us=p_s * 1e6,
                           paged_over_contiguous=p_s / c_s, bit_equal=equal)
                report.add("rows", row)
                log(row)
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
