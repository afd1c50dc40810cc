"""The plain-ASGI helpers of the completion routes (ddtree_jax/serving/asgi.py), on hand-made
ASGI channels."""

import asyncio
import json

import pytest

from ddtree_jax.serving import asgi


def _channel(messages):
    """A ``receive`` that hands out ``messages`` in order, then waits forever."""
    queue = asyncio.Queue()
    for m in messages:
        queue.put_nowait(m)
    return queue.get, queue


def _scope(length=None):
    return {"type": "http", "headers": [] if length is None else [(b"content-length", str(length).encode())]}


def _body(chunk, more=False):
    return {"type": "http.request", "body": chunk, "more_body": more}


def test_read_body_joins_chunks_and_enforces_the_limit():
    async def run():
        receive, _ = _channel([_body(b"ab", True), _body(b"cd", True), _body(b"e")])
        assert await asgi.read_body(_scope(), receive, 5) == b"abcde"
        receive, _ = _channel([_body(b"abc", True), _body(b"def")])  # no Content-Length: found while reading
        with pytest.raises(asgi.BodyTooLarge) as e:
            await asgi.read_body(_scope(), receive, 5)
        assert e.value.size is None
        with pytest.raises(asgi.BodyTooLarge) as e:  # declared: refused before reading
            await asgi.read_body(_scope(6), _channel([])[0], 5)
        assert e.value.size == 6
        with pytest.raises(ValueError, match="'12x' is not a byte count"):
            await asgi.read_body({"headers": [(b"content-length", b"12x")]}, _channel([])[0], 5)
        receive, _ = _channel([_body(b"ab", True), {"type": "http.disconnect"}])
        with pytest.raises(asgi.ClientGone):
            await asgi.read_body(_scope(), receive, 5)

    asyncio.run(run())


def test_disconnect_calls_back_once_on_a_disconnect_only():
    async def run():
        gone = []
        receive, queue = _channel([_body(b"", False)])  # a stray message is not a disconnect
        watcher = asgi.Disconnect(receive, lambda: gone.append(1))
        await asyncio.sleep(0.01)
        assert gone == [] and not watcher.gone
        queue.put_nowait({"type": "http.disconnect"})
        await asyncio.sleep(0.01)
        assert gone == [1] and watcher.gone
        watcher.close()

        receive, queue = _channel([])
        watcher = asgi.Disconnect(receive, lambda: gone.append(2))
        watcher.close()  # the response completed first
        queue.put_nowait({"type": "http.disconnect"})
        await asyncio.sleep(0.01)
        assert gone == [1]

    asyncio.run(run())


def test_responses_are_the_asgi_messages_a_server_expects():
    async def run():
        sent = []

        async def send(message):
            sent.append(message)

        await asgi.send_json(send, 418, {"a": "é"}, {"Retry-After": "1"})
        start, body = sent
        assert start["status"] == 418 and (b"retry-after", b"1") in start["headers"]
        assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
        assert json.loads(body["body"]) == {"a": "é"}
        sent.clear()
        stream = asgi.EventStream(send)
        await stream.start()
        await stream.write("data: x\n\n")
        await stream.end()
        assert stream.started and sent[0]["status"] == 200
        assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
        assert [m.get("more_body") for m in sent[1:]] == [True, False] and sent[1]["body"] == b"data: x\n\n"

    asyncio.run(run())
