"""End-to-end table of a trained pair: autoregressive vs linear DFlash vs DDTree on held-out code.

    PYTHONUNBUFFERED=1 python bench/bench_e2e.py --pair DIR [--minutes 9] [--batches 1 16] [--resume]
    python bench/bench_e2e.py --smoke            # tiny random pair on the CPU, seconds
    python bench/bench_e2e.py --warm-cache RUN   # compile only, on a random pair shaped like RUN's

``DIR`` holds ``target/``, ``drafter/``, ``tokenizer.json`` and ``data.json`` (as written by
``python -m ddtree_jax.training.export``); ``--target/--drafter/--tokenizer`` name them one by one.
Prompts: ``--prompt-len`` tokens from each held-out file of ``data.json`` that the running
interpreter has (the split of the training data; files too short are skipped), continued by
``--new`` tokens, stop tokens ignored, so every method decodes the same number of tokens.

For each batch size (1: the first ``--b1-prompts`` prompts one at a time; 16: one batch of
16), each method (ar, dflash, ddtree at each ``--budgets``) and each sampling setting (T=0,
T=1, T=0.6 + top-p 0.95): tokens/s of the decoding rounds (prefill excluded; a warm-up call
with the same shapes compiles first), tau (pooled and the published per-request mean of
rounds 2..), speedup over ar at the same batch and setting. At T=0: agreement of each method's
tokens with ar's (exact-match fraction and mean common prefix), and with ``--profile`` the round
time split (``generate(profile=True)``: draft, tree, verify, sample, commit) on a shorter run.

``--warm-cache RUN`` compiles every program the table runs (same flags) on a randomly initialised
pair with the sizes and tokenizer of the training run ``RUN``, written the way the export stage
writes the trained pair, and fills JAX's persistent compilation cache: on a GPU machine lent in
10-minute commands, it runs beside the target's training so the table's command spends its
minutes decoding rather than compiling. Nothing is measured or written to ``--out``.

Results go to ``bench/results/e2e_<device>_<date>.json`` after every configuration, so a run
stopped by ``--minutes`` keeps what it measured and ``--resume`` continues it; then a markdown
table and (if matplotlib is installed) ``..._tau.png`` / ``..._speedup.png``: tau and speedup
against the budget, one line per method and sampling setting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import uncompiled_call
from ddtree_jax.generation import generate
from ddtree_jax.sampling import SamplingParams

SETTINGS = {
    "T=0": SamplingParams(temperature=0.0),
    "T=1": SamplingParams(temperature=1.0),
    "T=0.6 top-p 0.95": SamplingParams(temperature=0.6, top_p=0.95),
}


def load_pair(args):
    from tokenizers import Tokenizer

    from ddtree_jax.checkpoints import load_drafter, load_target

    dtype = {"auto": "auto", "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    target = load_target(args.target, dtype=dtype)
    drafter = load_drafter(args.drafter, target)
    return target, drafter, Tokenizer.from_file(args.tokenizer)


def load_pair_folder(pair: str, dtype: str):
    """``load_pair`` of a pair folder (``target/``, ``drafter/``, ``tokenizer.json``) in ``dtype``
    (``auto``, ``float32`` or ``bfloat16``)."""
    return load_pair(argparse.Namespace(target=os.path.join(pair, "target"), drafter=os.path.join(pair, "drafter"),
                                        tokenizer=os.path.join(pair, "tokenizer.json"), dtype=dtype))


def smoke_pair():
    """An untrained tiny pair (random weights; tau ~ 1) and no tokenizer."""
    from flax import nnx

    from ddtree_jax.models import DFlashDrafter, KimiForCausalLM
    from ddtree_jax.training.configs import SIZES, drafter_config, target_config

    tcfg = target_config(SIZES["tiny"], 256)
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(0))
    drafter = DFlashDrafter(drafter_config(SIZES["tiny"], tcfg, mask_token_id=1), rngs=nnx.Rngs(1))
    return target, drafter, None


def random_pair_like(run: str, size: str, dest: str) -> None:
    """A randomly initialised pair of the training stages' ``size`` with the tokenizer of the run
    folder ``run``, written to ``dest`` by the export stage itself (float32 checkpoints in a scratch
    run folder, then ``export_pair``): the same configs and dtypes as the trained pair, so the same
    compiled programs."""
    from flax import nnx

    from ddtree_jax.checkpoints import save_checkpoint
    from ddtree_jax.models import DFlashDrafter, KimiForCausalLM
    from ddtree_jax.training.configs import SIZES, drafter_config, target_config
    from ddtree_jax.training.export import export_pair
    from ddtree_jax.training.run import RunFolder

    folder = RunFolder(run)
    scratch = dest.rstrip("/") + "_run"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    for name in ("data.json", "tokenizer.json"):
        shutil.copy(folder.file(name), scratch)
    tcfg = target_config(SIZES[size], folder.vocab_size)
    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(0), dtype=jnp.float32, impl="reference")
    save_checkpoint(target, os.path.join(scratch, "target_best"))
    drafter = DFlashDrafter(drafter_config(SIZES[size], tcfg, folder.mask_id), rngs=nnx.Rngs(1), dtype=jnp.float32)
    save_checkpoint(drafter, os.path.join(scratch, "drafter_best"))
    export_pair(scratch, dest)
    shutil.rmtree(scratch)


def heldout_prompts(data_json: str | None, tokenizer, count: int, prompt_len: int, new: int, vocab: int, seed: int = 0):
    """``count`` prompts of ``prompt_len`` tokens: from the start of the held-out files named in
    ``data_json`` (those this interpreter has, in listed order, at least ``prompt_len + new`` tokens
    long); random token ids when there is no tokenizer or data record (smoke runs)."""
    from ddtree_jax.training.data import read_source, stdlib_root

    prompts, sources = [], []
    if tokenizer is not None and data_json and os.path.isfile(data_json):
        with open(data_json) as f:
            paths = json.load(f)["heldout_paths"]
        root = stdlib_root()
        for p in paths:
            if len(prompts) == count:
                break
            if not os.path.isfile(os.path.join(root, p)):
                continue
            ids = tokenizer.encode(read_source(root, p)).ids
            if len(ids) >= prompt_len + new:
                prompts.append(ids[:prompt_len])
                sources.append(p)
    if len(prompts) < count:
        rng = np.random.default_rng(seed)
        for i in range(count - len(prompts)):
            prompts.append(rng.integers(2, vocab, prompt_len).tolist())
            sources.append(f"random#{i}")
    return prompts, sources


def _methods(budgets, block_size):
    return [("ar", 0), ("dflash", block_size - 1)] + [("ddtree", b) for b in budgets]


def _label(method, budget):
    return "ar" if method == "ar" else ("dflash" if method == "dflash" else f"ddtree@{budget}")


def _run(target, drafter, prompts, method, budget, sampling, new, max_len, seed, profile=False, sync_every=None):
    return generate(target, drafter if method != "ar" else None, prompts, method=method, budget=max(budget, 1),
                    sampling=sampling, max_new_tokens=new, max_len=max_len, seed=seed, compact=False, profile=profile,
                    sync_every=sync_every)


RETRIES = 3
"""``measure``: the calls a group gets at most while its call compiles a program."""


def measure(target, drafter, groups, method, budget, sampling, new, max_len, seed, sync_every=None):
    """Runs every group of prompts (one ``generate`` call each); totals over the groups. A call
    that compiled a program (or loaded one from the persistent cache: a call form or batch shape
    the warm-up at T=0 never reached) is not kept as a timing: the group runs again, up to
    ``RETRIES`` calls."""
    secs, toks, lengths, tokens, pubs = 0.0, 0, [], [], []
    for prompts in groups:
        out = uncompiled_call(lambda prompts=prompts: _run(target, drafter, prompts, method, budget, sampling, new,
                                                           max_len, seed, sync_every=sync_every),
                              RETRIES, lambda msg: print(f"[bench] {msg}", flush=True))
        secs += out.seconds
        toks += out.new_tokens
        lengths += [a for r in out.requests for a in r.acceptance_lengths]
        pubs += [r.tau for r in out.requests if r.acceptance_lengths]
        tokens += out.tokens
    return dict(seconds=secs, new_tokens=toks, tokens_per_s=toks / secs if secs else float("nan"),
                tau=float(np.mean(lengths)) if lengths else float("nan"),
                tau_published=float(np.mean(pubs)) if pubs else float("nan"), rounds=len(lengths)), tokens


def agreement(tokens, ref):
    exact = np.mean([a == b for a, b in zip(tokens, ref, strict=True)])
    prefix = []
    for a, b in zip(tokens, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    return dict(exact_match=float(exact), mean_common_prefix=float(np.mean(prefix)))


def summarize(results: dict) -> str:
    rows = results["runs"]
    by = {(r["batch"], r["setting"], r["label"]): r for r in rows}
    lines = [f"# End-to-end decoding, {results['device']}, {results['date']}", "",
             f"Pair: `{results['pair']}`; {results['prompts']} held-out prompts of {results['prompt_len']} tokens, "
             f"{results['new']} new tokens each; dtype {results['dtype']}.", "",
             f"Command: `{results.get('command', '?')}`; jax {results.get('jax', '?')}." +
             (f" {results['pair_note']}." if results.get("pair_note") else ""), "",
             "| batch | setting | method | tokens/s | speedup vs ar | tau | tau (published) | T=0 agreement with ar |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ar = by.get((r["batch"], r["setting"], "ar"))
        speed = r["tokens_per_s"] / ar["tokens_per_s"] if ar else float("nan")
        agree = r.get("agreement_with_ar")
        agree_s = f"{agree['exact_match']:.2f} exact, prefix {agree['mean_common_prefix']:.0f}" if agree else ""
        lines.append(f"| {r['batch']} | {r['setting']} | {r['label']} | {r['tokens_per_s']:.1f} | {speed:.2f}x | "
                     f"{r['tau']:.2f} | {r['tau_published']:.2f} | {agree_s} |")
    splits = [r for r in rows if r.get("time_split")]
    if splits:
        stages = list(splits[0]["time_split"])
        lines += ["", "Round time split (T=0, `generate(profile=True)`, ms per round). Each stage runs as its own "
                  "compiled program, timed to completion, so every stage also pays a dispatch and a host sync: on a "
                  "launch-bound model the stages add up to several times the real round (tokens/s above is the real "
                  "speed); read them as where a round's work goes, not as its length.", "",
                  "| batch | method | " + " | ".join(stages) + " |", "|---|---|" + "---|" * len(stages)]
        for r in splits:
            per = r["time_split_rounds"] or 1
            lines.append(f"| {r['batch']} | {r['label']} | " +
                         " | ".join(f"{r['time_split'][s] / per * 1e3:.2f}" for s in stages) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, stem: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (the JSON and markdown have the numbers)")
        return []
    rows = results["runs"]
    files = []
    for what, ylabel in (("tau", "tau (tokens per target pass)"), ("speedup", "speedup over autoregressive")):
        fig, axes = plt.subplots(1, len(results["batches"]), figsize=(6 * len(results["batches"]), 4), squeeze=False)
        for ax, batch in zip(axes[0], results["batches"], strict=True):
            for setting in SETTINGS:
                sel = [r for r in rows if r["batch"] == batch and r["setting"] == setting]
                ar = next((r for r in sel if r["label"] == "ar"), None)
                ar_tps = ar["tokens_per_s"] if ar else float("nan")

                def val(r, ar_tps=ar_tps, what=what):
                    return r["tau"] if what == "tau" else r["tokens_per_s"] / ar_tps
                tree = sorted((r["budget"], val(r)) for r in sel if r["method"] == "ddtree")
                if tree:
                    line = ax.plot(*zip(*tree, strict=True), marker="o", label=f"DDTree {setting}")[0]
                    lin = next((r for r in sel if r["method"] == "dflash"), None)
                    if lin:
                        ax.axhline(val(lin), ls="--", color=line.get_color(), label=f"DFlash {setting}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("DDTree node budget")
            ax.set_ylabel(ylabel)
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        path = f"{stem}_{what}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", help="folder with target/, drafter/, tokenizer.json, data.json")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--tokenizer")
    p.add_argument("--data-json", help="data.json naming the held-out files (default: the pair's)")
    p.add_argument("--smoke", action="store_true", help="tiny random pair on the CPU")
    p.add_argument("--warm-cache", metavar="RUN", help="compile only, on a random pair with RUN's tokenizer")
    p.add_argument("--size", default="h200", help="the training size of the --warm-cache pair")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (the batch-16 run uses 16)")
    p.add_argument("--b1-prompts", type=int, default=6, help="prompts decoded one at a time for batch 1")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256, help="new tokens per prompt")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="time split of the round at T=0 (a separate, shorter run)")
    p.add_argument("--profile-new", type=int, default=64)
    p.add_argument("--profile-budgets", type=int, nargs="*", default=[32, 256],
                   help="DDTree budgets whose round is profiled (ar and dflash always are; each costs compilations)")
    p.add_argument("--minutes", type=float, default=9.0, help="stop (keeping results) before this wall time")
    p.add_argument("--resume", action="store_true", help="continue the JSON of --tag, skipping what it has")
    p.add_argument("--tag", default=None, help="results file stem (default e2e_<device>_<date>)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=None, help="generate's rounds per call (default: its own)")
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="JAX's on-disk cache of compiled programs (default: $DDTREE_JAX_COMPILATION_CACHE or ~/.cache)")
    args = p.parse_args(argv)
    from ddtree_jax import compilation_cache

    print(f"[bench] compilation cache: {compilation_cache.enable(compilation_cache.resolve(args.compilation_cache))}")
    t_start = time.perf_counter()
    deadline = t_start + args.minutes * 60

    if args.smoke:
        args.budgets, args.prompts, args.b1_prompts, args.prompt_len, args.new = [4], 2, 2, 16, 24
        args.batches, args.profile_new, args.dtype = [1, 2], 8, "float32"
        target, drafter, tokenizer = smoke_pair()
        pair = "tiny random pair (--smoke)"
        data_json = None
    else:
        if args.warm_cache:
            args.pair = os.path.join(args.warm_cache, "random_pair")
            random_pair_like(args.warm_cache, args.size, args.pair)
        if args.pair:
            args.target = args.target or os.path.join(args.pair, "target")
            args.drafter = args.drafter or os.path.join(args.pair, "drafter")
            args.tokenizer = args.tokenizer or os.path.join(args.pair, "tokenizer.json")
        if not (args.target and args.drafter and args.tokenizer):
            p.error("give --pair DIR, or --target, --drafter and --tokenizer (or --smoke)")
        target, drafter, tokenizer = load_pair(args)
        pair = args.pair or f"{args.target} + {args.drafter}"
        data_json = args.data_json or (os.path.join(args.pair, "data.json") if args.pair else None)
    bs = drafter.config.block_size
    prompts, sources = heldout_prompts(data_json, tokenizer, args.prompts, args.prompt_len, args.new,
                                       target.config.vocab_size, args.seed)
    max_len = args.prompt_len + args.new + max(args.budgets + [bs]) + 1
    device = jax.devices()[0].device_kind.replace(" ", "_")
    date = datetime.date.today().strftime("%Y%m%d")
    stem = os.path.join(args.out, args.tag or f"e2e_{'smoke_' if args.smoke else ''}{device}_{date}")
    os.makedirs(args.out, exist_ok=True)
    results = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), date=date, pair=pair,
                   command=" ".join(["python3", *sys.argv]),
                   jax=jax.__version__, python=platform.python_version(), prompts=len(prompts),
                   prompt_sources=sources, prompt_len=args.prompt_len, new=args.new, dtype=args.dtype,
                   batches=args.batches, budgets=args.budgets, runs=[])
    if args.resume and os.path.isfile(stem + ".json"):
        with open(stem + ".json") as f:
            results["runs"] = json.load(f)["runs"]
    done = {(r["batch"], r["setting"], r["label"]) for r in results["runs"]}
    randoms = sum(s.startswith("random") for s in sources)
    print(f"[bench] {pair} on {results['device']}: {len(prompts)} prompts ({randoms} "
          f"random), batches {args.batches}, budgets {args.budgets}, settings {args.settings}")

    def save():
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1)

    stopped = False
    for batch in args.batches:
        if batch == 1:
            groups = [[q] for q in prompts[: args.b1_prompts]]
        else:
            groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)] or [prompts[:batch]]
        ar_tokens = {}
        for method, budget in _methods(args.budgets, bs):
            label = _label(method, budget)
            todo = [s for s in args.settings if (batch, s, label) not in done]
            if not todo:
                continue
            if time.perf_counter() > deadline:
                stopped = True
                break
            # Compiles the measured program: the state's shapes follow max_new_tokens, so the
            # warm-up decodes the same count (sampling parameters are data, not shapes).
            t = time.perf_counter()
            _run(target, drafter, groups[0], method, budget, SETTINGS["T=0"], args.new, max_len, args.seed,
                 sync_every=args.sync_every)
            compile_s = time.perf_counter() - t
            if args.warm_cache:
                if args.profile and (method != "ddtree" or budget in args.profile_budgets):
                    _run(target, drafter, groups[0], method, budget, SETTINGS["T=0"], args.profile_new, max_len,
                         args.seed, profile=True)
                print(f"[bench] compiled batch {batch} {label} ({time.perf_counter() - t:.0f}s, "
                      f"{time.perf_counter() - t_start:.0f}s in all)", flush=True)
                continue
            for setting in todo:
                if time.perf_counter() > deadline:
                    stopped = True
                    break
                rec, tokens = measure(target, drafter, groups, method, budget, SETTINGS[setting], args.new, max_len,
                                      args.seed, sync_every=args.sync_every)
                rec.update(batch=batch, setting=setting, method=method, budget=budget if method != "ar" else 0,
                           label=label, warmup_s=compile_s)
                if setting == "T=0":
                    if method == "ar":
                        ar_tokens[batch] = tokens
                    elif batch in ar_tokens:
                        rec["agreement_with_ar"] = agreement(tokens, ar_tokens[batch])
                    if args.profile and (method != "ddtree" or budget in args.profile_budgets):  # compile, then time
                        for _ in range(2):
                            out = _run(target, drafter, groups[0], method, budget, SETTINGS["T=0"], args.profile_new,
                                       max_len, args.seed, profile=True)
                        rec["time_split"], rec["time_split_rounds"] = out.time_split, out.rounds
                results["runs"].append(rec)
                done.add((batch, setting, label))
                save()
                print(f"[bench] batch {batch} {setting:17s} {label:11s} {rec['tokens_per_s']:9.1f} tok/s  tau "
                      f"{rec['tau']:.2f}" + (f"  agreement {rec['agreement_with_ar']['exact_match']:.2f}"
                                              if "agreement_with_ar" in rec else "")
                      + f"  ({time.perf_counter() - t_start:.0f}s)", flush=True)
            if stopped:
                break
        if stopped:
            break
    if args.warm_cache:
        print(f"[bench] {'stopped at the time limit' if stopped else 'compiled every program'} "
              f"({time.perf_counter() - t_start:.0f}s); the persistent cache now holds them")
        return
    if stopped:
        print(f"[bench] stopped at the {args.minutes:g}-minute limit; rerun with --resume --tag "
              f"{os.path.basename(stem)} to continue")
    save()
    with open(stem + ".md", "w") as f:
        f.write(summarize(results))
    files = plot(results, stem)
    print(summarize(results))
    print(f"[bench] wrote {stem}.json, {stem}.md" + "".join(f", {x}" for x in files))


if __name__ == "__main__":
    main()
