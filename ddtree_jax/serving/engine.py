"""``Engine``: continuous batching of streamed requests over a fixed number of decoding slots.

One ``DecodeState`` of ``slots`` rows lives on the device for the engine's lifetime. Between
batches of compiled rounds (``decode_round.run_rounds``, ``sync_every`` rounds at a time) the host

(a) retires requests: finished on the device (stop token, length, error), finished on the host
    (a stop string), or cancelled; a retired slot is marked ``FREE`` on the device (it commits
    nothing more) and takes the next request;
(b) admits queued requests into free slots and prefills them in chunks of at most
    ``prefill_chunk`` prompt tokens per engine step (so that a long prompt does not stall the
    running streams), up to ``prefill_batch`` slots per step, padded to a power of two (each
    (rows, chunk) shape compiles once); a slot whose prompt is in starts decoding (``activate``);
(c) runs the rounds and streams each running request's newly committed tokens (one small
    device-to-host transfer per batch of rounds).

A request's random stream depends on its seed (or, unseeded, a global request counter), never
on its slot or its neighbours, and greedy requests give exactly ``generate()``'s tokens whatever
the arrival order and slot count (the tests check both).

Drive it with ``step()`` (tests, benchmarks) or ``start()`` a background thread that steps while
there is work. ``submit`` is thread-safe, checks the request at once (``RequestError`` naming the
field) and refuses with ``EngineOverloaded`` when the bounded queue is full.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from ddtree_jax.backend import resolve_backend
from ddtree_jax.config import EngineConfig, is_int, token_id_problem
from ddtree_jax.decode_round import DecodePlan, Models, run_rounds
from ddtree_jax.decode_state import FINISH_REASONS, NO_STOP, RUNNING
from ddtree_jax.sampling import SamplingBatch, SamplingParams
from ddtree_jax.serving import _device
from ddtree_jax.serving.metrics import EngineMetrics
from ddtree_jax.serving.text import TextStream

__all__ = ["Engine", "EngineOverloaded", "RequestError", "RequestHandle", "RequestResult", "StreamChunk"]

log = logging.getLogger("ddtree_jax.serving")

_request_counter = itertools.count(1)
_MIN_CHUNK = 16


class EngineOverloaded(RuntimeError):
    """The engine's queue is full: retry later (HTTP 503/429)."""


