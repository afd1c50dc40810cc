"""The deterministic mode's cost: engine tokens/s with and without it, in one process.

    python bench/bench_deterministic.py --default [--streams 1 8 32]   # the shipped pair, bf16
    python bench/bench_deterministic.py --smoke --out /tmp/bench        # a tiny random bf16 pair, CPU

For each number of streams ``S`` (the engine's slots) and each mode (``EngineConfig.deterministic``
off, then on, on the same loaded models), ``--requests-per-slot * S`` seeded sampling requests
(temperature 0.8, top-p 0.95, top-k 50, a seed each) of ``--prompt-len`` random prompt tokens and
``--new`` new tokens (no stop tokens), all submitted at once to the engine's background thread:
tokens/s over the whole run (prefill included), and how many of the first ``--solo`` seeded
requests give the same tokens alone on the same engine (the mode's guarantee; without it, a
difference is possible, not certain). Every shape runs once untimed first (compilation); the
ratio is deterministic tokens/s over plain tokens/s at the same ``S``.

``--default`` runs on the device's own kernels (an NVIDIA GPU: the mode needs the Triton
kernels); ``--smoke`` runs them in interpret mode on the CPU (``impl="pallas"``: slow, a
pipeline check). Writes ``deterministic_<device>_<date>.{json,md}`` to ``--out`` (default
bench/results) with the device, date and command. What the figures say: docs/serving.md,
"Deterministic mode".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import Report, log
from ddtree_jax.serving import Engine

if "--smoke" in sys.argv:  # the CPU (set before JAX starts a backend)
    jax.config.update("jax_platforms", "cpu")


def _models(args):
    if args.default:
        pair = os.path.join(os.path.dirname(dt.__file__), "default_pair")
        target = dt.load_target(os.path.join(pair, "target"))
        return target, dt.load_drafter(os.path.join(pair, "drafter"), target)
    execution = dt.ExecutionConfig(impl="pallas")
    cfg = dt.KimiConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                        max_position_embeddings=256)
    target = dt.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, execution=execution)
    dcfg = dt.DFlashConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_target_layers=1, block_size=5,
                           mask_token_id=127, target_layer_ids=(0,), layer_types=("full_attention",),
                           vocab_size=128)
    return target, dt.DFlashDrafter(dcfg, rngs=nnx.Rngs(1), dtype=jnp.bfloat16, execution=execution)


def _run(eng: Engine, prompts, params, new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    handles = [eng.submit(p, s, max_tokens=new, ignore_eos=True) for p, s in zip(prompts, params, strict=True)]
    tokens = [h.result(timeout=3600).tokens for h in handles]
    return time.perf_counter() - t0, tokens


def run_case(target, drafter, streams: int, deterministic: bool, args) -> dict:
    config = dt.EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=args.budget), slots=streams,
                             max_model_len=args.prompt_len + args.new + 1, deterministic=deterministic)
    eng = Engine(target, drafter, config).start()
    try:
        n = args.requests_per_slot * streams
        rng = np.random.default_rng(streams)
        prompts = rng.integers(1, target.config.vocab_size - 1, size=(n, args.prompt_len)).tolist()
        params = [dt.SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1000 + i) for i in range(n)]
        _run(eng, prompts, params, args.new)  # compilation
        seconds, tokens = _run(eng, prompts, params, args.new)
        solo = min(args.solo, n) if streams > 1 else 0
        same = sum(_run(eng, [prompts[i]], [params[i]], args.new)[1][0] == tokens[i] for i in range(solo))
    finally:
        eng.stop()
    total = sum(len(t) for t in tokens)
    return dict(streams=streams, deterministic="on" if deterministic else "off", requests=n, tokens=total,
                seconds=round(seconds, 3), tokens_per_s=total / seconds,
                same_as_solo=f"{same} of {solo}" if solo else "-")


def main(argv=None) -> Report:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the shipped pair (ddtree_jax/default_pair)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random bf16 pair on the CPU (interpret mode)")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="default: 1 8 32 (smoke: 1 2)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--new", type=int, default=None, help="new tokens per request (default 128; smoke 8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 64 (smoke 8)")
    ap.add_argument("--requests-per-slot", type=int, default=None, help="default 4 (smoke 2)")
    ap.add_argument("--solo", type=int, default=4, help="seeded requests run again alone (per case)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "bench", "results"))
    args = ap.parse_args(argv)
    if args.default == args.smoke:
        ap.error("pass --default (the shipped pair) or --smoke")
    smoke = args.smoke
    args.streams = args.streams or ([1, 2] if smoke else [1, 8, 32])
    args.new = args.new or (8 if smoke else 128)
    args.prompt_len = args.prompt_len or (8 if smoke else 64)
    args.requests_per_slot = args.requests_per_slot or (2 if smoke else 4)
    if smoke:
        args.budget = min(args.budget, 4)
    report = Report(args, name="deterministic", title="Deterministic mode: engine tokens/s, off vs on",
                    sections=("runs", "ratio"))
    report.notes.append(f"ddtree budget {args.budget}, {args.requests_per_slot} requests per stream, prompts of "
                        f"{args.prompt_len} tokens, {args.new} new tokens, seeded sampling (T 0.8, top-p 0.95, "
                        "top-k 50)")
    target, drafter = _models(args)
    for streams in args.streams:
        rates = {}
        for deterministic in (False, True):
            log(f"streams {streams}, deterministic {'on' if deterministic else 'off'} ...")
            row = run_case(target, drafter, streams, deterministic, args)
            log(f"  {row['tokens_per_s']:.1f} tokens/s, same as solo: {row['same_as_solo']}")
            report.add("runs", row)
            rates[deterministic] = row["tokens_per_s"]
        report.add("ratio", dict(streams=streams, off_tokens_per_s=rates[False], on_tokens_per_s=rates[True],
                                 on_over_off=rates[True] / rates[False]))
    log(f"wrote {report.stem}.md")
    return report


if __name__ == "__main__":
    main()
