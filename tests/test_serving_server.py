"""The OpenAI-compatible server as a real subprocess on 127.0.0.1 (tiny checkpoints written here),
driven by the official ``openai`` client and raw HTTP: completions and chat, streaming and not,
stop strings, refused fields, malformed input, the OpenAI fields (``system_fingerprint``, ``usage``
only when asked), a huge request refused without stalling the running streams, and a bounded load
test (64 concurrent streams with mixed settings, some bad, some disconnecting) checked for
well-formed streams, greedy/seeded outputs equal to the same request alone, nothing lost or
duplicated, and freed slots. In-process (nothing compiles): every error status as an OpenAI error
object, the body limit, the API key, draining. Shutdown on SIGTERM: servers of their own. The
engine in a process of its own (``--engine-process``): the same outputs and refusals as the
one-process server, cancellation, the SIGTERM drain, and a killed engine process.
"""

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests._serving_fixtures import write_tiny_checkpoints  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS = 4
MAX_LOGPROBS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_tiny_checkpoints(str(tmp_path_factory.mktemp("serve")))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The persistent compilation cache the module's servers share."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache_dir: str, **extra) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "DDTREE_JAX_COMPILATION_CACHE": cache_dir, **extra}


class Server:
    """``python -m ddtree_jax.serving.cli`` on the tiny checkpoints as a subprocess on 127.0.0.1."""

    def __init__(self, paths, env, *extra, slots=SLOTS, max_model_len=64, log_name="server.log"):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.path.dirname(paths["target"]), log_name), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree_jax.serving.cli", "--target", paths["target"], "--drafter",
             paths["drafter"], "--tokenizer", paths["tokenizer"], "--budget", "6", "--slots", str(slots),
             "--max-model-len", str(max_model_len), "--prefill-chunk", "16", "--prefill-batch", "1", "--dtype",
             "float32", "--max-logprobs", str(MAX_LOGPROBS), "--served-model-name", "tiny", "--host", "127.0.0.1",
             "--port", str(self.port),
             "--log-level", "warning", *extra],
            env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout=400) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up in {timeout} s")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(paths, cache_dir):
    s = Server(paths, _env(cache_dir))
    try:
        s.wait_ready()
        yield s.base
    finally:
        s.proc.terminate()
        try:
            s.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ddtree_\S+) (\S+)$", text, re.M)}


def sse(server, path, body, *, stop_after=None):
    """POST a streaming request; returns ``(status, [parsed events], done)`` (``stop_after``: hang up
    after that many events)."""
    events, done = [], False
    with httpx.stream("POST", server + path, json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()], False
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            assert not done, "an event after [DONE]"
            if payload == "[DONE]":
                done = True
                continue
            events.append(json.loads(payload))
            if stop_after is not None and len(events) >= stop_after:
                return r.status_code, events, done
    return 200, events, done


