"""``python -m ddtree_jax serve``: the OpenAI-compatible server on a target (+ drafter) checkpoint.

    python -m ddtree_jax serve --target DIR --drafter DIR --tokenizer tokenizer.json \\
        [--method ddtree --budget 64] [--slots 8] [--host 127.0.0.1] [--port 8000] [--mesh expert=4,tensor=2]
        [--deterministic {auto,on,off}]

Also runnable alone: ``python -m ddtree_jax.serving.cli ...`` (same options). Stop tokens: the
``eos_token_id`` of ``generation_config.json`` in the target directory (or beside it), else the
tokenizer config's ``eos_token``, plus ``--stop-token-id``; ``--ignore-eos`` drops the defaults.

Start-up, in this order: ``preflight`` checks every option, folder, config, weights header,
tokenizer path and chat template the way ``generate`` does (``ddtree_jax/_preflight.py``; no JAX
imported yet); the port is bound (not yet listening), so a taken port is found at once; the
persistent compilation cache is enabled (``--compilation-cache``, as for ``generate``;
``ddtree_jax/compilation_cache.py``); the tokenizer and the models load; the optional warm-up
compiles the engine's shapes and reports its time; the server listens. A mistake anywhere before
listening is one line on stderr, ``<prog>: error: <option> <path>: ...``, exit status 2
(``--debug``: the traceback of loading errors). The server's shutdown on SIGTERM / SIGINT drains
(``--drain-timeout``; ``ddtree_jax/serving/server.py``) and exits 0.

``--engine-process``: the compilation cache, the models, the warm-up and the engine run in a
spawned process of their own, the HTTP front end in this one
(``ddtree_jax/serving/engine_process.py``); a loading error there is the same one line and exit
status 2. ``--api-servers N``: N HTTP front-end processes on the one port, each with its own
connection to the engine process (``serve_front_end``; docs/serving.md, "Several front ends").

The API key: ``--api-key``, else the environment variable ``DDTREE_JAX_API_KEY`` (which keeps it
out of the process list); without one, ``/v1/*`` is open.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from ddtree_jax import _preflight as pf
from ddtree_jax._preflight import PreflightError, option_error
from ddtree_jax.config import METHODS, ConfigError, DecodeConfig, EngineConfig, ExecutionConfig

__all__ = ["add_arguments", "add_serve_parser", "build_engine", "chat_template", "main", "preflight", "run_serve",
           "served_model_name", "set_switch_interval", "warm_up"]

# ddtree_jax.serving.server's constants, restated so that argument parsing does not import the
# server (tests/test_serve_cli.py checks that they agree).
API_KEY_ENV = "DDTREE_JAX_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_DRAIN_TIMEOUT = 20.0
DETERMINISTIC = ("auto", "on", "off")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``serve`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree_jax import compilation_cache as cc

    p.add_argument("--target", required=True, help="HF DeepseekV3ForCausalLM checkpoint directory")
    p.add_argument("--drafter", help="DFlash drafter checkpoint directory (not needed for --method ar)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, or a folder that holds one (chat template: "
                                                      "tokenizer_config.json beside it)")
    p.add_argument("--method", choices=METHODS, default="ddtree")
    p.add_argument("--budget", type=pf.budget, default=64,
                   help="DDTree node budget, or auto: chosen per round out of 0, 4, 8, 16, 32")
    p.add_argument("--slots", type=pf.positive_int, default=8, help="requests decoded at once")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                       "only; set --api-key before opening it to others)")
    p.add_argument("--port", type=pf.port, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; unset: open)")
    p.add_argument("--served-model-name", help="the model id clients use (default: the target directory's name)")
    p.add_argument("--max-model-len", type=pf.positive_int, help="prompt + max_tokens limit; sets the cache size "
                                                                 "(default: the target's context, at most 8192)")
    p.add_argument("--max-queue", type=pf.positive_int, default=256, help="waiting requests before 503")
    p.add_argument("--max-request-bytes", type=pf.positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--drain-timeout", type=pf.nonnegative_float, default=DEFAULT_DRAIN_TIMEOUT,
                   help="seconds the running requests get to finish after SIGTERM/SIGINT before they end with "
                        f"finish_reason 'abort' (default {DEFAULT_DRAIN_TIMEOUT:g})")
    p.add_argument("--max-logprobs", type=pf.nonnegative_int, default=0,
                   help="most top alternatives a request may ask for with its tokens' log-probabilities "
                        "(default 0: no log-probabilities, requests for them get 400)")
    p.add_argument("--page-size", type=pf.positive_int,
                   help="paged caches of this many positions per page (a power of two >= 16): the slots share one "
                        "pool, requests are admitted and preempted by pages and share the pages of common prefixes "
                        "(default: every slot owns --max-model-len positions; docs/paged-caches.md)")
    p.add_argument("--kv-cache-memory", type=pf.memory_size,
                   help="with --page-size: the page pool's size, in bytes (e.g. 40GiB) or as a share in (0, 1) of "
                        "the device memory free after loading (default: --slots full-length slots' worth)")
    p.add_argument("--prefill-chunk", type=pf.positive_int, default=512, help="prompt tokens per slot per engine step")
    p.add_argument("--prefill-batch", type=pf.positive_int, help="most slots prefilled per engine step (default: all)")
    p.add_argument("--admit-group", type=pf.positive_int,
                   help="while requests queue, admit them once this many slots are free (default: slots / 8)")
    p.add_argument("--admit-wait", type=pf.nonnegative_int, default=8,
                   help="most engine steps a free slot waits for --admit-group")
    p.add_argument("--sync-every", type=pf.positive_int_or_auto, default=None,
                   help="rounds per engine dispatch, or auto: 1, 2 or 4 by their measured cost (default: auto on a "
                        "GPU with a fixed budget, else 1)")
    p.add_argument("--read-lag", type=int, choices=(1, 2), default=None,
                   help="engine steps from a dispatch to its read-back (default: with --sync-every auto 2 after a "
                        "dispatch of several rounds and 1 after one, else 1; EngineConfig.read_lag)")
    p.add_argument("--seed", type=pf.seed, default=0, help="base key of the random streams")
    p.add_argument("--default-max-tokens", type=pf.positive_int, default=16, help="/v1/completions max_tokens default")
    p.add_argument("--stop-token-id", type=pf.nonnegative_int, action="append", help="in addition to the EOS token")
    p.add_argument("--ignore-eos", action="store_true", help="no default stop token")
    p.add_argument("--chat-template", help="a jinja2 file overriding tokenizer_config.json's template")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--mesh", default="", help="device mesh, e.g. expert=4,tensor=2 or data=2,expert=4 "
                                              "(default: one device)")
    p.add_argument("--dp-attention", choices=("on", "off"), default="on",
                   help="on (the default): the slots split over the mesh's data and expert axes, each device "
                        "holding and computing only its own slots' attention, caches, dense layers, LM head and "
                        "trees, the experts exchanging tokens around each MoE layer; off: slots split over data "
                        "only (docs/sharding.md)")
    p.add_argument("--impl", choices=("auto", "pallas", "reference"), default="auto")
    p.add_argument("--deterministic", choices=DETERMINISTIC, default="auto",
                   help="batch-invariant models: a seeded request's output depends only on the request, never on "
                        "what else shares the batch (EngineConfig.deterministic; needs the Triton kernels on one "
                        "device). auto (the default): on where they run compiled (an NVIDIA GPU, no --mesh); "
                        "docs/serving.md, 'Deterministic mode'")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling before listening")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine (models, device steps, detokenisation) in a process of its own, the HTTP "
                        "front end in this one: they no longer share one interpreter lock (docs/serving.md, "
                        "'Two processes')")
    p.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="HTTP front-end processes sharing the port (N > 1 implies --engine-process): parsing, "
                        "detokenising and server-sent events spread over N interpreters (docs/serving.md, "
                        "'Several front ends')")
    p.add_argument("--switch-interval", type=pf.positive_float, default=None, metavar="MS",
                   help="the interpreter's thread switch interval in every process of the server (default: "
                        "Python's, 5 ms): how long a thread that needs the interpreter lock (a new request's "
                        "intake, the engine process's message loop) may wait for the busy one holding it")
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help=f"folder of JAX's persistent compilation cache, or 'off' (default: ${cc.ENV_VAR}, else "
                        f"{cc.default_dir()})")
    p.add_argument("--debug", action="store_true", help="print tracebacks for checkpoint and tokenizer errors too")
    p.add_argument("--log-level", default="info")


def log(msg: str) -> None:
    """One ``[ddtree_jax.serve]`` line on stderr, in one write: the engine process and the front ends
    share stderr, and a line written in pieces (text, then newline) interleaves with theirs."""
    sys.stderr.write(f"[ddtree_jax.serve] {msg}\n")
    sys.stderr.flush()


def engine_config(args) -> EngineConfig:
    """The ``EngineConfig`` of parsed ``serve`` arguments (stop ids: ``--stop-token-id`` only; the
    EOS ids join at load), checked by the same dataclasses as ``generate`` and the ``Engine``;
    raises ``PreflightError`` naming the option."""
    try:
        config = EngineConfig(
            decode=DecodeConfig(method=args.method, budget=args.budget, sync_every=args.sync_every, seed=args.seed,
                                stop_token_ids=tuple(args.stop_token_id or ()), impl=args.impl),
            slots=args.slots, max_model_len=args.max_model_len, max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch,
            admit_group=args.admit_group, admit_wait=args.admit_wait, max_logprobs=args.max_logprobs,
            deterministic=args.deterministic == "on", page_size=args.page_size, read_lag=args.read_lag)
        if args.kv_cache_memory is not None and args.page_size is None:
            raise PreflightError(f"--kv-cache-memory {args.kv_cache_memory}: needs --page-size (the pool's pages)")
        config.decode.check_for(None, has_drafter=bool(args.drafter))
    except ConfigError as e:
        raise PreflightError(str(option_error(e))) from None
    return config


def _kv_pages(args, target, drafter) -> int | None:
    """The page pool's pages for ``--kv-cache-memory`` (bytes, or a share of the first device's
    memory free now, after loading), ``None`` without it."""
    import jax

    from ddtree_jax.serving._device import page_bytes

    memory = args.kv_cache_memory
    if memory is None:
        return None
    if isinstance(memory, float):
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise PreflightError(f"--kv-cache-memory {memory}: this device reports no memory size; give bytes "
                                 "(e.g. 8GiB)")
        memory = int(memory * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    per_page = page_bytes(target, drafter if args.method != "ar" else None, args.page_size)
    pages = memory // per_page
    if pages < 1:
        raise PreflightError(f"--kv-cache-memory {args.kv_cache_memory}: less than one page ({per_page} bytes)")
    return int(pages)


def mesh_axes_of(args) -> dict:
    """The models' and the state's logical -> mesh axis map for ``--dp-attention``."""
    from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES, NO_DP_ATTENTION

    return DEFAULT_MESH_AXES if args.dp_attention == "on" else NO_DP_ATTENTION


def _check_slots(args, sizes: dict[str, int]) -> None:
    """``--slots`` splits over the devices the slots live on (``ddtree_jax.rows``)."""
    rows = mesh_axes_of(args)["rows"]
    split = {a: sizes[a] for a in rows if sizes.get(a, 1) > 1}
    devices = math.prod(split.values())
    if args.slots % devices:
        hint = "; or --dp-attention off: slots split over data only" if "expert" in split else ""
        raise PreflightError(f"--slots {args.slots}: must be a multiple of the {devices} devices the slots split "
                             f"over ({', '.join(f'{a}={n}' for a, n in split.items())}){hint}")


def preflight(args) -> str:
    """Checks every option and file before anything loads (no JAX): the folders, configs and
    weights headers of the target and drafter and that they fit together, the stop tokens, the
    context, the mesh spec, the tokenizer path, ``tokenizer_config.json`` and the chat template,
    the API key. Returns the tokenizer file; raises ``PreflightError`` naming the option."""
    from ddtree_jax.serving.sharding import parse_mesh_spec

    if args.method != "ar" and not args.drafter:
        raise PreflightError(f"--method {args.method} needs --drafter (a DFlash drafter folder); "
                             "only --method ar runs without one")
    engine_config(args)
    if args.api_servers < 1:
        raise PreflightError(f"--api-servers {args.api_servers}: must be >= 1 (HTTP front-end processes)")
    if args.deterministic == "on" and args.mesh:
        raise PreflightError("--deterministic on: the fixed-order products run on one device; drop --mesh "
                             "(or --deterministic off)")
    if args.deterministic == "on" and args.impl == "reference":
        raise PreflightError("--deterministic on: needs the Triton kernels; --impl reference runs none "
                             "(use --impl auto on an NVIDIA GPU, or --impl pallas)")
    target_cfg = pf.check_model_dir(args.target, "target")
    if args.drafter:
        pf.check_pair(target_cfg, pf.check_model_dir(args.drafter, "drafter"), args.target, args.drafter)
    vocab, context = target_cfg.get("vocab_size"), target_cfg.get("max_position_embeddings")
    for s in args.stop_token_id or []:
        if isinstance(vocab, int) and s >= vocab:
            raise PreflightError(f"--stop-token-id {s}: outside --target {args.target}'s vocabulary [0, {vocab})")
    if isinstance(vocab, int) and args.max_logprobs > vocab:
        raise PreflightError(f"--max-logprobs {args.max_logprobs}: more than --target {args.target}'s vocabulary "
                             f"of {vocab} tokens")
    if not args.ignore_eos:
        pf.eos_token_ids(args.target, vocab)
    if args.max_model_len is not None and isinstance(context, int) and not 2 <= args.max_model_len <= context:
        raise PreflightError(f"--max-model-len {args.max_model_len}: must be in [2, {context}] (--target "
                             f"{args.target}'s max_position_embeddings)")
    try:
        sizes = parse_mesh_spec(args.mesh)
    except ValueError as e:
        raise PreflightError(f"--mesh: {e}") from None
    if -1 not in sizes.values():
        _check_slots(args, sizes)
    tokenizer = pf.resolve_tokenizer(args.tokenizer)
    tokenizer_config = os.path.join(os.path.dirname(os.path.abspath(tokenizer)), "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        pf.check_json_object(tokenizer_config, f"--tokenizer {args.tokenizer}")
    if args.chat_template:
        _check_template_file(args.chat_template)
    if args.api_key == "":
        raise PreflightError("--api-key: empty; give a key, or leave the option out for an open server")
    return tokenizer


def _check_template_file(path: str) -> None:
    import jinja2

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PreflightError(f"--chat-template {path}: cannot read it ({e})") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise PreflightError(f"--chat-template {path}: not a jinja2 template (line {e.lineno}: {e.message})") from None


def default_stop_ids(target_dir: str, tokenizer, tokenizer_path: str) -> list[int]:
    """EOS ids: ``generation_config.json`` in or beside the target directory, else the tokenizer
    config's ``eos_token``."""
    eos = pf.eos_token_ids(target_dir, None)
    if eos is not None:
        return eos
    from ddtree_jax.serving.server import load_chat_template

    _, specials = load_chat_template(tokenizer_path)
    eos = specials.get("eos_token")
    tid = tokenizer.token_to_id(eos) if eos else None
    return [tid] if tid is not None else []



