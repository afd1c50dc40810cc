"""Batch invariance on the GPU: does greedy DDTree give greedy autoregressive decoding's tokens?

The decode step is the round with a root-only tree (a verify of one token per row). If every
computation on the target's path gives a row the same bits whatever the number of rows and tokens
in the call, greedy DDTree commits exactly greedy AR's tokens. This script measures how close the
project gets, on a Kimi K2-shaped slice with random bf16 weights (``--layers`` layers, 1 dense then
MoE, 384 experts, the ``kimi_k2`` preset, made by ``dt.init_on_mesh``):

* ``agreement``: for each of ``--impls`` (``auto``: the Pallas kernels on the GPU; ``reference``:
  ``ragged_dot`` and the dense attention) and each of ``--batches``: greedy AR for ``--new``
  tokens, then greedy DDTree (budget ``--budget``) with each of ``--drafters``: ``oracle``
  proposes AR's own continuation (``ddtree_jax.testing.ContinuationOracleDrafter``: the tree's
  best path is AR's tokens in consecutive node slots, so every round verifies a long block and
  any disagreement is the target's own verify differing from its decode steps) and ``random``
  (a random one-layer DFlash drafter: about one token per round, the commit is always a verify
  block's root). Reports per row the tokens before the first difference (of ``--new``) and in
  total equal positions, and the mean acceptance length.
* ``components``: where the bits differ, one computation at a time at K2 shapes (bf16): the
  attention kernel (a decode step at position p against the same row in a 16-token chain verify
  over the same cache, B=1 vs B=8; with the model's fixed 512-key segments and with the older
  shape-dependent split), the dense attention reference, the MoE kernel (a row alone against the
  same row among 65 and 2,056 tokens; ``choose_blocks`` blocks and pinned blocks), ``ragged_dot``,
  and XLA's dense matmul (a projection's rows at M = 1, 16, 2,056). Bitwise equal or the largest
  difference.

    PYTHONUNBUFFERED=1 python bench/bench_batch_invariance.py                  # H200, ~6 minutes
    python bench/bench_batch_invariance.py --smoke --out /tmp/bench            # CPU, tiny, interpret

Writes ``batch_invariance_<device>_<date>.{json,md}`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import Report, k2_slice, log, past_deadline
from ddtree_jax.backend import resolve_backend
from ddtree_jax.models._layers import Linear, dense_product
from ddtree_jax.models.latent_attention import latent_attention
from ddtree_jax.models.moe import experts_ragged_dot, route_tokens, routed_experts
from ddtree_jax.models.tree_cache import BlockMask, causal_block_mask
from ddtree_jax.testing import ContinuationOracleDrafter
from pallas_kernels.triton.moe_grouped_matmul import MoEBlocks

if "--smoke" in sys.argv:  # the CPU (set before JAX starts a backend)
    jax.config.update("jax_platforms", "cpu")


def target_config(args) -> dt.KimiConfig:
    return k2_slice(args.layers, args.experts, smoke=args.smoke, num_attention_heads=16, qk_rope_head_dim=16)


def random_drafter(tcfg: dt.KimiConfig, dtype) -> dt.DFlashDrafter:
    heads = max(4, tcfg.hidden_size // 256)
    cfg = dt.DFlashConfig(
        hidden_size=tcfg.hidden_size, intermediate_size=2 * tcfg.hidden_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=tcfg.hidden_size // heads,
        num_target_layers=tcfg.num_hidden_layers, block_size=16, mask_token_id=tcfg.vocab_size - 1,
        target_layer_ids=dt.default_target_layer_ids(tcfg.num_hidden_layers, 1), layer_types=("full_attention",),
        vocab_size=tcfg.vocab_size,
    )
    return dt.init_on_mesh(lambda: dt.DFlashDrafter(cfg, rngs=nnx.Rngs(1), dtype=dtype))


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per row: tokens before the first difference, and equal positions in total."""
    prefix, same = [], []
    for g, w in zip(got, want, strict=True):
        j = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        prefix.append(j)
        same.append(sum(a == b for a, b in zip(g, w, strict=False)))
    return prefix, same


