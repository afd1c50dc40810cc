"""``budget="auto"``'s choices on the CPU, priced by a GPU's cost table: a simulation, not a measurement.

    PYTHONUNBUFFERED=1 python bench/replay_auto_budget.py --default \\
        --costs-from bench/results/auto_budget_nvidia_h100_80gb_hbm3_20261206.json [--costs 16:0.46,0.70,0.73,0.77] \\
        [--batches 1 16 64] [--settings T=0 T=1]
    python bench/replay_auto_budget.py --smoke --costs 2:1,2,3
    python bench/replay_auto_budget.py --k2-slice 2 --costs 1:1.615,3.756,4.479,5.691 --batches 1 --settings T=0

The chooser's rule is tuned against runs on a GPU, which are scarce and noisy; this replays it
where it is cheap. For each batch size and sampling setting it runs ``generate`` with
``budget="auto"`` on the pair's held-out prompts (float32 by default: the acceptance the GPU's bf16
rounds see, up to rounding) with the cost table given (``DecodeConfig.auto_costs``: the rule
chooses with those costs and does not time this machine's rounds), and prices the run as a GPU
would if every round cost its table entry: ``sum over budgets of rounds x cost``, against
autoregressive decoding's ``(new - 1) x cost[0]`` (its first token comes from the prefill). The
ratio is auto's speed over autoregressive decoding's in that model. What it leaves out: the host's
work between dispatches, compactions (the batch's shrinking rows are priced at the full batch),
the first dispatch's cost-table timing and any run-to-run spread; so a ratio here is what the rule
can reach, and the GPU's table (``bench_auto_budget.py``) is what it does.

Costs (ms per round at each budget of the set ``auto_budget_set(--auto-max)``, budget 0 first):
``--costs-from`` takes each batch's table from a ``bench_auto_budget.py`` results file (its auto
runs' ``costs_ms``); ``--costs BATCH:C0,C1,...`` gives or overrides one batch's. ``--k2-slice
LAYERS``: the K2-shaped slice with a controlled-acceptance pair at the tiny CPU shapes
(``bench._common.k2_models``), once per ``--acceptance`` level, on random prompts: the GPU's K2
slice decides at the same acceptance, so its table prices these rounds. Results go to
``bench/results/auto_replay_<device>_<date>.json`` and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import numpy as np

from bench._common import device_tag, k2_models
from bench._controlled import LEVELS
from bench.bench_auto_budget import ORDER, decode
from bench.bench_e2e import SETTINGS, heldout_prompts, load_pair_folder, smoke_pair
from ddtree_jax.config import DecodeConfig, auto_budget_set


def _log(msg: str) -> None:
    print(f"[replay] {msg}", flush=True)


def cost_tables(costs_from: str | None, costs: list[str], budgets: tuple[int, ...]) -> dict[int, tuple[float, ...]]:
    """``{batch: ms per round at each budget}`` from a ``bench_auto_budget.py`` results file's auto
    runs, then ``BATCH:C0,C1,...`` entries (one cost per budget of ``budgets``)."""
    tables = {}
    if costs_from:
        with open(costs_from) as f:
            for run in json.load(f)["runs"]:
                for batch, table in (run.get("costs_ms") or {}).items():
                    if len(table) == len(budgets):
                        tables.setdefault(int(batch), tuple(float(c) for c in table))
    for entry in costs:
        batch, _, values = entry.partition(":")
        table = tuple(float(c) for c in values.split(","))
        if len(table) != len(budgets):
            raise SystemExit(f"--costs {entry}: {len(table)} costs for the budget set {budgets}")
        tables[int(batch)] = table
    return tables


def replay(target, drafter, prompts, setting: str, new: int, auto_max: int, table, seed: int,
           fixed: tuple[int, ...] = (), alone: bool = False, restart: float | None = None) -> dict:
    """One auto run priced by ``table`` (ms per round at each budget of the set): its budget
    histogram, table time and ratio to autoregressive decoding's; and each ``fixed`` budget's run
    (a budget of the set) priced by the same table, its rounds at that budget's cost. ``alone``:
    each prompt decoded on its own at batch 1, one after the other (rounds summed). ``restart``:
    a pipeline restart's price in ms (``DecodeConfig.auto_restart``), added per probe run alone."""
    budgets = auto_budget_set(auto_max)
    config = DecodeConfig(budget="auto", auto_max_budget=auto_max, auto_costs=tuple(c / 1e3 for c in table),
                          auto_restart=None if restart is None else restart / 1e3, seed=seed)
    models = (target, drafter)
    t = time.perf_counter()
    out = decode(models, prompts, alone, config=config, max_new_tokens=new, sampling=SETTINGS[setting])
    rounds = np.asarray(out.auto.rounds)
    restarts = sum(d.form == "alone" for d in out.dispatches)
    auto_ms = float(rounds @ np.asarray(table)) + restarts * (restart or 0.0)
    ar_ms = (len(prompts) if alone else 1) * (new - 1) * table[0]
    over_fixed = {}
    for b in fixed:
        run = decode(models, prompts, alone, config=DecodeConfig(budget=b, seed=seed), max_new_tokens=new,
                     sampling=SETTINGS[setting])
        over_fixed[str(b)] = ar_ms / (run.rounds * table[budgets.index(b)])
    return dict(setting=setting, batch=1 if alone else len(prompts), histogram=dict(zip(map(str, budgets),
                                                                                         rounds.tolist(),
                                                                        strict=True)),
                restarts=restarts, auto_ms=auto_ms, ar_ms=ar_ms, over_ar=ar_ms / auto_ms, fixed_over_ar=over_fixed,
                tau=out.mean_tau, costs_ms=list(table), wall_s=time.perf_counter() - t)


