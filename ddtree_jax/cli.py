"""Command line: ``python -m ddtree_jax generate ...``, ``python -m ddtree_jax demo`` and ``plan``.

    python -m ddtree_jax generate --target DIR --drafter DIR --tokenizer tokenizer.json \\
        --prompt "Speculative decoding" --method ddtree --budget 64 --temperature 0.7 --top-p 0.9

    python -m ddtree_jax demo      # makes the built-in default once, then runs every method on it

    python -m ddtree_jax plan --config kimi-k2 --int4 --mesh expert=8 --slots 64 --max-model-len 32768
                                   # per-device bytes by kind, whether they fit, the most slots that fit

Every option, model folder (``config.json``, architecture, weights) and the tokenizer path are
checked before JAX, a tokenizer or a model loads (``ddtree_jax/_preflight.py``). Progress goes to
stderr; with one prompt the text streams to stdout as it is committed.

Compiled programs persist between runs in JAX's compilation cache (``--compilation-cache DIR|off``,
environment ``DDTREE_JAX_COMPILATION_CACHE``, default ``~/.cache/ddtree_jax/jax_cache``; see
``ddtree_jax/compilation_cache.py``), so a second run starts decoding in seconds.

Exit status: 0 done; 2 a bad option, path, model folder, tokenizer or checkpoint (one line on
stderr, ``<prog>: error: ...``, argparse's convention); 1 the demo's greedy outputs differ between
methods; 130 interrupted. Any other failure is a bug and prints its traceback. ``--debug`` prints
the traceback of checkpoint and tokenizer errors too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from ddtree_jax import _preflight as pf
from ddtree_jax._preflight import METHODS, PreflightError, load_tokenizer
from ddtree_jax.config import ConfigError, DecodeConfig, is_int, token_id_problem

_EPILOG = ("exit status: 0 done; 2 bad option, path, model folder, tokenizer or checkpoint (one-line message); "
           "1 the demo's greedy outputs differ; 130 interrupted. Other failures are bugs and show a traceback.")


def _log(msg: str) -> None:
    sys.stderr.write(f"{msg}\n")  # one write: lines of processes sharing stderr do not interleave
    sys.stderr.flush()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` on stderr, exit status 2."""

    def error(self, message: str):
        sys.stdout.flush()
        self.exit(2, f"{self.prog}: error: {message}\n")


class _UserError(Exception):
    """A user mistake found after argument parsing; printed as one line, exit status 2."""


# ---- checks before anything loads ------------------------------------------------------------


@dataclasses.dataclass
class _Checked:
    target_cfg: dict
    drafter_cfg: dict | None
    tokenizer_path: str
    decode: DecodeConfig  # the options' decode settings (stop ids: --stop-token-id only)


def _preflight_generate(args) -> _Checked:
    try:
        decode = DecodeConfig(method=args.method, budget=args.budget, sync_every=args.sync_every,
                              seed=args.seed or 0, stop_token_ids=tuple(args.stop_token_id or ()))
        decode.check_for(None, has_drafter=bool(args.drafter))
        target_cfg = pf.check_model_dir(args.target, "target")
        drafter_cfg = None
        if args.drafter:
            drafter_cfg = pf.check_model_dir(args.drafter, "drafter")
            pf.check_pair(target_cfg, drafter_cfg, args.target, args.drafter)
        vocab = target_cfg.get("vocab_size")
        decode.check_for(vocab if is_int(vocab) else None, has_drafter=bool(args.drafter))
    except ConfigError as e:
        raise pf.option_error(e) from None
    for i, p in enumerate(args.prompt):
        if not p:
            raise PreflightError(f"--prompt #{i + 1} is empty")
    return _Checked(target_cfg, drafter_cfg, pf.resolve_tokenizer(args.tokenizer), decode)



