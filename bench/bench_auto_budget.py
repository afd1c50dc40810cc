"""``budget="auto"`` against autoregressive decoding and DDTree at fixed budgets, per batch and setting.

    PYTHONUNBUFFERED=1 python bench/bench_auto_budget.py --default [--batches 1 16 64] [--new 128]
    python bench/bench_auto_budget.py --pair DIR          # a trained pair (as bench_e2e.py reads it)
    python bench/bench_auto_budget.py --smoke             # tiny random pair on the CPU, tiny sizes
    python bench/bench_auto_budget.py --k2-slice 2 [--acceptance high medium low] [--smoke]

For each batch size (``--batches``: that many held-out prompts of ``--prompt-len`` tokens decoded
together, ``--new`` tokens each, stop tokens ignored; batch 1: ``--b1-prompts`` prompts, each
decoded on its own, one after the other, per timed call) and each sampling setting (T=0, T=0.6 +
top-p 0.95, T=1): tokens/s of the decoding rounds (prefill excluded; a warm-up call with the same
shapes compiles first, and for ``auto`` measures or loads the cost table; then ``--repeats``
timed calls per run, interleaved across the runs of the cell, and their median) of ``ar``, DDTree at each
``--budgets`` and ``auto`` (``DecodeConfig(budget="auto", auto_max_budget=--auto-max)``), the
ratio of each to ``ar``, and for ``auto``: its ratio to the best fixed budget of the cell, the
per-round budget histogram, expected vs realized tokens, and the cost table it used (seconds per
round at each budget of the set, as measured by the library at that batch). ``--auto-plain`` adds
``auto-plain``: auto with every drafted budget priced out (``DecodeConfig.auto_costs``), so it
runs plain rounds with auto's held-back context, choices and probes: what auto's machinery costs
against autoregressive decoding where it drafts nothing.

``--k2-slice LAYERS``: a random Kimi K2-shaped target of that many layers and a one-layer drafter
(``bench._common.k2_models``; with ``--smoke`` the tiny CPU shapes) whose acceptance is set by
hand (``bench._controlled``: the real passes, steered logits), once per ``--acceptance`` level,
on random prompts.

Results go to ``bench/results/auto_budget_<device>_<date>.json`` after every run, with a markdown
table beside it, the device, date and command. ``--minutes`` starts a cell only if the longest
cell so far would end in time; ``--resume`` continues a run so stopped: it skips the cells whose
every label has its ``--repeats`` runs and runs a cell cut short again whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax

from bench._common import k2_models
from bench._controlled import LEVELS
from bench._timing import uncompiled_call
from bench.bench_e2e import SETTINGS, heldout_prompts, load_pair_folder, smoke_pair
from ddtree_jax.config import DecodeConfig, auto_budget_set
from ddtree_jax.generation import GenerateOutput, generate

ORDER = ("T=0", "T=0.6 top-p 0.95", "T=1")
PRICED_OUT = 1e3
"""``auto-plain``'s cost of a drafted round, in plain rounds: no expected acceptance pays it."""
RETRIES = 4


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _config(label: str, auto_max: int, seed: int, sync_every: int | None = None) -> DecodeConfig:
    if label == "ar":
        return DecodeConfig(method="ar", seed=seed, sync_every=sync_every)
    if label == "auto":
        return DecodeConfig(budget="auto", auto_max_budget=auto_max, seed=seed, sync_every=sync_every)
    if label == "auto-plain":  # (every drafted budget priced out: plain rounds and the probes)
        drafted = len(auto_budget_set(auto_max)) - 1
        return DecodeConfig(budget="auto", auto_max_budget=auto_max, seed=seed, sync_every=sync_every,
                            auto_costs=(1.0,) + (PRICED_OUT,) * drafted)
    return DecodeConfig(budget=int(label.split("@")[1]), seed=seed, sync_every=sync_every)


