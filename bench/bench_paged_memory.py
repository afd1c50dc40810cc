"""Concurrent requests on the same cache memory: paged caches against fixed slots.

    PYTHONUNBUFFERED=1 python bench/bench_paged_memory.py            # the issue's workload, CPU or GPU
    python bench/bench_paged_memory.py --smoke --out /tmp/bench     # tiny sizes (a pipeline check)

A mixed workload (``--requests`` requests, prompt lengths uniform in ``--prompt-range``, output
lengths uniform in ``--output-range``, every request running to its length: no stop tokens) on
an engine of ``--max-model-len`` positions per request. The cache memory is that of
``--fixed-slots`` contiguous slots (each ``cache_len`` positions, whatever its request needs: the
most requests such an engine runs at once). The paged engine gets exactly that memory as its page
pool (``EngineConfig.kv_pages`` default for ``slots=--fixed-slots``), and up to ``--rows`` rows per
round; all requests are submitted at once and the engine steps until every one has finished (or
``--max-steps``). Reported:
the most and the time-averaged number of requests decoding at once, preemptions, prefix hits, the
pool's pages, the ratio of the concurrency to the fixed slots, and how many requests finished with
their full length.

The models are random (a small Kimi-style target with ``--max-model-len`` positions and a
one-layer DFlash drafter): concurrency depends on the pages, not on what the models say. Results:
``paged_memory_<device>_<date>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import Report, log
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.dflash_config import DFlashConfig
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.models.kimi_config import KimiConfig
from ddtree_jax.serving import Engine


def models(max_len: int, smoke: bool):
    width = 32 if smoke else 64
    tcfg = KimiConfig(vocab_size=512, hidden_size=width, intermediate_size=2 * width, moe_intermediate_size=width,
                      num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                      num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                      max_position_embeddings=max_len)
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(0))
    dcfg = DFlashConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, num_target_layers=2, block_size=4, mask_token_id=511,
                        target_layer_ids=(0, 1), layer_types=("full_attention",), rms_norm_eps=1e-6,
                        rope_theta=10000.0, vocab_size=512)
    return target, DFlashDrafter(dcfg, rngs=nnx.Rngs(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[64, 4096])
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 1024])
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--fixed-slots", type=int, default=2, help="contiguous slots the cache memory holds")
    ap.add_argument("--rows", type=int, default=64, help="the paged engine's slots (rows per round)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after this many engine steps (0: when every request has finished); the "
                         "concurrency is over the steps run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt_range, args.output_range = 6, [16, 96], [8, 24]
        args.max_model_len, args.rows, args.prefill_chunk = 256, 8, 32

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 500, int(rng.integers(args.prompt_range[0], args.prompt_range[1] + 1))).tolist()
               for _ in range(args.requests)]
    outputs = [int(rng.integers(args.output_range[0], args.output_range[1] + 1)) for _ in range(args.requests)]
    target, drafter = models(args.max_model_len, args.smoke)
    decode = dt.DecodeConfig(method="ddtree", budget=args.budget)
    base = dt.EngineConfig(decode=decode, slots=args.fixed_slots, max_model_len=args.max_model_len,
                           prefill_chunk=args.prefill_chunk, max_queue=max(256, args.requests))
    fixed = Engine(target, drafter, base)
    fixed_bytes = fixed.state_bytes
    cache_len = fixed.cache_len
    del fixed
    eng = Engine(target, drafter, dataclasses.replace(base, slots=args.rows, page_size=args.page_size,
                                                      kv_pages=args.fixed_slots * -(-cache_len // args.page_size),
                                                      prefill_batch=8))
    log(f"{args.requests} requests, prompts {args.prompt_range}, outputs {args.output_range}; memory of "
        f"{args.fixed_slots} slots of {cache_len} positions = a pool of {eng.kv_pages} pages of {args.page_size}")
    eng.warmup()  # compiles the rounds and prefill shapes before the timed run
    handles = [eng.submit(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, outputs, strict=True)]
    peak, weighted, elapsed, steps = 0, 0.0, 0.0, 0
    t0 = last = time.perf_counter()
    while not all(h.done for h in handles) and not (args.max_steps and steps >= args.max_steps):
        eng.step()
        now = time.perf_counter()
        running = eng.metrics.snapshot()["running"]
        peak = max(peak, running)
        weighted += running * (now - last)
        elapsed, last, steps = elapsed + now - last, now, steps + 1
        if steps % 50 == 0:
            done = sum(h.done for h in handles)
            log(f"step {steps}: {running} running, {done}/{args.requests} done, {now - t0:.0f}s")
    results = [h.result() if h.done else None for h in handles]
    complete = sum(r is not None and len(r.tokens) == n and r.finish_reason == "length"
                   for r, n in zip(results, outputs, strict=True))
    if not all(h.done for h in handles):
        eng.stop()  # the rest end with "abort"
    snap = eng.metrics.snapshot()
    report = Report(args, name="paged_memory", title="Concurrent requests on the same cache memory",
                    sections=("concurrency",))
    report.notes.append(f"Workload: {args.requests} requests, prompts uniform in {args.prompt_range} tokens, outputs "
                        f"uniform in {args.output_range} tokens (seed {args.seed}), max_model_len "
                        f"{args.max_model_len}, DDTree budget {args.budget}, random models.")
    report.add("concurrency", dict(
        fixed_slots=args.fixed_slots, cache_MiB=fixed_bytes / 2**20, page_size=args.page_size, pages=eng.kv_pages,
        rows=args.rows, peak_running=peak, mean_running=weighted / max(elapsed, 1e-9),
        peak_over_fixed=peak / args.fixed_slots, mean_over_fixed=weighted / max(elapsed, 1e-9) / args.fixed_slots,
        preemptions=snap["preemptions"], prefix_hit_tokens=snap["kv_pages"]["prefix_hit_tokens"],
        steps=steps, complete=f"{complete}/{args.requests}", finished=sum(r is not None for r in results),
        seconds=time.perf_counter() - t0))
    log(f"peak {peak} running, mean {weighted / max(elapsed, 1e-9):.1f}; complete {complete}/{args.requests}; "
        f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
