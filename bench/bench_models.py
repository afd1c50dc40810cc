"""Kimi-style target on one GPU: prefill and tree-verify throughput and MoE layer time, grouped
matmuls (``jax.lax.ragged_dot``) against dense per-expert matmuls, in one run.

Reduced Kimi K2 shape: real hidden 7168, MLA ranks and head dims, expert shape 7168 x 2048, top-8
routing with a shared expert, vocabulary 163840, bf16 weights; 2 layers (1 dense + 1 MoE) and 64
routed experts by default so that it fits one GPU. Random weights (timing only). Expert variants:
``ragged_dot`` with the default lowering, on GPU also with jax's Pallas Triton grouped-matmul
lowering (``jax_ragged_dot_use_gpu_pallas_triton_lowering``), and dense per-expert matmuls (every
expert on every token, ``Experts.reference``). Prefill includes the LM head on every position.

    PYTHONUNBUFFERED=1 python bench/bench_models.py                 # H200
    python bench/bench_models.py --smoke --out /tmp/bench           # tiny config, CPU check

Writes ``models_<device>_<date>.json`` and ``.md`` to ``--out`` (default bench/results).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ddtree_jax.models import KimiConfig, KimiForCausalLM, YarnScaling  # noqa: E402

FULL = dict(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    max_position_embeddings=131072,
    model_type="kimi_k2",
    rope_scaling=YarnScaling(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
)
SMOKE = dict(
    FULL,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def time_it(fn, *args, iters: int, repeats: int = 3) -> float:
    """Median seconds per call after one warm-up (compilation) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def chain_of_branches(rng, batch: int, size: int):
    """Random trees (parents before children): ``(depths [B,T], ancestor_mask [B,T,T])``."""
    depths = np.zeros((batch, size), np.int32)
    mask = np.zeros((batch, size, size), bool)
    for b in range(batch):
        parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, size)]
        for i in range(size):
            mask[b, i, i] = True
            if i:
                depths[b, i] = depths[b, parents[i]] + 1
                mask[b, i] |= mask[b, parents[i]]
    return jnp.asarray(depths), jnp.asarray(mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config, few iterations (CPU check)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048, help="prefill tokens per row")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256], help="tree nodes (excl. root)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    if args.smoke:
        args.prompt, args.budgets, args.iters, args.batch = 32, [8], 2, 2
    cfg = KimiConfig(**(SMOKE if args.smoke else dict(FULL, n_routed_experts=args.experts)))
    dev = jax.devices()[0]
    meta = dict(
        device=getattr(dev, "device_kind", str(dev)),
        platform=dev.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        config={k: v for k, v in dataclasses.asdict(cfg).items() if k != "rope_scaling"},
        batch=args.batch,
        prompt=args.prompt,
        iters=args.iters,
    )
    log(f"device {meta['device']}, jax {jax.__version__}; building the model (bf16, {cfg.n_routed_experts} experts)")
    model = nnx.jit(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))()
    n_params = sum(int(np.prod(v.shape)) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    log(f"{n_params / 1e6:,.1f}M parameters")
    rng = np.random.default_rng(0)
    b, t = args.batch, args.prompt
    max_len = t + max(args.budgets) + 1
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)))
    lengths = jnp.full((b,), t, jnp.int32)
    results = []
    variants = [("ragged_dot", False, False), ("dense per-expert", True, False)]
    if dev.platform == "gpu" and hasattr(jax.config, "jax_ragged_dot_use_gpu_pallas_triton_lowering"):
        variants.append(("ragged_dot (Pallas Triton lowering)", False, True))

    def run_variant(name, dense, pallas):
        if dev.platform == "gpu" and hasattr(jax.config, "jax_ragged_dot_use_gpu_pallas_triton_lowering"):
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", pallas)  # part of the jit key

        @nnx.jit
        def prefill(m, ids, lengths):
            logits, _, cache = m.prefill(ids, lengths, m.init_cache(ids.shape[0], max_len), dense_experts=dense)
            return logits[:, -1], cache

        log(f"prefill [{name}] B={b} T={t}")
        sec = time_it(prefill, model, ids, lengths, iters=args.iters)
        results.append(dict(kind="prefill", experts=name, tokens=b * t, ms=sec * 1e3, tokens_per_s=b * t / sec))
        log(f"  {sec * 1e3:.2f} ms, {b * t / sec:,.0f} tokens/s")
        _, cache = prefill(model, ids, lengths)

        @nnx.jit
        def verify(m, tokens, depths, mask, cache):
            return m.verify(tokens, depths, mask, cache, dense_experts=dense)[0]

        for budget in args.budgets:
            nodes = budget + 1
            depths, mask = chain_of_branches(rng, b, nodes)
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, nodes)))
            log(f"verify [{name}] B={b} nodes={nodes} prefix={t}")
            sec = time_it(verify, model, tokens, depths, mask, cache, iters=args.iters)
            results.append(
                dict(
                    kind="verify",
                    experts=name,
                    budget=budget,
                    tokens=b * nodes,
                    ms=sec * 1e3,
                    tokens_per_s=b * nodes / sec,
                )
            )
            log(f"  {sec * 1e3:.2f} ms, {b * nodes / sec:,.0f} tokens/s")

        moe = model.model.layers[cfg.first_k_dense_replace].mlp
        moe_call = nnx.jit(lambda layer, x: layer(x, backend=model.backend, dense_experts=dense))
        for n in sorted({b * (max(args.budgets) + 1), b * t}):
            x = jnp.asarray(rng.normal(size=(1, n, cfg.hidden_size)), jnp.bfloat16)
            log(f"MoE layer [{name}] tokens={n}")
            sec = time_it(moe_call, moe, x, iters=args.iters)
            results.append(dict(kind="moe_layer", experts=name, tokens=n, ms=sec * 1e3, tokens_per_s=n / sec))
            log(f"  {sec * 1e3:.3f} ms")

    for name, dense, pallas in variants:
        try:
            run_variant(name, dense, pallas)
        except Exception as e:  # an optional lowering may be missing from this jax build: say so, go on
            if not pallas:
                raise
            log(f"  [{name}] not available here: {type(e).__name__}: {str(e).splitlines()[0]}")
            results[:] = [r for r in results if r["experts"] != name]
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", False)

    os.makedirs(args.out, exist_ok=True)
    stem = f"models_{'smoke_' if args.smoke else ''}{dev.platform}_{datetime.date.today():%Y%m%d}"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    lines = [
        f"# Kimi-style target benchmark ({meta['date']}, {meta['device']})",
        "",
        f"`{meta['command']}`, jax {meta['jax']}; hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
        f"({cfg.first_k_dense_replace} dense), {cfg.n_routed_experts} experts x {cfg.moe_intermediate_size}, "
        f"top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}, bf16; B={b}, prompt {t}; median of 3 x "
        f"{args.iters} calls.",
        "",
        "| pass | experts | tokens | ms | tokens/s | time / ragged_dot time |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        base = next(
            o for o in results if o["kind"] == r["kind"] and o["tokens"] == r["tokens"] and o["experts"] == "ragged_dot"
        )
        ratio = f"{r['ms'] / base['ms']:.2f}x" if r is not base else ""
        label = r["kind"] + (f" (budget {r['budget']})" if "budget" in r else "")
        lines.append(
            f"| {label} | {r['experts']} | {r['tokens']} | {r['ms']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} |"
        )
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {os.path.join(args.out, stem)}.json/.md")


if __name__ == "__main__":
    main()
