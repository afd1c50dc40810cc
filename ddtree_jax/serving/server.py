"""OpenAI-compatible HTTP server over an ``Engine`` (FastAPI + uvicorn; the ``serve`` extra).

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the chat template of
  ``tokenizer_config.json``, rendered with jinja2): ``stream: true`` answers with server-sent
  events ending in ``data: [DONE]``. Fields: ``model``, ``prompt`` / ``messages``, ``max_tokens``
  (chat: also ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``seed``, ``stop``, ``n`` (1 only), ``stream``, ``stream_options.include_usage``, and the
  extensions ``stop_token_ids`` and ``ignore_eos``. Refused with a 400 naming the field:
  ``logprobs``/``top_logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, non-zero penalties,
  ``logit_bias`` (sampling here is exact: the output follows the target's own law).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (prometheus text format).

``usage`` carries an extension ``speculative``: method, budget, rounds and the mean acceptance
length (tokens per target pass). Errors are OpenAI-style bodies ``{"error": {"message", "type",
"param", "code"}}``: 400 for invalid requests, 503 when the engine's queue is full. A client that
disconnects cancels its request; the slot is free after the current engine step.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ddtree_jax.config import is_int
from ddtree_jax.serving.engine import Engine, EngineOverloaded, RequestError, RequestResult

__all__ = ["create_app", "load_chat_template", "metrics_text", "serve"]


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.counted = False  # in the engine's rejected-requests metric already

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


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


def _refuse_unsupported(body: dict, chat: bool) -> None:
    if body.get("n") not in (None, 1):
        raise _bad("n", f"only n=1 is supported, got {body.get('n')!r}")
    if chat:
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise _bad("logprobs", "log-probabilities are not supported")
    elif body.get("logprobs") is not None:
        raise _bad("logprobs", "log-probabilities are not supported")
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
            ]:
                yield CounterMetricFamily(f"ddtree_{name}", doc, value=value)
            for name, doc, counts in [("requests", "finished requests by finish reason", s["requests"]),
                                      ("rejected_requests", "requests refused at submission", s["rejected"])]:
                c = CounterMetricFamily(f"ddtree_{name}", doc, labels=["reason"])
                for reason, n in sorted(counts.items()):
                    c.add_metric([reason], n)
                yield c
            for name, doc, h in [
                ("time_to_first_token_seconds", "submission to first streamed token", s["ttft"]),
                ("inter_token_latency_seconds", "time per streamed token after the first", s["itl"]),
                ("acceptance_length", "tokens accepted per round (bonus included)", s["accept"]),
            ]:
                buckets = [("+Inf" if math.isinf(b) else repr(float(b)), c) for b, c in h.cumulative()]
                yield HistogramMetricFamily(f"ddtree_{name}", doc, buckets=buckets, sum_value=h.total)

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry), CONTENT_TYPE_LATEST


def create_app(engine: Engine, *, model_name: str, chat_template: str | None = None,
               specials: dict[str, Any] | None = None, default_max_tokens: int = 16, manage_engine: bool = True):
    """The FastAPI app serving ``engine`` as model ``model_name``. With ``manage_engine`` the app
    starts the engine's thread at startup and stops it at shutdown."""
    import contextlib

    if engine.tokenizer is None:
        raise ValueError("the HTTP server needs an engine with a tokenizer")
    template = ChatTemplate(chat_template, specials or {}) if chat_template else None
    created = int(time.time())
    import jax

    device = dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform,
                  devices=jax.device_count(), processes=jax.process_count())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            engine.stop()

    app = FastAPI(title="ddtree-jax", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "method": engine.method, "budget": engine.budget,
                "slots": engine.slots, "max_model_len": engine.max_model_len, **device}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "ddtree-jax", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        body, ctype = metrics_text(engine)
        return Response(body, media_type=ctype)

    async def parse(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None) from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", None)
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(400, f"model: unknown model {model!r}; this server serves {model_name!r}", "model",
                           code="model_not_found")
        return body

    def encode_prompt(body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return engine.tokenizer.encode(prompt).ids
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
        text = template.render(clean)
        return engine.tokenizer.encode(text, add_special_tokens=False).ids

    def submit(body: dict, chat: bool):
        _refuse_unsupported(body, chat)
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
        ids = encode_messages(body) if chat else encode_prompt(body)
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        default = (min(engine.max_output_tokens, max(1, engine.max_model_len - len(ids))) if chat
                   else default_max_tokens)
        max_tokens = _integer(body, name, default, 1)
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad("ignore_eos", "must be a boolean")
        try:
            handle = engine.submit(ids, sampling, max_tokens=max_tokens, stop=_stops(body),
                                   stop_token_ids=_stop_ids(body), ignore_eos=ignore_eos)
        except RequestError as e:  # (the engine counted it)
            field = {"prompt": "messages" if chat else "prompt", "max_tokens": name}.get(e.field, e.field)
            err = _bad(field, e.message)
            err.counted = True
            raise err from None
        except EngineOverloaded as e:
            raise APIError(503, str(e), None, kind="server_overloaded", code="overloaded") from None
        return handle, stream, bool(options.get("include_usage")), len(ids)

    def usage(result: RequestResult) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
                "total_tokens": result.prompt_tokens + len(result.tokens),
                "speculative": {"method": engine.method, "budget": engine.budget, "rounds": result.rounds,
                                "mean_acceptance_length": round(result.tau, 4)}}

    def finish_reason(result: RequestResult) -> str:
        return result.finish_reason if result.finish_reason in ("stop", "length") else "abort"

    async def watch_disconnect(request: Request, handle):
        """Cancel ``handle`` once the client has gone (non-streaming requests)."""
        while not handle.done:
            if await request.is_disconnected():
                handle.cancel()
                return
            await asyncio.sleep(0.1)

    async def respond(request: Request, chat: bool):
        try:
            handle, stream, include_usage, _ = submit(await parse(request), chat)
        except APIError as e:
            if e.status == 400 and not e.counted:
                engine.metrics.count("rejected", "invalid")
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{handle.request_id}-{uuid.uuid4().hex[:8]}"
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())
        if not stream:
            watcher = asyncio.create_task(watch_disconnect(request, handle))
            try:
                result = None
                async for chunk in handle.astream():
                    result = chunk.result
            finally:
                watcher.cancel()
                if not handle.done:
                    handle.cancel()
            if result.finish_reason.startswith("error"):
                raise APIError(500, result.finish_reason, None, kind="server_error")
            choice = ({"index": 0, "message": {"role": "assistant", "content": result.text},
                       "logprobs": None, "finish_reason": finish_reason(result)} if chat else
                      {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)})
            return {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice],
                    "usage": usage(result)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices, extra=None) -> str:
            data = {"id": rid, "object": chunk_obj, "created": now, "model": model_name, "choices": choices,
                    **(extra or {})}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def choice(text: str | None, reason: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

        async def events():
            try:
                if chat:
                    yield event([choice(None, None, first=True)])
                async for chunk in handle.astream():
                    if not chunk.finished:
                        if chunk.text:
                            yield event([choice(chunk.text, None)])
                        continue
                    result = chunk.result
                    if result.finish_reason.startswith("error"):
                        if chunk.text:
                            yield event([choice(chunk.text, None)])
                        err = APIError(500, result.finish_reason, None, kind="server_error")
                        yield f"data: {json.dumps(err.body())}\n\n"
                    else:
                        yield event([choice(chunk.text, finish_reason(result))], {"usage": usage(result)})
                        if include_usage:
                            yield event([], {"usage": usage(result)})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or the response ended): nothing more to decode
                if not handle.done:
                    handle.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    return app


def serve(engine: Engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, specials: dict | None = None, log_level: str = "info") -> None:
    """Run the server until interrupted (uvicorn, one process; the engine thread does the work)."""
    import uvicorn

    app = create_app(engine, model_name=model_name, chat_template=chat_template, specials=specials)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