def one_by_one(outs: list[GenerateOutput]) -> GenerateOutput:
    """Batch-1 calls of ``generate`` on several prompts, one after the other, as one output: the
    requests in order; rounds, seconds and their parts summed; ``auto``'s rounds, tokens and
    dispatches pooled (its cost tables the first call's, the costs it paid the last call's)."""
    first, last = outs[0], outs[-1]
    auto = None
    if first.auto is not None:
        reports = [o.auto for o in outs]
        pooled = lambda field: tuple(map(sum, zip(*(getattr(r, field) for r in reports), strict=True)))  # noqa: E731
        auto = dataclasses.replace(last.auto, rounds=pooled("rounds"), expected=pooled("expected"),
                                   realized=pooled("realized"), drafted_rounds=sum(r.drafted_rounds for r in reports),
                                   costs=first.auto.costs, sequence=tuple(d for r in reports for d in r.sequence))
    return dataclasses.replace(first, requests=[r for o in outs for r in o.requests], auto=auto,
                               rounds=sum(o.rounds for o in outs), seconds=sum(o.seconds for o in outs),
                               prefill_seconds=sum(o.prefill_seconds for o in outs),
                               round_seconds=sum(o.round_seconds for o in outs),
                               dispatches=tuple(d for o in outs for d in o.dispatches),
                               compaction_seconds=tuple(c for o in outs for c in o.compaction_seconds))


def decode(models, prompts, alone: bool, **kw) -> GenerateOutput:
    """``generate`` on ``prompts`` together, or (``alone``) each on its own, one after the other
    (``one_by_one``)."""
    if alone:
        return one_by_one([generate(*models, [p], **kw) for p in prompts])
    return generate(*models, prompts, **kw)


def run_cell(target, drafter, prompts, labels, setting, new, auto_max, seed, repeats, deadline, publish,
             sync_every=None, alone=False, compact=True):
    """One cell: per label a warm-up call (compiles; auto: the cost table) and a first timed call,
    then ``repeats - 1`` more timed calls per label, interleaved across labels (a slow stretch of
    the device hits every label alike), while ``time.perf_counter() < deadline``. After every
    timed pass ``publish(records)`` gets one record per label timed so far, from its median call
    by tokens/s, so that a run cut short keeps what it measured. ``alone``: each call decodes the
    prompts one after the other at batch 1 (``decode``). ``compact``: ``generate``'s (False: the
    batch keeps its rows to the end).

    auto's choices follow timings, so its runs can compact to batch sizes an earlier run never
    reached, and the first run at a size times every budget there (the cost table): a call that
    reached a new size is not kept as a timing and runs again (at most ``RETRIES`` times); so is a
    call that compiled a program (or loaded one from the persistent cache): a budget the warm-up
    never chose (on the H100 one such call ran batch 1 at 90 tokens/s against 4,400-5,100 for the
    others, and the median of three became the slower of the other two)."""
    calls, outs, sizes = {}, {}, set()

    def timed(label):
        def new_sizes(out):
            fresh = set(out.auto.costs) - sizes if out.auto is not None else set()
            sizes.update(fresh)
            return f"reached batch sizes {sorted(fresh)} first (their costs timed): run again" if fresh else None

        return uncompiled_call(calls[label], RETRIES, lambda msg: _log(f"  {label}: {msg}"), again=new_sizes)

    for label in labels:
        if time.perf_counter() > deadline:
            break
        config = _config(label, auto_max, seed, sync_every)
        kw = dict(sampling=SETTINGS[setting], max_new_tokens=new, config=config, compact=compact)
        models = (target, drafter if config.uses_drafter else None)
        calls[label] = lambda models=models, kw=kw: decode(models, prompts, alone, **kw)
        first = calls[label]()
        sizes.update(first.auto.costs if first.auto is not None else ())
        outs[label] = [timed(label)]
        _log(f"  {label}: compiled and timed once")
        publish(_records(outs))
    for _ in range(repeats - 1):
        if time.perf_counter() > deadline:
            break
        for label in outs:
            outs[label].append(timed(label))
        publish(_records(outs))


