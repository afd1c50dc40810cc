"""The engine in a process of its own (``serve --engine-process``): ``EngineClient``, the front
end's stand-in for an ``Engine``, and the engine process's main loop.

The front-end process (uvicorn's event loop, the HTTP worker threads: parsing, chat templates,
tokenizing, detokenising, stop strings, results, SSE formatting) never touches the device. The
engine process, started with the ``spawn`` method (JAX must not be forked), loads the models
exactly as the one-process server does (``cli.build_engine``), warms up, and runs the ``Engine``'s
thread with an emitter that only moves token ids (``_IdEmitter``: the latency metrics, then one
message per step), so that the engine process's interpreter lock is left to the engine thread and
its launcher. The two talk over one duplex ``multiprocessing`` connection; every message is a
tuple whose first element names it.

Several front ends (``serve --api-servers N``): the first front end (the process ``serve``
started) launches the engine process with one connection per front end, then the other ``N - 1``
front-end processes (``cli.serve_front_end``), which serve the same listening socket, each
through its own connection; the kernel hands each new HTTP connection to one of them. A front
end's request ids are its index modulo ``N``, so they never collide; the engine sends each front
end the news of its own requests only. The first front end forwards its shutdown signal to the
others and stops the engine once they have drained and exited; another front end's connection
closing (its ``("detach",)``, or its exit) cancels that front end's requests; the engine process
stopping ends every front end.

front end -> engine
  ``("submit", rid, prompt, sampling, options)``: a request with the front end's request id
  ``rid`` (``Engine.submit``'s ``request_id``: it keys an unseeded request's random stream);
  ``options`` are ``submit``'s keyword arguments (stop strings stay in the front end).
  ``("cancel", rid)``; ``("stop_string", rid)``: the front end found a stop string in the
  request's text: the engine ends it as cancelled, with finish reason ``"stop"``;
  ``("count", field, key, n)``: a metrics counter (requests the front end
  refused); ``("snapshot", tag)``: the metrics, answered with ``("reply", tag, snapshot)``;
  ``("stop",)`` (the first front end only): stop the engine (``Engine.stop``), answered with
  ``("stopped",)`` to every front end; the process then exits. ``("detach",)`` (another front
  end, stopping): its requests are cancelled and the engine closes its end of the connection.

engine -> front end
  ``("ready", facts)`` once, after the warm-up (the engine's settings and device, ``FACTS``, and
  the engine process's id), or
  ``("failed", message)`` (a loading error, one line naming the option) and exit.
  ``("submitted", rid, refusal)``: ``refusal`` is ``None`` (queued), ``("request", field,
  message)`` (``RequestError``) or ``("overloaded", message)`` (``EngineOverloaded``).
  ``("chunks", items)``: ONE message per emitter pass (once per engine step) with every request's
  news of the step, in order: ``(rid, token_ids, acceptance_lengths, finish_reason, logprobs,
  ttft)``; ``logprobs`` a ``TokenLogprobs`` or ``None``, ``ttft`` set on the item with the
  request's first token (seconds from its submission to the engine).

The front end turns the items into stream chunks as the one-process ``Emitter`` does
(``_RemoteHandle._take``: the same ``TextStream``, the same results), ends a request whose text
completes a stop string at once, sends ``("stop_string", rid)`` and drops the engine's later items for
it. The tokens the engine committed for it after the stop string count in the engine's token
metrics (the one-process engine drops them before counting).

A request's handle is registered with the front end's reader before its ``submit`` is sent, so
that its chunks find it whatever the order of the reply and the first chunk. The engine process
ignores SIGINT and SIGTERM (the front end drains and then stops it) and stops when the front
end's end of the connection closes (the front end exited). When the engine process dies, every
open stream ends with an ``"error: ..."`` finish (the server sends an error event, then
``[DONE]``), new requests are refused (503) and ``failure`` says why (``/health``: 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np

from ddtree_jax.serving.emitter import (
    Emit,
    Emitter,
    StepLatency,
    StreamChunk,
    TokenLogprobs,
    deliver,
    request_result,
    stream_news,
)
from ddtree_jax.serving.engine import EngineOverloaded, RequestError, RequestHandle
from ddtree_jax.serving.text import TextStream

__all__ = ["FACTS", "EngineClient", "RemoteMetrics"]

# The engine's settings the server reads, copied to the front end at start-up.
FACTS = ("method", "budget", "slots", "max_model_len", "max_output_tokens", "max_logprobs", "vocab_size",
         "cache_len", "state_bytes")
STOP_TIMEOUT = 60.0  # seconds the engine process gets to stop before it is killed


# --------------------------------------------------------------------------------------------- engine side


class _IdEmitter(Emitter):
    """The engine process's emitter: a step's token ids, acceptance lengths and log-probabilities go
    to the front end in one ``("chunks", items)`` message (module docstring); the latency metrics
    and the finished requests' counts are kept here, as the ``Emitter`` keeps them."""

    def __init__(self, metrics, table: dict):
        super().__init__(metrics)
        self._table = table  # request id -> (handle, the sender of the front end that submitted it)

    def submit(self, items: list[Emit], seen: float) -> None:
        step, out = StepLatency(), {}
        for item in items:
            r = item.request
            if r.ended:
                continue
            first = r.first_token is None
            if item.tokens:
                step.add(r, len(item.tokens), seen)
            rid = r.handle.request_id
            owner = self._table.get(rid)
            if item.finish is not None:
                r.ended = True
                self.metrics.count("requests", item.finish.split(":")[0])
                self._table.pop(rid, None)
            elif not item.tokens:
                continue
            if owner is None:  # its front end has gone
                continue
            ttft = r.first_token - r.submitted if first and r.first_token is not None else None
            out.setdefault(owner[1], []).append((rid, item.tokens, item.acceptance, item.finish, item.logprobs, ttft))
        for send, chunks in out.items():
            try:
                send(("chunks", chunks))
            except OSError:  # that front end has gone; its requests are being cancelled
                pass
        step.record(self.metrics, seen)


