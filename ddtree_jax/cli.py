"""Command line: ``python -m ddtree_jax generate ...`` and ``python -m ddtree_jax demo``.

    python -m ddtree_jax generate --target DIR --drafter DIR --tokenizer tokenizer.json \\
        --prompt "Speculative decoding" --method ddtree --budget 64 --temperature 0.7 --top-p 0.9

    python -m ddtree_jax demo      # builds the built-in default once, then runs all methods

Progress goes to stderr; with one prompt the text streams as it is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ddtree_jax.generate import METHODS


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise SystemExit(f"--tokenizer: no such file {path!r}")
    return Tokenizer.from_file(path)


def _sampling_from_args(args):
    from ddtree_jax.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"bad sampling option: {e}") from None


def _stop_ids(args, tokenizer) -> list[int]:
    stop = list(args.stop_token_id or [])
    gen_cfg = os.path.join(os.path.dirname(os.path.abspath(args.target)), "generation_config.json")
    for cfg_path in (os.path.join(args.target, "generation_config.json"), gen_cfg):
        if os.path.isfile(cfg_path) and not args.ignore_eos:
            eos = json.load(open(cfg_path)).get("eos_token_id")
            stop += eos if isinstance(eos, list) else [eos] if eos is not None else []
            break
    return sorted(set(stop))


def run_generate(args) -> dict:
    """Loads the models and tokenizer, generates, prints text and statistics; returns a summary."""
    import jax.numpy as jnp

    from ddtree_jax.checkpoints import load_drafter, load_target
    from ddtree_jax.generate import generate

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    tokenizer = _load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=dtype)
    drafter = load_drafter(args.drafter, target) if args.method != "ar" else None
    _log(f"[ddtree_jax] loaded target{' + drafter' if drafter is not None else ''} in {time.perf_counter() - t0:.1f}s "
         f"(vocab {target.config.vocab_size}, {target.config.num_hidden_layers} layers)")
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    for i, ids in enumerate(prompts):
        if not ids:
            raise SystemExit(f"--prompt #{i + 1} encodes to no tokens")
    stream = len(prompts) == 1 and not args.no_stream
    printed = [0]

    def on_progress(out, gen):
        if stream:
            text = tokenizer.decode(out[0, : gen[0]].tolist())
            sys.stdout.write(text[printed[0] :])
            sys.stdout.flush()
            printed[0] = len(text)
        else:
            _log(f"[ddtree_jax] generated {int(gen.sum())}/{len(prompts) * args.max_new_tokens} tokens")

    if stream:
        sys.stdout.write(args.prompt[0])
    result = generate(
        target, drafter, prompts, method=args.method, budget=args.budget, sampling=_sampling_from_args(args),
        max_new_tokens=args.max_new_tokens, stop_tokens=_stop_ids(args, tokenizer), seed=args.seed or 0,
        sync_every=args.sync_every, profile=args.profile, on_progress=on_progress,
    )
    if stream:
        sys.stdout.write("\n")
    else:
        for prompt, r in zip(args.prompt, result.requests):
            print(f"--- {prompt!r} ->\n{tokenizer.decode(r.tokens)}")
    for i, r in enumerate(result.requests):
        _log(f"[ddtree_jax] request {i}: {len(r.tokens)} tokens, finish={r.finish_reason}, rounds={r.rounds}, tau={r.tau:.2f}")
    tps = result.new_tokens / result.seconds if result.seconds > 0 else float("nan")
    _log(f"[ddtree_jax] method={result.method} budget={result.budget}: {result.new_tokens} tokens in {result.seconds:.2f}s "
         f"({tps:.1f} tok/s incl. compilation on first use), mean tau={result.mean_tau:.2f}, prefill {result.prefill_seconds:.2f}s")
    if result.time_split:
        _log("[ddtree_jax] time split: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.time_split.items()))
    return dict(method=result.method, tokens=result.tokens, tau=result.mean_tau, seconds=result.seconds)


def run_demo(args) -> None:
    from ddtree_jax.default_model import make_default

    t0 = time.perf_counter()
    _log(f"[ddtree_jax] preparing the built-in default in {args.dir} (made and trained once, a few minutes) ...")
    path = make_default(args.dir, log=_log)
    _log(f"[ddtree_jax] default ready in {time.perf_counter() - t0:.1f}s: target/, drafter/, tokenizer.json")
    summaries = []
    for method in METHODS:
        _log(f"[ddtree_jax] === method {method} ===")
        ns = argparse.Namespace(
            target=os.path.join(path, "target"), drafter=os.path.join(path, "drafter"),
            tokenizer=os.path.join(path, "tokenizer.json"),
            prompt=args.prompt or ["Speculative decoding lets", "A draft tree", "With sampling, every node"],
            method=method, budget=args.budget, max_new_tokens=args.max_new_tokens, temperature=0.0, top_k=0,
            top_p=1.0, min_p=0.0, seed=None, stop_token_id=None, ignore_eos=True, dtype="float32", sync_every=8,
            profile=False, no_stream=True,
        )
        summaries.append(run_generate(ns))
    same = all(s["tokens"] == summaries[-1]["tokens"] for s in summaries)
    _log(f"[ddtree_jax] greedy outputs identical across ddtree / dflash / ar: {same}")
    if not same:
        raise SystemExit("greedy speculative output differs from autoregressive output")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree_jax", description="Exact tree speculative decoding in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with a target (+ drafter) checkpoint")
    g.add_argument("--target", required=True, help="HF DeepseekV3ForCausalLM checkpoint directory")
    g.add_argument("--drafter", help="DFlash drafter checkpoint directory (not needed for --method ar)")
    g.add_argument("--tokenizer", required=True, help="tokenizer.json")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--method", choices=METHODS, default="ddtree")
    g.add_argument("--budget", type=int, default=64, help="DDTree node budget")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop-token-id", type=int, action="append", help="in addition to generation_config's eos")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--sync-every", type=int, default=8, help="rounds on device between host checks")
    g.add_argument("--profile", action="store_true", help="time draft/tree/verify/sample/commit separately")
    g.add_argument("--no-stream", action="store_true")

    d = sub.add_parser("demo", help="make the built-in default model and run every method on it")
    from ddtree_jax.default_model import DEFAULT_DIR

    d.add_argument("--dir", default=DEFAULT_DIR)
    d.add_argument("--prompt", action="append")
    d.add_argument("--budget", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=64)

    args = ap.parse_args(argv)
    if args.command == "generate":
        if args.method != "ar" and not args.drafter:
            ap.error(f"--method {args.method} needs --drafter")
        run_generate(args)
    else:
        run_demo(args)


if __name__ == "__main__":
    main()
