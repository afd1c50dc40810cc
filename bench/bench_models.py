"""The Kimi K2-shaped target on one GPU, in one run: decode step, tree verify, prefill and attention
against their floors, the Pallas kernels beside the older plain-JAX paths, and INT4 routed experts.

Model: ``dt.KimiConfig.kimi_k2`` shapes (hidden 7168, MLA q_lora 1536 / kv_lora 512 / 64 heads,
384 routed experts x 2048, top-8 + 1 shared, vocabulary 163,840), bf16, random weights made by
``dt.init_on_mesh``; ``--layers`` layers (default 2: 1 dense + 1 MoE, about 40 GB; the floors
are those of the slice that runs, so a ratio carries over to more layers).

Parts (``--parts``, in this order; each variant of each case in its own try/except: a failure,
out of memory say, is reported and the run goes on):

* ``passes``: after a prefill of ``--prompt`` tokens per row, at each of ``--batches`` rows: the
  decode step (a verify of the root alone: what autoregressive decoding runs) and tree verifies of
  ``--budgets`` non-root nodes (random trees), logits included. Floor: the weight bytes the pass
  must read (every dense weight, the embedding rows it gathers, the routed experts a uniform
  routing of its tokens is expected to touch: ``bench._common.weight_read_bytes``) at the copy
  bandwidth measured in the same run.
* ``prefill``: one row of each of ``--prefill`` tokens into an empty cache, returning the cache
  and every layer's output (the LM head is not computed; without the outputs XLA would drop the
  last layer's MoE, which no cache needs). Floor: the larger of the weight-read
  time and the FLOPs (2 x tokens x active weights, without the LM head; causal MLA attention in
  the absorbed form: T(T+1)/2 x 2H(2r+dr) per layer) at the bf16 matmul rate measured in the run.
* ``round``: the compiled DDTree round (``generate``, kernels, a random one-layer DFlash
  drafter: about one token per round) at ``--batches`` rows and ``--round-budgets``, its stages
  timed apart (``profile=True``), and its overhead: the compiled round less the drafter's and the
  target's passes (tree, sampling, walk, commit and whatever glue the round adds).
* ``int4``: the ``passes`` cases at ``--int4-budgets`` (default 15 and 64) with the routed experts
  in INT4 (compressed-tensors ``pack-quantized``, group 32, symmetric: Kimi K2 Thinking's scheme;
  ``experts_int4``), the W4A16 kernel (``impl="auto"``). Floor: the same weight-read floor, now
  counting the routed experts' packed words and bf16 scales (what the INT4 model holds; the note
  gives the bytes). Beside it the bf16-expert figures of the ``kernels`` variant: taken from the
  ``passes`` rows of this run, or timed here when that part or variant did not run.
* ``attention``: one layer's MLA attention alone (``latent_attention``, the model's dispatch) at
  contexts ``--contexts`` (committed prefix before the block) for a decode step and verify blocks,
  B = 1 and 16. Floor: the larger of the cache-read time (latent + rope key up to the row's
  length, bf16) and the FLOP time. Variants: the kernel with the model's fixed 512-key segments in
  groups of 4 (batch-invariant), the kernel with the older shape-dependent split, the dense reference (reads
  the whole ``max_len`` cache).

Variants of the model passes: ``kernels`` (the Pallas MoE grouped matmul and MLA attention;
``impl="auto"``), ``ragged_dot`` (``impl="reference"``: ``jax.lax.ragged_dot`` experts and the
dense attention reference) and ``dense`` (``impl="reference"`` with every expert run densely).
Each configuration is compiled by a warm-up call; times exclude compilation (median of 3 repeats).

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/bench_models.py  # H200, ~7 min
    python bench/bench_models.py --smoke --out /tmp/bench                                # CPU, tiny

Writes ``models_<device>_<date>.{json,md}`` to ``--out`` (default bench/results) after every row.
``--deadline`` (seconds, default 450 on a GPU) skips what would start after it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from bench._common import (
    Report,
    copy_bandwidth,
    k2_slice,
    log,
    matmul_rate,
    one_layer_drafter_config,
    past_deadline,
    prefill_every_layer,
    random_tree,
    time_call,
    weight_read_bytes,
)
from ddtree_jax.backend import resolve_backend
from ddtree_jax.compiled import CompiledFn
from ddtree_jax.models.latent_attention import (
    SEGMENT_GROUP,
    SEGMENT_KEYS,
    cache_slots,
    hopper_runs,
    latent_attention,
)
from ddtree_jax.models.tree_cache import BlockMask, tree_block_mask

if "--smoke" in sys.argv:  # the CPU (set before JAX starts a backend)
    jax.config.update("jax_platforms", "cpu")

VARIANTS = ("kernels", "ragged_dot", "dense")
PARTS = ("passes", "round", "prefill", "int4", "attention")
INT4 = dt.Int4Format(group_size=32, symmetric=True)  # Kimi K2 Thinking's routed experts


def target_config(args) -> dt.KimiConfig:
    return k2_slice(args.layers, args.experts, smoke=args.smoke)


def impl_of(variant: str, smoke: bool) -> str:
    if variant == "kernels":
        return "pallas" if smoke else "auto"
    return "reference"


def active_weights(model, cfg) -> tuple[float, float]:
    """(weights a prefill token multiplies: every dense weight but the embedding and the LM head,
    k of E routed experts; the bytes of the same weights read once) -- for the prefill floor."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    params = nbytes = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if "embed_tokens" in path or "lm_head" in path:
            continue
        n = float(np.prod(var.shape))
        is_expert = "experts" in path and "shared_experts" not in path
        params += n * (k / e if is_expert else 1.0)
        nbytes += n * var[...].dtype.itemsize
    return params, nbytes