def _encode_prompts(args, tokenizer, checked: _Checked) -> list[list[int]]:
    cfg = checked.target_cfg
    vocab, context = cfg.get("vocab_size"), cfg.get("max_position_embeddings", 4096)
    prompts = []
    for i, text in enumerate(args.prompt):
        ids = tokenizer.encode(text).ids
        if not ids:
            raise _UserError(f"--prompt #{i + 1} encodes to no tokens")
        if isinstance(vocab, int) and max(ids) >= vocab:
            raise _UserError(f"--prompt #{i + 1} encodes to token id {max(ids)}, outside --target {args.target}'s "
                             f"vocabulary [0, {vocab}): does --tokenizer {args.tokenizer} belong to this target?")
        if isinstance(context, int) and len(ids) + args.max_new_tokens > context:
            raise _UserError(f"--max-new-tokens {args.max_new_tokens}: with --prompt #{i + 1} ({len(ids)} tokens) it "
                             f"exceeds the target's context of {context} positions (max_position_embeddings)")
        prompts.append(ids)
    return prompts


def _sampling_from_args(args):
    from ddtree_jax.sampling import SamplingParams

    try:  # already checked by the argparse types; SamplingParams stays the authority
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              seed=args.seed)
    except ValueError as e:
        raise _UserError(f"bad sampling option: {e}") from None