def check_stream(events, done, chat=False):
    """A well-formed stream asked with ``stream_options.include_usage``: one id and fingerprint,
    deltas with ``"usage": null``, one final chunk with a finish reason, then one chunk with empty
    choices and the usage, then [DONE]."""
    assert done and len(events) >= 2
    assert len({e["id"] for e in events}) == 1
    assert len({e["system_fingerprint"] for e in events}) == 1 and events[0]["system_fingerprint"].startswith("fp_")
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 0
    assert all(e["usage"] is None for e in chunks)
    finals = [e for e in chunks if e["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    key = "delta" if chat else "text"
    parts = [e["choices"][0][key] for e in chunks]
    text = "".join(p.get("content", "") for p in parts) if chat else "".join(parts)
    return text, chunks[-1]["choices"][0]["finish_reason"], last["usage"]


def test_completions_and_chat_with_the_openai_client(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json()["status"] == "ok"
    out = client.completions.create(model="tiny", prompt="The quick", max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len("The quick")
    spec = out.usage.model_extra["speculative"]
    assert spec["method"] == "ddtree" and spec["rounds"] >= 1 and 1 <= spec["mean_acceptance_length"] <= 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The quick", max_tokens=12, temperature=0, stream=True))
    assert streamed == out.choices[0].text
    # A stop string cuts the text before it.
    text = out.choices[0].text
    stop = text[4:6]
    cut = client.completions.create(model="tiny", prompt="The quick", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len("<system>Be brief.\n<user>Hi!\n<assistant>")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    seeded = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.8,
                                             top_p=0.9, seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("body,param", [
    (dict(prompt="x", temperature=-1), "temperature"),
    (dict(prompt="x", top_p=0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x" * 64), "prompt"),
    (dict(prompt="x", model="gpt-4"), "model"),
    (dict(prompt="x", n=0), "n"),
    (dict(prompt="x", n=129), "n"),
    (dict(prompt="x", logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt="x", logprobs=True), "logprobs"),
    (dict(prompt="x", seed=-3), "seed"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=[1, 999]), "prompt"),
])
def test_bad_completion_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


def test_malformed_and_refused_input(server, client):
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "x",', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for extra, param in [(dict(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs"),
                         (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                         (dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=1), "logprobs")]:
        r = httpx.post(server + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        assert param in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=-0.5)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=60)


def test_concurrent_streams_mixed_bad_and_disconnecting(server):
    """64 concurrent streaming requests through 4 slots, in a shuffled order: 24 greedy and 16 seeded
    (each compared with the same request run alone), 8 unseeded sampled, 8 invalid (400, naming the
    field), 8 that hang up after 2 events (cancelled, their slots freed). Nothing lost or duplicated."""
    prompts = ["The quick", "Hello", "abc def", "Tree", "0123", "Speculative"]
    greedy = [dict(prompt=prompts[i % 6], max_tokens=6 + i % 11, temperature=0) for i in range(24)]
    seeded = [dict(prompt=prompts[i % 6], max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i)
              for i in range(16)]
    sampled = [dict(prompt=prompts[i % 6], max_tokens=8, temperature=1.0, min_p=0.05 * (i % 2)) for i in range(8)]
    bad = [dict(prompt="x", temperature=-1.0), dict(prompt="x", top_p=2.0), dict(prompt="x", top_p=0.0),
           dict(prompt="x", max_tokens=0), dict(prompt="x", min_p=1.5), dict(prompt="x", top_k=-2),
           dict(prompt="x", temperature=-0.5, top_p=0.5), dict(prompt="x", max_tokens=-3)]
    bad_fields = ["temperature", "top_p", "top_p", "max_tokens", "min_p", "top_k", "temperature", "max_tokens"]
    hangups = [dict(prompt=["ab", "cd", "e", "fg"][i % 4], max_tokens=50, temperature=0, ignore_eos=True)
               for i in range(8)]
    alone = [httpx.post(server + "/v1/completions", json=b, timeout=120).json()["choices"][0]["text"]
             for b in greedy + seeded]
    before = metrics(server)

    jobs = ([("ok", b) for b in greedy + seeded + sampled] + [("bad", b) for b in bad]
            + [("hangup", b) for b in hangups])
    assert len(jobs) == 64
    order = np.random.default_rng(0).permutation(len(jobs)).tolist()

    def run(i):
        kind, body = jobs[i]
        return sse(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}},
                   stop_after=2 if kind == "hangup" else None)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {i: pool.submit(run, i) for i in order}
        results = {i: f.result(timeout=600) for i, f in futures.items()}

    ids = set()
    n_ok = len(greedy) + len(seeded) + len(sampled)
    for i, (kind, body) in enumerate(jobs):
        status, events, done = results[i]
        if kind == "bad":
            assert status == 400 and events[0]["error"]["param"] == bad_fields[i - n_ok], (body, events)
            continue
        if kind == "hangup":
            assert status == 200 and len(events) == 2 and not done
            continue
        text, reason, usage = check_stream(events, done)
        ids.add(events[0]["id"])
        # EOS (the tokenizer config's) may end a sampled request early.
        assert (reason, usage["completion_tokens"]) == ("length", body["max_tokens"]) or (
            reason == "stop" and usage["completion_tokens"] <= body["max_tokens"])
        if i < len(alone):
            assert text == alone[i], (i, body)
    assert len(ids) == n_ok  # nothing lost or duplicated

    deadline = time.monotonic() + 60
    while True:  # the hung-up requests are cancelled and every slot is free again
        m = metrics(server)
        if m["ddtree_running_requests"] == 0 and m["ddtree_free_slots"] == SLOTS and m["ddtree_queue_length"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    delta = {k: m.get(k, 0) - before.get(k, 0) for k in m}
    finished = delta['ddtree_requests_total{reason="length"}'] + delta.get('ddtree_requests_total{reason="stop"}', 0)
    assert finished == n_ok
    assert delta['ddtree_requests_total{reason="cancelled"}'] == len(hangups)
    assert delta['ddtree_rejected_requests_total{reason="invalid"}'] == len(bad)
    assert m["ddtree_time_to_first_token_seconds_count"] >= n_ok and m["ddtree_acceptance_length_count"] > 0
    # Every request that got a slot waited in the queue; each first token came after its slot's prefill.
    assert delta["ddtree_request_queue_time_seconds_count"] >= n_ok + len(hangups)
    assert delta["ddtree_request_prefill_time_seconds_count"] >= n_ok
    assert delta["ddtree_request_prefill_time_seconds_sum"] <= delta["ddtree_time_to_first_token_seconds_sum"]


def test_non_streaming_client_that_gives_up_cancels_its_request(server):
    """Every slot busy with a long stream, a non-streaming request waits in the queue; its client
    hangs up (the request needs a free slot, then ~60 rounds): the server cancels it, the streams
    finish. The client sends the request on a raw socket once the streams hold every slot (sent
    earlier, it could take a slot before the streams' threads reached the server, and never
    queue), and hangs up once the server has queued it (a timed give-up could hang up before a
    loaded server had even read the request). A run whose streams were too fast to see every
    slot busy, or the request queued, is run again (three runs in all)."""
    for _ in range(3):
        try:
            return _give_up_while_queued(server)
        except _MissedWindow:
            continue
    pytest.fail("three runs in a row: a stream finished before every slot was busy and the request queued")


def _settle(server, timeout=60) -> dict:
    deadline = time.monotonic() + timeout
    while (m := metrics(server))["ddtree_running_requests"] or m["ddtree_queue_length"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    return m


def _give_up_while_queued(server):
    before = _settle(server)
    finished = 'ddtree_requests_total{reason="length"}'
    long = dict(prompt="ab", max_tokens=60, temperature=0, ignore_eos=True)
    streamed = {**long, "stream": True, "stream_options": {"include_usage": True}}
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        busy = [pool.submit(sse, server, "/v1/completions", streamed) for _ in range(SLOTS)]
        try:
            deadline = time.monotonic() + 120
            while (m := metrics(server))["ddtree_free_slots"] > 0:
                if m.get(finished, 0) > before.get(finished, 0):
                    raise _MissedWindow(m)
                assert time.monotonic() < deadline, "the streams never held every slot"
                time.sleep(0.02)
            host, port = server.removeprefix("http://").split(":")
            body = json.dumps(long).encode()
            with socket.create_connection((host, int(port)), timeout=30) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                deadline = time.monotonic() + 120
                while (m := metrics(server))["ddtree_queue_length"] < 1:
                    if m.get(finished, 0) > before.get(finished, 0):
                        raise _MissedWindow(m)  # a slot freed: the request may have taken it unqueued
                    assert time.monotonic() < deadline, "the request never reached the queue"
                    time.sleep(0.05)
        finally:
            results = [f.result(timeout=120) for f in busy]
    for _, events, done in results:
        _, reason, usage = check_stream(events, done)
        assert reason == "length" and usage["completion_tokens"] == 60
    m = _settle(server, 30)
    key = 'ddtree_requests_total{reason="cancelled"}'
    assert m[key] - before.get(key, 0) == 1


def test_no_chat_template_is_400_and_a_full_queue_is_503():
    """In-process (nothing compiles: the requests are refused before they reach the engine)."""
    from fastapi.testclient import TestClient

    from ddtree_jax.config import DecodeConfig, EngineConfig
    from ddtree_jax.serving import Engine
    from ddtree_jax.serving.server import create_app
    from tests._model_fixtures import tiny_kimi
    from tests._serving_fixtures import char_tokenizer

    config = EngineConfig(decode=DecodeConfig(method="ar"), slots=1, max_model_len=32, max_queue=1)
    engine = Engine(tiny_kimi(0), None, config, tokenizer=char_tokenizer())
    with TestClient(create_app(engine, model_name="t", chat_template=None, manage_engine=False)) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        assert http.get("/v1/models").json()["data"][0]["id"] == "t"
        engine.submit([1, 2], max_tokens=2)  # the queue is now full (nothing steps the engine)
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
        text = http.get("/metrics").text
        assert 'ddtree_rejected_requests_total{reason="invalid"} 1.0' in text
        assert 'ddtree_rejected_requests_total{reason="overloaded"} 1.0' in text and "ddtree_queue_length 1.0" in text


def test_openai_fields_fingerprint_and_usage_only_when_asked(server):
    body = dict(prompt="The quick", max_tokens=5, temperature=0)
    whole = httpx.post(server + "/v1/completions", json=body, timeout=120).json()
    fingerprint = whole["system_fingerprint"]
    assert fingerprint.startswith("fp_") and whole["usage"]["completion_tokens"] == 5
    chat = httpx.post(server + "/v1/chat/completions", timeout=120,
                      json=dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)).json()
    assert chat["system_fingerprint"] == fingerprint
    for options in (None, {"include_usage": False}):
        _, events, done = sse(server, "/v1/completions", {**body, "stream": True, "stream_options": options})
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        assert all("usage" not in e and e["system_fingerprint"] == fingerprint for e in events)
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    _, events, done = sse(server, "/v1/completions", streamed)
    text, reason, usage = check_stream(events, done)
    assert text == whole["choices"][0]["text"] and reason == "length"
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens")} == {"prompt_tokens": 9, "completion_tokens": 5}
    _, events, done = sse(server, "/v1/chat/completions", {**chat_body(), "stream": True,
                                                           "stream_options": {"include_usage": True}})
    check_stream(events, done, chat=True)


def chat_body():
    return dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)


def test_logprobs_in_the_openai_shapes(client, server):
    """Completions' legacy shape and chat's, whole and streamed; greedy values are the top
    alternative's; the alternatives' probabilities sum to at most 1."""
    extra = {"ignore_eos": True}
    out = client.completions.create(model="tiny", prompt="The quick", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body=extra).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and value == pytest.approx(max(top.values()), abs=1e-6) and value <= 0
        assert sum(np.exp(list(top.values()))) <= 1 + 1e-5
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt="The quick", max_tokens=6, temperature=0, logprobs=3, stream=True, extra_body=extra)]
    assert [t for c in streamed if c for t in c.tokens] == lp.tokens
    assert [o for c in streamed if c for o in c.text_offset] == lp.text_offset
    assert [v for c in streamed if c for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert client.completions.create(model="tiny", prompt="The quick", max_tokens=2).choices[0].logprobs is None

    messages = [{"role": "user", "content": "Hi!"}]
    extra = {**extra, "top_k": 4}
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.9, seed=3,
                                          logprobs=True, top_logprobs=MAX_LOGPROBS, extra_body=extra).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == chat.message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert 1 <= len(e.top_logprobs) <= 4  # top_k 4 removes the rest
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.token in {a.token for a in e.top_logprobs}
        assert sum(np.exp([a.logprob for a in e.top_logprobs])) <= 1 + 1e-5
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.9,
                                                 seed=3, logprobs=True, top_logprobs=0, stream=True, extra_body=extra))
    parts = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in parts] == [e.token for e in content] and all(e.top_logprobs == [] for e in parts)
    assert [e.logprob for e in parts] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_n_choices(client, server):
    """n=3: three choices with their indexes, seeded ones reproducible and different from each
    other (choice i: seed + i, so choice 0 is the n=1 answer), streamed chunks tagged by index,
    usage summed over the choices."""
    body = dict(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    first = client.completions.create(n=3, **body)
    again = client.completions.create(n=3, **body)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and [c.text for c in again.choices] == texts
    assert len(set(texts)) == 3
    assert client.completions.create(**body).choices[0].text == texts[0]
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == 5
    assert first.usage.total_tokens == 29
    _, events, done = sse(server, "/v1/completions", {**{k: v for k, v in body.items() if k != "extra_body"},
                                                      "ignore_eos": True, "n": 3, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert done and events[-1]["usage"]["completion_tokens"] == 24
    per_index = {i: "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i)
                 for i in range(3)}
    assert per_index == dict(enumerate(texts))
    assert sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]) == [0, 1, 2]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=3, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_a_huge_request_is_refused_without_stalling_the_running_streams(server):
    """Streams run back to back and /health is polled while a 3.4 MiB prompt (under the body limit;
    tokenizing it takes seconds here) is refused for its length, and a body over the limit gets 413
    at once: no stream's gap between two chunks, and no /health answer, takes 2 s (or half the
    refusal's time, if longer)."""
    gaps, health, stop = [], [], threading.Event()

    def streams():
        while not stop.is_set():
            last = None
            with httpx.stream("POST", server + "/v1/completions", timeout=60,
                              json=dict(prompt="ab", max_tokens=60, temperature=0, ignore_eos=True, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

    def poll():
        while not stop.is_set():
            t = time.perf_counter()
            assert httpx.get(server + "/health", timeout=60).status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(streams), pool.submit(poll)]
        try:
            deadline = time.monotonic() + 60
            while len(gaps) < 5:
                assert time.monotonic() < deadline, "the streams did not start"
                time.sleep(0.05)
            before = len(gaps)
            t = time.perf_counter()
            r = httpx.post(server + "/v1/completions", json={"prompt": "hello world " * 300_000, "max_tokens": 2},
                           timeout=300)
            refusal = time.perf_counter() - t
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            t = time.perf_counter()
            r = httpx.post(server + "/v1/completions", content=b" " * (4 * 2**20 + 1), timeout=60,
                           headers={"content-type": "application/json"})
            too_large = (r.status_code, time.perf_counter() - t)
        finally:
            stop.set()
        for job in jobs:
            job.result(timeout=120)
    assert len(gaps) > before + 5, (before, len(gaps), refusal)  # the streams ran during the refusal
    # A loop blocked by the refusal would show a gap about as long as the refusal itself; the bound
    # grows with it so that a loaded machine's slower streams do not fail the test.
    bound = max(2.0, refusal / 2)
    assert max(gaps) < bound and max(health) < bound, (max(gaps), max(health), refusal)
    assert too_large[0] == 413 and too_large[1] < 5, too_large


# ---- in-process: errors, the body limit, the API key, draining (nothing compiles)


@pytest.fixture(scope="module")
def small_engine():
    from ddtree_jax.config import DecodeConfig, EngineConfig
    from ddtree_jax.serving import Engine
    from tests._model_fixtures import tiny_kimi
    from tests._serving_fixtures import char_tokenizer

    return Engine(tiny_kimi(0), None, EngineConfig(decode=DecodeConfig(method="ar"), slots=1, max_model_len=32),
                  tokenizer=char_tokenizer())


def _app_client(engine, **kw):
    from fastapi.testclient import TestClient

    from ddtree_jax.serving.server import create_app

    return TestClient(create_app(engine, model_name="t", manage_engine=False, **kw), raise_server_exceptions=False)


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_BODIES = {
    "nested 100,000 deep": (DEEP, "nested too deeply"),
    "nested inside a field": (b'{"prompt": "x", "stop": ' + DEEP + b"}", "nested too deeply"),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    "truncated": (b'{"prompt": "x",', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "a list": (b"[1, 2]", "must be a JSON object, got a JSON list"),
    "a string": (b'"hi"', "must be a JSON object, got a JSON str"),
    "a lone surrogate": (b'{"prompt": "a\\ud800b"}', "prompt: cannot be tokenized"),
    "a token id beyond 64 bits": (b'{"prompt": [1, 100000000000000000000000000000]}', "prompt: must hold integer"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_bodies_are_400_openai_errors(small_engine, case):
    raw, words = BAD_BODIES[case]
    with _app_client(small_engine) as http:
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert words in _openai_error(r, 400)["message"]


def test_bad_chat_bodies_are_400_openai_errors(small_engine):
    from tests._serving_fixtures import CHAT_TEMPLATE

    with _app_client(small_engine, chat_template=CHAT_TEMPLATE) as http:
        message = b'{"messages": [{"role": "user", "content": %s}]}'
        for raw, words in [(DEEP, "nested too deeply"), (message % b'"a\\ud800"', "messages: cannot be tokenized"),
                           (message % DEEP, "nested too deeply")]:
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert words in _openai_error(r, 400)["message"]


def test_every_status_is_an_openai_error_object(small_engine):
    with _app_client(small_engine, max_request_bytes=1000) as http:
        for method, path, status, code in [("GET", "/v1/nothing", 404, "not_found"),
                                           ("GET", "/nothing", 404, "not_found"),
                                           ("GET", "/v1/completions", 405, "method_not_allowed"),
                                           ("DELETE", "/v1/models", 405, "method_not_allowed")]:
            r = http.request(method, path)
            err = _openai_error(r, status)
            assert err["code"] == code and path in err["message"], err
        assert "POST" in http.request("GET", "/v1/completions").headers["allow"]
        r = http.post("/v1/completions", json={"prompt": "x" * 1000})
        err = _openai_error(r, 413)
        assert err["code"] == "request_too_large" and "at most 1000 bytes" in err["message"]
        r = http.post("/v1/completions", content=iter([b" " * 600, b" " * 600]))  # chunked: no Content-Length
        assert "chunked" in r.request.headers.get("transfer-encoding", "")
        assert _openai_error(r, 413)["message"].startswith("the request body is larger than 1000 bytes")
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True, "model": "other"})
        assert _openai_error(r, 400)["code"] == "model_not_found"


def test_a_failure_inside_the_server_is_a_500_openai_error(small_engine, monkeypatch):
    def broken(*args, **kw):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(small_engine, "submit", broken)
    with _app_client(small_engine) as http:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream})
            err = _openai_error(r, 500)
            assert err["type"] == "server_error" and err["message"] == "internal error: ZeroDivisionError"


def test_logprobs_from_an_engine_without_them_is_400(small_engine):
    from tests._serving_fixtures import CHAT_TEMPLATE

    with _app_client(small_engine, chat_template=CHAT_TEMPLATE) as http:
        for path, body in [("/v1/completions", {"prompt": "hi", "logprobs": 0}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                     "top_logprobs": 1})]:
            err = _openai_error(http.post(path, json=body), 400)
            assert err["param"] == "logprobs" and "--max-logprobs" in err["message"], err


