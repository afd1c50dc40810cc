"""``python -m ddtree_jax serve``: the OpenAI-compatible server on a target (+ drafter) checkpoint.

    python -m ddtree_jax serve --target DIR --drafter DIR --tokenizer tokenizer.json \\
        [--method ddtree --budget 64] [--slots 8] [--host 127.0.0.1] [--port 8000] [--mesh expert=4,tensor=2]

Also runnable alone: ``python -m ddtree_jax.serving.cli ...`` (same options). Stop tokens: the
``eos_token_id`` of ``generation_config.json`` in the target directory (or beside it), else the
tokenizer config's ``eos_token``, plus ``--stop-token-id``; ``--ignore-eos`` drops the defaults.
This module imports JAX only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from ddtree_jax._preflight import option_error
from ddtree_jax.config import METHODS, ConfigError, DecodeConfig, EngineConfig

__all__ = ["add_arguments", "add_serve_parser", "build_engine", "main", "run_serve"]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``serve`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF DeepseekV3ForCausalLM checkpoint directory")
    p.add_argument("--drafter", help="DFlash drafter checkpoint directory (not needed for --method ar)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (chat template: tokenizer_config.json beside it)")
    p.add_argument("--method", choices=METHODS, default="ddtree")
    p.add_argument("--budget", type=int, default=64, help="DDTree node budget")
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients use (default: the target directory's name)")
    p.add_argument("--max-model-len", type=int, help="prompt + max_tokens limit; sets the cache size (default: the "
                                                         "target's context, at most 8192)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per slot per engine step")
    p.add_argument("--prefill-batch", type=int, help="most slots prefilled per engine step (default: all)")
    p.add_argument("--sync-every", type=int, default=1, help="rounds per engine step")
    p.add_argument("--seed", type=int, default=0, help="base key of the random streams")
    p.add_argument("--default-max-tokens", type=int, default=16, help="/v1/completions max_tokens default")
    p.add_argument("--stop-token-id", type=int, action="append", help="in addition to the EOS token")
    p.add_argument("--ignore-eos", action="store_true", help="no default stop token")
    p.add_argument("--chat-template", help="a jinja2 file overriding tokenizer_config.json's template")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--mesh", default="", help="device mesh, e.g. expert=4,tensor=2 or data=2,expert=4 "
                                              "(default: one device)")
    p.add_argument("--impl", choices=("auto", "pallas", "reference"), default="auto")
    p.add_argument("--no-warmup", action="store_true", help="skip compiling before listening")
    p.add_argument("--log-level", default="info")


def _log(msg: str) -> None:
    print(f"[ddtree_jax.serve] {msg}", file=sys.stderr, flush=True)


def default_stop_ids(target_dir: str, tokenizer, tokenizer_path: str) -> list[int]:
    """EOS ids: ``generation_config.json`` in or beside the target directory, else the tokenizer
    config's ``eos_token``."""
    for d in (target_dir, os.path.dirname(os.path.abspath(target_dir))):
        path = os.path.join(d, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return sorted(set(eos if isinstance(eos, list) else [eos]))
    from ddtree_jax.serving.server import load_chat_template

    _, specials = load_chat_template(tokenizer_path)
    eos = specials.get("eos_token")
    tid = tokenizer.token_to_id(eos) if eos else None
    return [tid] if tid is not None else []


def _fail(parser, message: str):
    """Exit with one line naming the option: the parser's error (status 2), or ``SystemExit``."""
    if parser is None:
        raise SystemExit(message)
    parser.error(message)


def _engine_config(args, parser) -> EngineConfig:
    """The ``EngineConfig`` of parsed ``serve`` arguments (stop ids: ``--stop-token-id`` only),
    checked before anything loads."""
    try:
        config = EngineConfig(
            decode=DecodeConfig(method=args.method, budget=args.budget, sync_every=args.sync_every, seed=args.seed,
                                stop_token_ids=tuple(args.stop_token_id or ()), impl=args.impl),
            slots=args.slots, max_model_len=args.max_model_len, max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk, prefill_batch=args.prefill_batch)
        config.decode.check_for(None, has_drafter=bool(args.drafter))
    except ConfigError as e:
        _fail(parser, str(option_error(e)))
    return config


def build_engine(args, parser=None):
    """Loads the models (on the mesh) and tokenizer and returns ``(engine, model name, template,
    specials)``. A bad option exits with one line naming it (through ``parser.error`` if given)."""
    config = _engine_config(args, parser)  # before anything heavy loads
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from ddtree_jax.checkpoints import load_drafter, load_target
    from ddtree_jax.serving.engine import Engine
    from ddtree_jax.serving.server import load_chat_template
    from ddtree_jax.serving.sharding import make_mesh, state_sharding

    if not os.path.isfile(args.tokenizer):
        _fail(parser, f"--tokenizer: no such file {args.tokenizer!r}")
    tokenizer = Tokenizer.from_file(args.tokenizer)
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        _fail(parser, f"--mesh: {e}")
    dtype = {"auto": "auto", "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    target = load_target(args.target, mesh=mesh, dtype=dtype)
    drafter = load_drafter(args.drafter, target, mesh=mesh) if config.decode.uses_drafter else None
    _log(f"loaded in {time.perf_counter() - t0:.1f}s; mesh {dict(mesh.shape) if mesh is not None else 'none'}")
    template, specials = load_chat_template(args.tokenizer)
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()
    stop = [] if args.ignore_eos else default_stop_ids(args.target, tokenizer, args.tokenizer)
    stop += list(config.decode.stop_token_ids)
    try:
        config = dataclasses.replace(config, decode=dataclasses.replace(config.decode, stop_token_ids=tuple(stop)))
        engine = Engine(target, drafter, config, tokenizer=tokenizer, shard_state=state_sharding(mesh))
    except ConfigError as e:
        if e.field == "stop_token_ids":  # the EOS ids joined the option's
            _fail(parser, f"--stop-token-id or the EOS ids of {args.target}: {e.message}")
        _fail(parser, str(option_error(e)))
    _log(f"{args.slots} slots of {engine.max_model_len} positions (+{engine.cache_len - engine.max_model_len} "
         f"scratch): decoding state {engine.state_bytes / 2**20:.1f} MiB")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.target))
    return engine, name, template, specials


def run_serve(args, parser=None) -> None:
    """Runs the server for parsed ``serve`` arguments (blocks until interrupted); option errors
    go through ``parser.error`` if given."""
    engine, name, template, specials = build_engine(args, parser)
    from ddtree_jax.serving.server import serve

    if not args.no_warmup:
        t0 = time.perf_counter()
        engine.warmup()
        _log(f"compiled in {time.perf_counter() - t0:.1f}s")
    _log(f"serving {name!r} ({args.method}, budget {engine.budget}, {args.slots} slots, "
         f"chat template: {'yes' if template else 'no'}) on http://{args.host}:{args.port}")
    serve(engine, model_name=name, host=args.host, port=args.port, chat_template=template, specials=specials,
          log_level=args.log_level)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree_jax.serving.cli", description=__doc__.splitlines()[0])
    add_arguments(ap)
    run_serve(ap.parse_args(argv), ap)


if __name__ == "__main__":
    main()
