"""Serving benchmark: throughput, TTFT and inter-token latency against concurrency, through the HTTP
server, for autoregressive decoding, linear DFlash and DDTree in one run.

    python bench/bench_serving.py --target DIR --drafter DIR --tokenizer tokenizer.json \\
        [--concurrency 1 4 16 64] [--slots 64] [--max-tokens 128] [--budget 64] [--mesh expert=8]
    python bench/bench_serving.py --default          # the built-in default pair (made once, minutes)
    python bench/bench_serving.py --smoke            # tiny random models on the CPU: checks the pipeline

For each method a server (``python -m ddtree_jax.serving.cli``) starts on 127.0.0.1, compiles
(warm-up), then for each concurrency level ``c`` it serves ``--requests-per-level`` (default
``4c``, at least 8) streaming ``/v1/completions`` requests with ``c`` in flight at a time (prompts
from a fixed list, ``ignore_eos`` so every request makes ``--max-tokens`` tokens), from
``min(--client-processes, c)`` client processes (one Python client cannot parse the events of 64
fast streams). Per level:
output tokens/s over the level's wall time, requests/s, TTFT (request sent -> first text) and
inter-token latency ((last text - first text) / (tokens - 1), per request) as p50/p90/p99, and the
mean acceptance length the server reports. Greedy by default (``--temperature``).
``--engine-process on`` starts the servers with ``serve --engine-process`` (the engine in a
process of its own); ``both`` runs every method twice, one process and two, the two-process rows
named ``<method>+engine-process``. ``--api-servers N ...`` starts a server per value with that
many HTTP front-end processes (``serve --api-servers``; rows ``...+<N>fe`` for N > 1).
``--in-process`` (with ``--default`` or ``--smoke``) first runs
``bench_engine.py`` at a batch of ``--slots`` in a process of its own (``generate()`` and the
in-process engine, greedy, its random prompts of 64 tokens, its requests all submitted at once and
then from ``--slots`` closed-loop clients) and reports the servers' tokens/s at ``--slots`` streams
beside them: each layer of the stack in one run (with ``--smoke`` only a
check of the pipeline: the two benches' tiny models differ).

Writes ``bench/results/serving_<device>_<date>.{json,md}`` (``--out`` to change the folder) with the
device, date and command.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [
    "Speculative decoding lets a large model",
    "A small drafter proposes a block of tokens;",
    "A block diffusion drafter predicts",
    "A draft tree keeps the most probable",
    "With sampling, every node draws one token",
    "Mixture-of-experts models route each token",
    "Latent attention caches a compressed vector",
    "The quick brown fox",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _smoke_checkpoints(path: str) -> dict[str, str]:
    """Tiny random target + drafter and a character tokenizer (vocabulary 128), made on the CPU."""
    import jax
    from tokenizers import Tokenizer, decoders, models

    jax.config.update("jax_platforms", "cpu")  # this process only: keep any accelerator for the servers

    import ddtree_jax as dt
    from ddtree_jax.models import DFlashConfig, DFlashDrafter, KimiConfig, KimiForCausalLM

    tcfg = KimiConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                      n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256)
    dcfg = DFlashConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_target_layers=3, block_size=5, mask_token_id=127,
                        target_layer_ids=(0, 1), layer_types=("full_attention",) * 2, vocab_size=128)
    from flax import nnx

    target = KimiForCausalLM(tcfg, rngs=nnx.Rngs(0))
    dt.save_checkpoint(target, os.path.join(path, "target"))
    dt.save_checkpoint(DFlashDrafter(dcfg, rngs=nnx.Rngs(1)), os.path.join(path, "drafter"))
    pieces = ["<|endoftext|>"] + [chr(c) for c in range(32, 127)] + ["\n"]
    pieces += [f"<{i}>" for i in range(127 - len(pieces))] + ["<|mask|>"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|mask|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    return dict(target=os.path.join(path, "target"), drafter=os.path.join(path, "drafter"),
                tokenizer=os.path.join(path, "tokenizer.json"))


class Server:
    """``python -m ddtree_jax.serving.cli`` as a subprocess on a free 127.0.0.1 port."""

    def __init__(self, paths: dict, method: str, args, log_dir: str, engine_process: bool = False,
                 paged: bool = False, api_servers: int = 1):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ddtree_jax.serving.cli", "--target", paths["target"], "--tokenizer",
               paths["tokenizer"], "--method", method, "--budget", str(args.budget), "--slots", str(args.slots),
               "--port", str(self.port), "--host", "127.0.0.1", "--max-queue", str(max(256, 4 * args.slots)),
               "--sync-every", str(args.sync_every), "--log-level", "warning", "--served-model-name", "bench",
               "--prefill-chunk", str(args.prefill_chunk)]
        if method != "ar":
            cmd += ["--drafter", paths["drafter"]]
        if engine_process:
            cmd += ["--engine-process"]
        if api_servers > 1:
            cmd += ["--api-servers", str(api_servers)]
        if paged:
            cmd += ["--page-size", str(args.page_size)]
        for flag in ("max_model_len", "mesh", "dtype", "switch_interval"):
            if getattr(args, flag):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        self.log_path = os.path.join(log_dir, f"server_{method}{'_two_process' if engine_process else ''}"
                                              f"{'_paged' if paged else ''}_fe{api_servers}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)  # -m: ROOT's package

    def wait(self, timeout: float) -> dict:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log_path}:\n"
                                   + open(self.log_path).read()[-2000:])
            try:
                r = httpx.get(self.base + "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout}s; see {self.log_path}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def _one(session, base: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    usage, chunks = None, 0
    async with session.post(base + "/v1/completions", json=body) as r:
        headers = time.perf_counter()  # the server has checked the request and queued it in the engine
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:500]!r}")
        async for raw in r.content:  # one server-sent-event line at a time
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            event = json.loads(raw[6:])
            now = time.perf_counter()
            if event["choices"] and event["choices"][0]["text"]:
                chunks += 1
                first = first or now
                last = now
            if event.get("usage"):
                usage = event["usage"]
    tokens = usage["completion_tokens"]
    return dict(ttft=(first or time.perf_counter()) - t0, headers=headers - t0, e2e=time.perf_counter() - t0,
                tokens=tokens,
                itl=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
                tau=usage["speculative"]["mean_acceptance_length"], chunks=chunks)


async def _requests(base: str, concurrency: int, indices: list[int], max_tokens: int,
                    temperature: float) -> list[dict]:
    """The requests ``indices`` (prompts and seeds by index), ``concurrency`` in flight at a time
    (aiohttp: a tenth of httpx's client CPU per request, which at many streams delays the client's
    own requests and reads)."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def run(i):
            async with sem:
                body = dict(model="bench", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                            temperature=temperature, stream=True, ignore_eos=True,
                            stream_options={"include_usage": True})
                if temperature > 0:
                    body["seed"] = i
                return await _one(session, base, body)

        return await asyncio.gather(*(run(i) for i in indices))