class _Sender:
    """One connection's sending end, shared by threads; after ``close`` a send raises ``OSError``."""

    def __init__(self, conn):
        self.conn, self._lock = conn, threading.Lock()

    def __call__(self, message) -> None:
        with self._lock:
            if self.conn.closed:
                raise OSError("the connection is closed")
            self.conn.send(message)

    def close(self) -> None:
        """Close the connection once no send is under way."""
        with self._lock:
            self.conn.close()


def _engine_main(args, conns: list) -> None:
    """The engine process: load, warm up, report ``ready`` to every front end, then serve their
    messages. ``conns[0]`` is the first front end's (the process that started this one): its
    ``stop``, or its connection closing, stops the engine; another front end's connection closing
    cancels that front end's requests."""
    from multiprocessing.connection import wait

    from ddtree_jax import compilation_cache as cc
    from ddtree_jax._preflight import PreflightError
    from ddtree_jax.serving.cli import build_engine, log, set_switch_interval, warm_up

    set_switch_interval(args)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    senders = {conn: _Sender(conn) for conn in conns}

    def to_all(message) -> None:
        for send in senders.values():
            try:
                send(message)
            except OSError:
                pass

    try:
        log(f"compilation cache: {cc.enable(cc.resolve(args.compilation_cache)) or 'off'}")
        engine = build_engine(args)[0]
        if not args.no_warmup:
            warm_up(engine)
    except PreflightError as e:
        to_all(("failed", str(e)))
        return
    table: dict[int, tuple[RequestHandle, _Sender]] = {}
    engine.set_emitter(_IdEmitter(engine.metrics, table))
    engine.start()
    import jax

    dev = jax.devices()[0]
    facts = {name: getattr(engine, name) for name in FACTS}
    facts["device"] = dict(device=dev.device_kind, platform=dev.platform, devices=jax.device_count(),
                           processes=jax.process_count())
    facts["pid"] = os.getpid()
    to_all(("ready", facts))
    first, open_conns = conns[0], list(conns)
    try:
        while first in open_conns:
            for conn in wait(open_conns):
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # that front end has gone
                    message = ("detach",)
                if message[0] == "detach":  # its requests are cancelled; closing the end tells it so
                    open_conns.remove(conn)
                    gone = senders[conn]
                    for rid, (handle, send) in list(table.items()):
                        if send is gone:
                            table.pop(rid, None)
                            handle.cancel()
                    gone.close()
                    continue
                try:
                    kind = _handle(engine, message, senders[conn], table)
                except OSError:  # its front end is going: the next receive finds it gone
                    continue
                if kind == "stop" and conn is first:
                    open_conns.remove(conn)
                    break
    finally:
        engine.stop()
        to_all(("stopped",))


