"""Plain ASGI for the server's hot routes: reading a request body under a size limit, JSON and
server-sent-event responses, and watching for the client going away.

The completion routes speak ASGI to uvicorn directly instead of through FastAPI's routing and
Starlette's ``StreamingResponse``: with those, the framework (middleware layers, dependency
solving, a task group and cancel scopes per streamed response to listen for a disconnect) cost
about as much CPU per request as the rest of the front end, and a burst of new requests at many
streams waits for it (docs/serving.md). The other routes stay on FastAPI.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

__all__ = ["BodyTooLarge", "ClientGone", "Disconnect", "EventStream", "header", "read_body", "send_json"]


class ClientGone(Exception):
    """The client disconnected before its request's body was read."""


class BodyTooLarge(Exception):
    """The body is over the limit: ``size`` is its declared length, or ``None`` when found while
    reading."""

    def __init__(self, size: int | None):
        super().__init__(size)
        self.size = size


def header(scope: dict, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or ``None``."""
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


async def read_body(scope: dict, receive: Callable[[], Awaitable[dict]], limit: int) -> bytes:
    """The request's body. Raises ``BodyTooLarge`` from ``Content-Length`` before reading anything,
    or while reading; ``ValueError`` for a ``Content-Length`` that is not a byte count;
    ``ClientGone`` when the client disconnects first."""
    length = header(scope, b"content-length")
    if length is not None:
        if not length.isdigit():
            raise ValueError(f"Content-Length {length.decode('latin-1')!r} is not a byte count")
        if int(length) > limit:
            raise BodyTooLarge(int(length))
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(None)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_json(send, status: int, obj, headers: dict[str, str] | None = None) -> None:
    """A whole JSON response."""
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class EventStream:
    """A ``text/event-stream`` response: ``start()`` sends the headers, ``write(text)`` one write of
    events, ``end()`` the end of the body. Writes after the client has gone are dropped by the
    server (uvicorn), so a stream whose client left just ends early."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, send):
        self._send = send
        self.started = False

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
        self.started = True

    async def write(self, text: str) -> None:
        await self._send({"type": "http.response.body", "body": text.encode(), "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class Disconnect:
    """Watches ``receive`` (after the body was read) for the client going away, and calls
    ``on_gone()`` once if it does, on the event loop. ``close()`` stops watching (the response is
    complete). One task per request, nothing else."""

    def __init__(self, receive, on_gone: Callable[[], None]):
        self.gone = False
        self._on_gone = on_gone
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server's channel closed under us: the response's own sends end it
            return
        self.gone = True
        self._on_gone()

    def close(self) -> None:
        self._task.cancel()