def _client_process(base, concurrency, indices, max_tokens, temperature, barrier, out) -> None:
    """One client process: imports, waits for the others at ``barrier``, runs its share, and puts
    its results on ``out``."""
    import aiohttp  # noqa: F401  (imported before the barrier: not part of the timed level)

    barrier.wait()
    out.put(asyncio.run(_requests(base, concurrency, indices, max_tokens, temperature)))


def _scrape(base: str) -> dict[str, float]:
    """The server's ``/metrics`` as ``{name{labels}: value}``."""
    import re

    import httpx

    text = httpx.get(base + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ddtree_\S+) (\S+)$", text, re.M)}


def _inside(before: dict, after: dict, wall: float) -> dict:
    """What the server's own metrics say about a level (their change over it): the engine's mean
    time to first token, split into the queue (submission to a slot) and the slot to the token
    (prefill, first round, read-back), its mean inter-token latency, its steps per second and the
    engine thread's milliseconds per step outside waits (host), waiting for the device and streaming
    (emit, part of host), and the dispatches by rounds."""
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
    mean_ms = lambda h: 1e3 * d(f"ddtree_{h}_sum") / max(d(f"ddtree_{h}_count"), 1)
    steps = max(d("ddtree_engine_steps_total"), 1)
    per_step = lambda k: 1e3 * d(f"ddtree_engine_{k}_seconds_total") / steps
    dispatches = {k.split('"')[1]: int(d(k)) for k in after if k.startswith("ddtree_dispatches_total{") and d(k)}
    return dict(ttft_ms=mean_ms("time_to_first_token_seconds"), queue_ms=mean_ms("request_queue_time_seconds"),
                slot_to_token_ms=mean_ms("request_prefill_time_seconds"), itl_ms=mean_ms("inter_token_latency_seconds"),
                steps_per_s=d("ddtree_engine_steps_total") / wall, host_ms_per_step=per_step("host"),
                wait_ms_per_step=per_step("wait"), emit_ms_per_step=per_step("emit"), dispatches=dispatches)