def _handle(engine, message: tuple, send: _Sender, table: dict) -> str:
    """Act on one front end's message (module docstring); returns its kind."""
    kind = message[0]
    if kind == "submit":
        _, rid, prompt, sampling, options = message
        handle = RequestHandle(engine, rid)
        table[rid] = (handle, send)
        refusal = None
        try:
            engine.submit(prompt, sampling, handle=handle, **options)
        except RequestError as e:
            refusal = ("request", e.field, e.message)
        except EngineOverloaded as e:
            refusal = ("overloaded", str(e))
        if refusal is not None:
            table.pop(rid, None)
        send(("submitted", rid, refusal))
    elif kind in ("cancel", "stop_string"):
        entry = table.get(message[1])
        if entry is not None:
            if kind == "stop_string":
                entry[0].cancel_reason = "stop"
            entry[0].cancel()
    elif kind == "count":
        engine.metrics.count(*message[1:])
    elif kind == "snapshot":
        send(("reply", message[1], engine.metrics.snapshot()))
    return kind


# --------------------------------------------------------------------------------------------- front end


class _RemoteHandle(RequestHandle):
    """A request's handle in the front end (``RequestHandle``'s interface). Its chunks are made here
    from the engine process's items (``_take``), as the one-process ``Emitter`` makes them."""

    def __init__(self, client: EngineClient, request_id: int, prompt_tokens: int, text: TextStream,
                 logprobs: int | None):
        super().__init__(client, request_id)
        self._prompt_tokens = prompt_tokens
        self._submitted = time.perf_counter()
        # the stream state ``emitter.stream_news`` reads and updates
        self.text, self.logprobs = text, logprobs
        self.acceptance: list[int] = []
        self.logprob_parts: list[TokenLogprobs] = []
        self._ttft: float | None = None
        self._ended = False  # ended here (a stop string, or the engine's finish)

    def cancel(self) -> None:
        """Cancel the request; its slot is free again after the engine's current step."""
        self.cancel_requested = True
        if not self.done:
            self._engine._send_quietly(("cancel", self.request_id))

    def _take(self, item: tuple, deliveries: list) -> bool:
        """Turn one engine item into this stream's chunk (``Emitter._process``'s rules); returns
        whether its text completed a stop string (the engine must then end the request)."""
        _, tokens, acceptance, finish, logprobs, ttft = item
        if self._ended:
            return False
        if ttft is not None:
            self._ttft = ttft
        kept, text, part, reason = stream_news(self, tokens, acceptance, finish, logprobs)
        if reason is not None:
            self._end(reason, kept, text, part, deliveries)
            return self.text.stopped
        if kept or text:
            self._push(StreamChunk(kept, text, logprobs=part), deliveries)
        return False

    def _end(self, reason: str, tokens: list[int], text: str, logprobs: TokenLogprobs | None,
             deliveries: list) -> None:
        self._ended = True
        result = request_result(self, self.request_id, self._prompt_tokens, reason, ttft=self._ttft,
                                seconds=time.perf_counter() - self._submitted)
        self._push(StreamChunk(list(tokens), text, reason, result, logprobs), deliveries)

    def _fail(self, reason: str, deliveries: list) -> None:
        """End the stream with ``reason`` (the engine process is gone), unless it has ended."""
        if self._ended:
            return
        self._end(reason, [], "", None, deliveries)


class RemoteMetrics:
    """The engine process's metrics, as the server uses an ``EngineMetrics``: ``snapshot()`` (a
    round trip: call it off the event loop) and ``count()`` (sent, not waited for)."""

    def __init__(self, client: EngineClient):
        self._client = client

    def snapshot(self) -> dict:
        return self._client._ask("snapshot").result(timeout=STOP_TIMEOUT)

    def count(self, field: str, key: str | None = None, n: int = 1) -> None:
        self._client._send_quietly(("count", field, key, n))