def call_forms(dispatches) -> dict:
    """Per call form (``generation.Dispatch.form``): ``[calls, rounds given, ms choosing, ms in the
    call, ms waiting for its read-back]``, summed over ``dispatches``."""
    forms = {}
    for d in dispatches:
        tot = forms.setdefault(d.form, [0, 0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, d.rounds, d.choose * 1e3, d.launch * 1e3, d.wait * 1e3)):
            tot[i] += v
    return forms


def _records(outs: dict) -> list[dict]:
    recs = []
    for label, calls in outs.items():
        out = sorted(calls, key=lambda o: o.new_tokens / o.seconds)[len(calls) // 2]
        rec = dict(label=label, tokens=out.new_tokens, seconds=out.seconds, tokens_per_s=out.new_tokens / out.seconds,
                   tokens_per_s_runs=[o.new_tokens / o.seconds for o in calls], rounds=out.rounds,
                   tau=out.mean_tau, round_seconds=out.round_seconds, batch_sizes=out.batch_sizes,
                   compaction_ms=[c * 1e3 for c in out.compaction_seconds], calls=call_forms(out.dispatches))
        if out.auto is not None:
            a = out.auto
            rec.update(histogram={str(b): n for b, n in a.histogram.items()}, drafted_rounds=a.drafted_rounds,
                       expected=sum(a.expected), realized=sum(a.realized),
                       costs_ms={str(rows): [c * 1e3 for c in cs] for rows, cs in a.costs.items()},
                       restart_ms={str(rows): None if x is None else x * 1e3 for rows, x in a.restarts.items()},
                       probe_ms={str(rows): None if x is None else x * 1e3 for rows, x in a.probe_prices.items()},
                       run_costs_ms={str(rows): [c * 1e3 for c in cs] for rows, cs in a.run_costs.items()},
                       paid_ms={str(rows): [[n, lo * 1e3, mid * 1e3, hi * 1e3] for n, lo, mid, hi in per]
                                for rows, per in a.paid.items()},
                       sequence=" ".join(f"{b}x{n}" for b, n in a.sequence))
        # each dispatch (every label: the fixed budgets' timelines are auto's baseline): budget,
        # rounds, form, ms choosing, in the call, waiting for its read-back, its launch's start (ms
        # from the first's: the gaps are host work)
        rec["dispatches"] = [[d.budget, d.rounds, d.form, round(d.choose * 1e3, 3), round(d.launch * 1e3, 3),
                              round(d.wait * 1e3, 3), round(d.start * 1e3, 3)] for d in out.dispatches]
        recs.append(rec)
    return recs


def _cell(run: dict) -> str:
    """An auto run's cell in the per-run lists, its label after it where it is not ``auto``."""
    label = "" if run["label"] == "auto" else f" ({run['label']})"
    return f"{run.get('acceptance') or '-'}, batch {run['batch']}, {run['setting']}{label}"


def summarize(results: dict) -> str:
    runs = results["runs"]
    fixed = [f"ddtree@{b}" for b in results["budgets"]]
    plain = int(any(r["label"] == "auto-plain" for r in runs))
    lines = [f"# budget=\"auto\" vs fixed budgets, {results['device']}, {results['date']}", "",
             f"Pair: `{results['pair']}`; prompts of {results['prompt_len']} tokens, {results['new']} new tokens "
             f"each; auto's set: up to {results['auto_max']}."
             + (f" Batch 1: {results['b1_prompts']} prompts per call, each decoded on its own (rounds, histograms and "
                "tokens summed over them)." if results.get("b1_prompts") else ""), "",
             f"Command: `{results['command']}`; jax {results['jax']}.", "",
             "Tokens/s over autoregressive decoding at the same batch and setting (auto/best: auto over the best "
             "fixed budget of the cell).", "",
             "| acceptance | batch | setting | ar tok/s | " + " | ".join(f"@{b}" for b in results["budgets"]) +
             " | auto | auto/best | auto histogram (budget: rounds) | expected / realized tokens |"
             + (" auto, plain only |" if plain else ""),
             "|---|---|---|---|" + "---|" * (len(fixed) + 4 + plain)]
    levels = list(dict.fromkeys(r.get("acceptance") for r in runs))
    for level, batch, setting in ((lv, b, s) for lv in levels for b in results["batches"] for s in ORDER):
        cell = {r["label"]: r for r in runs
                if r.get("acceptance") == level and r["batch"] == batch and r["setting"] == setting}
        if "ar" not in cell:
            continue
        ar = cell["ar"]["tokens_per_s"]
        ratio = lambda lab, cell=cell, ar=ar: cell[lab]["tokens_per_s"] / ar if lab in cell else float("nan")
        best = max((ratio(lab) for lab in fixed if lab in cell), default=float("nan"))
        auto = cell.get("auto")
        hist = ", ".join(f"{b}: {n}" for b, n in auto["histogram"].items()) if auto else ""
        er = f"{auto['expected']:.0f} / {auto['realized']:.0f}" if auto else ""
        fixed_ratios = " | ".join(f"{ratio(lab):.2f}" for lab in fixed)
        lines.append(f"| {level or '-'} | {batch} | {setting} | {ar:.1f} | {fixed_ratios} | {ratio('auto'):.2f} | "
                     f"{ratio('auto') / best:.2f} | {hist} | {er} |"
                     + (f" {ratio('auto-plain'):.2f} |" if plain else ""))
    lines += ["", "Where each run's time went, ms per round: in the compiled calls (auto's choice, the dispatch, the "
              "rounds, the read back) and on the host between calls (cost lookups, harvest, compaction; each "
              "compaction's ms from the last read-back on the larger batch to the next launch: "
              "`GenerateOutput.compaction_seconds`):", "",
              "| acceptance | batch | setting | run | rounds | ms / round in calls | host ms / round | batch sizes "
              "| compactions (ms each) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "round_seconds" in r and r["rounds"]:
            calls, host = r["round_seconds"] / r["rounds"], (r["seconds"] - r["round_seconds"]) / r["rounds"]
            lines.append(f"| {r.get('acceptance') or '-'} | {r['batch']} | {r['setting']} | {r['label']} | "
                         f"{r['rounds']} | {1e3 * calls:.3f} | {1e3 * host:.3f} | {r.get('batch_sizes', '')} | "
                         f"{', '.join(f'{c:.2f}' for c in r.get('compaction_ms', [])) or '-'} |")
    lines += ["", "The compiled calls by form (`generation.Dispatch`): calls, rounds given, and per call the ms "
              "choosing (auto's choice, the form), in the call until it returned, and waiting for its read-back:", "",
              "| acceptance | batch | setting | run | form | calls | rounds | choose ms | call ms | wait ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for form, (n, rounds, choose, call, wait) in r.get("calls", {}).items():
            lines.append(f"| {r.get('acceptance') or '-'} | {r['batch']} | {r['setting']} | {r['label']} | {form} | "
                         f"{n} | {rounds} | {choose / n:.3f} | {call / n:.3f} | {wait / n:.3f} |")
    lines += ["", "Cost table (ms per round at each budget of the set, measured by the library) and the pipeline "
              "restart's price each cell's kept auto run decided with, in the cells' order "
              "(`auto_budget.restart_price`: twice the measured restart until an earlier run's first probe alone "
              "observed one; the first probe runs alone where it is at most `RESTART_SHARE` of a dispatch's "
              "plain rounds):", ""]
    seen = set()
    for r in runs:
        for rows, costs in r.get("costs_ms", {}).items():
            if rows not in seen:
                seen.add(rows)
                prices = [x.get("restart_ms", {}).get(rows, "-") for x in runs if rows in x.get("costs_ms", {})]
                lines.append(f"- batch {rows}: " + ", ".join(f"{b}: {c:.3f}" for b, c in
                                                             zip(r["histogram"], costs, strict=True))
                             + "; restart " + ", ".join("unknown" if p is None else p if isinstance(p, str)
                                                         else f"{p:.3f}" for p in prices))
    lines += ["", "The costs auto chose with at the end of each run (the table corrected by the run's timed "
              "dispatches, host work included), ms per round:", ""]
    for r in runs:
        for rows, costs in r.get("run_costs_ms", {}).items():
            lines.append(f"- {_cell(r)}, at {rows} rows: "
                         + ", ".join(f"{b}: {c:.3f}" for b, c in zip(r["histogram"], costs, strict=True)))
    lines += ["", "What the timed dispatches paid, ms per round (count: min / median / max), per budget:", ""]
    for r in runs:
        for rows, per in r.get("paid_ms", {}).items():
            lines.append(f"- {_cell(r)}, at {rows} rows: "
                         + ", ".join(f"{b}: {n}: {lo:.3f} / {mid:.3f} / {hi:.3f}" if n else f"{b}: -"
                                     for b, (n, lo, mid, hi) in zip(r["histogram"], per, strict=True)))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--default", action="store_true", help="the shipped pair (ddtree_jax/default_pair)")
    src.add_argument("--pair", help="folder with target/, drafter/, tokenizer.json, data.json")
    src.add_argument("--smoke", action="store_true", help="tiny random pair, tiny sizes (CPU)")
    p.add_argument("--k2-slice", type=int, metavar="LAYERS", default=None,
                   help="a K2-shaped slice of LAYERS layers with a controlled-acceptance pair (--smoke: tiny shapes)")
    p.add_argument("--acceptance", nargs="+", default=["high", "medium", "low"], choices=list(LEVELS),
                   help="--k2-slice: the acceptance levels (bench/_controlled.py)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--auto-max", type=int, default=32, help="auto's largest budget (DecodeConfig.auto_max_budget)")
    p.add_argument("--settings", nargs="+", default=list(ORDER), choices=list(ORDER))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--b1-prompts", type=int, default=8,
                   help="batch 1: prompts each timed call decodes one after the other (one prompt's acceptance "
                        "is one draw of a noisy quantity; --smoke: 2)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="stop (keeping results) before this wall time: a cell starts only if the longest cell so "
                        "far would end by then")
    p.add_argument("--resume", action="store_true", help="continue the results file of the same stem")
    p.add_argument("--tag", default=None, help="results file stem (default auto_budget_<device>_<date>)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per label and cell (the median is reported)")
    p.add_argument("--sync-every", type=int, default=None, help="generate's rounds per call (default: its own)")
    p.add_argument("--compact", choices=("on", "off"), default="on",
                   help="generate's compaction of finished rows (off: every label keeps the whole batch)")
    p.add_argument("--auto-plain", action="store_true",
                   help="also run auto with every drafted budget priced out (label auto-plain: its plain rounds, "
                        "held-back context and probes against autoregressive decoding)")
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="JAX's on-disk cache of compiled programs (and the cost tables beside it)")
    args = p.parse_args(argv)
    from ddtree_jax import compilation_cache

    compilation_cache.enable(compilation_cache.resolve(args.compilation_cache))
    if args.compilation_cache is not None:
        os.environ[compilation_cache.ENV_VAR] = args.compilation_cache  # the cost table's folder follows it
    deadline = time.perf_counter() + args.minutes * 60  # (--minutes: whatever runs by then is saved)
    levels = [None]
    if args.smoke:
        args.b1_prompts = 2
    if args.k2_slice is not None:
        target, drafter = k2_models(args.k2_slice, smoke=args.smoke, acceptance=LEVELS[args.acceptance[0]])
        tokenizer, data_json, levels = None, None, args.acceptance
        shapes = " (smoke shapes)" if args.smoke else ""
        pair = f"K2-shaped slice of {args.k2_slice} layers{shapes}, controlled acceptance"
        if args.smoke:
            args.batches, args.budgets, args.auto_max, args.prompt_len, args.new = [1, 4], [4, 8], 8, 8, 16
    elif args.smoke:
        target, drafter, tokenizer = smoke_pair()
        args.batches, args.budgets, args.auto_max = [1, 4], [2, 4], 4
        args.prompt_len, args.new, pair, data_json = 8, 6, "smoke (random tiny pair)", None
    else:
        from ddtree_jax.default_model import SHIPPED_DIR

        pair = SHIPPED_DIR if args.default or not args.pair else args.pair
        target, drafter, tokenizer = load_pair_folder(pair, args.dtype)
        data_json = os.path.join(pair, "data.json")
    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    name = f"auto_budget_{device.replace(' ', '_').lower()}_{date.replace('-', '')}"
    stem = os.path.join(args.out, args.tag or name)
    results = dict(device=device, backend=jax.default_backend(), date=date, pair=pair, jax=jax.__version__,
                   command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                   batches=args.batches, budgets=args.budgets, auto_max=args.auto_max, prompt_len=args.prompt_len,
                   new=args.new, b1_prompts=args.b1_prompts, runs=[])
    if args.resume and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            before = json.load(f)
        # (the file covers every call's batches, and names each call)
        results.update(runs=before["runs"], batches=sorted(set(before["batches"]) | set(args.batches)),
                       command=f"{before['command']}`, then `{results['command']}")
    # (a cell counts as done when every label has its --repeats runs; a cell cut short runs again
    # whole, so that its columns come from the same interleaved runs)
    done = {(r.get("acceptance"), r["batch"], r["setting"], r["label"]) for r in results["runs"]
            if len(r.get("tokens_per_s_runs", ())) >= args.repeats}
    os.makedirs(args.out, exist_ok=True)

    def save():
        with open(stem + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(summarize(results))

    labels = ["ar", *(f"ddtree@{b}" for b in args.budgets), "auto", *(["auto-plain"] if args.auto_plain else [])]
    _log(f"{pair} on {device}: batches {args.batches}, settings {args.settings}, {labels}")
    stopped, longest = False, 0.0  # (the longest cell so far: a cell is started only if that long fits)
    for level in levels:
        if level is not None:  # the same arrays; the level is the models' static setting
            target.acceptance = drafter.acceptance = LEVELS[level]
        for batch in args.batches:
            count = args.b1_prompts if batch == 1 else batch
            prompts, _ = heldout_prompts(data_json, tokenizer, count, args.prompt_len, args.new,
                                         target.config.vocab_size, args.seed)
            for setting in args.settings:
                if all((level, batch, setting, label) in done for label in labels):
                    continue
                if time.perf_counter() + longest > deadline:  # (a cell cut short runs again whole)
                    stopped = True
                    break
                t0 = time.perf_counter()
                kept = [r for r in results["runs"] if (r.get("acceptance"), r["batch"], r["setting"]) !=
                        (level, batch, setting)]

                def publish(recs, kept=kept, level=level, batch=batch, setting=setting):
                    for rec in recs:
                        rec.update(acceptance=level, batch=batch, setting=setting)
                    results["runs"] = kept + recs
                    save()

                run_cell(target, drafter, prompts, labels, setting, args.new, args.auto_max, args.seed, args.repeats,
                         deadline, publish, sync_every=args.sync_every, alone=batch == 1,
                         compact=args.compact == "on")
                for rec in results["runs"][len(kept):]:
                    extra = f", histogram {rec['histogram']}" if "histogram" in rec else ""
                    _log(f"{level + ' ' if level else ''}batch {batch} {setting} {rec['label']}: "
                         f"{rec['tokens_per_s']:.1f} tok/s (median of {len(rec['tokens_per_s_runs'])}), "
                         f"tau {rec['tau']:.2f}{extra}")
                longest = max(longest, time.perf_counter() - t0)
                _log(f"cell done in {time.perf_counter() - t0:.0f}s incl. compile")
                stopped = stopped or time.perf_counter() > deadline
    save()
    print(summarize(results))
    _log(f"{'stopped by --minutes; --resume continues. ' if stopped else ''}wrote {stem}.json and {stem}.md")
    return results


if __name__ == "__main__":
    main()