class RequestError(ValueError):
    """An invalid request; ``field`` names the offending field (``prompt``, ``max_tokens``, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """A finished request.

    Attributes:
      request_id: the engine's id (also keys an unseeded request's random stream).
      prompt_tokens: number of prompt tokens.
      tokens: generated token ids (ends with the stop token for a stop-token finish; with the token
        that completed the stop string for a stop-string finish).
      text: decoded text (stop string excluded), ``""`` without a tokenizer.
      finish_reason: ``"stop"``, ``"length"``, ``"cancelled"``, ``"abort"`` or ``"error: ..."``.
      acceptance_lengths: tokens accepted per round (bonus included).
      ttft: seconds from submission to the first token (``None`` if there was none).
      seconds: seconds from submission to the end.
    """

    request_id: int
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    acceptance_lengths: list[int]
    ttft: float | None
    seconds: float

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length per round (bonus token included)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    """What one engine step produced for a request: new tokens and new text; the last chunk
    carries ``finish_reason`` and ``result``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    result: RequestResult | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle:
    """A submitted request: stream its chunks (blocking or async), wait for its result, cancel it."""

    def __init__(self, engine: Engine, request_id: int):
        self._engine = engine
        self.request_id = request_id
        self._cond = threading.Condition()
        self._chunks: list[StreamChunk] = []
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._result: RequestResult | None = None
        self.cancel_requested = False

    def _push(self, chunk: StreamChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            if chunk.finished:
                self._result = chunk.result
            listeners = list(self._listeners)
            self._cond.notify_all()
        for loop, queue in listeners:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # the listener's loop has closed
                pass

    @property
    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Cancel the request; its slot is free again after the current engine step."""
        self.cancel_requested = True
        self._engine._wake()

    def result(self, timeout: float | None = None) -> RequestResult:
        """Block until the request finishes (``TimeoutError`` after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
            return self._result

    def stream(self, timeout: float | None = None) -> Iterator[StreamChunk]:
        """The request's chunks as they come (blocking), ending with the finished one."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda i=i: len(self._chunks) > i, timeout):
                    raise TimeoutError(f"request {self.request_id}: no output for {timeout}s")
                chunk = self._chunks[i]
            i += 1
            yield chunk
            if chunk.finished:
                return

    async def astream(self) -> AsyncIterator[StreamChunk]:
        """The request's chunks as they come, for asyncio code (each chunk exactly once)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            backlog = list(self._chunks)
            self._listeners.append((asyncio.get_running_loop(), queue))
        try:
            for chunk in backlog:
                yield chunk
                if chunk.finished:
                    return
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            with self._cond:
                self._listeners = [x for x in self._listeners if x[1] is not queue]


@dataclasses.dataclass
class _Request:
    """A request inside the engine (host bookkeeping)."""

    handle: RequestHandle
    prompt: np.ndarray  # i32 [P]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: list[int]
    text: TextStream
    submitted: float
    slot: int = -1
    prefilled: int = 0  # prompt tokens (of prompt[:-1]) in the slot's caches
    running: bool = False
    read_tokens: int = 0  # device tokens read back so far
    read_rounds: int = 0
    acceptance: list[int] = dataclasses.field(default_factory=list)
    first_token: float | None = None
    last_emit: float | None = None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


class Engine:
    """Continuous-batching decoding engine over ``config.slots`` fixed slots.

    Args:
      target, drafter: the models (``drafter`` may be ``None`` for ``method="ar"``).
      config: the settings (``EngineConfig``; its ``decode`` as in ``generate``, with
        ``sync_every`` 1 by default); checked against the models here (``ConfigError`` naming the
        field).
      tokenizer: a ``tokenizers.Tokenizer`` (or anything with ``decode(ids)``), for text and stop
        strings; ``None``: tokens only.
      shard_state: optional function placing the state (``ddtree_jax.serving.sharding``).

    The resolved settings are attributes: ``method``, ``budget`` (DDTree's node budget; the
    drafter's block for dflash, 0 for ar), ``slots``, ``max_model_len``, ``max_output_tokens``,
    ``max_queue``, ``prefill_chunk``, ``prefill_batch``, ``sync_every``, ``stop_token_ids``,
    ``max_stop_ids``, ``cache_len`` (positions per slot).
    """

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, *, tokenizer=None,
                 shard_state: Callable | None = None):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        cfg = target.config
        config.check_for(cfg.vocab_size, drafter is not None, cfg.max_position_embeddings)
        decode = config.decode
        self.config = config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.max_output_tokens = config.max_output_tokens or self.max_model_len - 1
        method, slots = decode.method, config.slots
        depth = drafter.config.block_size - 1 if decode.uses_drafter else 0
        budget = decode.budget if method == "ddtree" else depth
        self.method, self.budget, self.slots = method, budget, slots
        self.tokenizer = tokenizer
        self.max_queue, self.prefill_chunk = config.max_queue, config.prefill_chunk
        self.sync_every = decode.sync_every or 1
        self.prefill_batch = min(config.prefill_batch or slots, slots)
        self.stop_token_ids = list(decode.stop_token_ids)
        self.max_stop_ids = max(config.max_stop_ids, len(self.stop_token_ids))
        self.plan = DecodePlan(method=method, budget=budget, backend=resolve_backend(decode.impl),
                               hidden_layer_ids=tuple(drafter.config.target_layer_ids) if decode.uses_drafter else ())
        tgraph, self._tparams = nnx.split(target)
        dgraph, self._dparams = nnx.split(drafter) if decode.uses_drafter else (None, None)
        self._models = Models(tgraph, dgraph)
        self._target, self._drafter = target, drafter
        # The cache holds a prompt + its tokens, and one verify block (or one prompt chunk) of scratch.
        # (a commit writes depth + 1 positions: more than the verify block when budget < depth)
        self.cache_len = self.max_model_len + max(budget + 1, depth + 1, self.prefill_chunk)
        self.tokens_per_round = depth + 1
        self._shard_state = shard_state
        self._state = self._empty_state()
        self._base_key = jax.random.key(decode.seed)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._slot: list[_Request | None] = [None] * slots
        self._admitted: list[_Request] = []  # prefilling, in admission order
        self.metrics = EngineMetrics(slots)
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def state_bytes(self) -> int:
        """Device memory of the decoding state (caches of every slot included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self._state))

    def _empty_state(self):
        return _device.empty_state(self._target, self._drafter, self.plan, self.slots, self.cache_len,
                                   self.max_output_tokens, self.max_stop_ids, self._shard_state)

    # ------------------------------------------------------------------------------------ requests

    def check_request(self, prompt, sampling: SamplingParams | None = None, max_tokens: int = 16,
                      stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                      ignore_eos: bool = False) -> tuple[np.ndarray, list[int], tuple[str, ...]]:
        """Validates a request (``RequestError`` naming the field); returns the prompt as an array,
        the stop ids and the stop strings."""
        if isinstance(prompt, str) or not isinstance(prompt, Sequence | np.ndarray):
            raise RequestError("prompt", "must be a list of token ids")
        arr = np.asarray(prompt)
        if arr.ndim != 1 or arr.size == 0:
            raise RequestError("prompt", f"must be a non-empty 1-D list of token ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise RequestError("prompt", "must hold integer token ids")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise RequestError("prompt", f"token id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise RequestError("sampling", f"must be SamplingParams, got {type(sampling).__name__}")
        if not is_int(max_tokens) or max_tokens < 1:
            raise RequestError("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
        if arr.size >= self.max_model_len:
            raise RequestError("prompt", f"has {arr.size} tokens; the context is {self.max_model_len} tokens "
                                         f"(prompt + max_tokens)")
        if arr.size + max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"{max_tokens} + the prompt's {arr.size} tokens exceeds the context "
                                             f"of {self.max_model_len} tokens")
        if max_tokens > self.max_output_tokens:
            raise RequestError("max_tokens", f"{max_tokens} exceeds this engine's limit of {self.max_output_tokens}")
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) for s in stop):
            raise RequestError("stop", "must be a string or a list of strings")
        if any(stop) and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer (the engine has none)")
        ids = [] if ignore_eos else list(self.stop_token_ids)
        for s in stop_token_ids:
            problem = token_id_problem(s, self.vocab_size)
            if problem is not None:
                raise RequestError("stop_token_ids", problem)
            ids.append(int(s))
        ids = sorted(set(ids))
        if len(ids) > self.max_stop_ids:
            raise RequestError("stop_token_ids", f"{len(ids)} stop tokens; this engine takes at most "
                                                 f"{self.max_stop_ids}")
        return arr.astype(np.int32), ids, tuple(s for s in stop if s)

    def submit(self, prompt, sampling: SamplingParams | None = None, *, max_tokens: int = 16,
               stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (), ignore_eos: bool = False,
               request_id: int | None = None, handle: RequestHandle | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once.

        Raises ``RequestError`` (naming the field) for an invalid request and ``EngineOverloaded``
        when ``max_queue`` requests are already waiting. ``sampling`` defaults to greedy.
        ``request_id`` (default: a global counter) keys an unseeded request's random stream;
        ``handle`` lets a driver hand out the handle before the request reaches the engine
        (``ddtree_jax.serving.multihost``).
        """
        try:
            arr, stop_ids, stop = self.check_request(prompt, sampling, max_tokens, stop_token_ids, stop, ignore_eos)
        except RequestError:
            self.metrics.count("rejected", "invalid")
            raise
        if handle is None:
            rid = next(_request_counter) if request_id is None else int(request_id)
            handle = RequestHandle(self, rid % 2**32)
        req = _Request(handle=handle, prompt=arr, sampling=sampling or SamplingParams(temperature=0.0),
                       max_tokens=max_tokens, stop_ids=stop_ids, text=TextStream(self.tokenizer, stop),
                       submitted=time.perf_counter())
        with self._lock:
            if self._stopping:
                raise EngineOverloaded("the engine is shutting down")
            if len(self._queue) >= self.max_queue:
                self.metrics.count("rejected", "overloaded")
                raise EngineOverloaded(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._queue.append(req)
            self.metrics.count("prompt_tokens", n=int(arr.size))
            self._update_load()
            self._work.notify_all()
        return handle

    def generate(self, prompts: Sequence[Sequence[int]], sampling=None, **kw) -> list[RequestResult]:
        """Submit ``prompts`` (one ``SamplingParams`` or one per prompt) and step until all finish
        (no background thread needed; with one running, just waits)."""
        samplings = sampling if isinstance(sampling, Sequence) else [sampling] * len(prompts)
        handles = [self.submit(p, s, **kw) for p, s in zip(prompts, samplings, strict=True)]
        while not all(h.done for h in handles):
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.001)
        return [h.result() for h in handles]

    # ------------------------------------------------------------------------------------ the loop

    def _wake(self) -> None:
        with self._lock:
            self._work.notify_all()

    def _update_load(self) -> None:  # holds the lock
        running = sum(1 for r in self._slot if r is not None and r.running)
        prefilling = sum(1 for r in self._slot if r is not None and not r.running)
        self.metrics.set_load(len(self._queue), running, prefilling)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue) or any(r is not None for r in self._slot)

    def step(self) -> bool:
        """One engine step: retire, admit, prefill one chunk, run ``sync_every`` rounds, stream.
        Returns whether there was anything to do."""
        with self._lock:
            cancelled_queued = [r for r in self._queue if r.handle.cancel_requested]
            for r in cancelled_queued:
                self._queue.remove(r)
            cancelled = [r for r in self._slot if r is not None and r.handle.cancel_requested]
            for r in cancelled:
                self._slot[r.slot] = None
                if r in self._admitted:
                    self._admitted.remove(r)
            for i in range(self.slots):
                if self._slot[i] is None and self._queue:
                    req = self._queue.popleft()
                    req.slot = i
                    self._slot[i] = req
                    self._admitted.append(req)
            self._update_load()
            busy = any(r is not None for r in self._slot)
        for r in cancelled_queued:
            self._finish(r, "cancelled")
        running_cancelled = [r for r in cancelled if r.running]
        if running_cancelled:
            self._release([r.slot for r in running_cancelled])
        for r in cancelled:
            self._finish(r, "cancelled")
        if not busy:
            return bool(cancelled_queued or cancelled)
        self._prefill_step()
        self._decode_step()
        self.metrics.count("engine_steps")
        with self._lock:
            self._update_load()
        return True

    def _rows(self, slots: list[int]) -> np.ndarray:
        """Slot indices padded to a power of two by repeating the first (with identical data)."""
        return np.array(slots + [slots[0]] * (_pow2(len(slots)) - len(slots)), np.int32)

    @staticmethod
    def _pad(rows: np.ndarray, n: int) -> np.ndarray:
        return np.concatenate([rows, np.repeat(rows[:1], n - len(rows), axis=0)]) if n > len(rows) else rows

    @staticmethod
    def _fetch(tree):
        """Device -> host; with several processes (``jax.distributed``) every process gathers the
        whole (small) arrays, so that all of them take the same host decisions."""
        if jax.process_count() == 1:
            return jax.device_get(tree)
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)

    def _release(self, slots: list[int]) -> None:
        self._state = _device.release(self._state, self._rows(slots))

    def _prefill_step(self) -> None:
        with self._lock:
            batch = [r for r in self._admitted][: self.prefill_batch]
        if not batch:
            return
        need = [r for r in batch if r.prefilled < r.prompt.size - 1]
        if need:
            longest = max(r.prompt.size - 1 - r.prefilled for r in need)
            T = min(self.prefill_chunk, max(_MIN_CHUNK, _pow2(longest)))
            R = _pow2(len(need))
            ids = np.zeros((len(need), T), np.int32)
            counts = np.zeros((len(need),), np.int32)
            starts = np.array([r.prefilled for r in need], np.int32)
            for i, r in enumerate(need):
                chunk = r.prompt[r.prefilled : min(r.prefilled + T, r.prompt.size - 1)]
                ids[i, : chunk.size] = chunk
                counts[i] = chunk.size
            self._state = _device.prefill_chunk(
                self._models, self._tparams, self._dparams, self.plan, self._state, self._rows([r.slot for r in need]),
                self._pad(ids, R), self._pad(starts, R), self._pad(counts, R))
            for r, c in zip(need, counts, strict=True):
                r.prefilled += int(c)
        ready = [r for r in batch if r.prefilled == r.prompt.size - 1]
        if ready:
            self._activate(ready)

    def _activate(self, reqs: list[_Request]) -> None:
        R = _pow2(len(reqs))
        stop_ids = np.full((len(reqs), self.max_stop_ids), NO_STOP, np.int32)
        for i, r in enumerate(reqs):
            stop_ids[i, : len(r.stop_ids)] = r.stop_ids
        pad = lambda x: self._pad(np.asarray(x), R)
        sampling = SamplingBatch(*(pad(np.array([getattr(r.sampling, f) for r in reqs], dtype))
                                   for f, dtype in (("temperature", np.float32), ("top_k", np.int32),
                                                    ("top_p", np.float32), ("min_p", np.float32))),
                                 seed=pad(np.array([r.sampling.seed or 0 for r in reqs], np.uint32)),
                                 has_seed=pad(np.array([r.sampling.seed is not None for r in reqs], bool)))
        self._state = _device.activate(
            self._state, self._rows([r.slot for r in reqs]), pad([r.prompt[-1] for r in reqs]),
            pad(np.array([r.prompt.size - 1 for r in reqs], np.int32)),
            pad(np.array([r.max_tokens for r in reqs], np.int32)), pad(stop_ids), sampling,
            pad(np.array([r.handle.request_id for r in reqs], np.uint32)))
        with self._lock:
            for r in reqs:
                r.running = True
                self._admitted.remove(r)

    def _decode_step(self) -> None:
        with self._lock:
            running = [r for r in self._slot if r is not None and r.running]
        if not running:
            return
        self._state = run_rounds(self._models, self._tparams, self._dparams, self.plan, self._state, self._base_key,
                                 self.sync_every)
        tok_starts = np.zeros((self.slots,), np.int32)
        rnd_starts = np.zeros((self.slots,), np.int32)
        for r in running:
            tok_starts[r.slot], rnd_starts[r.slot] = r.read_tokens, r.read_rounds
        got = self._fetch(_device.harvest(self._state, tok_starts, rnd_starts,
                                             tokens=self.sync_every * self.tokens_per_round, rounds=self.sync_every))
        now = time.perf_counter()
        release = []
        for r in running:
            s = r.slot
            n_new, n_rounds = int(got["generated"][s]) - r.read_tokens, int(got["rounds"][s]) - r.read_rounds
            new = got["tokens"][s, :n_new].tolist()
            accepted = got["accept"][s, :n_rounds].tolist()
            r.read_tokens += n_new
            r.read_rounds += n_rounds
            r.acceptance += accepted
            self.metrics.count("rounds", n=n_rounds)
            for a in accepted:
                self.metrics.observe("accept", a)
            kept, text = r.text.add(new)
            if kept:
                self.metrics.tokens(len(kept), now)
                if r.first_token is None:
                    r.first_token = now
                    self.metrics.observe("ttft", now - r.submitted)
                    if len(kept) > 1:
                        self.metrics.observe("itl", 0.0, len(kept) - 1)
                else:
                    self.metrics.observe("itl", (now - r.last_emit) / len(kept), len(kept))
                r.last_emit = now
            code = int(got["finish"][s])
            if r.text.stopped:
                release.append(s)
                self._finish(r, "stop", kept, text)
            elif code != RUNNING:
                release.append(s)
                self._finish(r, FINISH_REASONS[code], kept, text + r.text.flush())
            elif kept or text:
                r.handle._push(StreamChunk(kept, text))
        if release:
            self._release(release)

    def _finish(self, r: _Request, reason: str, tokens: list[int] | None = None, text: str = "") -> None:
        """Retire ``r``: free its slot (host side) and send its last chunk."""
        with self._lock:
            if r.slot >= 0 and self._slot[r.slot] is r:
                self._slot[r.slot] = None
            if r in self._admitted:
                self._admitted.remove(r)
        now = time.perf_counter()
        result = RequestResult(
            request_id=r.handle.request_id, prompt_tokens=int(r.prompt.size), tokens=list(r.text.tokens),
            text=r.text.text, finish_reason=reason, acceptance_lengths=list(r.acceptance),
            ttft=None if r.first_token is None else r.first_token - r.submitted, seconds=now - r.submitted)
        self.metrics.count("requests", reason.split(":")[0])
        r.handle._push(StreamChunk(list(tokens or []), text, reason, result))

    # ------------------------------------------------------------------------------------ thread

    def start(self) -> Engine:
        """Step in a background thread while there is work (idle otherwise)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._stopping or bool(self._queue)
                                    or any(r is not None for r in self._slot))
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a failed device step fails the requests in it, not the engine
                log.exception("engine step failed")
                self._fail_all(f"error: engine step failed: {type(e).__name__}: {e}")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            active = [r for r in self._slot if r is not None]
        for r in active:
            self._finish(r, reason)
        self._state = self._empty_state()

    def stop(self) -> None:
        """Stop the background thread; requests still queued or running finish with ``"abort"``."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            pending = list(self._queue) + [r for r in self._slot if r is not None]
            self._queue.clear()
        for r in pending:
            self._finish(r, "abort")

    def warmup(self) -> None:
        """Compile the common shapes before serving: a round, and the prefill and activation of every
        power-of-two number of newcomers up to ``prefill_batch`` (with the smallest prompt chunk)."""
        prompt = [0] * min(_MIN_CHUNK + 1, self.max_model_len - 1)
        R = 1
        while R <= min(self.prefill_batch, self.max_queue):
            handles = [self.submit(prompt, SamplingParams(temperature=0.0), max_tokens=1, ignore_eos=True,
                                   request_id=0) for _ in range(R)]
            if self._thread is None:
                while not all(h.done for h in handles):
                    self.step()
            for h in handles:
                h.result()
            R *= 2
        self.metrics = EngineMetrics(self.slots)  # the warm-up requests are not traffic
