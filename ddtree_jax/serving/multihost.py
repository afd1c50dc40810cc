"""Serving across several processes (``jax.distributed``, one per host): the engines step in lockstep.

Every process holds the same ``Engine`` over one global mesh, and every compiled call must be made
by all of them with the same inputs. Requests enter on process 0 only (its HTTP server); before each
engine step process 0 broadcasts what changed — new requests (with their ids) and cancellations —
with ``jax.experimental.multihost_utils.broadcast_one_to_all``, every process applies the same
changes, and then all of them run the same ``Engine.step()``. The engine's host decisions depend
only on its inputs and on the harvested tokens, which every process gathers in full
(``Engine._fetch``), so they stay in step without further messages.

    driver = LockstepEngine(engine)            # on every process, after jax.distributed.initialize()
    if jax.process_index() == 0:
        serve(driver, ...)                     # the server submits through the driver
    else:
        driver.run()                           # follows process 0 until it shuts down

Each message is a length broadcast (one int32) and, when non-empty, a JSON payload padded to a
power of two bytes (so the broadcast's shape is known to all and compiles a few times only).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading

import numpy as np

from ddtree_jax.sampling import SamplingParams
from ddtree_jax.serving.engine import Engine, EngineOverloaded, RequestHandle

__all__ = ["LockstepEngine"]


def _broadcast(value: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(value))


class LockstepEngine:
    """An ``Engine`` driven in lockstep on every process; on process 0 it offers the engine's
    interface to the server (``submit``, ``metrics``, ``start``/``stop``, ...)."""

    def __init__(self, engine: Engine, *, process_index: int | None = None, broadcast=_broadcast):
        import jax

        self.engine = engine
        self.process_index = jax.process_index() if process_index is None else process_index
        self._broadcast = broadcast
        self._lock = threading.Condition()
        self._inbox: list[tuple[dict, RequestHandle]] = []
        self._handles: dict[int, RequestHandle] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None

    def __getattr__(self, name):  # method, budget, slots, tokenizer, metrics, max_model_len, ...
        return getattr(self.engine, name)

    # ---- process 0: the server's side

    def submit(self, prompt, sampling: SamplingParams | None = None, *, max_tokens: int = 16, stop_token_ids=(),
               stop=(), ignore_eos: bool = False) -> RequestHandle:
        if self.process_index != 0:
            raise RuntimeError("requests enter on process 0")
        arr, stop_ids, stops = self.engine.check_request(prompt, sampling, max_tokens, stop_token_ids, stop,
                                                         ignore_eos)
        sampling = sampling or SamplingParams(temperature=0.0)
        with self._lock:
            if self._stopping:
                raise EngineOverloaded("the engine is shutting down")
            if len(self._inbox) + self.engine.metrics.queue_length >= self.engine.max_queue:
                self.engine.metrics.count("rejected", "overloaded")
                raise EngineOverloaded(f"the request queue is full ({self.engine.max_queue} waiting); retry later")
            handle = RequestHandle(self, next(self._ids) % 2**32)
            self._inbox.append((dict(rid=handle.request_id, prompt=arr.tolist(), sampling=dataclasses.asdict(sampling),
                                     max_tokens=max_tokens, stop_token_ids=stop_ids, stop=list(stops)), handle))
            self._lock.notify_all()
        return handle

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def start(self) -> LockstepEngine:
        """Process 0: run the lockstep loop in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="ddtree-lockstep", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Process 0: tell every process to stop after the current step."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- every process

    def _message(self) -> dict:
        """Process 0: wait for something to do, then what the other processes must apply."""
        with self._lock:
            self._lock.wait_for(lambda: self._stopping or self._inbox or self.engine.has_work()
                                or any(h.cancel_requested for h in self._handles.values()))
            new, self._inbox = self._inbox, []
            cancel = [rid for rid, h in self._handles.items() if h.cancel_requested]
            for _, handle in new:
                self._handles[handle.request_id] = handle
            return dict(new=[n for n, _ in new], cancel=cancel, stop=self._stopping)

    def _exchange(self, message: dict | None) -> dict:
        payload = json.dumps(message).encode() if self.process_index == 0 else b""
        n = int(self._broadcast(np.array(len(payload), np.int32)))
        size = 1 << max(6, (n - 1).bit_length())
        buf = np.zeros(size, np.uint8)
        buf[: len(payload)] = np.frombuffer(payload, np.uint8)
        return json.loads(self._broadcast(buf)[:n].tobytes())

    def step(self) -> bool:
        """One lockstep step on this process; returns False once process 0 has said stop."""
        message = self._exchange(self._message() if self.process_index == 0 else None)
        for n in message["new"]:
            handle = self._handles.get(n["rid"]) if self.process_index == 0 else None
            self._handles.setdefault(n["rid"], handle or RequestHandle(self, n["rid"]))
            self.engine.submit(n["prompt"], SamplingParams(**n["sampling"]), max_tokens=n["max_tokens"],
                               stop_token_ids=n["stop_token_ids"], stop=n["stop"], ignore_eos=True,
                               handle=self._handles[n["rid"]])
        for rid in message["cancel"]:
            if rid in self._handles:
                self._handles[rid].cancel_requested = True
        if message["stop"]:
            self.engine.stop()
            return False
        self.engine.step()
        with self._lock:
            self._handles = {rid: h for rid, h in self._handles.items() if not h.done}
        return True

    def run(self) -> None:
        """Step until process 0 stops (the loop of processes > 0; process 0's thread)."""
        while self.step():
            pass