def attention_flops(cfg, b: int, t: int, context: int, causal_block: bool, per_head: bool = False) -> float:
    """MLA attention FLOPs of one layer per (query, visible key): ``2H(2r+dr)`` in the absorbed
    form, ``2H(dn+dr+dv)`` in the per-head form (its up-projection of the keys and values,
    ``2 t r H (dn+dv)``, added)."""
    h = cfg.num_attention_heads
    if per_head:
        per = 2 * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        up = 2 * t * cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return b * (per * (t * (t + 1) / 2) + up)
    per = 2 * h * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    keys = t * context + (t * (t + 1) / 2 if causal_block else t)  # a tree node sees at least itself
    return b * per * keys


def variant_call(fn, args, row, floor_s, report, section):
    try:
        sec = time_call(fn, *args, target_s=0.3)
        row.update(ms=sec * 1e3, floor_ms=floor_s * 1e3, x_floor=sec / floor_s)
        log(f"  {row.get('pass', row.get('case'))} B={row['B']} [{row['variant']}]: {sec * 1e3:.3f} ms, "
            f"floor {floor_s * 1e3:.3f} ms ({sec / floor_s:.2f}x)")
    except Exception as e:  # noqa: BLE001 - out of memory or a lowering problem: report, go on
        msg = str(e).splitlines()[0] if str(e) else ""
        row["error"] = ("OOM: " if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower() else "") + \
            f"{type(e).__name__}: {msg[:140]}"
        log(f"  {row.get('pass', row.get('case'))} B={row['B']} [{row['variant']}] failed: {row['error']}")
    report.add(section, row)
    gc.collect()


