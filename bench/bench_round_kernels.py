"""Where a decoding round's device time goes, per method and budget, beside an autoregressive step
at the same batch, in one run.

    PYTHONUNBUFFERED=1 python bench/bench_round_kernels.py --batch 64 --plans ar:0 ddtree:4 ddtree:16
    python bench/bench_round_kernels.py --smoke --out /tmp/bench     # a tiny random pair on the CPU

The round is the engine's compiled call (``serving._device.rounds_and_harvest``, one round and its
read-back), on the shipped pair (greedy, every row running, 128-token held-out prompts, the cache
of ``generate``'s default length). Per plan: wall microseconds per round over ``--rounds`` calls
back to back (untraced); device microseconds per round (the sum of its kernels on the GPU's
streams, from a profiler trace of as many calls) and kernels per round; both over the
autoregressive step's; the ``--top`` kernels by time. A plan ``method:budget:ref`` runs the
drafter's attention through its plain-JAX reference instead of the kernel (the round as it was
before the kernel), in the same run; ``ar:0:ctx`` is the autoregressive round that also extends
the drafter's context as it commits, ``ar:0:held`` the same round holding that context back and
adding it every ``DEFER_ROUNDS`` rounds (``budget="auto"``'s budget 0 in the engine: the flush
op counted in the rounds it serves). A plan ``method:budget:chunk`` runs ``generate``'s compiled
call instead, ``--chunk`` rounds in its device-side loop, and ``auto:budget`` the call
``budget="auto"`` runs at that budget (``auto_round.run_tallied_rounds`` of the set up to
``--auto-max``: at budget 0 plain rounds holding the drafter's context back, flushed every
``auto_round.HELD_DISPATCHES`` calls; above it the rounds and their tally), so the auto programs'
extra work shows against the fixed ones; ``probe:budget`` the probing call ``budget="auto"``
runs (``auto_round.run_probe_rounds``: the held-back context added, one drafted round at that
budget, then plain rounds holding their context back), timed per round of the call;
``probe:budget:mixed`` the same probing call as one call in ``MIXED`` among plain ``auto:0``
calls of known trip count (as ``generate`` runs it), all of them timed. Two candidate forms of
that call, for the same rounds:
``method:budget:fixed`` (a loop of known trip count, ``generate``'s form on GPUs: no predicate
read back each iteration, no early end; ``auto:budget:fixed``: ``run_fixed_tallied_rounds``) and
``method:budget:unrolled`` (``decode_round.unrolled_rounds``: no loop). With
``--ahead`` the timed calls are read back one call late, the way ``generate`` overlaps a call's
launch with the previous call's rounds (a call that makes the host wait for its rounds gains
nothing from it), and ``launch_us`` is the host time spent launching them, per round. On
a CPU there is no device trace: wall time only. Results: ``round_kernels_<device>_<date>.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import Report, device_trace, log
from bench.bench_e2e import heldout_prompts, smoke_pair
from ddtree_jax.auto_budget import AutoPlan
from ddtree_jax.auto_round import (
    DEFER_ROUNDS,
    HELD_DISPATCHES,
    round_plans,
    run_fixed_tallied_rounds,
    run_flush,
    run_probe_rounds,
    run_tallied_rounds,
    with_deferred,
)
from ddtree_jax.backend import REFERENCE, resolve_backend
from ddtree_jax.config import auto_budget_set
from ddtree_jax.decode_round import DecodePlan, Models, prefill, run_rounds, unrolled_rounds
from ddtree_jax.decode_state import NO_STOP
from ddtree_jax.generation import _progress
from ddtree_jax.sampling import SamplingParams, batch_sampling
from ddtree_jax.serving import _device

CAPACITY = 1024  # new tokens a row may hold: the rounds never finish a row
MIXED = 4  # probe:budget:mixed: one probing call in this many
FORMS = ("fixed", "unrolled", "mixed")  # the chunked calls' forms besides the plain loop


def shipped_pair():
    from tokenizers import Tokenizer

    import ddtree_jax as dt
    from ddtree_jax.default_model import SHIPPED_DIR

    target = dt.load_target(os.path.join(SHIPPED_DIR, "target"))
    drafter = dt.load_drafter(os.path.join(SHIPPED_DIR, "drafter"), target)
    return target, drafter, Tokenizer.from_file(os.path.join(SHIPPED_DIR, "tokenizer.json")), SHIPPED_DIR


def start_state(models, tp, dp, plan, prompts):
    """Every prompt prefilled into its own running row (greedy)."""
    b = len(prompts)
    lengths = np.array([len(q) for q in prompts], np.int32)
    padded = np.zeros((b, int(lengths.max()) - 1), np.int32)
    for i, q in enumerate(prompts):
        padded[i, : len(q) - 1] = q[:-1]
    roots = np.array([q[-1] for q in prompts], np.int32)
    return prefill(models, tp, dp, plan, jnp.asarray(padded), jnp.asarray(lengths - 1), jnp.asarray(roots),
                   max_len=int(lengths.max()) + CAPACITY + 64, capacity=CAPACITY,
                   max_new_tokens=jnp.full((b,), CAPACITY, jnp.int32), stop_ids=jnp.full((b, 1), NO_STOP, jnp.int32),
                   sampling=batch_sampling(SamplingParams(temperature=0.0), b),
                   request_ids=jnp.arange(b, dtype=jnp.uint32))


def with_attention(drafter, backend):
    """The drafter (the same weights) with its attention run on ``backend``."""
    from flax import nnx

    graphdef, state = nnx.split(drafter)
    drafter = nnx.merge(graphdef, state)
    drafter._attend_on(backend)
    return drafter


@functools.partial(jax.jit, static_argnames=("models", "plan", "rounds"), donate_argnames=("state",))
def _unrolled(models, tp, dp, plan, state, key, rounds: int):
    return unrolled_rounds(models, tp, dp, plan, state, key, rounds)


def measure(target, drafter, prompts, method: str, budget: int, rounds: int, trace: bool,
            context: str = "", chunk: int = 0, auto_max: int = 16, form: str = "loop", ahead: bool = False) -> dict:
    """Wall and device time per round of one plan (module doc); ``context``: for an autoregressive
    round, ``"ctx"`` to extend the drafter's context as it commits, ``"held"`` to hold it back
    and flush it every ``DEFER_ROUNDS`` rounds (``budget="auto"``'s budget 0); ``chunk``: rounds
    per call of ``generate``'s compiled call (0: the engine's one-round call); ``method="auto"``:
    ``budget="auto"``'s call at ``budget`` (with ``chunk`` rounds); ``form``: the chunked call's
    form (``"loop"``: ``run_rounds``; ``"fixed"``: ``run_rounds``' loop of known trip count, as
    ``generate`` runs on GPUs; ``"unrolled"``: ``decode_round.unrolled_rounds``);
    ``ahead``: time the calls read back one call late."""
    probe = method == "probe"
    auto = method == "auto" or probe
    uses = method != "ar" or bool(context)
    plan = DecodePlan(method="ddtree" if auto else method, budget=auto_max if auto else budget,
                      backend=resolve_backend("auto"),
                      hidden_layer_ids=tuple(drafter.config.target_layer_ids) if uses else ())
    if auto:
        budgets = auto_budget_set(auto_max)
        plans = round_plans(plan, AutoPlan(budgets=budgets, draft_len=drafter.config.block_size - 1, probe_every=8))
        plan = plans[budgets.index(budget)]
        plain = plans[0]
    models, tp, dp = Models.split(target, drafter if uses else None)
    key = jax.random.key(0)
    box, calls = [start_state(models, tp, dp, plan, prompts)], [0]
    if context == "held" or auto:
        box[0] = with_deferred(box[0], drafter, HELD_DISPATCHES * chunk if auto else DEFER_ROUNDS)

    def one_round():
        if context == "held" and calls[0] % DEFER_ROUNDS == DEFER_ROUNDS - 1:
            box[0] = _device.flush(models, tp, dp, box[0])
        if auto and budget == 0 and calls[0] % HELD_DISPATCHES == 0:  # (generate's flushes)
            box[0] = run_flush(models, tp, dp, box[0])
        calls[0] += 1
        # (chunked calls: what generate reads back after each, its own array: the next call takes the state)
        if probe and form == "mixed" and (calls[0] - 1) % MIXED:  # a plain call between probes
            box[0] = run_rounds(models, tp, dp, plain, box[0], key, chunk, True)
            return _progress(box[0])
        if probe:  # the probing call (it adds the held-back context itself)
            box[0], tally = run_probe_rounds(models, tp, dp, plan, plain, box[0], key, chunk,
                                             form in ("fixed", "mixed"))
            return _progress(box[0], tally)
        if auto and budget == 0:  # plain rounds holding the drafter's context back
            box[0] = run_rounds(models, tp, dp, plan, box[0], key, chunk, form == "fixed")
            return _progress(box[0])
        if auto:
            tallied = run_fixed_tallied_rounds if form == "fixed" else run_tallied_rounds
            box[0], tally = tallied(models, tp, dp, plan, box[0], key, chunk)
            return _progress(box[0], tally)
        if chunk:
            box[0] = (_unrolled(models, tp, dp, plan, box[0], key, chunk) if form == "unrolled" else
                      run_rounds(models, tp, dp, plan, box[0], key, chunk, form == "fixed"))
            return _progress(box[0])
        box[0], packed = _device.rounds_and_harvest(models, tp, dp, plan, box[0], key, rounds=1, tokens=16)
        return packed

    def read_each():
        return jax.device_get(one_round())

    per_call = chunk or 1
    calls_timed = max(1, rounds // per_call)
    t0 = time.perf_counter()
    read_each()
    first_call_s = time.perf_counter() - t0  # the compile, mostly
    for _ in range(max(2, calls_timed - 1)):  # as many untimed calls as timed (the first plan ran slow)
        read_each()
    t0 = time.perf_counter()
    last, launching = None, 0.0
    for _ in range(calls_timed):
        if ahead:  # launch this call, then read the previous one back
            t = time.perf_counter()
            out = one_round()
            launching += time.perf_counter() - t
            if last is not None:
                jax.device_get(last)
            last = out
        else:
            last = read_each()
    jax.block_until_ready(last)
    row = dict(wall_us=(time.perf_counter() - t0) / (calls_timed * per_call) * 1e6, first_call_s=first_call_s)
    if ahead:
        row["launch_us"] = launching / (calls_timed * per_call) * 1e6
    if trace:
        kernels, launched = device_trace(read_each, (), calls_timed)
        row.update(device_us=sum(kernels.values()) / 1e3 / per_call, kernels=launched / per_call,
                   top=sorted(((k, v / per_call) for k, v in kernels.items()), key=lambda kv: -kv[1]))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny random pair on the CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--plans", nargs="+", default=["ar:0", "ddtree:4", "ddtree:16"],
                    help="method:budget[:variant] (module doc); x ar: over ar:0, or ar:0:chunk for chunked plans "
                         "(ar:0 is added if absent)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds timed (and traced) per plan")
    ap.add_argument("--chunk", type=int, default=8, help="rounds per call of the :chunk and auto plans")
    ap.add_argument("--auto-max", type=int, default=16, help="the auto plans' largest budget")
    ap.add_argument("--ahead", action="store_true", help="read each timed call back one call late (module doc)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    plans = [(m, int(b), rest[0] if rest else "") for m, b, *rest in (p.split(":") for p in args.plans)]
    if not any(m == "ar" and not v for m, _, v in plans):
        plans.insert(0, ("ar", 0, ""))
    if args.smoke:
        (target, drafter, tokenizer), data = smoke_pair(), None
        args.batch, args.rounds = min(args.batch, 2), min(args.rounds, 3)
    else:
        target, drafter, tokenizer, pair = shipped_pair()
        data = os.path.join(pair, "data.json")
    prompts, _ = heldout_prompts(data, tokenizer, args.batch, 128 if not args.smoke else 16, 128,
                                 target.config.vocab_size, 0)
    trace = jax.default_backend() == "gpu"
    report = Report(args, name="round_kernels", title="One decoding round's device time by kernel",
                    sections=("rounds", "kernels"))
    report.notes.append(f"Batch {args.batch}, greedy, every row running; {args.rounds} rounds back to back per "
                        "plan (wall: untraced; device: the sum of the round's kernels in a trace of as many). "
                        "x ar: over the autoregressive step of the same run.")
    rows = {}
    for method, budget, variant in plans:
        chunked = variant in ("chunk", "fixed", "unrolled", "mixed") or method in ("auto", "probe")
        note = {"ref": " (reference drafter attention)", "ctx": " extending the drafter's context",
                "held": " holding the drafter's context back", "fixed": " (a loop of known trip count)",
                "mixed": f" (one call in {MIXED}, the others plain)",
                "unrolled": " (unrolled)"}.get(variant, "")
        note += f" ({args.chunk} rounds a call{', read one call late' if args.ahead else ''})" if chunked else ""
        log(f"{method}:{budget}{note} at batch {args.batch}")
        d = with_attention(drafter, REFERENCE) if variant == "ref" else drafter
        rows[(method, budget, variant)] = r = measure(target, d, prompts, method, budget, args.rounds, trace,
                                                      context=variant if variant in ("ctx", "held") else "",
                                                      chunk=args.chunk if chunked else 0, auto_max=args.auto_max,
                                                      form=variant if variant in FORMS else "loop",
                                                      ahead=args.ahead and chunked)
        same = "fixed" if variant in ("fixed", "mixed") else "chunk"  # x ar: the same kind of call
        ar = (chunked and (rows.get(("ar", 0, same)) or rows.get(("ar", 0, "chunk")))) or rows.get(("ar", 0, "")) or r
        name = ("ar" if method == "ar" else f"{method}@{budget}") + note
        out = dict(plan=name, wall_us=r["wall_us"],
                   wall_x_ar=r["wall_us"] / ar["wall_us"], first_call_s=r["first_call_s"])
        if "launch_us" in r:
            out["launch_us"] = r["launch_us"]
        if trace:
            out.update(device_us=r["device_us"], device_x_ar=r["device_us"] / ar["device_us"], kernels=r["kernels"])
            for name, ns in r["top"][: args.top]:
                report.add("kernels", dict(plan=out["plan"], kernel=name[:60], us_per_round=ns / 1e3))
        report.add("rounds", out)
        log(", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
    log(f"wrote {report.stem}.md")
    return report


if __name__ == "__main__":
    main()
