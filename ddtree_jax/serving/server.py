"""OpenAI-compatible HTTP server over an ``Engine`` (FastAPI + uvicorn; the ``serve`` extra).

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the chat template of
  ``tokenizer_config.json``, rendered with jinja2): ``stream: true`` answers with server-sent
  events ending in ``data: [DONE]``. Fields: ``model``, ``prompt`` / ``messages``, ``max_tokens``
  (chat: also ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``seed``, ``stop``, ``n``, ``logprobs`` (completions: the number of alternatives; chat: a
  boolean, with ``top_logprobs``), ``stream``, ``stream_options.include_usage``, and the
  extensions ``stop_token_ids`` and ``ignore_eos``. Refused with a 400 naming the field: ``echo``,
  ``best_of`` > 1, ``suffix``, non-zero penalties, ``logit_bias`` (sampling here is exact: the
  output follows the target's own law), and more alternatives than the engine's ``max_logprobs``.
* ``n`` > 1: n engine requests of the same prompt, each with its own prefill, merged into one
  response (``choices[i].index``; stream chunks tagged by index); a seeded request's choice ``i``
  uses seed ``seed + i`` (mod 2**32), as vLLM does. ``usage`` counts the prompt once and sums the
  completion tokens. Log-probabilities: ``ddtree_jax/serving/openai_logprobs.py``.
* ``GET /v1/models``, ``GET /health`` (503 while draining; ``front_end``: which of ``serve --api-servers``'
  front-end processes answered, 0 for the first), ``GET /metrics`` (prometheus text).

Responses and stream chunks carry ``system_fingerprint`` (a digest of what decides the outputs:
package and JAX versions, device, model name, method, budget, slots, context). A stream carries
``usage`` only when ``stream_options.include_usage`` is true, as OpenAI does: then every chunk has
``"usage": null`` and one more chunk with empty ``choices`` and the usage comes before
``[DONE]``. ``usage`` carries an extension ``speculative``: method, budget, rounds and the mean
acceptance length (tokens per target pass).

Every error, whatever its status, is an OpenAI error object ``{"error": {"message", "type",
"param", "code"}}``: 400 invalid request (a field, or a body that is not a JSON object: invalid
JSON or UTF-8, nested too deeply, another top-level type), 401 missing or wrong API key, 404 / 405
unknown route or method, 413 body larger than ``max_request_bytes`` (checked from
``Content-Length`` before reading, and while reading), 500 engine failure, 503 queue full or
shutting down.

The completion routes speak ASGI to uvicorn directly (``serving/asgi.py``; the other routes are
FastAPI's). A body of up to ``INLINE_BYTES`` is parsed, checked and tokenized on the event loop
(a short prompt costs less there than the hop to a thread); a larger one on a pool of worker
threads (tokenizing with ``encode_batch``, which releases the GIL), so a huge or pathological
request delays only itself. A client that disconnects cancels its request; the slot is free after
the current engine step.

Access: with ``api_key`` every ``/v1/*`` route needs ``Authorization: Bearer <key>`` (compared in
constant time); ``/health`` and ``/metrics`` stay open.

Shutdown (``serve``): the first SIGTERM or SIGINT stops admitting (503 for new ``/v1/*`` requests),
lets the running requests finish for up to ``drain_timeout`` seconds, then cancels the rest, whose
responses end normally with ``finish_reason`` ``"abort"`` (streams: a final chunk, then
``[DONE]``); the process then exits with status 0. Each further signal ends the wait under way
at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import hmac
import json
import json.encoder
import math
import os
import secrets
import signal
import socket
import time
import traceback
import weakref
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_jax.config import is_int
from ddtree_jax.serving import asgi
from ddtree_jax.serving.cli import log as _log
from ddtree_jax.serving.engine import Engine, EngineOverloaded, Inbox, RequestError, RequestResult
from ddtree_jax.serving.openai_logprobs import CompletionOffsets, TokenTexts, chat_logprobs, completion_logprobs

__all__ = ["API_KEY_ENV", "DEFAULT_DRAIN_TIMEOUT", "DEFAULT_MAX_REQUEST_BYTES", "Admission", "create_app",
           "load_chat_template", "metrics_text", "serve"]

API_KEY_ENV = "DDTREE_JAX_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 256k-token prompt as a JSON list of ids fits, with room
DEFAULT_DRAIN_TIMEOUT = 20.0  # seconds; with the abort grace, inside a 30 s termination grace period
ABORT_GRACE = 10.0  # seconds the cancelled requests get to send their final chunk
CPU_WORKERS = 4  # threads for parsing, chat templates and tokenizing
INLINE_BYTES = 4096  # bodies up to this size are parsed and tokenized on the event loop (module doc)


_encode = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(x, ensure_ascii=False), one encoder
_encode_str = json.encoder.encode_basestring  # what that encoder writes for a str


class StreamEvents:
    """A streamed completion's server-sent events: ``data: `` + ``json.dumps(obj,
    ensure_ascii=False)`` + a blank line, byte for byte, where ``obj`` is ``{"id", "object",
    "created", "model", "system_fingerprint", "choices"}`` and, with ``include_usage``, ``"usage"``.
    The fields before the choices are rendered once per response, not once per event."""

    __slots__ = ("_head", "_tail", "_usage")

    def __init__(self, rid: str, obj: str, created: int, model: str, fingerprint: str, include_usage: bool):
        self._head = (f'data: {{"id": {_encode(rid)}, "object": {_encode(obj)}, "created": {created}, '
                      f'"model": {_encode(model)}, "system_fingerprint": {_encode(fingerprint)}, "choices": ')
        self._usage = include_usage
        self._tail = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def event(self, choices: list, use: dict | None = None) -> str:
        """The event of ``choices`` (and, with ``include_usage``, ``use``: ``None`` writes null)."""
        if self._usage and use is not None:
            return f'{self._head}{_encode(choices)}, "usage": {_encode(use)}}}\n\n'
        return self._head + _encode(choices) + self._tail

    def text(self, index: int, text: str, reason: str | None) -> str:
        """``event`` of one completion choice without log-probabilities: ``{"index", "text",
        "logprobs": null, "finish_reason"}``."""
        return (f'{self._head}[{{"index": {index}, "text": {_encode_str(text)}, "logprobs": null, '
                f'"finish_reason": {"null" if reason is None else _encode_str(reason)}}}]{self._tail}')


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.counted = False  # in the engine's rejected-requests metric already

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def _too_large(limit: int, size: int | None = None) -> APIError:
    """413; ``size``: the body's declared size (``None``: found too large while reading)."""
    what = f"is {size} bytes" if size is not None else f"is larger than {limit} bytes"
    return APIError(413, f"the request body {what}; this server takes at most {limit} bytes (--max-request-bytes)",
                    None, code="request_too_large")