class EngineClient:
    """An ``Engine`` running in a process of its own (module doc), with the interface the server
    uses: the settings in ``FACTS`` as attributes, ``tokenizer`` (loaded here), ``device`` (the
    engine process's device facts), ``metrics`` (``RemoteMetrics``), ``asubmit`` / ``submit``
    returning handles with ``RequestHandle``'s interface (``astream``, ``stream``, ``result``,
    ``cancel``, ``done``, ``request_id``), ``start`` / ``stop``. ``failure``: ``None`` while the
    engine process runs, else why it is gone. ``pid``: the engine process's id.

    Start it with ``launch``."""

    def __init__(self, process, conn, facts: dict, tokenizer, *, index: int = 0, count: int = 1,
                 front_ends: list | None = None, on_gone: Callable[[], None] | None = None,
                 drain_timeout: float = 0.0):
        from ddtree_jax.serving.server import ABORT_GRACE

        self._process, self._conn = process, conn
        self._front_end_grace = drain_timeout + ABORT_GRACE + STOP_TIMEOUT
        self._index, self._count = index, count
        self._front_ends = front_ends or []  # the other front ends' processes (the first front end's)
        self._on_gone = on_gone
        self._detaching = False
        self._send = _Sender(conn)
        for name in FACTS:
            setattr(self, name, facts[name])
        self.device = facts["device"]
        self.tokenizer = tokenizer
        self.metrics = RemoteMetrics(self)
        self.failure: str | None = None
        self.pid = facts["pid"]
        self._lock = threading.Lock()
        self._handles: dict[int, _RemoteHandle] = {}
        self._waiting: dict[tuple, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._tags = itertools.count()
        self._stopped = threading.Event()
        # The reader's own messages (stop strings) go out from this thread, so that the reader
        # never waits for a send: a send blocked on a full pipe waits for the engine process,
        # which may be waiting for the reader to take its messages.
        self._outbox = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddtree-engine-outbox")
        self._reader = threading.Thread(target=self._read, name="ddtree-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, args, tokenizer, *, log: Callable[[str], None] | None = None, front_ends: int = 1,
               sock=None) -> EngineClient:
        """Spawn the engine process for parsed ``serve`` arguments and wait until it has loaded and
        warmed up; with ``front_ends`` > 1, then spawn that many less one more front-end processes
        (``cli.serve_front_end``: each serves the listening socket ``sock`` through its own
        connection to the engine). ``tokenizer``: this front end's copy. Raises ``PreflightError``
        with the engine process's message when loading fails, or when it exits before it is ready."""
        from ddtree_jax._preflight import PreflightError

        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(front_ends)]
        process = ctx.Process(target=_engine_main, args=(args, [child for _, child in pipes]), name="ddtree-engine")
        process.start()
        for _, child in pipes:  # the engine process's ends live only there: its exit closes the connections
            child.close()
        conn = pipes[0][0]
        if log is not None:
            log(f"engine process {process.pid} started")
        try:
            message = conn.recv()
        except (EOFError, OSError):
            process.join()
            raise PreflightError(f"the engine process exited while loading (exit code {process.exitcode})") from None
        if message[0] != "ready":
            process.join()
            raise PreflightError(message[1])
        from ddtree_jax.serving.cli import serve_front_end

        others = []
        for i, (end, _) in enumerate(pipes[1:], start=1):
            others.append(ctx.Process(target=serve_front_end, args=(args, end, sock, i, front_ends),
                                      name=f"ddtree-front-end-{i}", daemon=True))  # (ended if this process dies)
            others[-1].start()
            end.close()
        if others and log is not None:
            log(f"front-end processes {', '.join(str(p.pid) for p in others)} started")
        return cls(process, conn, message[1], tokenizer, count=front_ends, front_ends=others,
                   drain_timeout=getattr(args, "drain_timeout", 0.0))

    @classmethod
    def attach(cls, conn, tokenizer, index: int, count: int,
               on_gone: Callable[[], None] | None = None) -> EngineClient:
        """A further front end's client (front end ``index`` of ``count``) on its connection to an
        engine process another front end launched: waits for the engine's ``ready``. Its request
        ids are ``index`` modulo ``count`` (distinct across front ends); ``stop`` only closes the
        connection (the engine's requests of this front end are cancelled); ``on_gone`` runs once
        the engine process has gone. Raises ``PreflightError`` when the engine failed to load."""
        from ddtree_jax._preflight import PreflightError

        try:
            message = conn.recv()
        except (EOFError, OSError):
            raise PreflightError("the engine process exited while loading") from None
        if message[0] != "ready":
            raise PreflightError(message[1])
        return cls(None, conn, message[1], tokenizer, index=index, count=count, on_gone=on_gone)

    @property
    def front_end(self) -> int:
        """This front end's index among ``serve --api-servers``' front ends (0: the first)."""
        return self._index

    def signal_front_ends(self, sig: int) -> None:
        """Send ``sig`` to the other front-end processes (the first front end forwards its shutdown)."""
        for p in self._front_ends:
            if p.is_alive():
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ requests

    def _request(self, prompt, sampling, options: dict) -> tuple[_RemoteHandle, concurrent.futures.Future]:
        stop = tuple(s for s in (options.pop("stop", None) or ()) if s)
        if stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer (the server has none)")
        rid = next(self._ids) % (2**32 // self._count) * self._count + self._index  # distinct across front ends
        handle = _RemoteHandle(self, rid, int(np.size(prompt)), TextStream(self.tokenizer, stop),
                               options.get("logprobs"))
        reply: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.failure is not None:
                raise EngineOverloaded(f"the engine is not running ({self.failure})")
            self._handles[rid] = handle
            self._waiting["submitted", rid] = reply
        try:
            self._send(("submit", rid, np.asarray(prompt), sampling, options))
        except OSError:
            self._forget(rid)
            raise EngineOverloaded("the engine process is gone") from None
        return handle, reply

    def _accepted(self, handle: _RemoteHandle, refusal) -> _RemoteHandle:
        if refusal is None:
            return handle
        self._forget(handle.request_id)
        if refusal[0] == "request":
            raise RequestError(refusal[1], refusal[2])
        raise EngineOverloaded(refusal[1])

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._handles.pop(rid, None)
            self._waiting.pop(("submitted", rid), None)

    async def asubmit(self, prompt, sampling=None, **options) -> _RemoteHandle:
        """``Engine.submit`` for asyncio code: the engine process's answer is awaited, not blocked
        on. Raises ``RequestError`` / ``EngineOverloaded`` as ``Engine.submit`` does."""
        handle, reply = self._request(prompt, sampling, options)
        return self._accepted(handle, await asyncio.wrap_future(reply))

    def submit(self, prompt, sampling=None, **options) -> _RemoteHandle:
        """``Engine.submit``, blocking until the engine process has queued or refused the request."""
        handle, reply = self._request(prompt, sampling, options)
        return self._accepted(handle, reply.result())

    def _ask(self, kind: str) -> concurrent.futures.Future:
        tag = next(self._tags)
        reply: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.failure is not None:
                reply.set_exception(RuntimeError(f"the engine is not running ({self.failure})"))
                return reply
            self._waiting["reply", tag] = reply
        self._send_quietly((kind, tag))
        return reply

    def _send_quietly(self, message) -> None:
        """Send ``message``; a gone engine process is noticed by the reader instead."""
        try:
            self._send(message)
        except OSError:
            pass

    # ------------------------------------------------------------------ the reader

    def _read(self) -> None:
        """The front end's reader thread: the engine process's messages, until it is gone."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "chunks":
                deliveries: list = []
                with self._lock:
                    handles = [self._handles.get(item[0]) for item in message[1]]
                    for item in message[1]:
                        if item[3] is not None:
                            self._handles.pop(item[0], None)
                for handle, item in zip(handles, message[1], strict=True):
                    if handle is not None and handle._take(item, deliveries):
                        self._outbox.submit(self._send_quietly, ("stop_string", item[0]))
                deliver(deliveries)
            elif kind in ("submitted", "reply"):
                with self._lock:
                    reply = self._waiting.pop((kind, message[1]), None)
                if reply is not None:
                    reply.set_result(message[2])
            elif kind == "stopped":
                self._stopped.set()
        self._gone()

    def _gone(self) -> None:
        """The connection closed: fail what is open, refuse what comes."""
        if self._process is None:
            reason = "the engine process stopped" if self._stopped.is_set() else "the engine process exited"
        else:
            self._process.join(timeout=5)
            reason = ("the engine process stopped" if self._stopped.is_set() else
                      f"the engine process exited (exit code {self._process.exitcode})")
        with self._lock:
            self.failure = reason
            handles, self._handles = list(self._handles.values()), {}
            waiting, self._waiting = self._waiting, {}
        deliveries: list = []
        for handle in handles:
            handle._fail(f"error: {reason}", deliveries)
        deliver(deliveries)
        for (kind, _), reply in waiting.items():
            if kind == "submitted":
                reply.set_result(("overloaded", f"the engine is not running ({reason})"))
            else:
                reply.set_exception(RuntimeError(f"the engine is not running ({reason})"))
        if self._on_gone is not None and not self._detaching:
            self._on_gone()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> EngineClient:
        """Nothing to do: the engine process steps from ``launch`` on."""
        return self

    def stop(self) -> None:
        """Stop the engine (requests still queued or running finish with ``"abort"``) and its
        process (killed after ``STOP_TIMEOUT`` seconds), once the other front-end processes have
        exited (each drains its own requests first; killed once their drain, its abort grace and
        ``STOP_TIMEOUT`` seconds have passed). A further front end's client (``attach``) only
        closes its connection."""
        if self._process is None:
            self._detaching = True
            self._send_quietly(("detach",))
            self._reader.join(timeout=STOP_TIMEOUT)
            self._outbox.shutdown(wait=True)  # (after the reader: it may still hand the outbox a message)
            self._conn.close()
            return
        deadline = time.monotonic() + self._front_end_grace  # one deadline: they drain side by side
        for p in self._front_ends:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._send_quietly(("stop",))
        self._process.join(timeout=STOP_TIMEOUT)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout=STOP_TIMEOUT)
        self._outbox.shutdown(wait=True)  # (after the reader: it may still hand the outbox a message)