def _load(option: str, path: str, debug: bool, load):
    """``load()``, its checkpoint errors as one line naming ``option`` and ``path``."""
    try:
        return load()
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        if debug:
            raise
        raise PreflightError(f"{option} {path}: {e}") from None


def build_engine(args):
    """Loads the models (on the mesh) and tokenizer and returns ``(engine, model name, template, specials)``.
    Loading errors raise ``PreflightError`` naming the option (``args.debug``: the original error)."""
    import jax.numpy as jnp

    from ddtree_jax.checkpoints import load_drafter, load_target
    from ddtree_jax.serving.engine import Engine
    from ddtree_jax.serving.sharding import make_mesh, state_sharding

    debug = getattr(args, "debug", False)
    config = engine_config(args)
    tokenizer_path = pf.resolve_tokenizer(args.tokenizer)
    tokenizer = pf.load_tokenizer(tokenizer_path, debug)
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        raise PreflightError(f"--mesh: {e}") from None
    if mesh is not None:
        _check_slots(args, dict(mesh.shape))
    mesh_axes = mesh_axes_of(args)
    dtype = {"auto": "auto", "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    # --deterministic on: both models on --impl's kernels (on a CPU, --impl pallas: interpret mode)
    execution = ExecutionConfig(impl=args.impl) if config.deterministic else None
    target = _load("--target", args.target, debug,
                   lambda: load_target(args.target, mesh=mesh, dtype=dtype, execution=execution,
                                       mesh_axes=mesh_axes))
    drafter = (_load("--drafter", args.drafter, debug,
                     lambda: load_drafter(args.drafter, target, mesh=mesh, execution=execution,
                                          mesh_axes=mesh_axes))
               if config.decode.uses_drafter else None)
    log(f"loaded in {time.perf_counter() - t0:.1f}s; mesh {dict(mesh.shape) if mesh is not None else 'none'}")
    stop = [] if args.ignore_eos else default_stop_ids(args.target, tokenizer, tokenizer_path)
    stop += list(config.decode.stop_token_ids)
    deterministic = config.deterministic or (args.deterministic == "auto" and mesh is None
                                             and target.backend.kernels and not target.backend.interpret)
    try:
        config = dataclasses.replace(config, decode=dataclasses.replace(config.decode, stop_token_ids=tuple(stop)),
                                     deterministic=deterministic, kv_pages=_kv_pages(args, target, drafter))
        engine = Engine(target, drafter, config, tokenizer=tokenizer, shard_state=state_sharding(mesh, mesh_axes))
    except ConfigError as e:
        if e.field == "stop_token_ids":  # the EOS ids joined the option's
            raise PreflightError(f"--stop-token-id or the EOS ids of {args.target}: {e.message}") from None
        if e.field in ("batch_invariant", "deterministic"):
            raise PreflightError(f"--deterministic {args.deterministic}: {e.message}") from None
        raise PreflightError(str(option_error(e))) from None
    pages = "" if engine.page_size is None else (f", paged: a pool of {engine.kv_pages} pages of "
                                                  f"{engine.page_size} positions")
    log(f"{args.slots} slots of {engine.max_model_len} positions (+{engine.cache_len - engine.max_model_len} "
         f"scratch){pages}: decoding state {engine.state_bytes / 2**20:.1f} MiB; deterministic mode "
         f"{'on' if deterministic else 'off'}")
    return (engine, served_model_name(args), *chat_template(args))


def served_model_name(args) -> str:
    """The model id clients use: ``--served-model-name``, else the target directory's name."""
    return args.served_model_name or os.path.basename(os.path.normpath(args.target))


def chat_template(args) -> tuple[str | None, dict]:
    """``(template, special tokens)``: ``--chat-template``'s file, else ``tokenizer_config.json``'s."""
    from ddtree_jax.serving.server import load_chat_template

    template, specials = load_chat_template(pf.resolve_tokenizer(args.tokenizer))
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()
    return template, specials


def warm_up(engine) -> None:
    """``engine.warmup()``, its time and compilations (and cache hits) logged."""
    from ddtree_jax import compilation_cache as cc

    t1 = time.perf_counter()
    with cc.CompileWatch(log=log, prefix="  ") as watch:
        engine.warmup()
    log(f"warm-up in {time.perf_counter() - t1:.1f}s ({watch.summary()})")


def _launch_engine_process(args, sock):
    """``(EngineClient, model name, template, specials)``: the engine in a process of its own
    (``ddtree_jax/serving/engine_process.py``), which loads and warms up, and the other
    ``--api-servers`` front ends on ``sock``; the tokenizer and chat template load here too."""
    from ddtree_jax.serving.engine_process import EngineClient

    tokenizer = _front_end_tokenizer(args)
    engine = EngineClient.launch(args, tokenizer, log=log, front_ends=args.api_servers, sock=sock)
    try:
        return (engine, served_model_name(args), *chat_template(args))
    except BaseException:
        _stop_engine_process(engine)
        raise


def _front_end_tokenizer(args):
    """A front end's tokenizer; the process is a front end from here on: JAX on the CPU alone (it
    computes nothing and never claims the device; the engine process is spawned afresh)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    return pf.load_tokenizer(pf.resolve_tokenizer(args.tokenizer), getattr(args, "debug", False))


def _serve_options(args) -> dict:
    """``server.serve``'s keyword arguments that every front end takes from the command line."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return dict(log_level=args.log_level, api_key=api_key, max_request_bytes=args.max_request_bytes,
                drain_timeout=args.drain_timeout)