def _unavailable() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or after the restart", None,
                    kind="server_unavailable", code="shutting_down")


# --------------------------------------------------------------------------------------------- chat template


def load_chat_template(tokenizer_path: str) -> tuple[str | None, dict[str, Any]]:
    """The chat template and special-token strings from the ``tokenizer_config.json`` beside
    ``tokenizer_path`` (``None`` when there is none). A list of named templates gives "default"."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return None, {}
    with open(cfg_path) as f:
        cfg = json.load(f)
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)

    def token(v):
        return v.get("content") if isinstance(v, dict) else v

    specials = {k: token(cfg.get(k)) or "" for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return template, specials


class ChatTemplate:
    """A jinja2 chat template in a sandbox, rendered as HF transformers does."""

    def __init__(self, source: str, specials: dict[str, Any]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._specials = specials

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._specials)
        except jinja2.exceptions.TemplateError as e:
            raise _bad("messages", f"the chat template refused them: {e}") from None


# --------------------------------------------------------------------------------------------- field checks


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf else f">= {lo:g}"
        raise _bad(name, f"must be {'in ' if hi != math.inf else ''}{interval}, got {v!r}")
    return float(v)


def _integer(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise _bad(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}")
    return v


def _refuse_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise _bad("echo", "echo is not supported")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "only best_of=1 is supported")
    if body.get("suffix") is not None:
        raise _bad("suffix", "suffix is not supported")
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if body.get(name) not in (None, neutral):
            raise _bad(name, "penalties are not supported (the output follows the target's exact sampling law)")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools", "tools are not supported")


def _sampling(body: dict):
    from ddtree_jax.sampling import SamplingParams

    top_k = _integer(body, "top_k", 0, -1)
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_integer(body, "seed", None, 0, 2**32 - 1),
    )


MAX_N = 128  # choices per request, as OpenAI allows


def _logprobs(body: dict, chat: bool, limit: int) -> tuple[int | None, str]:
    """``(alternatives per token or None, the field that asked)``; ``limit``: the engine's
    ``max_logprobs`` (0: none)."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise _bad("logprobs", f"must be a boolean, got {on!r}")
        if not on:
            if body.get("top_logprobs") is not None:
                raise _bad("top_logprobs", "needs logprobs: true")
            return None, "logprobs"
        name, k = "top_logprobs", _integer(body, "top_logprobs", 0, 0, 20)
    else:
        name, k = "logprobs", _integer(body, "logprobs", None, 0)
        if k is None:
            return None, name
    if limit == 0:
        raise _bad("logprobs", "this server returns no log-probabilities (start it with --max-logprobs N)")
    if k > limit:
        raise _bad(name, f"{k} alternatives asked; this server returns at most {limit} (--max-logprobs)")
    return k, name


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise _bad("stop", "must be a string or a list of at most 16 strings")
    return [s for s in stop if s]


