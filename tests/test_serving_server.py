"""The OpenAI-compatible server as a real subprocess on 127.0.0.1 (tiny checkpoints written here),
driven by the official ``openai`` client and raw HTTP: completions and chat, streaming and not,
stop strings, refused fields, malformed input, and a bounded load test (64 concurrent streams with
mixed settings, some bad, some disconnecting) checked for well-formed streams, greedy/seeded
outputs equal to the same request alone, nothing lost or duplicated, and freed slots.
"""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    paths = write_tiny_checkpoints(str(tmp_path_factory.mktemp("serve")))
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(os.path.join(os.path.dirname(paths["target"]), "server.log"), "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_jax.serving.cli", "--target", paths["target"], "--drafter", paths["drafter"],
         "--tokenizer", paths["tokenizer"], "--budget", "6", "--slots", str(SLOTS), "--max-model-len", "64",
         "--prefill-chunk", "16", "--prefill-batch", "1", "--dtype", "float32", "--served-model-name", "tiny",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited ({proc.returncode}):\n{log.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not come up in 400 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
    """A well-formed stream: one id, deltas, one final chunk with a finish reason and usage, [DONE]."""
    assert done and events
    assert len({e["id"] for e in events}) == 1
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is events[-1]
    key = "delta" if chat else "text"
    parts = [e["choices"][0][key] for e in events]
    text = "".join(p.get("content", "") for p in parts) if chat else "".join(parts)
    return text, events[-1]["choices"][0]["finish_reason"], events[-1]["usage"]


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
    (dict(prompt="x", n=2), "n"),
    (dict(prompt="x", logprobs=2), "logprobs"),
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
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "logprobs": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
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
        return sse(server, "/v1/completions", {**body, "stream": True}, stop_after=2 if kind == "hangup" else None)

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


def test_non_streaming_client_that_gives_up_cancels_its_request(server):
    """Every slot busy with a long stream, a non-streaming request waits in the queue; its client
    hangs up (the request needs a free slot, then ~60 rounds): the server cancels it, the streams
    finish. The client sends the request on a raw socket once the streams hold every slot (sent
    earlier, it could take a slot before the streams' threads reached the server, and never
    queue), and hangs up once the server has queued it (a timed give-up could hang up before a
    loaded server had even read the request)."""
    before = metrics(server)
    long = dict(prompt="ab", max_tokens=60, temperature=0, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        busy = [pool.submit(sse, server, "/v1/completions", {**long, "stream": True}) for _ in range(SLOTS)]
        deadline = time.monotonic() + 120
        while metrics(server)["ddtree_free_slots"] > 0:
            assert time.monotonic() < deadline, "the streams never held every slot"
            time.sleep(0.02)
        host, port = server.removeprefix("http://").split(":")
        body = json.dumps(long).encode()
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 120
            while metrics(server)["ddtree_queue_length"] < 1:
                assert time.monotonic() < deadline, "the request never reached the queue"
                time.sleep(0.05)
        for f in busy:
            _, events, done = f.result(timeout=120)
            _, reason, usage = check_stream(events, done)
            assert reason == "length" and usage["completion_tokens"] == 60
    deadline = time.monotonic() + 30
    while (m := metrics(server))["ddtree_running_requests"] or m["ddtree_queue_length"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
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
