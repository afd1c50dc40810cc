"""End-to-end decoding speed: autoregressive vs linear DFlash vs DDTree, in one run.

    PYTHONUNBUFFERED=1 python bench/bench_generate.py [--batch 4 --new 64 --budgets 32 128]
    python bench/bench_generate.py --smoke --out /tmp/bench      # tiny CPU check

Target: a Kimi-style slice (MLA + sigmoid-routed MoE, vocabulary 163840, bf16, random weights;
``--hidden/--layers/--experts`` set its size). Two drafters:
  * a random DFlash drafter (real drafter compute; it does not agree with the target, tau ~ 1),
  * the bigram oracle (``ddtree_jax.testing``): the target with zeroed attention/MLP outputs
    (same compute) and a drafter that proposes its exact greedy continuation (tau = block size):
    the upper bound that shows what verification costs.
Until the project's trained pair ships, these two bracket real acceptance.

Each configuration is compiled by a warm-up call first; the timed call excludes compilation.
Greedy decoding throughout, so every method must give identical tokens (checked, also against
``impl="reference"``). Writes generate_<device>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from ddtree_jax.testing import BigramOracleDrafter, make_bigram


def kimi_slice(args) -> dt.KimiConfig:
    return dt.KimiConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        q_lora_rank=args.hidden // 2,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=args.experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        max_position_embeddings=4096,
        model_type="kimi_k2",
    )


def drafter_config(tcfg: dt.KimiConfig) -> dt.DFlashConfig:
    return dt.DFlashConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=2 * tcfg.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_target_layers=tcfg.num_hidden_layers,
        block_size=16,
        mask_token_id=tcfg.vocab_size - 1,
        target_layer_ids=dt.default_target_layer_ids(tcfg.num_hidden_layers, 1),
        layer_types=("full_attention",),
        vocab_size=tcfg.vocab_size,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default: bf16 on GPU, f32 on CPU")
    ap.add_argument(
        "--check-only", action="store_true", help="random drafter, AR vs DDTree only: the greedy-equality check"
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.prompt, args.new, args.budgets = 2, 8, 8, [8]
        args.hidden, args.layers, args.experts, args.vocab = 256, 2, 8, 1024
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")  # no TF32: true float32 products
    dtype = {
        "bfloat16": jnp.bfloat16,
        "float32": jnp.float32,
        None: jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32,
    }[args.dtype]
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(
        f"[bench_generate] {device}, jax {jax.__version__}, B={args.batch}, prompt={args.prompt}, new={args.new}",
        flush=True,
    )

    tcfg = kimi_slice(args)
    target = dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype)
    drafter = dt.DFlashDrafter(drafter_config(tcfg), rngs=nnx.Rngs(1), dtype=dtype)
    oracle_target = make_bigram(dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype))
    oracle = BigramOracleDrafter(block_size=16)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, tcfg.vocab_size - 1, size=(args.batch, args.prompt)).tolist()
    max_len = args.prompt + args.new + max(args.budgets + [15]) + 1

    runs = [("random drafter", target, drafter), ("bigram oracle", oracle_target, oracle)]
    methods = [("ar", 0), ("dflash", 15)] + [("ddtree", b) for b in args.budgets]
    if args.check_only:
        runs, methods = runs[:1], [("ar", 0), ("ddtree", args.budgets[0])]
    rows, tokens_by_pair = [], {}
    for pair, tgt, drf in runs:
        for method, budget in methods:
            kw = dict(method=method, budget=max(budget, 1), max_new_tokens=args.new, max_len=max_len)
            t0 = time.perf_counter()
            dt.generate(tgt, drf, prompts, **kw)  # compile
            compile_s = time.perf_counter() - t0
            out = dt.generate(tgt, drf, prompts, **kw)
            n = out.new_tokens
            row = dict(
                pair=pair,
                method=method,
                budget=out.budget,
                tokens=n,
                seconds=out.seconds,
                tok_per_s=n / out.seconds,
                tau=out.mean_tau,
                rounds=out.rounds,
                ms_per_round=1e3 * out.seconds / out.rounds,
                compile_s=compile_s,
            )
            rows.append(row)
            tokens_by_pair.setdefault(pair, {})[(method, budget)] = out.tokens
            print(
                f"[bench_generate] {pair:15s} {method:6s} budget {out.budget:4d}: {row['tok_per_s']:9.1f} tok/s, "
                f"tau {row['tau']:.2f}, {row['ms_per_round']:.2f} ms/round (compile {compile_s:.0f}s)",
                flush=True,
            )

    def agreeing_prefix(tokens, ref):
        """Shortest common prefix (over requests) with the AR tokens: len(ref[0]) if identical."""
        return min(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
            for a, b in zip(tokens, ref, strict=False)
        )

    checks = {}
    for pair, toks in tokens_by_pair.items():
        for (method, budget), t in toks.items():
            if method != "ar":
                checks[f"{pair} {method} {budget}"] = agreeing_prefix(t, toks[("ar", 0)])
    split = None
    if not args.check_only:
        ref = dt.generate(
            target,
            drafter,
            prompts,
            method="ddtree",
            budget=args.budgets[0],
            max_new_tokens=args.new,
            max_len=max_len,
            impl="reference",
        )
        checks["random drafter ddtree impl=reference"] = agreeing_prefix(
            ref.tokens, tokens_by_pair["random drafter"][("ar", 0)]
        )
        for _ in range(2):  # the second call runs compiled
            prof = dt.generate(
                oracle_target,
                oracle,
                prompts,
                method="ddtree",
                budget=args.budgets[0],
                max_new_tokens=args.new,
                max_len=max_len,
                profile=True,
            )
        split = {k: 1e3 * v / prof.rounds for k, v in prof.time_split.items()}
        print(f"[bench_generate] time split per round (ms, oracle, ddtree {args.budgets[0]}): {split}", flush=True)
    print(f"[bench_generate] tokens agreeing with greedy AR (of {args.new}, min over requests): {checks}", flush=True)

    now = datetime.datetime.now(datetime.UTC)
    ar = {r["pair"]: r["tok_per_s"] for r in rows if r["method"] == "ar"}
    for r in rows:
        r["speedup_vs_ar"] = r["tok_per_s"] / ar[r["pair"]]
    result = dict(
        bench="generate",
        device=device,
        host=platform.node(),
        date=now.isoformat(timespec="seconds"),
        command="python " + " ".join(sys.argv),
        jax=jax.__version__,
        config=vars(args),
        rows=rows,
        greedy_checks=checks,
        time_split_ms_per_round=split,
    )
    os.makedirs(args.out, exist_ok=True)
    kind = (
        "smoke" if args.smoke else jax.default_backend() + ("_check_" + np.dtype(dtype).name if args.check_only else "")
    )
    stem = os.path.join(args.out, f"generate_{kind}_{now.strftime('%Y%m%d')}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    md = [
        f"# End-to-end decoding ({now.date()}, {device})",
        "",
        f"`{result['command']}`, jax {jax.__version__}. Target: Kimi-style slice hidden {args.hidden}, "
        f"{args.layers} layers, "
        f"{args.experts} experts (top-8 + 1 shared), vocab {args.vocab}, {np.dtype(dtype).name}, random weights. "
        f"B={args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy.",
        "",
        "| drafter | method | budget | tok/s | speedup vs AR | tau | ms/round |",
        "|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['pair']} | {r['method']} | {r['budget']} | {r['tok_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x "
        f"| {r['tau']:.2f} | {r['ms_per_round']:.2f} |"
        for r in rows
    ]
    md += ["", f"Leading tokens identical to greedy AR (of {args.new}; min over the batch): {checks}."]
    if split:
        md += [
            "",
            f"Time split per round, bigram oracle, DDTree budget {args.budgets[0]}, stages timed separately (ms): "
            + ", ".join(f"{k} {v:.2f}" for k, v in split.items()),
        ]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