REPEAT_WINDOW = 1.0
"""Seconds after the signal that starts a further front end's drain in which the same signal again
(from the first front end, and from outside: a service manager signals every process) does not
cut the drain short."""


def set_switch_interval(args) -> None:
    """``--switch-interval``: this process's thread switch interval (nothing without it)."""
    if getattr(args, "switch_interval", None) is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)


def serve_front_end(args, conn, sock, index: int, count: int) -> None:
    """A further front-end process of ``serve --api-servers`` (spawned by the first front end,
    ``EngineClient.launch``): the HTTP server on the shared listening socket ``sock``, through its
    own connection ``conn`` to the engine process. It leaves the terminal's process group (the
    first front end forwards the shutdown signal: one drain, not two) and stops once the engine
    process has gone."""
    import signal

    os.setsid()
    set_switch_interval(args)
    tokenizer = _front_end_tokenizer(args)
    from ddtree_jax.serving.engine_process import EngineClient
    from ddtree_jax.serving.server import serve

    try:
        engine = EngineClient.attach(conn, tokenizer, index, count,
                                     on_gone=lambda: os.kill(os.getpid(), signal.SIGTERM))
    except PreflightError as e:
        log(f"front end {index}: {e}")
        return
    template, specials = chat_template(args)
    serve(engine, model_name=served_model_name(args), chat_template=template, specials=specials, sock=sock,
          repeat_window=REPEAT_WINDOW, **_serve_options(args))