def _level(base: str, concurrency: int, n: int, args, max_tokens: int | None = None) -> dict:
    """``n`` requests with ``concurrency`` in flight, from ``min(--client-processes, concurrency)``
    client processes (each ``concurrency / K`` in flight, every K-th request): one Python client
    process parses too few server-sent events per second to keep up with the engine at 64 streams."""
    max_tokens = max_tokens or args.max_tokens
    K = max(1, min(args.client_processes, concurrency))
    before = _scrape(base)
    if K == 1:
        t0 = time.perf_counter()
        results = asyncio.run(_requests(base, concurrency, list(range(n)), max_tokens, args.temperature))
        wall = time.perf_counter() - t0
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(K + 1), ctx.Queue()
        procs = [ctx.Process(target=_client_process, daemon=True,
                             args=(base, concurrency // K + (k < concurrency % K), list(range(k, n, K)), max_tokens,
                                   args.temperature, barrier, out)) for k in range(K)]
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        results = [r for _ in procs for r in out.get(timeout=3600)]
        wall = time.perf_counter() - t0
        for p in procs:
            p.join()
    inside = _inside(before, _scrape(base), wall)
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
    ttft = [r["ttft"] for r in results]
    itl = [r["itl"] for r in results if r["itl"] is not None]
    tokens = sum(r["tokens"] for r in results)
    return dict(concurrency=concurrency, requests=n, client_processes=K, wall_s=wall, output_tokens=tokens,
                tokens_per_s=tokens / wall, requests_per_s=n / wall,
                ttft_ms={f"p{q}": pct(ttft, q) for q in (50, 90, 99)}, ttft_ms_mean=1e3 * float(np.mean(ttft)),
                headers_ms_mean=1e3 * float(np.mean([r["headers"] for r in results])),
                itl_ms={f"p{q}": pct(itl, q) for q in (50, 90, 99)},
                e2e_ms_p50=pct([r["e2e"] for r in results], 50), mean_tau=float(np.mean([r["tau"] for r in results])),
                inside=inside)