def summarize(results: dict) -> str:
    lines = [f"# auto's choices replayed on {results['device']}, priced by a cost table ({results['date']})", "",
             "A simulation, not a measurement: time = rounds x the table's cost of a round at their budget "
             "(host work, compactions and spread left out; bench/replay_auto_budget.py says what it is).", "",
             f"- command: `{results['command']}`", f"- pair: {results['pair']}, dtype {results['dtype']}, "
             f"{results['new']} new tokens, prompts of {results['prompt_len']}"
             + (f"; batch 1: {results['b1_prompts']} prompts, each on its own, rounds summed"
                if results.get("b1_prompts") else ""), "",
             "Fixed budgets are priced at auto's table cost of their budget (auto's drafted round builds the "
             "largest tree on the depths its budget reaches, so a fixed round is a little cheaper than that).", "",
             "| acceptance | batch | setting | rounds at each budget | tau | table time, auto / AR (ms) | "
             "auto over AR | " + " | ".join(f"@{b} over AR" for b in results["fixed"]) + " | auto over the best |",
             "|---|---|---|---|---|---|---|" + "---|" * len(results["fixed"]) + "---|"]
    for r in results["runs"]:
        hist = " / ".join(f"{b}: {n}" for b, n in r["histogram"].items())
        fixed = "".join(f" {r['fixed_over_ar'][str(b)]:.3f}x |" for b in results["fixed"])
        best = max([1.0, *r["fixed_over_ar"].values()])
        lines.append(f"| {r.get('acceptance') or '-'} | {r['batch']} | {r['setting']} | {hist} | {r['tau']:.2f} | "
                     f"{r['auto_ms']:.1f} / {r['ar_ms']:.1f} | {r['over_ar']:.3f}x |{fixed} "
                     f"{r['over_ar'] / best:.3f}x |")
    lines += ["", "Cost tables (ms per round at each budget):", ""]
    lines += [f"- batch {b}: " + ", ".join(f"{x}: {c:.3f}" for x, c in zip(results["budgets"], t, strict=True))
              for b, t in sorted(results["tables"].items(), key=lambda kv: int(kv[0]))]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--default", action="store_true", help="the shipped pair (ddtree_jax/default_pair)")
    src.add_argument("--pair", help="folder with target/, drafter/, tokenizer.json, data.json")
    src.add_argument("--smoke", action="store_true", help="tiny random pair, tiny sizes")
    src.add_argument("--k2-slice", type=int, metavar="LAYERS", default=None,
                     help="a K2-shaped slice of LAYERS layers (tiny CPU shapes) with a controlled-acceptance pair")
    p.add_argument("--acceptance", nargs="+", default=["high", "medium", "low"], choices=list(LEVELS),
                   help="--k2-slice: the acceptance levels (bench/_controlled.py)")
    p.add_argument("--costs-from", help="a bench_auto_budget.py results json (its auto runs' cost tables)")
    p.add_argument("--costs", nargs="*", default=[], metavar="BATCH:C0,C1,...",
                   help="one batch's ms per round at each budget of the set")
    p.add_argument("--restart-ms", type=float, default=None,
                   help="a pipeline restart's price (DecodeConfig.auto_restart; default: unknown, no probe runs "
                        "alone), added to auto's time per probe run alone")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--settings", nargs="+", default=list(ORDER), choices=list(ORDER))
    p.add_argument("--auto-max", type=int, default=16, help="auto's largest budget (DecodeConfig.auto_max_budget)")
    p.add_argument("--budgets", type=int, nargs="*", default=[4, 16],
                   help="fixed budgets replayed beside auto (each a budget of auto's set)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--b1-prompts", type=int, default=8,
                   help="batch 1: prompts decoded on their own, one after the other, their rounds summed")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="results file stem (default auto_replay_<device>_<date>)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)

    budgets = auto_budget_set(args.auto_max)
    tables = cost_tables(args.costs_from, args.costs, budgets)
    if set(args.budgets) - set(budgets) - {0}:
        raise SystemExit(f"--budgets {args.budgets}: each must be one of auto's set {budgets[1:]}")
    missing = [b for b in args.batches if b not in tables]
    if missing:
        raise SystemExit(f"no cost table for batch {missing}: give --costs-from or --costs BATCH:...")
    levels = [None]
    if args.k2_slice is not None:
        target, drafter = k2_models(args.k2_slice, smoke=True, acceptance=LEVELS[args.acceptance[0]])
        tokenizer, data, levels = None, None, args.acceptance
        pair = f"K2-shaped slice of {args.k2_slice} layers (tiny CPU shapes), controlled acceptance"
        args.dtype = "bfloat16"
    elif args.smoke:
        target, drafter, tokenizer = smoke_pair()
        args.prompt_len, args.new = min(args.prompt_len, 8), min(args.new, 8)
        pair, data = "smoke (random tiny pair)", None
    else:
        from ddtree_jax.default_model import SHIPPED_DIR

        pair = SHIPPED_DIR if args.default else args.pair
        pair = os.path.relpath(pair) if args.default else pair
        target, drafter, tokenizer = load_pair_folder(pair, args.dtype)
        data = os.path.join(pair, "data.json")
    results = dict(device=device_tag(args.smoke), date=datetime.date.today().isoformat(), pair=pair,
                   dtype=args.dtype, jax=jax.__version__, command="python " + " ".join([sys.argv[0], *sys.argv[1:]]),
                   budgets=list(budgets), fixed=list(args.budgets), new=args.new, prompt_len=args.prompt_len,
                   b1_prompts=args.b1_prompts,
                   tables={str(b): list(tables[b]) for b in args.batches}, runs=[])
    stem = args.tag or f"auto_replay_{results['device']}_{datetime.date.today():%Y%m%d}"
    os.makedirs(args.out, exist_ok=True)
    cells = [(level, b, s) for level in levels for b in args.batches for s in args.settings]
    for i, (level, batch, setting) in enumerate(cells, 1):
        if level is not None:  # the same arrays; the level is the models' static setting
            target.acceptance = drafter.acceptance = LEVELS[level]
        count = args.b1_prompts if batch == 1 else batch
        prompts, _ = heldout_prompts(data, tokenizer, count, args.prompt_len, args.new, target.config.vocab_size,
                                     args.seed)
        run = replay(target, drafter, prompts, setting, args.new, args.auto_max, tables[batch], args.seed,
                     tuple(args.budgets), alone=batch == 1, restart=args.restart_ms)
        run["acceptance"] = level
        results["runs"].append(run)
        fixed = ", ".join(f"@{b} {x:.3f}x" for b, x in run["fixed_over_ar"].items())
        _log(f"[{i}/{len(cells)}] {level + ', ' if level else ''}batch {batch}, {setting}: rounds {run['histogram']}, "
             f"{run['over_ar']:.3f}x autoregressive decoding by the table ({fixed}; {run['wall_s']:.0f} s)")
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, stem + ".md"), "w") as f:
            f.write(summarize(results))
    _log(f"wrote {os.path.join(args.out, stem)}.json and .md")
    return results


if __name__ == "__main__":
    main()