def time_passes(args, report, model, cfg, bw, rate, *, budgets, variants, section, extra=None):
    """Decode step and tree verifies of ``budgets`` nodes at each of ``--batches`` rows after a
    prefill of ``--prompt`` tokens: one row per (case, batch, variant) into ``section``; beside the
    weight-read floor a roofline (the LM head at the larger of its read and FLOP times)."""
    rng = np.random.default_rng(3)
    max_len = args.prompt + max(budgets) + 8
    head_bytes = model.lm_head.kernel[...].nbytes
    prefill = lambda m, ids, n, c: m.prefill(ids, n, c)[2]
    verify = lambda m, tok, dep, anc, c: m.verify(tok, dep, anc, c)[0]
    verify_dense = lambda m, tok, dep, anc, c: m.verify(tok, dep, anc, c, dense_experts=True)[0]
    for b in args.batches:
        if past_deadline(args):
            return
        kernels = model.with_execution(dt.ExecutionConfig(impl=impl_of("kernels", args.smoke)))
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (b, args.prompt)), jnp.int32)
        try:
            cache = CompiledFn(prefill, reads=(kernels,))(ids, jnp.full((b,), args.prompt, jnp.int32),
                                                          kernels.init_cache(b, max_len))
        except Exception as e:  # noqa: BLE001
            log(f"  B={b} prefill failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        cases = [("decode step", 0)] + [(f"verify {budget}", budget) for budget in budgets]
        for name, budget in cases:
            depths, anc = random_tree(rng, b, budget)
            tok = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (b, budget + 1)), jnp.int32)
            tokens = b * (budget + 1)
            floor = weight_read_bytes(model, cfg, tokens, embedding="rows") / bw
            # the LM head over many tree tokens is bound by FLOPs, not reads: a roofline floor
            roofline = floor + max(0.0, 2 * tokens * cfg.hidden_size * cfg.vocab_size / rate - head_bytes / bw)
            for variant in variants:
                if past_deadline(args):
                    return
                variant_model = model.with_execution(dt.ExecutionConfig(impl=impl_of(variant, args.smoke)))
                fn = CompiledFn(verify_dense if variant == "dense" else verify, reads=(variant_model,))
                row = {"pass": name, "B": b, "tokens": tokens, "variant": variant, **(extra or {})}
                variant_call(fn, (tok, depths, anc, cache), row, floor, report, section)
                if "ms" in row:
                    row["x_roofline"] = row["ms"] / (roofline * 1e3)
        del cache
        gc.collect()


def part_passes(args, report, model, cfg, bw, rate):
    time_passes(args, report, model, cfg, bw, rate, budgets=args.budgets, variants=args.variants, section="passes")


def expert_bytes(model) -> float:
    """Bytes of the routed experts' parameters (packed words, scales and zero points for INT4)."""
    total = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if "experts" in path and "shared_experts" not in path:
            total += float(np.prod(var.shape)) * var[...].dtype.itemsize
    return total