def part_agreement(args, report, target, tcfg, dtype):
    rng = np.random.default_rng(0)
    drafter = random_drafter(tcfg, dtype) if "random" in args.drafters else None
    for label in args.impls:
        # "<impl>+fixed": the target's dense products through the fixed-order kernel as well
        impl = label.removesuffix("+fixed")
        model = target.with_execution(dt.ExecutionConfig(impl=impl, batch_invariant=label.endswith("+fixed")))
        for b in args.batches:
            if past_deadline(args):
                return
            prompts = rng.integers(0, tcfg.vocab_size - 1, (b, args.prompt)).tolist()
            # An explicit cache size with room for a drafter block: generate's default (prompt + new
            # + budget + 1) gives DDTree with a DFlash drafter tokens other than AR's when the
            # budget is below the block size (seen on main, CPU, float32: a bug outside this script).
            kw = dict(max_new_tokens=args.new, impl=impl, max_len=args.prompt + args.new + max(args.budget, 16) + 16)
            try:
                ar = dt.generate(model, None, prompts, method="ar", **kw).tokens
            except Exception as e:  # noqa: BLE001 - report and go on
                log(f"  {label} B={b} AR failed: {type(e).__name__}: {str(e)[:200]}")
                report.add("agreement", dict(impl=label, B=b, drafter="-", error=f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            for name in args.drafters:
                if past_deadline(args):
                    return
                row = dict(impl=label, B=b, drafter=name, budget=args.budget, new=args.new)
                try:
                    if name == "oracle":
                        table = np.zeros((b, args.prompt + args.new + 32), np.int32)
                        for i, (p, t) in enumerate(zip(prompts, ar, strict=True)):
                            table[i, : len(p) + len(t)] = p + t
                        d = ContinuationOracleDrafter(table, block_size=16, vocab_size=tcfg.vocab_size)
                    else:
                        d = drafter
                    out = dt.generate(model, d, prompts, method="ddtree", budget=args.budget, **kw)
                    prefix, same = agreement(out.tokens, ar)
                    row.update(agree_prefix_mean=float(np.mean(prefix)), agree_prefix_min=int(min(prefix)),
                               equal_positions_mean=float(np.mean(same)),
                               rows_all_equal=sum(p == args.new for p in prefix),
                               mean_tau=float(out.mean_tau), prefixes=" ".join(map(str, prefix)))
                    log(f"  {label} B={b} {name}: agree {np.mean(prefix):.1f}/{args.new} before the first difference "
                        f"(min {min(prefix)}), tau {out.mean_tau:.2f}")
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    log(f"  {label} B={b} {name} failed: {row['error']}")
                    traceback.print_exc()
                report.add("agreement", row)


def compare(a, b) -> dict:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return dict(bitwise_equal=bool((a == b).all()), max_abs_diff=float(np.abs(a - b).max()),
                max_abs=float(np.abs(b).max()))


def part_components(args, report, target, tcfg, dtype):
    rng = np.random.default_rng(5)
    kernels = resolve_backend("auto" if jax.default_backend() == "gpu" else "pallas")
    ref = resolve_backend("reference")

    def add(name, comparison, fn):
        if past_deadline(args):
            return
        row = dict(component=name, comparison=comparison)
        try:
            row.update(fn())
            log(f"  {name} [{comparison}]: bitwise {row['bitwise_equal']}, max diff {row['max_abs_diff']:.3g}")
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            log(f"  {name} [{comparison}] failed: {row['error']}")
        report.add("components", row)

    # Attention: a chain verify of T tokens at `start` against T decode steps at start + d over the
    # same cache (a chain's nodes sit in consecutive slots, as the oracle's best path does).
    h, r, dr = tcfg.num_attention_heads, tcfg.kv_lora_rank, tcfg.qk_rope_head_dim
    S, T, start0 = (4096, 16, 3000) if not args.smoke else (96, 5, 60)
    scale = tcfg.softmax_scale()

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    B = 8
    ql, qr, lat, kr = arr(B, T, h, r), arr(B, T, h, dr), arr(B, S, r), arr(B, S, dr)
    start = jnp.full((B,), start0, jnp.int32)

    def attention_case(backend, segment_keys):
        def run():
            f = jax.jit(lambda *a: latent_attention(*a[:4], BlockMask(a[4], a[5]), scale=scale, backend=backend,
                                                    segment_keys=segment_keys))
            verify = f(ql, qr, lat, kr, start, causal_block_mask(B, T))
            step = jax.jit(lambda *a: latent_attention(*a[:4], BlockMask(a[4]), scale=scale, backend=backend,
                                                       segment_keys=segment_keys))
            one = jnp.stack([step(ql[:1, d:d + 1], qr[:1, d:d + 1], lat[:1], kr[:1], start[:1] + d)[0, 0]
                             for d in range(T)])
            return compare(one, verify[0])
        return run

    seg = 512 if not args.smoke else 32
    add(f"attention kernel, {seg}-key segments", f"decode step B=1 vs chain verify T={T} B={B}",
        attention_case(kernels, seg))
    add("attention kernel, shape-dependent split", f"decode step B=1 vs chain verify T={T} B={B}",
        attention_case(kernels, 0))
    add("attention reference (dense, bf16)", f"decode step B=1 vs chain verify T={T} B={B}", attention_case(ref, 0))

    # MoE routed experts with the first MoE layer's weights: row 0 alone vs among n tokens. The
    # weights go in as arguments: captured by the closures they would be 34 GB of constants.
    layer = next(lyr for lyr in target.model.layers if hasattr(lyr.mlp, "experts"))
    gu, dn = layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...]
    big = 2056 if not args.smoke else 200
    x = arr(big, tcfg.hidden_size)
    w, ids = jax.jit(layer.mlp.gate)(x)
    pinned = MoEBlocks(block_m=16) if not args.smoke else MoEBlocks(block_m=16, block_k=64)

    def moe_case(n, blocks, backend=kernels):
        def run():
            f = jax.jit(lambda x, w, i, gu, dn: routed_experts(x, gu, dn, w, i, backend=backend, blocks=blocks))
            return compare(f(x[:1], w[:1], ids[:1], gu, dn)[0], f(x[:n], w[:n], ids[:n], gu, dn)[0])
        return run

    for n in (65, big):
        add("MoE kernel, choose_blocks", f"row alone vs among {n} tokens", moe_case(n, None))
        add("MoE kernel, pinned blocks (block_m 16)", f"row alone vs among {n} tokens", moe_case(n, pinned))

    def ragged(n):
        def run():
            f = jax.jit(lambda x, w, i, gu, dn: experts_ragged_dot(x, gu, dn, route_tokens(w, i, gu.shape[0])))
            return compare(f(x[:1], w[:1], ids[:1], gu, dn)[0], f(x[:n], w[:n], ids[:n], gu, dn)[0])
        return run

    add("MoE ragged_dot (XLA)", "row alone vs among 65 tokens", ragged(65))

    # XLA's dense matmuls and the row-wise ops around them, every shape the target runs: each
    # Linear of the first dense and the first MoE layer, the absorbed attention's per-head
    # products, the router's float32 product, an RMSNorm and the LM head (float32 accumulation).
    # Row 0 alone against the same row among 16 and 65 rows (a budget-15 / budget-64 verify at
    # B=1); q_a_proj also among `big` rows.
    dense = next(lyr for lyr in target.model.layers if not hasattr(lyr.mlp, "experts"))
    linears = {}
    for tag, lyr in (("dense layer", dense), ("MoE layer", layer)):
        for path, mod in nnx.iter_graph(lyr):
            if isinstance(mod, Linear):
                linears[f"{tag} {'.'.join(map(str, path))}"] = mod.kernel[...]

    def rows_case(fn, operand, m, width=None):
        """``fn(rows, operand)`` on row 0 alone and among ``m`` rows of ``width`` (default: the
        operand's first dim), the operand as an argument."""
        def run():
            rows = arr(m, width or operand.shape[0])
            f = jax.jit(fn)
            return compare(f(rows[:1], operand)[0], f(rows, operand)[0])
        return run

    def einsum_case(spec, shape, w):
        """XLA's einsum, or (``spec`` None) the batch-invariant mode's product with the heads as
        groups (``w [heads, K, N]``)."""
        def run():
            x = arr(*shape)
            f = jax.jit((lambda x, w: jnp.einsum(spec, x, w)) if spec else (lambda x, w: dense_product(x, w, kernels)))
            return compare(f(x[:1], w)[0], f(x, w)[0])
        return run

    # The model's own functions: its product (``Linear``, the LM head's float32 accumulation, the
    # router's float32 product) and its RMSNorm module (its small weight captured; the width
    # comes from the operand).
    norm = dense.input_layernorm
    for name, kernel in linears.items():
        for m in (16, 65) + ((big,) if name.endswith("q_a_proj") else ()):
            add(f"XLA matmul {name} [{kernel.shape[0]}x{kernel.shape[1]}]", f"row alone vs among {m} rows",
                rows_case(dense_product, kernel, m))
    nh, dn = tcfg.num_attention_heads, tcfg.qk_nope_head_dim
    w_kv = layer.self_attn.kv_b_proj.kernel[...].reshape(tcfg.kv_lora_rank, nh, dn + tcfg.v_head_dim)
    w_k, w_v = w_kv[..., :dn], w_kv[..., dn:]
    for m in (16, 65):
        add("absorbed q (btnd,rnd->btnr)", f"token alone vs among {m} tokens",
            einsum_case("tnd,rnd->tnr", (m, nh, dn), w_k))
        add("absorbed out (btnr,rnd->btnd)", f"token alone vs among {m} tokens",
            einsum_case("tnr,rnd->tnd", (m, nh, tcfg.kv_lora_rank), w_v))
        if kernels.kernels:  # the batch-invariant mode's products (interpret mode off a GPU)
            add("absorbed q, fixed-order kernel", f"token alone vs among {m} tokens",
                einsum_case(None, (m, nh, dn), w_k.transpose(1, 2, 0)))
            add("absorbed out, fixed-order kernel", f"token alone vs among {m} tokens",
                einsum_case(None, (m, nh, tcfg.kv_lora_rank), w_v.transpose(1, 0, 2)))
        add("router (float32)", f"row alone vs among {m} rows",
            rows_case(lambda x, w: dense_product(x.astype(jnp.float32), w.T), layer.mlp.gate.weight[...], m,
                      width=tcfg.hidden_size))
        add("RMSNorm (hidden)", f"row alone vs among {m} rows",
            rows_case(lambda x, _: norm(x), norm.weight[...], m))
        add("LM head (float32 accumulation)", f"row alone vs among {m} rows",
            rows_case(functools.partial(dense_product, out_dtype=jnp.float32), target.lm_head.kernel[...], m))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    ap.add_argument("--parts", nargs="+", default=["components", "agreement"], choices=("components", "agreement"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--drafters", nargs="+", default=["oracle", "random"], choices=("oracle", "random"))
    ap.add_argument("--impls", nargs="+", default=None,
                    help="default: auto+fixed auto reference (smoke: pallas+fixed pallas reference); +fixed: the "
                         "target's dense products through the fixed-order kernel (ExecutionConfig.batch_invariant)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds; later configurations are skipped (default 500 on a GPU, none on a CPU)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.batches, args.prompt, args.new, args.budget = 2, [1, 2], 8, 8, 6
    if args.deadline is None:
        args.deadline = 500.0 if jax.default_backend() == "gpu" else 0.0
    args.impls = args.impls or (["pallas+fixed", "pallas", "reference"] if args.smoke else
                                ["auto+fixed", "auto", "reference"])
    dtype = jnp.bfloat16
    tcfg = target_config(args)
    report = Report(args, name="batch_invariance", title="Batch invariance: greedy DDTree vs greedy AR",
                    sections=("components", "agreement"))
    log(f"{report.meta['device']} ({jax.default_backend()}), jax {jax.__version__}; "
        f"{tcfg.num_hidden_layers} layers, {tcfg.n_routed_experts} experts, bf16")
    target = dt.init_on_mesh(lambda: dt.KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=dtype, impl="reference"))
    if "components" in args.parts:
        part_components(args, report, target, tcfg, dtype)
    if "agreement" in args.parts:
        part_agreement(args, report, target, tcfg, dtype)
    report.write()
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