def _stop_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise _bad("stop_token_ids", "must be a list of token ids")
    return ids


# --------------------------------------------------------------------------------------------- the app


def metrics_text(engine: Engine) -> tuple[bytes, str]:
    """The engine's metrics in the prometheus text format: ``(body, content type)``."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    s = engine.metrics.snapshot()

    class _Collector:
        def collect(self):
            for name, doc, value in [
                ("queue_length", "requests waiting for a slot", s["queue_length"]),
                ("running_requests", "requests decoding in a slot", s["running"]),
                ("prefilling_requests", "requests being prefilled into a slot", s["prefilling"]),
                ("free_slots", "slots holding no request", s["free_slots"]),
                ("slots", "decoding slots", s["slots"]),
                ("tokens_per_second", "generated tokens per second over the last 10 s", s["tokens_per_second"]),
                ("mean_acceptance_length", "mean tokens per target pass since start", s["mean_acceptance_length"]),
            ]:
                yield GaugeMetricFamily(f"ddtree_{name}", doc, value=value)
            for name, doc, value in [
                ("prompt_tokens", "prompt tokens of accepted requests", s["prompt_tokens"]),
                ("generation_tokens", "generated tokens streamed", s["generated_tokens"]),
                ("request_rounds", "decoding rounds run, per request", s["rounds"]),
                ("engine_steps", "engine steps", s["engine_steps"]),
                ("engine_host_seconds", "engine-thread seconds in steps outside waits for the device",
                 s["host_seconds"]),
                ("engine_wait_seconds", "engine-thread seconds waiting for rounds to come back", s["wait_seconds"]),
                ("engine_prefill_seconds", "engine-thread seconds preparing prefill steps", s["prefill_seconds"]),
                ("engine_launch_seconds", "seconds launching the steps' programs (beside the engine thread)",
                 s["launch_seconds"]),
                ("engine_state_ops_seconds", "of those, seconds launching the programs before the rounds "
                 "(prefill chunks, activations, releases, page-table uploads)", s["state_ops_seconds"]),
                ("engine_emit_seconds", "engine-thread seconds detokenising and streaming", s["emit_seconds"]),
            ]:
                yield CounterMetricFamily(f"ddtree_{name}", doc, value=value)
            for name, doc, counts in [("requests", "finished requests by finish reason", s["requests"]),
                                      ("rejected_requests", "requests refused at submission", s["rejected"])]:
                c = CounterMetricFamily(f"ddtree_{name}", doc, labels=["reason"])
                for reason, n in sorted(counts.items()):
                    c.add_metric([reason], n)
                yield c
            c = CounterMetricFamily("ddtree_dispatches", "dispatches of decoding rounds by rounds per dispatch",
                                    labels=["rounds"])
            for rounds, n in sorted(s["dispatches"].items(), key=lambda kv: int(kv[0])):
                c.add_metric([rounds], n)
            yield c
            pages = s["kv_pages"]
            for name, doc, key in [
                ("kv_pages_free", "paged caches: pages free or cached (allocatable)", "free"),
                ("kv_pages_used", "paged caches: pages held by requests", "used"),
                ("kv_pages_shared", "paged caches: pages held by more than one request", "shared"),
                ("kv_pages_cached", "paged caches: prefix pages held by no request (evictable)", "cached"),
            ] if pages else []:
                yield GaugeMetricFamily(f"ddtree_{name}", doc, value=pages[key])
            for name, doc, value in [
                ("preemptions", "paged caches: requests preempted for pages (resumed later)", s["preemptions"]),
                ("prefix_hit_tokens", "paged caches: prompt tokens found in the prefix cache",
                 pages["prefix_hit_tokens"]),
            ] if pages else []:
                yield CounterMetricFamily(f"ddtree_{name}", doc, value=value)
            auto = s["auto_budget"]
            for name, doc, key in [
                ("auto_budget_rounds", "budget='auto': rounds run at each budget", "rounds"),
                ("auto_budget_expected_tokens", "budget='auto': expected tokens (draft path probabilities) at each "
                                                "budget", "expected_tokens"),
                ("auto_budget_realized_tokens", "budget='auto': accepted tokens at each budget", "realized_tokens"),
            ] if auto else []:
                c = CounterMetricFamily(f"ddtree_{name}", doc, labels=["budget"])
                for budget, n in zip(auto["budgets"], auto[key], strict=True):
                    c.add_metric([str(budget)], n)
                yield c
            for name, doc, h in [
                ("time_to_first_token_seconds", "submission to first streamed token", s["ttft"]),
                ("request_queue_time_seconds", "submission to a slot", s["queue_time"]),
                ("request_prefill_time_seconds", "a slot to the first streamed token (prefill, first round, "
                 "read-back)", s["prefill_time"]),
                ("inter_token_latency_seconds", "time per streamed token after the first", s["itl"]),
                ("acceptance_length", "tokens accepted per round (bonus included)", s["accept"]),
            ]:
                buckets = [("+Inf" if math.isinf(b) else repr(float(b)), c) for b, c in h.cumulative()]
                yield HistogramMetricFamily(f"ddtree_{name}", doc, buckets=buckets, sum_value=h.total)

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry), CONTENT_TYPE_LATEST


@dataclasses.dataclass
class _Prepared:
    """A request checked and tokenized (on a worker thread), ready for ``Engine.submit``."""

    ids: np.ndarray
    sampling: Any
    max_tokens: int
    max_tokens_field: str
    stop: list[str]
    stop_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    n: int
    logprobs: int | None
    logprobs_field: str


class Admission:
    """Who gets in: the API key, the draining state and the requests in flight, shared by the
    app's gate and ``serve``'s shutdown (all on the event loop's thread).

    ``in_flight`` counts ``/v1/*`` requests from arrival to the last byte of their response;
    ``handles`` are the engine requests of those responses."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key.encode() if api_key else None
        self.draining = False  # new /v1/* requests get 503
        self.aborting = False  # the drain deadline passed: no new engine requests, the running ones cancelled
        self.in_flight = 0
        self.handles: weakref.WeakSet = weakref.WeakSet()
        self._skip = asyncio.Event()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.api_key is None:
            return True
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def skip_drain(self) -> None:
        """End the drain's wait now (a second signal)."""
        self._skip.set()

    async def drain(self, timeout: float) -> None:
        """Stop admitting; wait up to ``timeout`` s for the requests in flight; cancel the rest (their
        responses end with finish_reason "abort") and give them ``ABORT_GRACE`` s to send it."""
        self.draining = True
        _log(f"draining: no new requests; {self.in_flight} in flight get up to {timeout:g}s to finish")
        await self._until_idle(timeout)
        if self.in_flight:
            self.aborting = True
            _log(f"drain deadline: ending {len(self.handles)} request(s) with finish_reason 'abort'")
            for handle in list(self.handles):
                handle.cancel()
            await self._until_idle(ABORT_GRACE)
        _log("drained" if not self.in_flight else f"{self.in_flight} request(s) still open after the grace; closing")

    async def _until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and not self._skip.is_set():
            await asyncio.sleep(0.05)
        self._skip.clear()


class _App:
    """The server's ASGI app: the API key and draining for ``/v1/*`` (counting the requests in
    flight), then the completion routes in plain ASGI (``serving/asgi.py``: ``routes`` maps a path
    to its handler, POST only), and every other route on the FastAPI app ``api``."""

    def __init__(self, api, admission: Admission, routes: dict):
        self.api, self.admission, self.routes = api, admission, routes
        self.state = api.state

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            return await self.api(scope, receive, send)
        adm = self.admission
        if not adm.authorized(scope.get("headers", [])):
            err = APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'", None,
                           code="invalid_api_key")
            return await asgi.send_json(send, err.status, err.body(), {"WWW-Authenticate": "Bearer"})
        if adm.draining:
            return await asgi.send_json(send, 503, _unavailable().body())
        route = self.routes.get(path)
        if route is not None and scope["method"] != "POST":
            err = APIError(405, f"Method Not Allowed: {scope['method']} {path}", None, code="method_not_allowed")
            return await asgi.send_json(send, 405, err.body(), {"Allow": "POST"})
        adm.in_flight += 1
        try:
            await (route or self.api)(scope, receive, send)
        finally:
            adm.in_flight -= 1


def _fingerprint(engine, model_name: str, device: dict) -> str:
    """``system_fingerprint``: a digest of what decides the outputs besides the request."""
    import jax

    from ddtree_jax import __version__

    facts = dict(version=__version__, jax=jax.__version__, model=model_name, method=engine.method,
                 budget=engine.budget, slots=engine.slots, max_model_len=engine.max_model_len, **device)
    return "fp_" + hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def _device_facts(engine) -> dict:
    """The device facts of ``/health`` and the fingerprint: where the engine runs."""
    from ddtree_jax.serving.engine_process import EngineClient

    if isinstance(engine, EngineClient):
        return dict(engine.device)
    import jax

    return dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform,
                devices=jax.device_count(), processes=jax.process_count())


def create_app(engine: Engine, *, model_name: str, chat_template: str | None = None,
               specials: dict[str, Any] | None = None, default_max_tokens: int = 16, manage_engine: bool = True,
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               cpu_workers: int = CPU_WORKERS):
    """The ASGI app serving ``engine`` as model ``model_name`` (FastAPI's, with the completion
    routes in plain ASGI in front): an ``Engine``, or an
    ``EngineClient`` (the engine in a process of its own: ``engine_process``; once that process is
    gone, ``/health`` answers 503 with its ``failure``). With ``manage_engine`` the app starts the
    engine at startup and stops it at shutdown. ``api_key``: required on
    ``/v1/*``; ``max_request_bytes``: the largest body; ``cpu_workers``: the threads that parse,
    render and tokenize. ``app.state.admission`` is the app's ``Admission`` (``serve`` drains it)."""
    import contextlib

    if engine.tokenizer is None:
        raise ValueError("the HTTP server needs an engine with a tokenizer")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    template = ChatTemplate(chat_template, specials or {}) if chat_template else None
    created = int(time.time())
    device = _device_facts(engine)
    fingerprint = _fingerprint(engine, model_name, device)
    admission = Admission(api_key)
    texts = TokenTexts(engine.tokenizer)
    pool = concurrent.futures.ThreadPoolExecutor(cpu_workers, thread_name_prefix="ddtree-http")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            engine.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ddtree-jax", lifespan=lifespan)
    app.state.admission = admission
    boot = secrets.token_hex(4)  # completion ids: "cmpl-<boot>-<request id>", unique across restarts

    def request_id(handle, chat: bool) -> str:
        return f"{'chatcmpl' if chat else 'cmpl'}-{boot}-{handle.request_id}"

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return APIError(exc.status_code, message, None, code=code).response(exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}", None, kind="server_error").response()

    @app.get("/health")
    async def health():
        failure = getattr(engine, "failure", None)
        status = "draining" if admission.draining else "failed" if failure else "ok"
        body = {"status": status, "model": model_name, "method": engine.method, "budget": engine.budget,
                "slots": engine.slots, "max_model_len": engine.max_model_len, **device,
                "front_end": getattr(engine, "front_end", 0)}
        if failure:
            body["error"] = failure
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "ddtree-jax", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():  # off the loop: an engine in another process answers a round trip
        body, ctype = await asyncio.get_running_loop().run_in_executor(pool, metrics_text, engine)
        return Response(body, media_type=ctype)

    def parse(raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None) from None
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: nested too deeply", None) from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got a JSON {type(body).__name__}", None)
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(400, f"model: unknown model {model!r}; this server serves {model_name!r}", "model",
                           code="model_not_found")
        return body

    def tokenize(text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        try:  # encode_batch releases the GIL while it runs (encode does not reliably)
            return engine.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as e:  # the tokenizers library raises plain Exception subclasses (e.g. lone surrogates)
            raise _bad(field, f"cannot be tokenized ({e})") from None

    def encode_prompt(body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenize(prompt, "prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            raise _bad("prompt", "one prompt per request (batches are not supported)")
        raise _bad("prompt", "must be a string or a list of token ids")

    def encode_messages(body: dict) -> list[int]:
        if template is None:
            raise APIError(400, "messages: this model has no chat template (no chat_template in "
                                "tokenizer_config.json); use /v1/completions", "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list of messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "each message needs a string 'role'")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise _bad(f"messages[{i}].content", "only text parts are supported")
                content = "".join(p["text"] for p in content)
            if content is not None and not isinstance(content, str):
                raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
            clean.append({**m, "content": content or ""})
        return tokenize(template.render(clean), "messages", add_special_tokens=False)

    def prepare(raw: bytes, chat: bool) -> _Prepared:
        """Everything a request costs the CPU before the engine: on a worker thread."""
        try:
            body = parse(raw)
            _refuse_unsupported(body)
            n = _integer(body, "n", 1, 1, MAX_N)
            logprobs, logprobs_field = _logprobs(body, chat, engine.max_logprobs)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise _bad("stream", "must be a boolean")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                raise _bad("stream_options", "must be an object")
            try:
                sampling = _sampling(body)
            except ValueError as e:  # SamplingParams' own checks
                raise _bad("sampling", str(e)) from None
            stop, stop_ids = _stops(body), _stop_ids(body)
            ignore_eos = body.get("ignore_eos", False)
            if not isinstance(ignore_eos, bool):
                raise _bad("ignore_eos", "must be a boolean")
            ids = encode_messages(body) if chat else encode_prompt(body)
            name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
            default = (min(engine.max_output_tokens, max(1, engine.max_model_len - len(ids))) if chat
                       else default_max_tokens)
            max_tokens = _integer(body, name, default, 1)
            return _Prepared(np.asarray(ids), sampling, max_tokens, name, stop, stop_ids, ignore_eos,
                             stream, bool(options.get("include_usage")), n, logprobs, logprobs_field)
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", None) from None

    async def engine_submit(*args, **kw):
        """``engine.submit``; an engine in another process is awaited (``EngineClient.asubmit``)."""
        asubmit = getattr(engine, "asubmit", None)
        return engine.submit(*args, **kw) if asubmit is None else await asubmit(*args, **kw)

    async def submit(p: _Prepared, chat: bool) -> list:
        """The request's ``n`` engine requests (none of them if one is refused)."""
        if admission.aborting:
            raise _unavailable()
        handles = []
        try:
            for i in range(p.n):
                sampling = p.sampling
                if i and sampling.seed is not None:
                    sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32)
                handles.append(await engine_submit(p.ids, sampling, max_tokens=p.max_tokens, stop=p.stop,
                                                   stop_token_ids=p.stop_ids, ignore_eos=p.ignore_eos,
                                                   logprobs=p.logprobs))
        except RequestError as e:  # (the engine counted it)
            for handle in handles:
                handle.cancel()
            field = {"prompt": "messages" if chat else "prompt", "max_tokens": p.max_tokens_field,
                     "logprobs": p.logprobs_field}.get(e.field, e.field)
            err = _bad(field, e.message)
            err.counted = True
            raise err from None
        except EngineOverloaded as e:
            for handle in handles:
                handle.cancel()
            raise APIError(503, str(e), None, kind="server_overloaded", code="overloaded") from None
        if admission.aborting:  # the drain deadline passed while the engine process answered
            for handle in handles:
                handle.cancel()
            raise _unavailable()
        for handle in handles:
            admission.handles.add(handle)
        return handles

    def usage(results: list[RequestResult]) -> dict:
        completion = sum(len(r.tokens) for r in results)
        rounds = sum(r.rounds for r in results)
        accepted = sum(sum(r.acceptance_lengths) for r in results)
        return {"prompt_tokens": results[0].prompt_tokens, "completion_tokens": completion,
                "total_tokens": results[0].prompt_tokens + completion,
                "speculative": {"method": engine.method, "budget": engine.budget, "rounds": rounds,
                                "mean_acceptance_length": round(accepted / rounds, 4) if rounds else 0.0}}

    def finish_reason(result: RequestResult) -> str:
        return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"

    def logprobs_of(p: _Prepared, chat: bool, tokens: list[int], lp, offsets: CompletionOffsets | None):
        """A choice's ``logprobs`` object (``None`` when the request did not ask)."""
        if p.logprobs is None:
            return None
        return chat_logprobs(tokens, lp, texts) if chat else completion_logprobs(tokens, lp, texts, offsets)

    async def merged(handles):
        """Lists of ``(choice index, chunk)``: every handle's chunks as they come (each time all
        that have arrived), until each has finished."""
        if len(handles) == 1:
            async for batch in handles[0].astream_batches():
                yield [(0, chunk) for chunk in batch]
            return
        inbox = Inbox(asyncio.get_running_loop())

        async def pump(i, handle):
            async for batch in handle.astream_batches():
                inbox.put_nowait([(i, chunk) for chunk in batch])

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        try:
            left = len(handles)
            while left:
                batch = [pair for pairs in await inbox.take() for pair in pairs]
                left -= sum(chunk.finished for _, chunk in batch)
                yield batch
        finally:
            for task in tasks:
                task.cancel()

    def release(handles) -> None:
        for handle in handles:
            if not handle.done:
                handle.cancel()
            admission.handles.discard(handle)

    async def completion_route(scope, receive, send, chat: bool) -> None:
        """``POST /v1/completions`` (``chat`` False) and ``/v1/chat/completions``, in plain ASGI."""
        try:
            raw = await asgi.read_body(scope, receive, max_request_bytes)
        except asgi.ClientGone:
            return
        except asgi.BodyTooLarge as e:
            return await refuse(send, _too_large(max_request_bytes, e.size))
        except ValueError as e:  # the Content-Length
            return await refuse(send, APIError(400, str(e), None))
        try:
            if len(raw) <= INLINE_BYTES:  # a small body costs less here than a hop to a worker thread
                prepared = prepare(raw, chat)
            else:
                prepared = await asyncio.get_running_loop().run_in_executor(pool, prepare, raw, chat)
            handles = await submit(prepared, chat)
        except APIError as e:
            return await refuse(send, e)
        except Exception as e:
            return await internal_error(send, e)
        watcher = asgi.Disconnect(receive, lambda: [h.cancel() for h in handles if not h.done])
        events = asgi.EventStream(send)
        try:
            if prepared.stream:
                await stream_response(events, handles, prepared, chat)
            else:
                status, body = await whole_response(handles, prepared, chat)
                await asgi.send_json(send, status, body)
        except Exception as e:
            if events.started:
                raise  # uvicorn logs it and closes the connection
            await internal_error(send, e)
        finally:
            watcher.close()
            release(handles)

    async def refuse(send, e: APIError) -> None:
        if e.status in (400, 413) and not e.counted:
            engine.metrics.count("rejected", "invalid" if e.status == 400 else "too_large")
        await asgi.send_json(send, e.status, e.body())

    async def internal_error(send, e: Exception) -> None:
        _log(f"internal error: {''.join(traceback.format_exception(e)).rstrip()}")
        await refuse(send, APIError(500, f"internal error: {type(e).__name__}", None, kind="server_error"))

    async def whole_response(handles, p: _Prepared, chat: bool) -> tuple[int, dict]:
        results: list[RequestResult | None] = [None] * len(handles)
        async for batch in merged(handles):
            for i, chunk in batch:
                if chunk.finished:
                    results[i] = chunk.result
        failed = next((r for r in results if r.finish_reason.startswith("error")), None)
        if failed is not None:
            return 500, APIError(500, failed.finish_reason, None, kind="server_error").body()
        choices = []
        for i, result in enumerate(results):
            lp = logprobs_of(p, chat, result.tokens, result.logprobs, CompletionOffsets())
            choices.append({"index": i, "message": {"role": "assistant", "content": result.text}, "logprobs": lp,
                            "finish_reason": finish_reason(result)} if chat else
                           {"index": i, "text": result.text, "logprobs": lp, "finish_reason": finish_reason(result)})
        return 200, {"id": request_id(handles[0], chat), "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_name, "system_fingerprint": fingerprint,
                     "choices": choices, "usage": usage(results)}

    async def stream_response(out: asgi.EventStream, handles, p: _Prepared, chat: bool) -> None:
        rid, now = request_id(handles[0], chat), int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [CompletionOffsets() for _ in handles]
        plain = not chat and p.logprobs is None  # a completion choice is its text alone
        events = StreamEvents(rid, obj, now, model_name, fingerprint, p.include_usage)
        event = events.event

        def choice(i: int, chunk, reason: str | None, first: bool = False) -> dict:
            text = None if first else chunk.text
            lp = None if first else logprobs_of(p, chat, chunk.token_ids, chunk.logprobs, offsets[i])
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}

        def events_of(i: int, chunk, results: list) -> tuple[list[str], bool]:
            """One chunk's events, and whether it ended the response with an error."""
            news = bool(chunk.text) or (p.logprobs is not None and bool(chunk.token_ids))
            if not chunk.finished:
                if not news:
                    return [], False
                return [events.text(i, chunk.text, None) if plain else event([choice(i, chunk, None)])], False
            result = results[i] = chunk.result
            if result.finish_reason.startswith("error"):
                err = APIError(500, result.finish_reason, None, kind="server_error")
                last = [event([choice(i, chunk, None)])] if news else []
                return last + [f"data: {json.dumps(err.body())}\n\n"], True
            reason = finish_reason(result)
            return [events.text(i, chunk.text or "", reason) if plain else event([choice(i, chunk, reason)])], False

        # The chunks that arrived together go out in one write (each its own event): a stream that
        # fell behind catches up at once.
        results: list[RequestResult | None] = [None] * len(handles)
        await out.start()
        if chat:
            await out.write("".join(event([choice(i, None, None, first=True)]) for i in range(len(handles))))
        failed = False
        async for batch in merged(handles):
            text = []
            for i, chunk in batch:
                more, failed = events_of(i, chunk, results)
                text += more
                if failed:
                    break
            if text:
                await out.write("".join(text))
            if failed:
                break
        if not failed and p.include_usage:
            await out.write(event([], usage(results)))
        await out.write("data: [DONE]\n\n")
        await out.end()

    routes = {"/v1/completions": functools.partial(completion_route, chat=False),
              "/v1/chat/completions": functools.partial(completion_route, chat=True)}
    return _App(app, admission, routes)


def serve(engine: Engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, specials: dict | None = None, log_level: str = "info",
          api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, sock: socket.socket | None = None,
          on_signal=None, repeat_window: float = 0.0) -> None:
    """Run the server until SIGTERM or SIGINT, then drain (module doc) and return (uvicorn; the
    engine's thread, or with an ``EngineClient`` the engine's process, does the work). ``sock``: a
    bound socket to listen on (``ddtree_jax._preflight.bind_port``, which ``serve``'s command line
    calls before loading anything); default: bind ``host:port`` now. ``on_signal(signum)``, if
    given, runs on each of those signals first (``serve --api-servers`` forwards them); a signal
    within ``repeat_window`` seconds of the one that started the drain does not end it (a further
    front end may get the same signal from the first front end and from outside)."""
    from ddtree_jax._preflight import bind_port

    app = create_app(engine, model_name=model_name, chat_template=chat_template, specials=specials,
                     api_key=api_key, max_request_bytes=max_request_bytes)
    sock = sock if sock is not None else bind_port(host, port)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    _DrainingServer(config, app.state.admission, drain_timeout, on_signal, repeat_window).run(sockets=[sock])


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT drain the app before it stops (module doc)."""

    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout: float, on_signal=None,
                 repeat_window: float = 0.0):
        super().__init__(config)
        self.admission, self.drain_timeout, self.on_signal = admission, drain_timeout, on_signal
        self.repeat_window, self._drain_started = repeat_window, None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame):  # a signal handler, on the loop's (main) thread
        if self.on_signal is not None:
            self.on_signal(sig)
        if self._loop is None or not self.started:  # not serving yet: stop at once
            self.should_exit = True
        elif self._drain_started is not None:  # (not admission.draining: the drain task may not have run yet)
            if time.monotonic() - self._drain_started >= self.repeat_window:
                self._loop.call_soon_threadsafe(self.admission.skip_drain)
        else:
            self._drain_started = time.monotonic()
            _log(f"{signal.Signals(sig).name}: shutting down")
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self):
        self._drain_task = self._loop.create_task(self._drain_and_exit())

    async def _drain_and_exit(self):
        await self.admission.drain(self.drain_timeout)
        self.should_exit = True