def part_round(args, report, model, cfg, bw):
    """The compiled DDTree round against the two model passes in it.

    ``generate`` (kernels, a random one-layer DFlash drafter: about one token per round, so every
    round runs) gives the compiled round's ms; ``profile=True`` times the stages apart (draft,
    tree, verify, sample, commit; each ends in a synchronisation, which overstates short stages).
    The round's overhead is the compiled round less the drafter's and the target's passes. Its
    bound: the round less the target's verify timed back to back by ``passes`` and the drafter's
    read floor (its own weights and the shared LM head at ``bw``): the drafter takes at least that.
    """
    impl = impl_of("kernels", args.smoke)
    model = model.with_execution(dt.ExecutionConfig(impl=impl))
    dcfg = one_layer_drafter_config(cfg)
    drafter = dt.init_on_mesh(lambda: dt.DFlashDrafter(dcfg, rngs=nnx.Rngs(1), dtype=jnp.bfloat16))
    draft_floor_ms = 1e3 * (sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(drafter)))
                            + model.lm_head.kernel[...].nbytes) / bw
    rng = np.random.default_rng(6)
    verify_ms = {(r["pass"], r["B"]): r["ms"] for r in report.sections["passes"]
                 if r["variant"] == "kernels" and "ms" in r}
    for b in args.batches:
        prompts = rng.integers(0, cfg.vocab_size - 1, (b, args.prompt)).tolist()
        for budget in args.round_budgets:
            if past_deadline(args):
                return
            kw = dict(method="ddtree", budget=budget, max_new_tokens=args.round_new, impl=impl)
            row = {"B": b, "budget": budget}
            try:
                dt.generate(model, drafter, prompts, **kw)  # compiles
                out = dt.generate(model, drafter, prompts, **kw)
                for _ in range(2):  # the second call runs compiled
                    prof = dt.generate(model, drafter, prompts, profile=True, **kw)
                round_ms = 1e3 * out.seconds / out.rounds
                split = {k: 1e3 * v / prof.rounds for k, v in prof.time_split.items()}
                overhead = round_ms - split["draft"] - split["verify"]
                row.update(round_ms=round_ms, rounds=out.rounds, tau=out.mean_tau,
                           **{f"{k}_ms": v for k, v in split.items()},
                           overhead_ms=overhead, overhead_share=overhead / round_ms)
                timed = verify_ms.get((f"verify {budget}", b))
                if timed is not None:  # the verify timed back to back by ``passes``: no launch gaps
                    bound = round_ms - timed - draft_floor_ms
                    row.update(draft_floor_ms=draft_floor_ms, overhead_bound_ms=bound,
                               overhead_bound_share=bound / round_ms)
                log(f"  round B={b} budget={budget}: {round_ms:.3f} ms compiled; apart (ms): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in split.items())
                    + f"; overhead {overhead:.3f} ms ({100 * overhead / round_ms:.1f}% of the round)")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                log(f"  round B={b} budget={budget} failed: {row['error']}")
            report.add("round", row)
            report.write()
    del drafter
    gc.collect()


def part_int4(args, report, model, cfg, bw, rate):
    """The INT4-expert model's decode step and verifies; the bf16 figures beside them."""
    int4_model = dt.init_on_mesh(lambda: dt.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                            experts_int4=INT4))
    dense_bytes = expert_bytes(model) if model is not None else None
    report.notes.append(
        f"INT4 routed experts (group {INT4.group_size}, symmetric): {expert_bytes(int4_model) / 2**30:.3g} GiB "
        "(packed words + bf16 scales)" + (f" against {dense_bytes / 2**30:.3g} GiB in bf16." if dense_bytes else "."))
    time_passes(args, report, int4_model, cfg, bw, rate, budgets=args.int4_budgets, variants=("kernels",),
                section="int4", extra={"experts": "int4"})
    del int4_model
    gc.collect()
    have = {(r["pass"], r["B"]) for r in report.sections["passes"] if r["variant"] == "kernels" and "ms" in r}
    want = {(f"verify {b}" if b else "decode step", bb) for b in [0, *args.int4_budgets] for bb in args.batches}
    if model is not None and not want <= have:  # the bf16 figures were not measured by ``passes``
        time_passes(args, report, model, cfg, bw, rate, budgets=args.int4_budgets, variants=("kernels",),
                    section="int4", extra={"experts": "bf16"})


def int4_summary(report):
    """Per case: INT4 and bf16 experts (kernels) side by side, each against its own floor."""
    bf16 = {(r["pass"], r["B"]): r for r in report.sections["passes"] if r["variant"] == "kernels"}
    bf16.update({(r["pass"], r["B"]): r for r in report.sections["int4"] if r.get("experts") == "bf16"})
    lines = []
    for r in report.sections["int4"]:
        if r.get("experts") != "int4":
            continue
        line = {"pass": r["pass"], "B": r["B"], "tokens": r["tokens"]}
        ref = bf16.get((r["pass"], r["B"]), {})
        for label, row in (("int4", r), ("bf16", ref)):
            line[f"{label} floor_ms"] = row.get("floor_ms")
            line[label] = (f"{row['ms']:.3f} ms ({row['x_floor']:.2f}x)" if "ms" in row
                           else row.get("error", "not run")[:40])
        if "ms" in r and "ms" in ref:
            line["bf16 / int4"] = ref["ms"] / r["ms"]
        lines.append(line)
    report.sections["summary: int4"] = lines