def _stop_ids(args, checked: _Checked) -> list[int]:
    stop = list(args.stop_token_id or [])
    gen_cfg = os.path.join(os.path.dirname(os.path.abspath(args.target)), "generation_config.json")
    for cfg_path in (os.path.join(args.target, "generation_config.json"), gen_cfg):
        if os.path.isfile(cfg_path) and not args.ignore_eos:
            try:
                with open(cfg_path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:
                raise _UserError(f"--target {args.target}: cannot read {cfg_path} ({e})") from None
            eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
            vocab = checked.target_cfg.get("vocab_size")
            bad = [e for e in eos if token_id_problem(e, vocab if is_int(vocab) else None)]
            if bad:
                raise _UserError(f"--target {args.target}: eos_token_id {bad[0]!r} in {cfg_path} is not a token id "
                                 f"of its vocabulary [0, {vocab}) (--ignore-eos skips it)")
            stop += eos
            break
    return sorted(set(stop))


def _enable_cache(args) -> str | None:
    from ddtree_jax import compilation_cache

    return compilation_cache.enable(compilation_cache.resolve(args.compilation_cache))


# ---- loading and decoding --------------------------------------------------------------------


@dataclasses.dataclass
class _Models:
    target: object
    drafter: object | None
    block: int  # drafted tokens per round (the drafter's block size - 1); 0 without a drafter


def _load_models(args, need_drafter: bool) -> _Models:
    import jax.numpy as jnp

    from ddtree_jax.checkpoints import load_drafter, load_target

    dtype = {"auto": "auto", "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    _log(f"[ddtree_jax] loading the target from {args.target} ...")
    try:
        target = load_target(args.target, dtype=dtype)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        if args.debug:
            raise
        raise _UserError(f"--target {args.target}: {e}") from None
    drafter = None
    if need_drafter:
        _log(f"[ddtree_jax] loading the drafter from {args.drafter} ...")
        try:
            drafter = load_drafter(args.drafter, target)
        except (ValueError, OSError) as e:
            if args.debug:
                raise
            raise _UserError(f"--drafter {args.drafter}: {e}") from None
    _log(f"[ddtree_jax] loaded target{' + drafter' if drafter is not None else ''} in {time.perf_counter() - t0:.1f}s "
         f"(vocab {target.config.vocab_size}, {target.config.num_hidden_layers} layers)")
    return _Models(target, drafter, drafter.config.block_size - 1 if drafter is not None else 0)


def _settings(method: str, budget: int | str, block: int) -> str:
    """What a method actually ran with, in words."""
    if method == "ddtree" and budget == "auto":
        return f"tree of a budget chosen per round over a block of {block}"
    if method == "ddtree":
        return f"tree of {budget} drafted nodes over a block of {block}"
    if method == "dflash":
        return f"chain of the {block} drafted tokens"
    return "one token per target pass"


@dataclasses.dataclass
class _Run:
    method: str
    settings: str
    tokens: list[list[int]]
    new_tokens: int
    passes: int  # target passes, summed over requests
    tau: float
    seconds: float  # prefill + decoding
    compile_seconds: float
    code: str  # where the compiled programs came from (CompileWatch.code)


def _decode(args, models: _Models, prompts, tokenizer, *, stream: bool, decode: DecodeConfig, sampling) -> _Run:
    from ddtree_jax.compilation_cache import CompileWatch
    from ddtree_jax.generation import generate

    # Streaming: the prompt is echoed with the first tokens, so no message lands glued to it.
    shown = {"echoed": False, "chars": 0}
    last = [time.perf_counter()]
    total = len(prompts) * args.max_new_tokens

    def on_progress(out, gen):
        if stream:
            if not shown["echoed"]:
                sys.stdout.write(args.prompt[0])
                shown["echoed"] = True
            text = tokenizer.decode(out[0, : gen[0]].tolist())
            sys.stdout.write(text[shown["chars"] :])
            sys.stdout.flush()
            shown["chars"] = len(text)
        elif time.perf_counter() - last[0] >= 2.0 or int(gen.sum()) == total:
            last[0] = time.perf_counter()
            _log(f"[ddtree_jax]   {decode.method}: {int(gen.sum())}/{total} tokens "
                 f"({time.perf_counter() - start:.0f}s)")

    _log(f"[ddtree_jax] {decode.method} ({_settings(decode.method, decode.budget, models.block)}): prefill + decoding "
         f"{len(prompts)} prompt(s) x {args.max_new_tokens} new tokens; the first call of each shape compiles ...")
    start = time.perf_counter()
    try:
        with CompileWatch(log=_log, prefix="[ddtree_jax]   ") as watch:
            result = generate(
                models.target, models.drafter if decode.uses_drafter else None, prompts, config=decode,
                sampling=sampling, max_new_tokens=args.max_new_tokens, profile=args.profile, on_progress=on_progress,
            )
    finally:
        if stream and shown["echoed"]:
            sys.stdout.write("\n")
            sys.stdout.flush()
    if not stream:
        for prompt, r in zip(args.prompt, result.requests, strict=True):
            print(f"--- {prompt!r} ->\n{tokenizer.decode(r.tokens)}", flush=True)
    for i, r in enumerate(result.requests):
        _log(f"[ddtree_jax] request {i}: {len(r.tokens)} tokens, finish={r.finish_reason}, rounds={r.rounds}, "
             f"tau={r.tau:.2f}")
    seconds = result.seconds + result.prefill_seconds
    tps = result.new_tokens / result.seconds if result.seconds > 0 else float("nan")
    _log(f"[ddtree_jax] {result.method} ({_settings(result.method, decode.budget, models.block)}): "
         f"{result.new_tokens} tokens in {result.seconds:.2f}s + prefill {result.prefill_seconds:.2f}s "
         f"({tps:.1f} tok/s, {watch.summary()}), mean tau={result.mean_tau:.2f}")
    if result.auto is not None:
        a = result.auto
        _log("[ddtree_jax] auto budget, rounds per budget: " + ", ".join(f"{b}: {n}" for b, n in a.histogram.items())
             + f"; expected {sum(a.expected):.0f} vs realized {sum(a.realized):.0f} tokens")
    if result.time_split:
        _log("[ddtree_jax] time split: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.time_split.items()))
    return _Run(method=result.method, settings=_settings(result.method, decode.budget, models.block),
                tokens=result.tokens, new_tokens=result.new_tokens, passes=sum(r.rounds for r in result.requests),
                tau=result.mean_tau, seconds=seconds, compile_seconds=watch.seconds, code=watch.code())


def run_generate(args, parser=None) -> _Run:
    """Checks the options and folders, loads the tokenizer and models, generates, prints text and statistics."""
    try:
        checked = _preflight_generate(args)
        stop = _stop_ids(args, checked)
        tokenizer = load_tokenizer(checked.tokenizer_path, args.debug)
        prompts = _encode_prompts(args, tokenizer, checked)
        cache = _enable_cache(args)
        sampling = _sampling_from_args(args)
        _log(f"[ddtree_jax] compilation cache: {cache or 'off'}")
        models = _load_models(args, need_drafter=checked.decode.uses_drafter)
    except (PreflightError, _UserError) as e:
        _fail(parser, str(e))
    stream = len(prompts) == 1 and not args.no_stream
    decode = dataclasses.replace(checked.decode, stop_token_ids=tuple(stop))
    return _decode(args, models, prompts, tokenizer, stream=stream, decode=decode, sampling=sampling)


def _fail(parser, message: str):
    if parser is None:
        raise SystemExit(message)
    parser.error(message)


# ---- demo ------------------------------------------------------------------------------------

# Measured on 2 CPU cores (docs/training.md, "A pair on the CPU").
_MAKE_MINUTES = "4 to 7"


def run_demo(args, parser=None) -> None:
    from ddtree_jax.default_model import CODE_PROMPTS, CORPUS_PROMPTS, RECIPE_DIR, SHIPPED_DIR, is_complete

    if args.dir is None:
        args.dir = RECIPE_DIR if args.retrain else SHIPPED_DIR
    # What --dir holds: the shipped pair, the CPU recipe (made here, or to make with --retrain), or
    # any other trained pair (an export's target/, drafter/ and tokenizer.json).
    shipped = os.path.abspath(args.dir) == SHIPPED_DIR
    recipe = not shipped and (args.retrain or is_complete(args.dir))
    try:
        if os.path.exists(args.dir) and not os.path.isdir(args.dir):
            raise PreflightError(f"--dir {args.dir}: is a file, expected a folder for the default model")
        for i, p in enumerate(args.prompt or []):
            if not p:
                raise PreflightError(f"--prompt #{i + 1} is empty")
        if not recipe and not all(os.path.exists(os.path.join(args.dir, f)) for f in ("target", "drafter",
                                                                                        "tokenizer.json")):
            raise PreflightError(f"--dir {args.dir}: holds no pair (target/, drafter/, tokenizer.json); pass --retrain "
                                 "to make the CPU default there")
        if not recipe or is_complete(args.dir):
            for role in ("target", "drafter"):
                pf.check_model_dir(os.path.join(args.dir, role), role, option=f"--dir ({role})")
        cache = _enable_cache(args)
    except PreflightError as e:
        _fail(parser, str(e))
    _log(f"[ddtree_jax] compilation cache: {cache or 'off'}")
    from ddtree_jax.compilation_cache import CompileWatch
    from ddtree_jax.training.recipe import make_default

    t0 = time.perf_counter()
    if shipped:
        _log(f"[ddtree_jax] using the shipped default in {args.dir}: a Kimi-style MoE target and a DFlash drafter "
             "trained on the Python standard library (its README.md says how); --retrain makes a small one on this "
             "CPU instead")
    elif not recipe:
        _log(f"[ddtree_jax] using the pair in {args.dir} (target/, drafter/, tokenizer.json)")
    elif is_complete(args.dir):
        _log(f"[ddtree_jax] using the default made earlier in {args.dir} (target/, drafter/, tokenizer.json)")
    else:
        _log(f"[ddtree_jax] making the default in {args.dir}: a tokenizer, then training the target and the drafter "
             f"(first run only, about {_MAKE_MINUTES} minutes on 2 CPU cores; later runs reuse it) ...")
        with CompileWatch(log=_log, prefix="[ddtree_jax]   "):
            make_default(args.dir, log=_log)
        _log(f"[ddtree_jax] default ready in {time.perf_counter() - t0:.0f}s: target/, drafter/, tokenizer.json")
    prompts_text = args.prompt or list(CORPUS_PROMPTS if recipe else CODE_PROMPTS)
    base = dict(
        target=os.path.join(args.dir, "target"), drafter=os.path.join(args.dir, "drafter"),
        tokenizer=os.path.join(args.dir, "tokenizer.json"), prompt=prompts_text, budget=args.budget,
        max_new_tokens=args.max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None,
        stop_token_id=None, ignore_eos=True, dtype="float32", sync_every=8, profile=False, no_stream=True,
        compilation_cache=args.compilation_cache, debug=args.debug,
    )
    ns = argparse.Namespace(method="ddtree", **base)
    try:
        checked = _preflight_generate(ns)
        tokenizer = load_tokenizer(checked.tokenizer_path, args.debug)
        prompts = _encode_prompts(ns, tokenizer, checked)
        models = _load_models(ns, need_drafter=True)
    except (PreflightError, _UserError) as e:
        _fail(parser, str(e))
    sampling = _sampling_from_args(ns)
    runs = []
    for method in METHODS:
        _log(f"[ddtree_jax] === method {method} ===")
        runs.append(_decode(ns, models, prompts, tokenizer, stream=False,
                            decode=dataclasses.replace(checked.decode, method=method), sampling=sampling))
    same = all(r.tokens == runs[-1].tokens for r in runs)
    _summary(runs, prompts, args.max_new_tokens, same)
    if not same:
        print(f"{parser.prog if parser else 'demo'}: greedy speculative output differs from autoregressive output",
              file=sys.stderr)
        raise SystemExit(1)


def _summary(runs: list[_Run], prompts, max_new_tokens: int, same: bool) -> None:
    import jax

    ar = next((r for r in runs if r.method == "ar"), None)
    backend = jax.default_backend()
    w = max(len(r.settings) for r in runs)
    lines = [f"summary: {len(prompts)} prompts x {max_new_tokens} new tokens, greedy, float32, on {backend}",
             f"  {'method':<7} {'ran with':<{w}} {'tokens':>6} {'target passes':>13} {'tau':>5} {'wall':>7} "
             f"{'compile':>8}  compiled code"]
    for r in runs:
        lines.append(f"  {r.method:<7} {r.settings:<{w}} {r.new_tokens:>6} {r.passes:>13} {r.tau:>5.2f} "
                     f"{r.seconds:>6.1f}s {r.compile_seconds:>7.1f}s  {r.code}")
    lines.append("  tau: tokens committed per target pass (bonus token included); target passes: summed over the "
                 "prompts; wall: prefill + decoding; compile: the part of wall spent tracing and compiling, or tracing "
                 "and loading compiled code from the persistent cache")
    if ar is not None:
        for r in runs:
            if r.method != "ar" and r.passes:
                lines.append(f"  {r.method}: tau {r.tau:.2f}, so {r.passes} target passes instead of {ar.passes}: "
                             f"{1 - r.passes / ar.passes:.0%} of the target passes saved")
    lines.append(f"  greedy outputs identical across {' / '.join(r.method for r in runs)}: {same}")
    if backend == "cpu":
        lines.append("  note: on a CPU, fewer target passes do not mean less time: a CPU is bound by arithmetic, and a "
                     "verify pass costs about as much per token as a decode step, so the speculative methods are not "
                     "faster here. Wall-clock speedups need an accelerator: the shipped pair's figures on a GPU are in "
                     "bench/RESULTS.md (bench_e2e.py).")
    for line in lines:
        _log("[ddtree_jax] " + line)


# ---- plan ------------------------------------------------------------------------------------


def _plan_models(args):
    """``(target config, its Int4Format or None, dtype, drafter config, words describing them)``
    from ``--target``/``--config``, ``--drafter``/``--drafter-layers``, ``--int4``, ``--dtype``."""
    import jax.numpy as jnp

    from ddtree_jax import planner
    from ddtree_jax.models import DFlashConfig, KimiConfig

    dtype = {"auto": "auto", "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    if args.target:
        raw = pf.check_model_dir(args.target, "target", weights=False)
        try:
            tcfg, int4, dtype = planner.target_from_hf(raw, args.target, dtype)
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise PreflightError(f"--target {args.target}: {e}") from None
        if args.int4 and int4 is None:
            raise PreflightError(f"--int4: --target {args.target} has no INT4 quantization_config in config.json; "
                                 "its routed experts load dense")
        name = args.target
    else:
        tcfg, raw = KimiConfig.kimi_k2(), None
        int4 = planner.K2_INT4 if args.int4 else None
        dtype = jnp.bfloat16 if dtype == "auto" else dtype
        name = "Kimi K2"
    if args.drafter:
        draw = pf.check_model_dir(args.drafter, "drafter", weights=False)
        pf.check_pair(raw or tcfg.to_hf_dict(), draw, args.target or "kimi-k2", args.drafter)
        try:
            dcfg = DFlashConfig.from_hf_dict(draw)
        except ValueError as e:
            raise PreflightError(f"--drafter {args.drafter}: {e}") from None
    else:
        dcfg = planner.drafter_config_for(tcfg, args.drafter_layers or 1)
    experts = f"INT4 in groups of {int4.group_size}" if int4 is not None else "dense"
    words = (f"target {name}: {tcfg.num_hidden_layers} layers, {tcfg.n_routed_experts} routed experts ({experts}), "
             f"{jnp.dtype(dtype).name}; DFlash drafter: {dcfg.num_hidden_layers} layer(s), block {dcfg.block_size}")
    return tcfg, int4, dtype, dcfg, words


def _plan_report(plan, words: str, memory: int, fraction: float, usable: int) -> list[str]:
    from ddtree_jax.planner import KINDS

    gib = 2**30
    mesh = ",".join(f"{a}={s}" for a, s in plan.mesh.items()) or "none (one device)"
    rows = "data x expert" if plan.dp_attention else "data"
    lines = [words,
             f"mesh {mesh}; data-parallel attention {'on' if plan.dp_attention else 'off'}: slots split over "
             f"{plan.row_devices} row device(s) ({rows}), replicated over the rest",
             f"{plan.slots} slots of {plan.max_model_len} positions (+{plan.cache_len - plan.max_model_len} scratch), "
             f"budget {plan.budget}; largest pass: {plan.activation_pass}",
             f"  {'per device':<32} {'GiB':>9}"]
    for kind, value in plan.bytes.items():
        lines.append(f"  {KINDS[kind]:<32} {value / gib:>9.3f}")
    spare = usable - plan.total
    lines += [f"  {'total':<32} {plan.total / gib:>9.3f}",
              f"usable memory: {memory / gib:.2f} GiB x {fraction:g} = {usable / gib:.2f} GiB per device",
              f"fits: {'yes' if plan.fits(usable) else 'no'} ({abs(spare) / gib:.2f} GiB "
              f"{'to spare' if spare >= 0 else 'over'})",
              f"most slots that fit at {plan.max_model_len} positions: {plan.max_slots(usable)} "
              f"(a multiple of {plan.row_devices})"]
    return lines


def run_plan(args, parser=None) -> None:
    """Checks the options and model folders, plans (``ddtree_jax.planner.plan_capacity``) and
    prints the per-device bytes by kind, whether they fit and the most slots that fit (``--json``:
    the same as one JSON object)."""
    from ddtree_jax.serving.sharding import parse_mesh_spec

    try:
        try:
            mesh = parse_mesh_spec(args.mesh)
        except ValueError as e:
            raise PreflightError(f"--mesh: {e}") from None
        from ddtree_jax import planner

        try:
            memory = planner.device_memory(args.device_memory)
        except ValueError as e:
            raise PreflightError(f"--device-memory: {e}") from None
        tcfg, int4, dtype, dcfg, words = _plan_models(args)
        dp = args.dp_attention == "on"
        plan = planner.plan_capacity(tcfg, dcfg, mesh, slots=args.slots, max_model_len=args.max_model_len,
                                     budget=args.budget, int4=int4, dtype=dtype, dp_attention=dp,
                                     prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch)
    except ConfigError as e:
        _fail(parser, str(pf.option_error(e)))
    except PreflightError as e:
        _fail(parser, str(e))
    usable = planner.usable_memory(memory, args.memory_fraction)
    if args.json:
        print(json.dumps({
            "description": words, "mesh": plan.mesh, "dp_attention": plan.dp_attention,
            "row_devices": plan.row_devices, "slots": plan.slots, "max_model_len": plan.max_model_len,
            "cache_len": plan.cache_len, "budget": plan.budget, "activation_pass": plan.activation_pass,
            "activation_passes_bytes": plan.activation.passes(plan.slots),
            "per_device_bytes": plan.bytes, "total_bytes": plan.total, "device_memory_bytes": memory,
            "memory_fraction": args.memory_fraction, "usable_bytes": usable, "fits": plan.fits(usable),
            "max_slots": plan.max_slots(usable)}, indent=2))
    else:
        print("\n".join(_plan_report(plan, words, memory, args.memory_fraction, usable)))


# ---- argument parsing ------------------------------------------------------------------------


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from ddtree_jax import compilation_cache as cc

    ap = _Parser(prog="python -m ddtree_jax", description="Exact tree speculative decoding in JAX.", epilog=_EPILOG)
    sub = ap.add_subparsers(dest="command", required=True)
    common = _Parser(add_help=False)
    common.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                        help=f"folder of JAX's persistent compilation cache, or 'off' (default: ${cc.ENV_VAR}, else "
                             f"{cc.default_dir()})")
    common.add_argument("--debug", action="store_true", help="print tracebacks for checkpoint and tokenizer errors too")

    g = sub.add_parser("generate", parents=[common], epilog=_EPILOG,
                       help="generate text with a target (+ drafter) checkpoint")
    g.add_argument("--target", required=True, help="DeepseekV3ForCausalLM / Kimi checkpoint folder "
                                                    "(config.json + *.safetensors)")
    g.add_argument("--drafter", help="DFlash drafter checkpoint folder (not needed for --method ar)")
    g.add_argument("--tokenizer", required=True, help="tokenizer.json, or a folder that holds one")
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--method", choices=METHODS, default="ddtree")
    g.add_argument("--budget", type=pf.budget, default=64,
                   help="DDTree node budget, >= 1 (default 64), or auto: chosen per round out of 0, 4, 8, 16, 32")
    g.add_argument("--max-new-tokens", type=pf.positive_int, default=64, help=">= 1 (default 64)")
    g.add_argument("--temperature", type=pf.temperature, default=0.0, help=">= 0; 0 = greedy (default)")
    g.add_argument("--top-k", type=pf.top_k, default=0, help=">= 0; 0 = off (default)")
    g.add_argument("--top-p", type=pf.top_p, default=1.0, help="in (0, 1]; 1 = off (default)")
    g.add_argument("--min-p", type=pf.min_p, default=0.0, help="in [0, 1]; 0 = off (default)")
    g.add_argument("--seed", type=pf.seed, default=None, help="in [0, 2**32)")
    g.add_argument("--stop-token-id", type=pf.nonnegative_int, action="append",
                   help="in addition to generation_config's eos")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weight dtype; auto (default): the checkpoint's own")
    g.add_argument("--sync-every", type=pf.positive_int, default=None,
                   help="rounds on device between host checks, >= 1 (default 8; 4 with --budget auto)")
    g.add_argument("--profile", action="store_true", help="time draft/tree/verify/sample/commit separately")
    g.add_argument("--no-stream", action="store_true")

    d = sub.add_parser("demo", parents=[common], epilog=_EPILOG,
                       help="run every method on the built-in default pair (shipped; or made on the CPU with "
                            "--retrain)")
    from ddtree_jax.default_model import RECIPE_DIR, SHIPPED_DIR

    d.add_argument("--retrain", action="store_true",
                   help="instead of the shipped pair, make a small default on this CPU (once, a few minutes; reused "
                        "after) and run on it")
    d.add_argument("--dir", default=None,
                   help=f"the default's folder (default: the shipped pair, {SHIPPED_DIR}; with --retrain, where the "
                        f"CPU recipe writes it, default {RECIPE_DIR})")
    d.add_argument("--prompt", action="append",
                   help="repeat for a batch (default: three code prompts; with --retrain, three corpus sentences)")
    d.add_argument("--budget", type=pf.positive_int, default=32,
                   help="DDTree node budget, >= 1 (default 32); dflash drafts the chain of the drafter's block, "
                        "ar one token per pass")
    d.add_argument("--max-new-tokens", type=pf.positive_int, default=64, help=">= 1 (default 64)")
    from ddtree_jax.serving.cli import add_serve_parser

    s = add_serve_parser(sub)
    return ap, {"generate": g, "demo": d, "serve": s, "plan": _plan_parser(sub)}


def _plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", epilog=_EPILOG,
                       help="per-device memory of a serving setup by kind (weights, caches, state, activations), "
                            "whether it fits, and the most slots that fit (docs/capacity.md)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--target", help="target checkpoint folder (its config.json; the weights may be absent)")
    target.add_argument("--config", choices=("kimi-k2",), help="a published target architecture")
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--drafter", help="DFlash drafter checkpoint folder (its config.json)")
    drafter.add_argument("--drafter-layers", type=pf.positive_int,
                         help="instead: a DFlash drafter of this many layers shaped for the target (default 1)")
    p.add_argument("--mesh", default="", help="device mesh, e.g. expert=8 or data=2,expert=4 (default: one device)")
    p.add_argument("--dp-attention", choices=("on", "off"), default="on",
                   help="as serve's: on (the default), the slots split over the mesh's data and expert axes; off: "
                        "over data only")
    p.add_argument("--int4", action="store_true",
                   help="INT4 routed experts in groups of 32 (Kimi K2 Thinking's); a --target's come from its "
                        "quantization_config")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weight dtype; auto (default): the target's own (--config kimi-k2: bfloat16)")
    p.add_argument("--slots", type=pf.positive_int, required=True, help="requests decoded at once")
    p.add_argument("--max-model-len", type=pf.positive_int, required=True, help="prompt + max_tokens per slot")
    p.add_argument("--budget", type=pf.budget, default=64, help="DDTree node budget, >= 1 (default 64), or auto")
    p.add_argument("--prefill-chunk", type=pf.positive_int, default=512, help="prompt tokens per slot per engine step")
    p.add_argument("--prefill-batch", type=pf.positive_int, help="most slots prefilled per engine step (default: all)")
    p.add_argument("--device-memory", default="h200",
                   help="bytes per device, or h200 (141e9 bytes; the default)")
    p.add_argument("--memory-fraction", type=pf.memory_fraction, default=0.9,
                   help="share of the device memory the plan may fill, in (0, 1] (default 0.9)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv=None) -> None:
    ap, subs = _parser()
    args = ap.parse_args(argv)
    sub = subs[args.command]
    try:
        if args.command == "generate":
            run_generate(args, sub)
        elif args.command == "serve":
            from ddtree_jax.serving.cli import run_serve

            run_serve(args, sub)
        elif args.command == "plan":
            run_plan(args, sub)
        else:
            run_demo(args, sub)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"\n{sub.prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