def _markdown(report: dict) -> str:
    lines = [f"# Serving benchmark: {report['device']} ({report['date']})", "",
             f"Command: `{report['command']}`", "",
             f"Models: {report['models']}; slots {report['slots']}, budget {report['budget']}, "
             f"max_tokens {report['max_tokens']}, temperature {report['temperature']}, "
             f"sync_every {report['sync_every']}, engine process {report['engine_process']}, paged "
             f"{report.get('paged', 'off')} (pages of {report.get('page_size')}); host {report['host']}, "
             f"jax {report['jax']}.", "",
             "| method | concurrency | requests | tok/s | req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
             "| e2e p50 ms | tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, levels in report["results"].items():
        for r in levels:
            t, i = r["ttft_ms"], r["itl_ms"]
            lines.append(f"| {method} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                         f"{r['requests_per_s']:.2f} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | "
                         f"{i['p50']:.2f} / {i['p90']:.2f} / {i['p99']:.2f} | {r['e2e_ms_p50']:.0f} | "
                         f"{r['mean_tau']:.2f} |")
    lines += ["", "tok/s: output tokens over the level's wall time (all requests, `concurrency` in flight, "
              f"from up to {report.get('client_processes', 1)} client processes). "
              "TTFT: request sent -> first text. ITL: (last text - first text) / (tokens - 1) per request. "
              "tau: mean acceptance length (tokens per target pass) the server reports in `usage`."]
    lines += ["", "Inside the server (its `/metrics`, over each level): the client's mean TTFT and its mean time to "
              "the response's headers (sent once the request is checked and queued in the engine: the intake "
              "path), beside the engine's TTFT (submission to the engine -> first token streamed), split into "
              "the queue (-> a slot) and the slot to the token (prefill, first round, read-back); the engine's "
              "mean ITL; its steps per second and the engine thread's ms per step: host work (emit: of it, "
              "streaming), waiting for the device; "
              "dispatches by rounds per dispatch.", "",
              "| method | concurrency | client TTFT ms | client to headers ms | engine TTFT ms | queue ms | "
              "slot -> token ms | engine ITL ms | steps/s | host ms/step | emit ms/step | wait ms/step | "
              "dispatches |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, levels in report["results"].items():
        for r in levels:
            e = r["inside"]
            sizes = ", ".join(f"{k}: {v}" for k, v in sorted(e["dispatches"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"| {method} | {r['concurrency']} | {r['ttft_ms_mean']:.1f} | {r['headers_ms_mean']:.1f} | "
                         f"{e['ttft_ms']:.1f} | "
                         f"{e['queue_ms']:.1f} | {e['slot_to_token_ms']:.1f} | {e['itl_ms']:.2f} | "
                         f"{e['steps_per_s']:.0f} | {e['host_ms_per_step']:.2f} | {e['emit_ms_per_step']:.2f} | "
                         f"{e['wait_ms_per_step']:.2f} | {sizes} |")
    if report.get("in_process"):
        lines += _in_process_markdown(report)
    return "\n".join(lines) + "\n"


def _in_process(args) -> list[dict]:
    """``bench_engine.py`` at a batch of ``args.slots`` for the methods it runs, in a subprocess
    (the servers after it get the whole device); its report's rows."""
    if not (args.default or args.smoke):
        raise SystemExit("bench_serving: --in-process needs --default or --smoke (bench_engine.py's models)")
    methods = [m for m in args.methods if m in ("ar", "dflash", "ddtree")]
    path = os.path.join(tempfile.mkdtemp(prefix="bench_engine_"), "engine.json")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_engine.py"), "--smoke" if args.smoke else "--default",
           "--batches", str(args.slots), "--methods", *methods, "--budget", str(args.budget),
           "--new", str(args.max_tokens), "--repeats", str(args.repeats), "--sync-every", str(args.sync_every),
           "--streams", "0", str(args.slots), "--out", os.path.dirname(path),
           "--json", path]
    print(f"[bench_serving] in process: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(path) as f:
        return json.load(f)["rows"]


def _in_process_markdown(report: dict) -> list[str]:
    """The in-process rows beside the server levels of the same load: the engine's requests all
    submitted at once beside the servers at as many streams as slots and as many as requests; the
    engine's closed-loop clients beside the servers at as many streams."""
    slots = report["slots"]
    lines = ["", f"In process at a batch of {slots} (`bench_engine.py`: its own random prompts of 64 tokens, "
             "greedy; its requests all submitted at once, or from closed-loop clients) beside the servers "
             "at the same number of streams and, for the requests all at once, at as many streams as slots:", "",
             "| method | in-process load | generate() tok/s | engine tok/s | engine / generate | server | streams | "
             "server tok/s | server / engine |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["in_process"]:
        streams = r.get("streams", 0)
        shapes = {streams} if streams else {slots, r.get("requests", slots)}
        load = f"{streams} closed-loop streams" if streams else f"{r.get('requests', slots)} requests at once"
        for name, levels in report["results"].items():
            if name.split("+")[0] != r["method"]:
                continue
            for lv in levels:
                if lv["concurrency"] in shapes:
                    lines.append(f"| {r['method']} | {load} | {r['generate_tok_s']:,.0f} | {r['engine_tok_s']:,.0f} | "
                                 f"{r['engine_over_generate']:.2f}x | {name} | {lv['concurrency']} | "
                                 f"{lv['tokens_per_s']:,.0f} | {lv['tokens_per_s'] / r['engine_tok_s']:.2f}x |")
    return lines


def _write(args, health: dict, models: str, results: dict, in_process) -> tuple[dict, str]:
    """Write the report so far (after every server: a run cut short keeps what it measured);
    returns it and the files' path without the extension."""
    import jax

    date = datetime.date.today().strftime("%Y%m%d")
    device = health.get("device", "unknown")
    report = dict(device=device, platform=health.get("platform"), devices=health.get("devices"), date=date,
                  command="python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  host=platform.node(), jax=jax.__version__, models=models, slots=args.slots, budget=args.budget,
                  max_tokens=args.max_tokens, temperature=args.temperature, sync_every=args.sync_every,
                  engine_process=args.engine_process, paged=args.paged, page_size=args.page_size,
                  client_processes=args.client_processes,
                  mesh=args.mesh, smoke=args.smoke, results=results, in_process=in_process)
    os.makedirs(args.out, exist_ok=True)
    tag = "".join(ch if ch.isalnum() else "_" for ch in device.lower()).strip("_") + ("_smoke" if args.smoke else "")
    stem = os.path.join(args.out, f"serving_{tag}_{date}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(report))
    return report, stem


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--tokenizer")
    ap.add_argument("--default", action="store_true", help="the shipped default pair (ddtree_jax/default_pair)")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, small levels (CPU check)")
    ap.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"])
    ap.add_argument("--concurrency", type=int, nargs="+")
    ap.add_argument("--requests-per-level", type=int)
    ap.add_argument("--slots", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--budget", type=int)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sync-every", default="auto", help="the server's --sync-every: rounds per dispatch or auto")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--mesh", default="")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--engine-process", choices=("off", "on", "both"), default="off",
                    help="serve --engine-process: the engine in a process of its own (both: each method twice)")
    ap.add_argument("--api-servers", type=int, nargs="+", default=[1],
                    help="serve --api-servers: HTTP front-end processes (each value its own server; > 1 runs "
                         "the engine in a process of its own, rows named <method>+engine-process+<N>fe)")
    ap.add_argument("--paged", choices=("off", "on", "both"), default="off",
                    help="the server with paged caches (--page-size; a pool of --slots full-length slots' worth), "
                         "the contiguous one, or both in turn (same levels)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--in-process", action="store_true",
                    help="also generate() and the in-process engine at --slots (bench_engine.py, first)")
    ap.add_argument("--switch-interval", type=float, metavar="MS",
                    help="the servers' serve --switch-interval (rows named ...+si<MS>ms)")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="client processes a level's streams are spread over (default: half the CPUs, at most 8)")
    ap.add_argument("--repeats", type=int, default=1, help="--in-process: bench_engine.py's --repeats")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    small = args.smoke
    args.concurrency = args.concurrency or ([1, 2] if small else [1, 4, 16, 64])
    args.slots = args.slots or (2 if small else max(args.concurrency))
    args.max_tokens = args.max_tokens or (12 if small else 128)
    args.budget = args.budget or (6 if small else 64)
    if small:
        args.max_model_len = args.max_model_len or 64
        args.prefill_chunk = min(args.prefill_chunk, 16)
        args.dtype = args.dtype or "float32"

    workdir = tempfile.mkdtemp(prefix="bench_serving_")
    if small:
        paths, models = _smoke_checkpoints(workdir), "tiny random target + drafter (smoke)"
    elif args.default:
        from ddtree_jax.default_model import SHIPPED_DIR as d

        paths = dict(target=f"{d}/target", drafter=f"{d}/drafter", tokenizer=f"{d}/tokenizer.json")
        models = f"built-in default ({d})"
    else:
        if not (args.target and args.tokenizer and (args.drafter or args.methods == ["ar"])):
            ap.error("--target, --drafter and --tokenizer (or --default, or --smoke)")
        paths = dict(target=args.target, drafter=args.drafter, tokenizer=args.tokenizer)
        models = f"{args.target} + {args.drafter}"

    in_process = _in_process(args) if args.in_process else None
    results, health = {}, {}
    split = {"off": [False], "on": [True], "both": [False, True]}
    variants = [(m, two or fe > 1, pg, fe) for m in args.methods for two in split[args.engine_process]
                for pg in split[args.paged] for fe in args.api_servers]
    for method, two, paged, fe in dict.fromkeys(variants):
        server = Server(paths, method, args, workdir, engine_process=two, paged=paged, api_servers=fe)
        name = method + ("+engine-process" if two else "") + (f"+paged{args.page_size}" if paged else "") + \
            (f"+{fe}fe" if fe > 1 else "") + (f"+si{args.switch_interval:g}ms" if args.switch_interval else "")
        try:
            t0 = time.perf_counter()
            health = server.wait(args.startup_timeout)
            print(f"[bench_serving] {name}: server up in {time.perf_counter() - t0:.0f}s on {health['device']}",
                  flush=True)
            results[name] = []
            for c in args.concurrency:
                n = args.requests_per_level or max(8 if not small else 4, 4 * c)
                # Untimed pass first: whatever this level's batch shapes compile happens here.
                _level(server.base, c, c, args, max_tokens=4)
                r = _level(server.base, c, n, args)
                results[name].append(r)
                print(f"[bench_serving] {name} c={c}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms, tau {r['mean_tau']:.2f}",
                      flush=True)
        finally:
            server.close()
        if results.get(name):
            _write(args, health, models, results, in_process)

    report, stem = _write(args, health, models, results, in_process)
    print(f"[bench_serving] wrote {stem}.md / .json", flush=True)
    return report


if __name__ == "__main__":
    main()