def run_serve(args, parser: argparse.ArgumentParser | None = None) -> None:
    """Runs the server for parsed ``serve`` arguments until SIGTERM / SIGINT (module doc for the
    order of start-up). A mistake before listening exits with status 2 and one line on stderr
    (through ``parser.error`` when given)."""
    from ddtree_jax import compilation_cache as cc

    t0 = time.perf_counter()
    set_switch_interval(args)
    try:
        preflight(args)
        sock = pf.bind_port(args.host, args.port)
    except PreflightError as e:
        _fail(parser, str(e))
    if args.api_servers > 1:
        args.engine_process = True
    try:
        if args.engine_process:  # the engine process enables the cache, loads and warms up
            engine, name, template, specials = _launch_engine_process(args, sock)
        else:
            log(f"compilation cache: {cc.enable(cc.resolve(args.compilation_cache)) or 'off'}")
            engine, name, template, specials = build_engine(args)
    except PreflightError as e:
        sock.close()
        _fail(parser, str(e))
    try:
        _serve(args, engine, name, template, specials, sock, t0)
    except BaseException:
        if args.engine_process:  # no process of this server outlives it
            _stop_engine_process(engine)
        raise
    log("stopped")


def _stop_engine_process(engine) -> None:
    import signal

    engine.signal_front_ends(signal.SIGTERM)
    engine.stop()