def part_prefill(args, report, model, cfg, bw, rate):
    rng = np.random.default_rng(4)
    params, nbytes = active_weights(model, cfg)
    layers = cfg.num_hidden_layers
    for t in args.prefill:
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (1, t)), jnp.int32)
        for variant in args.variants:
            if past_deadline(args):
                return
            # the kernels also with the attention in the per-head form (its own flops and floor)
            per_head = variant == "kernels" and args.per_head_prefill and t >= args.per_head_prefill
            for label, min_tokens in [(variant, 0)] + ([("kernels, per-head attention", args.per_head_prefill)]
                                                       if per_head else []):
                flops = 2 * t * params + layers * attention_flops(cfg, 1, t, 0, True, per_head=min_tokens > 0)
                floor = max(flops / rate, nbytes / bw)
                execution = dt.ExecutionConfig(impl=impl_of(variant, args.smoke),
                                               per_head_prefill_min_tokens=min_tokens)
                fn = CompiledFn(prefill_every_layer, reads=(model.with_execution(execution),),
                                dense_experts=variant == "dense")
                row = {"pass": f"prefill {t}", "B": 1, "tokens": t, "variant": label, "tflop": flops / 1e12}
                variant_call(fn, (ids, jnp.full((1,), t, jnp.int32), model.init_cache(1, t)), row, floor, report,
                             "prefill")
                if "ms" in row:
                    row["matmul_rate_share"] = flops / rate / (row["ms"] / 1e3)
                    report.write()


def part_attention(args, report, cfg, bw, rate):
    rng = np.random.default_rng(5)
    h, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = cfg.softmax_scale()
    kernels = resolve_backend(impl_of("kernels", args.smoke))
    # the Hopper kernel (the default where it runs), the Triton kernel with the model's fixed segments
    # (the batch-invariant mode's) and with its shape-dependent split, XLA's dense reference
    variants = [("Hopper kernel (mosaic_gpu)", kernels, SEGMENT_KEYS, True),
                (f"Triton kernel, {SEGMENT_KEYS}-key segments x{SEGMENT_GROUP}", kernels, SEGMENT_KEYS, False),
                ("Triton kernel, shape-dependent split", kernels, 0, False),
                ("dense reference", resolve_backend("reference"), 0, False)]
    for context in args.contexts:
        for b, t in args.attention_cases:
            max_len = cache_slots(context + max(t for _, t in args.attention_cases))  # as init_cache allocates
            ql = jnp.asarray(rng.standard_normal((b, t, h, r)), jnp.bfloat16)
            qr = jnp.asarray(rng.standard_normal((b, t, h, dr)), jnp.bfloat16)
            lat = jnp.asarray(rng.standard_normal((b, max_len, r)), jnp.bfloat16)
            kr = jnp.asarray(rng.standard_normal((b, max_len, dr)), jnp.bfloat16)
            start = jnp.full((b,), context, jnp.int32)
            anc = np.zeros((b, t, t), bool)
            for row_ in range(b):
                for i in range(1, t):
                    p = rng.integers(0, i)
                    anc[row_, i] = anc[row_, p]
                    anc[row_, i, p] = True
            within = tree_block_mask(jnp.asarray(anc))
            read = b * (context + t) * (r + dr) * 2
            floor = max(read / bw, attention_flops(cfg, b, t, context, False) / rate)
            case = "decode step" if t == 1 else f"verify T={t}"
            for name, backend, seg, hopper in variants:
                if past_deadline(args):
                    return
                if hopper and not hopper_runs(backend, t, h, r, dr, jnp.bfloat16, max_len):
                    continue  # off an sm_90 GPU (or at shapes it does not take): it would be the Triton kernel
                fn = jax.jit(lambda *a, backend=backend, seg=seg, hopper=hopper: latent_attention(
                    *a[:4], BlockMask(a[4], a[5]), scale=scale, backend=backend, segment_keys=seg, hopper=hopper))
                row = {"case": case, "context": context, "B": b, "T": t, "variant": name}
                variant_call(fn, (ql, qr, lat, kr, start, within), row, floor, report, "attention")
            del ql, qr, lat, kr
            gc.collect()