def test_api_key_guards_every_v1_route(small_engine):
    with _app_client(small_engine, api_key="s3cret") as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret-and-more"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nothing")):
                r = http.request(method, path, headers=headers, json={"prompt": "hi"})
                assert _openai_error(r, 401)["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert http.get("/v1/models", headers=ok).status_code == 200
        assert http.get("/v1/models", headers={"authorization": "bearer s3cret"}).status_code == 200
        assert _openai_error(http.get("/v1/nothing", headers=ok), 404)["code"] == "not_found"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_draining_refuses_new_requests_with_503(small_engine):
    with _app_client(small_engine) as http:
        http.app.state.admission.draining = True
        err = _openai_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert err["code"] == "shutting_down"
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"


# ---- shutdown: a server of its own per test


def _stream_all(base, body, headers):
    """A streamed request read to its end: ``(events, done)``."""
    events, done = [], False
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events, done


def _drain_run(paths, cache_dir, *, drain_timeout, sig, log_name, slots, max_model_len, max_tokens, extra=(), **env):
    """A server of ``slots`` slots (``extra``: more options); ``slots + 2`` streams of ``max_tokens``
    tokens; ``sig`` once every slot is busy and two streams wait in the queue. Returns the server's
    output, the streams' ``(events, done)``, what /health and a new request got during the drain
    (``None`` without a drain), and the exit status."""
    s = Server(paths, _env(cache_dir, **env), "--drain-timeout", str(drain_timeout), *extra, slots=slots,
               max_model_len=max_model_len, log_name=log_name)
    headers = {"Authorization": f"Bearer {env['DDTREE_JAX_API_KEY']}"} if "DDTREE_JAX_API_KEY" in env else {}
    try:
        s.wait_ready()
        body = dict(prompt="ab", max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        with concurrent.futures.ThreadPoolExecutor(slots + 2) as pool:
            jobs = [pool.submit(_stream_all, s.base, body, headers) for _ in range(slots + 2)]
            deadline = time.monotonic() + 120
            while (m := metrics(s.base))["ddtree_queue_length"] < 2 or m["ddtree_free_slots"] > 0:
                if any(k.startswith("ddtree_requests_total") and v for k, v in m.items()):
                    raise _MissedWindow(m)  # a stream finished before the queue held two: too fast a run
                assert time.monotonic() < deadline, f"never {slots} running and 2 queued: {m}"
                time.sleep(0.02)
            s.proc.send_signal(sig)
            during = None
            if drain_timeout:
                deadline = time.monotonic() + 30
                while (h := httpx.get(s.base + "/health", timeout=30)).status_code != 503:
                    assert time.monotonic() < deadline, "never draining"
                    time.sleep(0.05)
                during = (h.json()["status"], httpx.post(s.base + "/v1/completions", json=body, headers=headers,
                                                         timeout=30))
            streams = [j.result(timeout=300) for j in jobs]
        code = s.proc.wait(timeout=120)
        return s.output(), streams, during, code
    except _MissedWindow:
        raise
    except BaseException:
        print(s.output()[-3000:])
        raise
    finally:
        s.close()


class _MissedWindow(Exception):
    """The streams ran faster than the test could see every slot busy and two queued."""


def _drain_run_retrying(*args, **kw):
    """``_drain_run``, again (up to three runs in all) when the streams outran the signal's window."""
    for attempt in range(3):
        try:
            return _drain_run(*args, **kw)
        except _MissedWindow:
            if attempt == 2:
                raise


def test_sigterm_lets_running_requests_finish_then_exits_0(paths, cache_dir):
    """SIGTERM with one stream running and two queued, a long drain deadline: /health says
    draining, a new request gets 503, the three streams finish normally, the process exits 0.
    The API key comes from the environment."""
    output, streams, during, code = _drain_run_retrying(paths, cache_dir, drain_timeout=300, sig=signal.SIGTERM,
                                               log_name="drain.log", slots=1, max_model_len=256, max_tokens=240,
                                               DDTREE_JAX_API_KEY="k3y")
    status, refused = during
    assert status == "draining" and _openai_error(refused, 503)["code"] == "shutting_down"
    for events, done in streams:
        _, reason, usage = check_stream(events, done)
        assert reason == "length" and usage["completion_tokens"] == 240
    assert code == 0, output[-3000:]


def test_sigint_past_the_drain_deadline_aborts_with_a_final_chunk(paths, cache_dir, server):
    """SIGINT with a drain deadline of 0: the running and the queued streams end at once (running
    ones may have finished first) with a final chunk, their usage and [DONE]; the queued ones with
    finish_reason "abort" and no tokens; the process exits 0. The server has the shapes of the
    module's server (``server``, which ran first): its programs load from the persistent
    compilation cache."""
    output, streams, _, code = _drain_run_retrying(paths, cache_dir, drain_timeout=0, sig=signal.SIGINT,
                                          log_name="abort.log", slots=SLOTS, max_model_len=64, max_tokens=60)
    ends = []
    for events, done in streams:
        _, reason, usage = check_stream(events, done)
        ends.append((reason, usage["completion_tokens"]))
    assert all(e == ("length", 60) or (e[0] == "abort" and e[1] < 60) for e in ends), ends
    assert ends.count(("abort", 0)) >= 2, ends
    assert code == 0
    warmup = [line for line in output.splitlines() if "warm-up in" in line]
    assert len(warmup) == 1 and "from the persistent cache" in warmup[0], warmup


# ---- serve --engine-process: the engine in a process of its own (its programs from the module's cache)


def _engine_pid(output: str) -> int:
    return int(re.search(r"engine process (\d+) started", output).group(1))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_process_server(paths, cache_dir, server):
    """A ``--engine-process`` server like ``server`` (started after it: its shapes are cached; with
    ``--switch-interval``, which changes no output):
    greedy outputs (completions and chat, with log-probabilities) equal the one-process server's; a
    stream's chunks join up to the same text; refusals from the engine process (the context, stop
    ids) and from the front end are the same 400s naming the field, counted in the engine's
    metrics; a client that hangs up frees its slot. Then the engine process is killed with streams
    running and queued: each stream ends (an error event, then [DONE]) instead of hanging,
    /health is 503, new requests get 503."""
    s = Server(paths, _env(cache_dir), "--engine-process", "--switch-interval", "1", log_name="two_process.log")
    try:
        s.wait_ready()
        _same_as_one_process(server, s.base)
        _hangup_frees_the_slot(s.base)
        _killed_engine_ends_the_streams(s)
    except BaseException:
        print(s.output()[-3000:])
        raise
    finally:
        s.close()


def _same_as_one_process(server, base):
    for prompt, n in (("The quick", 12), ("Tree", 20), ("0123", 7)):
        body = dict(prompt=prompt, max_tokens=n, temperature=0, logprobs=2)
        one, two = (httpx.post(b + "/v1/completions", json=body, timeout=120).json() for b in (server, base))
        assert two["choices"] == one["choices"] and two["usage"] == one["usage"]
        status, events, done = sse(base, "/v1/completions", {**body, "stream": True,
                                                             "stream_options": {"include_usage": True}})
        text, _, usage = check_stream(events, done)
        assert status == 200 and text == one["choices"][0]["text"] and usage == one["usage"]
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0)
    one, two = (httpx.post(b + "/v1/chat/completions", json=chat, timeout=120).json() for b in (server, base))
    assert two["choices"] == one["choices"]
    # Stop strings are applied in the front end here: the text ends before the first one, the
    # log-probabilities with the tokens kept, and the engine counts the finish as a stop.
    full = httpx.post(server + "/v1/completions", json=dict(prompt="The quick", max_tokens=24, temperature=0,
                                                           ignore_eos=True), timeout=120).json()["choices"][0]["text"]
    assert len(full) >= 8, full
    body = dict(prompt="The quick", max_tokens=24, temperature=0, ignore_eos=True, logprobs=2, stop=["zz", full[5:7]])
    stops = 'ddtree_requests_total{reason="stop"}'
    before = metrics(base).get(stops, 0)
    one, two = (httpx.post(b + "/v1/completions", json=body, timeout=120).json() for b in (server, base))
    assert one["choices"][0]["finish_reason"] == "stop" and len(one["choices"][0]["text"]) <= 5
    assert two["choices"] == one["choices"] and two["usage"] == one["usage"]
    status, events, done = sse(base, "/v1/completions", {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    text, _, usage = check_stream(events, done)
    assert status == 200 and text == one["choices"][0]["text"] and usage == one["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 60
    while metrics(base).get(stops, 0) < before + 2:  # the engine ends them at its next step
        assert time.monotonic() < deadline, metrics(base)
        time.sleep(0.05)
    bad = 'ddtree_rejected_requests_total{reason="invalid"}'
    before = metrics(base).get(bad, 0)
    refusals = ((dict(prompt="hello", max_tokens=60), "max_tokens"), (dict(prompt="x" * 70, max_tokens=1), "prompt"),
                (dict(prompt="x", logprobs=MAX_LOGPROBS + 1), "logprobs"),
                (dict(prompt="x", stop_token_ids=[128]), "stop_token_ids"))
    for body, param in refusals:
        assert _openai_error(httpx.post(base + "/v1/completions", json=body, timeout=60), 400)["param"] == param
    assert metrics(base)[bad] == before + len(refusals)
    health = httpx.get(base + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["device"] == httpx.get(server + "/health", timeout=10).json()["device"]


def _hangup_frees_the_slot(base):
    before = metrics(base)
    status, events, done = sse(base, "/v1/completions", dict(prompt="ab", max_tokens=50, temperature=0,
                                                             ignore_eos=True, stream=True), stop_after=2)
    assert status == 200 and len(events) == 2 and not done
    key = 'ddtree_requests_total{reason="cancelled"}'
    deadline = time.monotonic() + 60
    while (m := metrics(base)).get(key, 0) - before.get(key, 0) < 1 or m["ddtree_free_slots"] < SLOTS:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def _killed_engine_ends_the_streams(s):
    body = dict(prompt="ab", max_tokens=60, temperature=0, ignore_eos=True, stream=True)
    with concurrent.futures.ThreadPoolExecutor(SLOTS + 2) as pool:
        jobs = [pool.submit(sse, s.base, "/v1/completions", body) for _ in range(SLOTS + 2)]
        deadline = time.monotonic() + 120
        # every request has reached the engine: the slots are all taken and two wait
        while (m := metrics(s.base))["ddtree_queue_length"] < 2 or m["ddtree_free_slots"] > 0:
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        os.kill(_engine_pid(s.output()), signal.SIGKILL)
        results = [j.result(timeout=60) for j in jobs]
    errors = 0
    for status, events, done in results:
        assert status == 200 and done
        if "error" in events[-1]:
            assert "engine process exited" in events[-1]["error"]["message"]
            errors += 1
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert errors >= 2
    health = httpx.get(s.base + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert _openai_error(httpx.post(s.base + "/v1/completions", json=dict(prompt="x"), timeout=10), 503)["code"] \
        == "overloaded"


def test_two_process_sigterm_drains_and_the_engine_process_exits(paths, cache_dir, server):
    """SIGTERM with every slot busy and two streams queued: all six finish, the server exits 0 and
    its engine process with it."""
    output, streams, during, code = _drain_run_retrying(
        paths, cache_dir, drain_timeout=300, sig=signal.SIGTERM, log_name="drain2.log", slots=SLOTS,
        max_model_len=64, max_tokens=60, extra=("--engine-process",))
    assert during[0] == "draining" and _openai_error(during[1], 503)["code"] == "shutting_down"
    for events, done in streams:
        _, reason, usage = check_stream(events, done)
        assert reason == "length" and usage["completion_tokens"] == 60
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # the engine process stopped cleanly too
    pid = _engine_pid(output)
    deadline = time.monotonic() + 30
    while not _gone(pid):
        assert time.monotonic() < deadline, f"engine process {pid} outlived the server"
        time.sleep(0.1)


def test_several_front_ends_share_the_port_and_drain_together(paths, cache_dir, server):
    """``--api-servers 3``: three front-end processes answer on one port (``/health`` names the one
    that answered; new connections reach all three), greedy outputs equal the one-process
    server's whichever front end serves them, and SIGTERM to the first front end, with a stream
    running in every slot, lets every stream finish, then the server exits 0 and its engine and
    front-end processes with it."""
    s = Server(paths, _env(cache_dir), "--api-servers", "3", log_name="front_ends.log")
    try:
        s.wait_ready()
        seen, deadline = set(), time.monotonic() + 120
        # (a new connection each; a front end still starting on a busy machine answers later)
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.add(httpx.get(s.base + "/health", timeout=10).json()["front_end"])
            time.sleep(0.01)
        assert seen == {0, 1, 2}, seen
        bodies = [dict(prompt=p, max_tokens=n, temperature=0) for p, n in (("The quick", 12), ("Tree", 20),
                                                                             ("0123", 7))] * 3
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            got = list(pool.map(lambda b: httpx.post(s.base + "/v1/completions", json=b, timeout=120).json(), bodies))
        for body, two in zip(bodies, got, strict=True):
            one = httpx.post(server + "/v1/completions", json=body, timeout=120).json()
            assert two["choices"] == one["choices"], (body, two)
        body = dict(prompt="ab", max_tokens=60, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
            jobs = [pool.submit(_stream_all, s.base, body, {}) for _ in range(SLOTS)]
            deadline = time.monotonic() + 60
            while metrics(s.base)["ddtree_free_slots"] > 0 and not any(j.done() for j in jobs):
                assert time.monotonic() < deadline, "the streams never filled the slots"
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            for events, done in [j.result(timeout=300) for j in jobs]:
                _, reason, usage = check_stream(events, done)
                assert reason == "length" and usage["completion_tokens"] == 60
        assert s.proc.wait(timeout=120) == 0
        output = s.output()
        assert "Traceback" not in output, output[-3000:]
        pids = [_engine_pid(output)] + [int(p) for p in re.search(r"front-end processes ([\d, ]+) started",
                                                                  output).group(1).split(", ")]
        assert len(pids) == 3
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes {pids} outlived the server"
            time.sleep(0.1)
    except BaseException:
        print(s.output()[-3000:])
        raise
    finally:
        s.close()


def test_a_signal_repeated_within_the_window_does_not_cut_the_drain():
    """``serve(repeat_window=...)`` (the further front ends of ``--api-servers``): the same signal
    again within the window keeps the drain; after it, a signal ends the drain at once (as in one
    process, whose window is 0). Never a second drain, even when the second signal comes before
    the loop has started the first."""
    import uvicorn

    from ddtree_jax.serving.server import Admission, _DrainingServer

    class Loop:
        calls: list = []

        def call_soon_threadsafe(self, fn):
            self.calls.append(fn.__name__)

    for window, later, skipped in ((60.0, 0.0, False), (0.0, 0.0, True)):
        admission = Admission()
        server = _DrainingServer(uvicorn.Config(app=None), admission, drain_timeout=30, repeat_window=window)
        server._loop, server.started, Loop.calls = Loop(), True, []
        server.handle_exit(signal.SIGTERM, None)
        assert Loop.calls == ["_start_drain"]
        time.sleep(later)  # the drain task has not run: admission.draining is still False
        server.handle_exit(signal.SIGTERM, None)
        assert ("skip_drain" in Loop.calls) == skipped, (window, Loop.calls)
        assert Loop.calls.count("_start_drain") == 1, Loop.calls


def test_stream_events_are_json_dumps_byte_for_byte():
    """``StreamEvents`` renders each event's fixed fields once; its events must be the bytes of
    ``json.dumps(obj, ensure_ascii=False)`` for any text (quotes, backslashes, control characters,
    non-ASCII) and with or without usage."""
    from ddtree_jax.serving.server import StreamEvents

    rng = random.Random(0)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "é", "ß", "中", "🙂", "\u2028", "a", " ", "/", "{", "}"]
    for include_usage in (False, True):
        ids = dict(id='cmpl-"x\\y', object="text_completion", created=1764800000, model="mödel\n",
                   system_fingerprint="fp_0")
        events = StreamEvents(ids["id"], ids["object"], ids["created"], ids["model"], ids["system_fingerprint"],
                              include_usage)

        def dumped(choices, use=None, ids=ids, include_usage=include_usage):
            obj = dict(ids, choices=choices)
            if include_usage:
                obj["usage"] = use
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        for _ in range(200):
            text = "".join(rng.choices(alphabet, k=rng.randrange(12)))
            index = rng.randrange(4)
            reason = rng.choice([None, "stop", "length", 'odd "reason"'])
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            assert events.text(index, text, reason) == dumped([choice])
            chat = {"index": index, "delta": {"content": text}, "logprobs": {"content": [{"logprob": -0.5}]},
                    "finish_reason": reason}
            assert events.event([chat]) == dumped([chat])
        use = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert events.event([], use) == dumped([], use if include_usage else None)