def _serve(args, engine, name, template, specials, sock, t0) -> None:
    if not args.engine_process and not args.no_warmup:
        warm_up(engine)
    from ddtree_jax.serving.server import serve

    host, port = sock.getsockname()[:2]
    options = _serve_options(args)
    split = f"engine in process {engine.pid}" if args.engine_process else "one process"
    if args.api_servers > 1:
        split += f", {args.api_servers} front ends"
    log(f"serving {name!r} ({args.method}, budget {engine.budget}, {args.slots} slots, {split}, chat template: "
         f"{'yes' if template else 'no'}, API key: {'required' if options['api_key'] else 'none'}) on "
         f"http://{host}:{port} "
         f"after {time.perf_counter() - t0:.1f}s")
    serve(engine, model_name=name, host=args.host, port=port, chat_template=template, specials=specials, sock=sock,
          on_signal=engine.signal_front_ends if args.api_servers > 1 else None, **options)


def _fail(parser: argparse.ArgumentParser | None, message: str):
    if parser is None:
        sys.stderr.write(f"python -m ddtree_jax serve: error: {message}\n")  # one write (see log)
        sys.stderr.flush()
        raise SystemExit(2)
    parser.error(message)


def main(argv=None) -> None:
    from ddtree_jax.cli import _Parser

    ap = _Parser(prog="python -m ddtree_jax.serving.cli", description=__doc__.splitlines()[0])
    add_arguments(ap)
    run_serve(ap.parse_args(argv), ap)


if __name__ == "__main__":
    main()