def summary(report):
    """One line per case: each variant's ms and ratio to the floor side by side."""
    for section in ("passes", "prefill", "attention"):
        cases: dict[tuple, dict] = {}
        for row in report.sections[section]:
            key = tuple(row.get(k) for k in ("pass", "case", "context", "B", "T") if k in row)
            line = cases.setdefault(key, {k: row[k] for k in ("pass", "case", "context", "B", "T", "tokens")
                                          if k in row})
            line.setdefault("floor_ms", row.get("floor_ms"))
            line[row["variant"]] = (f"{row['ms']:.3f} ms ({row['x_floor']:.2f}x)" if "ms" in row
                                    else row.get("error", "")[:40])
        report.sections[f"summary: {section}"] = list(cases.values())
    int4_summary(report)
    report.write()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--budgets", type=int, nargs="+", default=[15, 64, 256])
    ap.add_argument("--int4-budgets", type=int, nargs="+", default=[15, 64])
    ap.add_argument("--round-budgets", type=int, nargs="+", default=[15, 64])
    ap.add_argument("--round-new", type=int, default=32, help="new tokens per request in the round part")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--prefill", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--per-head-prefill", type=int, default=0,
                    help="also time prefills of at least this many tokens with the per-head attention form")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--deadline", type=float, default=None, help="seconds (default 450 on a GPU, none on a CPU)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    args.attention_cases = [(1, 1), (16, 1), (1, 65), (16, 16)]
    if args.smoke:
        args.batches, args.budgets, args.prompt, args.prefill, args.contexts = [1, 2], [3, 8], 16, [32], [40]
        args.int4_budgets, args.round_budgets, args.round_new = [3], [3], 4
        args.attention_cases = [(1, 1), (2, 5)]
    if args.deadline is None:
        args.deadline = 450.0 if jax.default_backend() == "gpu" else 0.0
    cfg = target_config(args)
    report = Report(args, name="models", title="Kimi K2-shaped target, one GPU",
                    sections=("passes", "round", "prefill", "int4", "attention"))
    bw, rate = copy_bandwidth(), matmul_rate()
    report.meta.update(copy_bandwidth_GBps=round(bw / 1e9, 1), bf16_matmul_TFLOPs=round(rate / 1e12, 1),
                       layers=cfg.num_hidden_layers, experts=cfg.n_routed_experts)
    log(f"{report.meta['device']} ({jax.default_backend()}), jax {jax.__version__}, copy {bw / 1e9:,.0f} GB/s, "
        f"bf16 matmul {rate / 1e12:,.0f} TFLOP/s; {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts")
    model = None
    if {"passes", "round", "prefill", "int4"} & set(args.parts):
        model = dt.init_on_mesh(lambda: dt.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
        report.notes.append(f"Weights: {weight_read_bytes(model, cfg, 0, embedding='rows') / 2**30:.2f} GiB "
                            "without routed experts and embedding table.")
    if "passes" in args.parts:
        part_passes(args, report, model, cfg, bw, rate)
    if "round" in args.parts:
        part_round(args, report, model, cfg, bw)
    if "prefill" in args.parts:
        part_prefill(args, report, model, cfg, bw, rate)
    if "int4" in args.parts:
        part_int4(args, report, model, cfg, bw, rate)
    del model
    gc.collect()
    if "attention" in args.parts:
        part_attention(args, report, cfg, bw, rate)
    summary(report)
    log(f"wrote {report.stem}.md")


if __name__ == "__main__":
    main()
