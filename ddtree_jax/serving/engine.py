"""``Engine``: continuous batching of streamed requests over a fixed number of decoding slots.

One ``DecodeState`` of ``slots`` rows lives on the device for the engine's lifetime. Each engine
step (``step()``)

(a) frees the slots of requests that ended on the host (cancelled, or a stop string) and admits
    queued requests into free slots;
(b) prefills admitted requests in chunks of at most ``prefill_chunk`` prompt tokens per step (a
    long prompt does not stall the running streams), up to ``prefill_batch`` slots per step,
    padded to a power of two (a shape not compiled yet runs padded on a compiled one while it
    compiles in the background: ``serving/shapes.py``); a slot whose prompt is in starts decoding
    (``activate_first``: a new request's prefill takes its whole prompt and its first token is
    drawn from the last position, read back as soon as that has run, before the rounds after it;
    docs/first-token.md);
(c) dispatches compiled rounds without waiting for them (``sync_every`` of them, or with
    ``sync_every="auto"`` 1, 2 or 4, whichever the measured cost per round favours at the current
    load: ``serving/dispatch.py``), and meanwhile reads back the rounds dispatched
    ``EngineConfig.read_lag`` steps before (1 or 2; by default with ``"auto"``, 2 after a
    dispatch of several rounds): one packed device-to-host transfer, per-slot
    work only for slots with news, and the token ids handed to the ``Emitter`` (stop strings,
    chunks; the text of a request without stop strings is decoded by its reader, off this
    thread): the host's work runs while the device computes the rounds dispatched. The programs (a)
    to (c) run on the state are queued in order on the engine thread (``_ops``) and launched,
    with the rounds, from a launcher thread beside the read-back (``_launch_rounds``): a launch is
    host work too, and the step does not wait for it (the next step's launch queues behind it).
    Admission and retirement take effect at the next round boundary; under load, free slots wait
    for a group of newcomers (``admit_group``, at most ``admit_wait`` steps) so that one prefill
    serves several.

A request's random stream depends on its seed (or, unseeded, a global request counter), never
on its slot or its neighbours, and greedy requests give exactly ``generate()``'s tokens whatever
the arrival order and slot count (the tests check both). The numbers its tokens are drawn from
are the same whatever shares the batch only in the deterministic mode
(``EngineConfig.deterministic``: both models batch-invariant, so a row's prefill and rounds
compute the same bits whatever its neighbours, the prefill's rows and chunk length); without it,
bf16 rounding can differ with the batch and change a sampled token (docs/serving.md).

Drive it with ``step()`` (tests, benchmarks) or ``start()`` a background thread that steps while
there is work. ``submit`` is thread-safe, checks the request at once (``RequestError`` naming the
field) and refuses with ``EngineOverloaded`` when the bounded queue is full.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import auto_costs
from ddtree_jax.auto_budget import AutoChooser, AutoPlan
from ddtree_jax.auto_round import engine_deferred, plain_tally, round_plans, tally_width
from ddtree_jax.backend import resolve_backend
from ddtree_jax.config import AUTO, ConfigError, EngineConfig, auto_budget_set, is_int, token_id_problem
from ddtree_jax.decode_round import DecodePlan, Models
from ddtree_jax.decode_state import FINISH_REASONS, NO_STOP, RUNNING, DecodeState
from ddtree_jax.sampling import SamplingBatch, SamplingParams
from ddtree_jax.serving import _device
from ddtree_jax.serving.dispatch import ROUNDS, DispatchSizer
from ddtree_jax.serving.emitter import Emit, Emitter, RequestResult, StreamChunk, TokenLogprobs, deliver
from ddtree_jax.serving.metrics import EngineMetrics
from ddtree_jax.serving.pages import PagePool, PageTable, page_keys, preemption_order
from ddtree_jax.serving.text import TextStream

__all__ = ["Engine", "EngineOverloaded", "Inbox", "RequestError", "RequestHandle", "RequestResult", "StreamChunk",
           "TokenLogprobs"]

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


class RequestHandle:
    """A submitted request: stream its chunks (blocking or async), wait for its result, cancel it."""

    def __init__(self, engine: Engine, request_id: int):
        self._engine = engine
        self.request_id = request_id
        # ``_push`` takes the plain lock (a C-level context manager; the Condition's own is Python
        # code) and notifies through the Condition built on it only when a reader waits.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._chunks: list[StreamChunk] = []
        # Replaced, never changed in place (copy on write): ``_push`` reads it without a copy.
        self._listeners: list[tuple[asyncio.AbstractEventLoop, Inbox]] = []
        # Threads waiting in ``stream`` (woken by every chunk) and in ``result`` (by the last one
        # only: a thread per request blocked on its result must not wake at every engine step)
        self._blocked = 0
        self._blocked_results = 0
        self._result: RequestResult | None = None
        self.cancel_requested = False
        # The finish reason a cancellation gives: "stop" when the two-process server's front end
        # found a stop string (engine_process), else "cancelled".
        self.cancel_reason = "cancelled"

    def _push(self, chunk: StreamChunk, deliveries: list | None = None) -> None:
        """Record ``chunk`` and wake blocking readers. Async listeners get it through their event
        loop: at once, or, given ``deliveries``, appended there as ``(loop, queue, chunk)`` for the
        caller to hand over with one wake-up per loop (``emitter.deliver``)."""
        with self._mutex:
            self._chunks.append(chunk)
            if chunk.finished:
                self._result = chunk.result
            listeners = self._listeners
            if self._blocked or (self._blocked_results and chunk.finished):
                self._cond.notify_all()
        if not listeners:
            return
        if deliveries is not None:
            deliveries.extend((loop, queue, chunk) for loop, queue in listeners)
            return
        deliver([(loop, queue, chunk) for loop, queue in listeners])

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
            self._blocked_results += 1
            try:
                if not self._cond.wait_for(lambda: self._result is not None, timeout):
                    raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
            finally:
                self._blocked_results -= 1
            return self._result

    def _wait(self, predicate, timeout: float | None) -> bool:
        """``Condition.wait_for`` counted in ``_blocked`` (holds the lock): woken by every chunk."""
        self._blocked += 1
        try:
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._blocked -= 1

    def stream(self, timeout: float | None = None) -> Iterator[StreamChunk]:
        """The request's chunks as they come (blocking), ending with the finished one."""
        i = 0
        while True:
            with self._cond:
                if not self._wait(lambda i=i: len(self._chunks) > i, timeout):
                    raise TimeoutError(f"request {self.request_id}: no output for {timeout}s")
                chunk = self._chunks[i]
            i += 1
            yield chunk
            if chunk.finished:
                return

    async def astream(self) -> AsyncIterator[StreamChunk]:
        """The request's chunks as they come, for asyncio code (each chunk exactly once)."""
        async for batch in self.astream_batches():
            for chunk in batch:
                yield chunk

    async def astream_batches(self) -> AsyncIterator[list[StreamChunk]]:
        """``astream``'s chunks, as lists: each time every chunk that has arrived (at least one),
        in order, so that a reader that fell behind catches up in one pass; the last list ends
        with the finished chunk."""
        loop = asyncio.get_running_loop()
        inbox = Inbox(loop)
        with self._cond:
            backlog = list(self._chunks)
            self._listeners = [*self._listeners, (loop, inbox)]
        try:
            batch = backlog
            while True:
                for k, c in enumerate(batch):
                    if c.finished:
                        yield batch[: k + 1]
                        return
                if batch:
                    yield batch
                batch = await inbox.take()
        finally:
            with self._cond:
                self._listeners = [x for x in self._listeners if x[1] is not inbox]


class Inbox:
    """Items handed to one waiting task on an event loop, lighter than an ``asyncio.Queue``:
    ``put_nowait`` (on that loop: ``emitter.deliver`` for ``astream_batches``' chunks) appends and
    wakes the waiter; ``take`` returns every item that has arrived once one has, in order."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._loop = loop

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list:
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


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
    admitted: float | None = None  # when it last took a slot
    slot: int = -1
    prefilled: int = 0  # prompt tokens (of prompt[:-1]) in the slot's caches
    running: bool = False
    retired: bool = False  # the engine is done with it (its slot is free or being freed)
    ended: bool = False  # the emitter has sent its last chunk
    acceptance: list[int] = dataclasses.field(default_factory=list)
    out: list[int] = dataclasses.field(default_factory=list)  # tokens read back so far
    rounds_done: int = 0  # rounds read back so far (a resumed request's random stream continues)
    context: np.ndarray | None = None  # paged, resumed after preemption: prompt + ``out`` (None: the prompt)
    first_page: bytes | None = None  # paged: the prefix key of its first full page of context, if any
    leader: _Request | None = None  # paged: a request prefilling the same first page, to wait for
    logprobs: int | None = None  # top alternatives asked for; None: no log-probabilities
    logprob_parts: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    first_token: float | None = None
    last_emit: float | None = None
    early: bool = False  # its first token was emitted from its activation: its first harvest's copy is dropped

    @property
    def tokens(self) -> np.ndarray:
        """What the slot's caches hold when the request starts decoding, and its root (the last)."""
        return self.prompt if self.context is None else self.context


def _batch_invariant(model, role: str):
    """``model`` in ``ExecutionConfig.batch_invariant`` (``EngineConfig.deterministic``)."""
    execution = getattr(model, "execution", None)
    if execution is None:
        raise ConfigError("EngineConfig", "deterministic",
                          f"the {role} ({type(model).__name__}) has no ExecutionConfig to make batch-invariant")
    return model if execution.batch_invariant else model.with_execution(
        dataclasses.replace(execution, batch_invariant=True))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


class Engine:
    """Continuous-batching decoding engine over ``config.slots`` fixed slots.

    Args:
      target, drafter: the models (``drafter`` may be ``None`` for ``method="ar"``).
      config: the settings (``EngineConfig``; its ``decode`` as in ``generate``, except that
        ``sync_every`` is the rounds per dispatch: ``"auto"`` by default on GPUs with a fixed
        budget, else 1); checked against the models here (``ConfigError`` naming the field).
      tokenizer: a ``tokenizers.Tokenizer`` (or anything with ``decode(ids)``), for text and stop
        strings; ``None``: tokens only.
      shard_state: optional function placing the state (``ddtree_jax.serving.sharding``).

    The resolved settings are attributes: ``method``, ``budget`` (DDTree's node budget or
    ``"auto"``; the drafter's block for dflash, 0 for ar), ``slots``, ``max_model_len``, ``max_output_tokens``,
    ``max_queue``, ``prefill_chunk``, ``prefill_batch``, ``admit_group``, ``admit_wait``, ``sync_every``
    (an integer or ``"auto"``), ``dispatch_rounds`` (the rounds a dispatch may run: ``(sync_every,)``,
    or with ``"auto"`` ``dispatch.ROUNDS``), ``read_lag`` (steps from a dispatch to its read-back: 1,
    2, or ``"auto"``: 2 after a dispatch of several rounds, 1 after one),
    ``stop_token_ids``, ``max_stop_ids``, ``max_logprobs``, ``cache_len`` (positions per slot). With ``budget="auto"``:
    ``auto_plan`` (the budget set) and ``auto_costs`` (seconds per round at each budget:
    ``decode.auto_costs``, else the cost table's, timed at start-up on a scratch state of running
    rows if it has none); each dispatch runs the compiled rounds of the budget the host chooses
    from the dispatches read back so far (``auto_budget.AutoChooser``); the metrics count the
    rounds, expected and realized tokens per budget.
    """

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, *, tokenizer=None,
                 shard_state: Callable | None = None):
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        cfg = target.config
        config.check_for(cfg.vocab_size, drafter is not None, cfg.max_position_embeddings)
        decode = config.decode
        if config.deterministic:
            target = _batch_invariant(target, "target")
            drafter = _batch_invariant(drafter, "drafter") if decode.uses_drafter else drafter
        self.config = config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.max_output_tokens = config.max_output_tokens or self.max_model_len - 1
        method, slots = decode.method, config.slots
        depth = drafter.config.block_size - 1 if decode.uses_drafter else 0
        budget = decode.max_budget if method == "ddtree" else depth
        self.method, self.budget, self.slots = method, decode.budget if method == "ddtree" else depth, slots
        self.tokenizer = tokenizer
        self.max_queue, self.prefill_chunk = config.max_queue, config.prefill_chunk
        sync = decode.sync_every
        if sync is None:  # a round's launch costs more than a small model's round on a GPU (docs/serving.md)
            sync = AUTO if jax.default_backend() == "gpu" and not decode.is_auto and jax.process_count() == 1 else 1
        elif sync == AUTO and jax.process_count() > 1:
            raise ConfigError("DecodeConfig", "sync_every", "'auto' measures costs on each host, which would "
                              "choose differently across processes; give an integer")
        self.sync_every = sync
        self.dispatch_rounds = ROUNDS if sync == AUTO else (sync,)
        self._sizer = DispatchSizer(self.dispatch_rounds) if sync == AUTO else None
        self.read_lag = config.read_lag or (AUTO if sync == AUTO else 1)
        self.prefill_batch = min(config.prefill_batch or slots, slots)
        self.admit_group = min(config.admit_group or max(1, slots // 8), self.prefill_batch)
        self.admit_wait = config.admit_wait
        self._held = 0  # steps admission has waited for a group
        self.stop_token_ids = list(decode.stop_token_ids)
        self.max_stop_ids = max(config.max_stop_ids, len(self.stop_token_ids))
        self.max_logprobs = config.max_logprobs
        self.plan = DecodePlan(method=method, budget=budget, backend=resolve_backend(decode.impl),
                               hidden_layer_ids=tuple(drafter.config.target_layer_ids) if decode.uses_drafter else (),
                               logprobs=config.max_logprobs)
        self._models, self._tparams, self._dparams = Models.split(target, drafter if decode.uses_drafter else None)
        self._target, self._drafter = target, drafter
        self.cache_len = config.cache_len(self.max_model_len, depth)
        self.tokens_per_round = depth + 1
        self._shard_state = shard_state
        # Slots split over the target's row mesh in blocks, one per device: free slots are taken
        # device by device in turn (a burst of requests prefills on every device at once).
        self._row_mesh = getattr(target, "row_mesh", None)
        self._row_blocks = _device.row_blocks(target, slots)
        self._block_slots = slots // self._row_blocks
        self._admission_order = [j * self._block_slots + i for i in range(self._block_slots)
                                 for j in range(self._row_blocks)]
        self.page_size = config.page_size
        if self.page_size is not None:
            self._init_pages(config, target, drafter if decode.uses_drafter else None)
        self._base_key = jax.random.key(decode.seed)
        # each slot's first token's log-probability entries (``_device.activate_first``)
        self._first_logprobs = jnp.zeros((self.slots, 1 + 2 * config.max_logprobs), jnp.int32)
        self.auto_plan = None
        self._defer, self._deferred_rounds = 0, 0  # budget 0's held-back context: its size, rounds since a flush
        if decode.is_auto:
            if config.max_logprobs:
                raise ConfigError("EngineConfig", "max_logprobs", "log-probabilities are not computed with "
                                  "budget='auto' yet; use a fixed budget or max_logprobs=0")
            self.auto_plan = AutoPlan(budgets=auto_budget_set(decode.auto_max_budget), draft_len=depth,
                                      probe_every=decode.auto_probe_every)
            self._auto_plans = round_plans(self.plan, self.auto_plan)
            self._auto = AutoChooser(self.auto_plan, learn_costs=decode.auto_costs is None)
            # Budget 0 holds the drafter's context back (``auto_round``), up to DEFER_ROUNDS positions a slot.
            self._defer = engine_deferred(config, depth)
            self.auto_costs = decode.auto_costs or self._measure_costs()
        self._state = self._empty_state()
        # The prefill's executables per (rows, chunk) shape: a new shape runs padded on a compiled
        # one while it compiles in the background (serving/shapes.py).
        self._prefill = _device.prefill_shapes(self._models, self.plan, self._tparams, self._dparams, self._state)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._slot: list[_Request | None] = [None] * slots
        self._admitted: list[_Request] = []  # prefilling, in admission order
        self.metrics = self._new_metrics()
        self._emitter = Emitter(self.metrics)
        # The dispatches not read back yet, oldest first: (launch future -> packed harvest or None,
        # the slots' requests at dispatch or None, the auto budget's index or None, whether it
        # launched rounds alone, its rounds: _read_back's arguments).
        self._inflight: collections.deque[tuple] = collections.deque()
        # New requests' first tokens, read back as soon as their activation has run (before the
        # rounds after it): (requests, future of the device array of their first tokens, the
        # dispatches launched before the activation). Dispatches launched so far (``_reads``):
        self._early: collections.deque[tuple] = collections.deque()
        self._launches = 0
        # The step's programs on the state (table uploads, releases, prefill chunks, activations),
        # in program order, queued by the engine thread and launched before the step's rounds.
        self._ops: list[Callable[[DecodeState], DecodeState]] = []
        # The step's launches (the host's share of running compiled programs: on a GPU about as long
        # as a small model's round, mostly without the interpreter lock) overlap the read-back and
        # streaming of the rounds before. With several processes every process must launch its
        # programs in the same order as the others, so there they stay on the engine thread.
        self._launcher = concurrent.futures.ThreadPoolExecutor(1, "ddtree-launch") if jax.process_count() == 1 else None
        self._waited = 0.0
        self._last_read: float | None = None  # when the last clean dispatch was read back (_read_back)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def _init_pages(self, config: EngineConfig, target, drafter) -> None:
        """The paged caches' host side: the pool, one page table per slot, and the coverage rule."""
        P = self.page_size
        if self._shard_state is not None or jax.process_count() > 1:
            raise ConfigError("EngineConfig", "page_size", "paged caches run on one device (no mesh form yet)")
        for role, model in (("target", target), ("drafter", drafter)):
            if model is not None and not hasattr(model, "init_paged_cache"):
                raise ConfigError("EngineConfig", "page_size",
                                  f"the {role} ({type(model).__name__}) has no paged cache (init_paged_cache)")
        self.pages_per_slot = -(-self.cache_len // P)
        self.kv_pages = config.kv_pages or self.slots * self.pages_per_slot
        # A dispatch's rounds run while the ``read_lag`` dispatches before it are not read back yet:
        # the table must cover all their tokens past the last length read back, and a round's scratch.
        self._block = self.cache_len - self.max_model_len
        self._margin = (self._lag(self.dispatch_rounds[-1]) + 1) * self.dispatch_rounds[-1] * self.tokens_per_round
        longest = -(-(self.max_model_len - 1 + self._block) // P)
        if longest > self.kv_pages:
            raise ConfigError("EngineConfig", "kv_pages",
                              f"{self.kv_pages} pages of {P} positions cannot hold one request of max_model_len "
                              f"{self.max_model_len} with its scratch ({longest} pages)")
        self._pool = PagePool(self.kv_pages + 1, P)
        self._tables = [PageTable(self._pool) for _ in range(self.slots)]
        self._dirty: set[int] = set()

    def _admit_pages(self, slot: int, r: _Request) -> bool:
        """Admit ``r`` to ``slot``'s page table if the pool has the pages for its context and its
        first dispatch (less a cached prefix it shares, which it will not compute again:
        ``r.prefilled``); ``False``, changing nothing, if not."""
        tokens = r.tokens
        need = self._cover(r, tokens.size - 1)
        if not self._pool.can_admit(tokens, need - (tokens.size - 1)):
            return False
        table = self._tables[slot]
        r.prefilled = table.admit(tokens)
        covered = table.ensure(need)
        assert covered, "can_admit promised these pages"
        self._dirty.add(slot)
        keys = page_keys(tokens[: min(tokens.size - 1, self.page_size)], self.page_size)
        r.first_page = keys[0] if keys else None
        if r.prefilled == 0 and r.first_page is not None:
            # a request prefilling the same first page publishes it soon: wait, then match it
            r.leader = next((x for x in self._admitted if x.first_page == r.first_page and x.leader is None), None)
        return True

    def _waiting(self, r: _Request) -> bool:
        """Whether ``r`` waits for its leader's prefill; once the leader is done (decoding,
        finished or preempted), ``r`` is admitted again to match what it published."""
        if r.leader is None:
            return False
        if any(x is r.leader for x in self._admitted):
            return True
        r.leader = None
        table = self._tables[r.slot]
        table.release_all()
        r.prefilled = table.admit(r.tokens)
        covered = table.ensure(self._cover(r, r.tokens.size - 1))
        assert covered, "the pages just released cover what the match does not"
        self._dirty.add(r.slot)
        return False

    def _cover(self, r: _Request, known: int) -> int:
        """Positions ``r``'s table must cover for its next dispatch when its caches hold ``known``
        positions as far as the host has read back: the rounds of as many dispatches as may be in
        flight (the read lag + 1) and one scratch block past them, never more than its whole run needs."""
        return min(r.prompt.size + r.max_tokens - 1 + self._block, known + self._margin + self._block)

    def _known(self, r: _Request) -> int:
        """Positions of ``r``'s caches that hold its tokens for good, as far as the host knows."""
        return r.prompt.size + len(r.out) - 1 if r.running else r.prefilled

    def _release_pages(self, r: _Request, publish: bool) -> None:
        """Give back ``r``'s pages (finish, cancellation, preemption); with ``publish``, its full
        pages of committed tokens enter the prefix cache first. Its slot's table row becomes null
        at the next sync (``_sync_tables``), before any later program runs."""
        table = self._tables[r.slot]
        if table.admitted is None:
            return
        if publish:
            self._queue_flush()  # (before the table sync that takes the slot's pages away)
            known = self._known(r)
            table.commit(known)
            table.publish(np.concatenate([r.prompt, np.asarray(r.out, np.int32)])[:known])
        table.release_all()
        self._dirty.add(r.slot)

    def _sync_tables(self) -> None:
        """Upload the page-table rows changed on the host since the last sync (one compiled scatter,
        rows padded to a power of two with identical data)."""
        if not self._dirty:
            return
        slots = sorted(self._dirty)
        self._dirty.clear()
        table = np.stack([self._tables[s].as_row(self.pages_per_slot) for s in slots])
        R = _pow2(len(slots))
        rows, table = self._rows(slots, R), self._pad(table, R)
        self._ops.append(lambda state, rows=rows, table=table: _device.set_page_rows(state, rows, table))

    def _preempt(self, r: _Request) -> None:
        """Free ``r``'s slot and pages and queue it first again, to resume by recomputation: its
        context becomes prompt + the tokens read back, whose pages it published (the rounds of a
        dispatch not read back yet are dropped and run again: same keys, so the same tokens)."""
        self._release_pages(r, publish=True)
        with self._lock:
            if self._slot[r.slot] is r:
                self._slot[r.slot] = None
            self._admitted = [x for x in self._admitted if x is not r]
            self._queue.appendleft(r)
        for _, snapshot, *_ in self._inflight:
            if snapshot is not None and snapshot[r.slot] is r:
                snapshot[r.slot] = None  # its in-flight rounds are dropped
        if r.running:
            self._release([r.slot])
        r.context = np.concatenate([r.prompt, np.asarray(r.out, np.int32)]) if r.out else None
        r.running, r.prefilled, r.slot, r.leader = False, 0, -1, None
        self.metrics.count("preemptions")

    def _ensure_pages(self, snapshot: list[_Request | None]) -> None:
        """Before a dispatch: every running slot's table covers its next rounds (``_cover``);
        when the pool runs short, preempt the most recently admitted requests until it does
        (a request that is itself the most recent is preempted, and its slot leaves ``snapshot``)."""
        for s, r in enumerate(snapshot):
            if r is None:
                continue
            table = self._tables[s]
            need = self._cover(r, self._known(r))
            if table.capacity >= need:
                continue
            while not table.ensure(need):
                victim = next(t for t in preemption_order(self._tables))
                owner = self._slot[self._tables.index(victim)]
                self._preempt(owner)
                if owner is r:
                    snapshot[s] = None
                    break
                for i, x in enumerate(snapshot):
                    if x is owner:
                        snapshot[i] = None
            else:
                self._dirty.add(s)

    def _new_metrics(self) -> EngineMetrics:
        return EngineMetrics(self.slots, auto_budgets=self.auto_plan.budgets if self.auto_plan else ())

    def _rounds(self, plan: DecodePlan, state, rounds: int):
        """``rounds`` rounds of ``plan`` on ``state`` and their harvest: ``(state, packed)``."""
        return _device.rounds_and_harvest(self._models, self._tparams, self._dparams, plan, state, self._base_key,
                                          rounds=rounds, tokens=rounds * self.tokens_per_round + 1,
                                          first_logprobs=self._first_logprobs if plan.logprobs else None)

    def _measure_costs(self) -> tuple[float, ...]:
        """Seconds per round at each budget (``auto_costs``): the cost table's, or timed now
        (before the engine's own state exists) on a scratch state whose slots all run: distinct
        roots, empty caches, sampled at temperature 1, limits the output buffer's, put back before
        every call. With several processes, process 0's costs (every process must choose alike)."""
        key = auto_costs.cost_key(auto_costs.models_digest(self._target, self._drafter), backend=self.plan.backend,
                                  rows=self.slots, cache_len=self.cache_len, per_call=self.dispatch_rounds[0],
                                  budgets=self.auto_plan.budgets)
        scratch = [self._empty_state()]
        packed = self._scratch_activation()

        def before():
            scratch[0] = _device.activate(scratch[0], packed)
            return scratch[0]

        def run(k):
            scratch[0], packed = self._rounds(self._auto_plans[k], scratch[0], self.dispatch_rounds[0])
            return packed

        costs = auto_costs.default_table().get_or_measure(key, run, per_call=self.dispatch_rounds[0], before=before)
        del scratch[0]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            costs = tuple(float(c) for c in multihost_utils.broadcast_one_to_all(np.asarray(costs, np.float64)))
        return costs

    def _scratch_activation(self):
        """An activation (``_device.activate``'s input) under which every slot runs: distinct
        roots, empty caches, sampled at temperature 1 with its own seed, limits the output
        buffer's. For timing the compiled rounds on a scratch state."""
        S = self.slots
        rows = np.arange(S, dtype=np.int32)
        ones = np.ones((S,), np.float32)
        sampling = SamplingBatch(temperature=ones, top_k=np.zeros((S,), np.int32), top_p=ones,
                                 min_p=np.zeros((S,), np.float32), seed=rows.astype(np.uint32),
                                 has_seed=np.ones((S,), bool))
        return _device.activation_rows(rows, rows % self.vocab_size, np.zeros((S,), np.int32),
                                       np.full((S,), self.max_output_tokens, np.int32),
                                       np.full((S, self.max_stop_ids), NO_STOP, np.int32), sampling, rows,
                                       np.zeros((S,), np.int32))

    @property
    def state_bytes(self) -> int:
        """Device memory of the decoding state (caches of every slot included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self._state))

    def _empty_state(self):
        return _device.empty_state(self._target, self._drafter, self.plan, self.slots, self.cache_len,
                                   self.max_output_tokens, self.max_stop_ids, self._shard_state,
                                   pages=None if self.page_size is None else (self.kv_pages + 1, self.page_size),
                                   deferred=self._defer)

    def _flush(self, state):
        """The state with every slot's held-back drafter context added (an op of ``_ops``)."""
        return _device.flush(self._models, self._tparams, self._dparams, state)

    def _queue_flush(self) -> None:
        """Queue ``_flush`` (with ``budget="auto"``, when budget-0 rounds may hold context back):
        before a drafted dispatch, before a slot's held positions would pass the buffer, and before
        a request's pages are published (its drafter pages must hold its whole context)."""
        if self._deferred_rounds:
            self._ops.append(self._flush)
            self._deferred_rounds = 0

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
               logprobs: int | None = None, request_id: int | None = None,
               handle: RequestHandle | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once.

        Raises ``RequestError`` (naming the field) for an invalid request and ``EngineOverloaded``
        when ``max_queue`` requests are already waiting. ``sampling`` defaults to greedy.
        ``logprobs``: ``None``, or the number of top alternatives (0 .. ``max_logprobs``) to return
        with each token's log-probability (``StreamChunk.logprobs``, ``RequestResult.logprobs``).
        ``request_id`` (default: a global counter) keys an unseeded request's random stream;
        ``handle`` lets a driver hand out the handle before the request reaches the engine
        (``ddtree_jax.serving.multihost``).
        """
        try:
            arr, stop_ids, stop = self.check_request(prompt, sampling, max_tokens, stop_token_ids, stop, ignore_eos)
            self._check_logprobs(logprobs)
        except RequestError:
            self.metrics.count("rejected", "invalid")
            raise
        if handle is None:
            rid = next(_request_counter) if request_id is None else int(request_id)
            handle = RequestHandle(self, rid % 2**32)
        req = _Request(handle=handle, prompt=arr, sampling=sampling or SamplingParams(temperature=0.0),
                       max_tokens=max_tokens, stop_ids=stop_ids, text=TextStream(self.tokenizer, stop, deferred=True),
                       submitted=time.perf_counter(), logprobs=logprobs)
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

    def _check_logprobs(self, logprobs) -> None:
        if logprobs is None:
            return
        if not is_int(logprobs) or logprobs < 0:
            raise RequestError("logprobs", f"must be None or an integer >= 0, got {logprobs!r}")
        if self.max_logprobs == 0:
            raise RequestError("logprobs", "this engine returns no log-probabilities (EngineConfig.max_logprobs "
                                           "is 0; serve --max-logprobs)")
        if logprobs > self.max_logprobs:
            raise RequestError("logprobs", f"{logprobs} alternatives asked; this engine returns at most "
                                           f"{self.max_logprobs}")

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

    def _admit_now(self) -> bool:  # holds the lock
        """Whether queued requests enter free slots this step: yes once ``min(admit_group,
        queued)`` slots are free, when no slot runs, or after ``admit_wait`` steps of waiting."""
        free = sum(r is None for r in self._slot)
        if not (free and self._queue):
            return False
        if free < min(self.admit_group, len(self._queue)) and free < self.slots and self._held < self.admit_wait:
            self._held += 1
            return False
        self._held = 0
        return True

    def _update_load(self) -> None:  # holds the lock
        running = sum(1 for r in self._slot if r is not None and r.running)
        prefilling = sum(1 for r in self._slot if r is not None and not r.running)
        self.metrics.set_load(len(self._queue), running, prefilling)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue) or bool(self._inflight) or any(r is not None for r in self._slot)

    def step(self) -> bool:
        """One engine step; returns whether there was anything to do.

        In order: free the slots of requests that ended on the host (cancelled, or a stop string
        found by the emitter), admit queued requests into free slots, prefill one chunk, dispatch
        its rounds (asynchronously: launched from a second thread, ``_launch_rounds``),
        and meanwhile read back the tokens of the dispatch ``_lag(rounds)`` steps before (1: the
        previous one; every earlier one when this step dispatches no rounds) and hand them to
        the emitter: the host's work runs while the device computes the rounds dispatched, and
        while the host launches them. A request's tokens therefore reach its stream one or two
        engine steps after the rounds that made them ran; ``drain`` reads the last dispatches
        back. A new request's first token is read back as soon as its prefill has run
        (``_early_tokens``): in the step that activates it when that step reads no round back,
        otherwise after the step's read-backs."""
        t0 = time.perf_counter()
        self._waited = 0.0
        stopped = self._emitter.take_stopped()
        with self._lock:
            cancelled_queued = [r for r in self._queue if r.handle.cancel_requested]
            for r in cancelled_queued:
                self._queue.remove(r)
            cancelled = [r for r in self._slot if r is not None and r.handle.cancel_requested and not r.retired]
            freed, waits = [], []
            for r in cancelled + stopped:
                r.retired = True
                if r.slot >= 0 and self._slot[r.slot] is r:
                    self._slot[r.slot] = None
                    freed.append(r)
                if r in self._admitted:
                    self._admitted.remove(r)
            if self.page_size is not None:
                for r in freed:
                    self._release_pages(r, publish=r.running)
            for i in self._admission_order if self._admit_now() else ():
                if self._slot[i] is None and self._queue:
                    if self.page_size is not None and not self._admit_pages(i, self._queue[0]):
                        break  # first come, first served: wait for pages
                    req = self._queue.popleft()
                    req.slot = i
                    req.admitted = time.perf_counter()
                    self._slot[i] = req
                    self._admitted.append(req)
                    waits.append(req.admitted - req.submitted)
            self._update_load()
            busy = any(r is not None for r in self._slot)
        if waits:
            self.metrics.observe_many("queue_time", waits)
        ended = [Emit(r, [], [], r.handle.cancel_reason) for r in cancelled_queued + cancelled]
        self._release([r.slot for r in freed if r.running])
        if not busy and not self._inflight:
            self._last_read = None  # (idle: the next read-back times nothing)
            self._run_ops()
            self._emitter.submit(ended, time.perf_counter())
            return bool(ended or stopped)
        t1 = time.perf_counter()
        self._prefill_step()
        self.metrics.count("prefill_seconds", n=time.perf_counter() - t1)
        # The step's programs are launched before the dispatches before are read back, beside them
        # if they can; the step does not wait for them (the next step's launch queues behind them).
        # (Preparing may preempt, dropping a preempted request's rounds from those in flight.)
        # A step with rounds of its own reads back the dispatches launched ``_lag`` steps ago or
        # earlier; one without reads back everything before it (nothing would come to wait for).
        previous = len(self._inflight)
        live = [self._live(d) for d in self._inflight]  # (of what is read back below)
        rounds = self._prepare_rounds()
        self._submit_launch(rounds)
        n_read = previous if rounds is None else max(previous - (self._lag(rounds[2]) - 1), 0)
        streaming = any(live[:n_read])
        if not n_read:  # (the next read-back spans two steps: it times nothing)
            self._last_read = None
        items = ended + self._early_tokens()  # (before the harvests that would bring them)
        for i in range(n_read):
            if i:  # (a second read-back in a step times nothing: its rounds ran during the first's wait)
                self._last_read = None
            items += self._read_back(*self._inflight.popleft())
        if not streaming and self._early and self._inflight:
            # No running request's round was read back (the engine was idle, only prefilled, or
            # read back rounds of requests that had ended): the new requests' first tokens need
            # only their prefill, so the step waits for the launcher to launch their activation
            # (not the rounds behind it; or the whole launch, should it fail before) and streams
            # them, rather than leaving them to the next step, which reads them back after those
            # rounds.
            t1 = time.perf_counter()
            concurrent.futures.wait([self._early[-1][1], self._inflight[-1][0]],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            self._waited += time.perf_counter() - t1
        items += self._early_tokens()
        t1 = time.perf_counter()
        self._emitter.submit(items, t1)
        self.metrics.count("emit_seconds", n=time.perf_counter() - t1)
        self.metrics.count("engine_steps")
        if self.page_size is not None:
            self.metrics.set_pages(self._pool.stats())
        self.metrics.count("wait_seconds", n=self._waited)
        self.metrics.count("host_seconds", n=time.perf_counter() - t0 - self._waited)
        with self._lock:
            self._update_load()
        return True

    def _lag(self, rounds: int) -> int:
        """Steps from the launch of a dispatch of ``rounds`` rounds to the read-back of the
        dispatches before it (``EngineConfig.read_lag``; automatic: 2 after several rounds, 1
        after one)."""
        return (2 if rounds > 1 else 1) if self.read_lag == AUTO else self.read_lag

    @staticmethod
    def _live(dispatch: tuple) -> bool:
        """Whether a dispatch (an ``_inflight`` entry) holds rounds of a request that is still
        running (rounds of requests that have ended stream to no one)."""
        _, snapshot, *_, n = dispatch
        return bool(n) and any(r is not None and not r.retired for r in snapshot)

    @property
    def _reads(self) -> int:
        """Dispatches read back (or dropped by ``_fail_all``) so far: those launched and no longer
        in flight."""
        return self._launches - len(self._inflight)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until no prefill shape is compiling in the background (a chunk of a shape not
        compiled yet runs on a larger compiled one meanwhile: benchmarks of the steady state wait
        for them); returns whether none is (False: ``timeout`` seconds passed first)."""
        return self._prefill.wait(timeout)

    def drain(self) -> None:
        """Read back the dispatches in flight (if any): afterwards every committed token has
        reached its stream and no launch is running."""
        while self._inflight:
            self._emitter.submit(self._read_back(*self._inflight.popleft()), time.perf_counter())
        # (every launch has ended: an activation that did not run never will)
        self._early = collections.deque(e for e in self._early if e[1].done())
        self._emitter.submit(self._early_tokens(), time.perf_counter())

    def _settle(self) -> None:
        """Wait until no launch is running (the launcher alone touches ``_state`` meanwhile);
        launches that failed count as done (their dispatch's read-back raises)."""
        concurrent.futures.wait([f for f, *_ in self._inflight])

    def _rows(self, slots: list[int], n: int | None = None) -> np.ndarray:
        """Slot indices padded to ``n`` (default: a power of two) by repeating the first (with
        identical data)."""
        n = _pow2(len(slots)) if n is None else n
        return np.array(slots + [slots[0]] * (n - len(slots)), np.int32)

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
        if slots:
            rows = self._rows(slots, self.slots)
            self._ops.append(lambda state, rows=rows: _device.release(state, rows))

    def _prefill_step(self) -> None:
        with self._lock:
            batch = [r for r in self._admitted if not (self.page_size is not None and self._waiting(r))]
            batch = batch[: self.prefill_batch]
        if not batch:
            return
        need = [r for r in batch if r.prefilled < self._end(r)]
        if self.page_size is not None:
            self._sync_tables()
        logits = {}  # (the chunk's logits, for the activation of requests whose prompt it ends)
        if need:
            longest = max(self._end(r) - r.prefilled for r in need)
            width = min(self.prefill_chunk, max(_MIN_CHUNK, _pow2(longest)))
            # Rows device by device (one block without a row mesh): each device prefills its own slots.
            blocks, per = self._row_blocks, self._block_slots
            most = max(collections.Counter(r.slot // per for r in need).values())
            R, T, prefill = self._prefill.get(blocks * _pow2(most), width)
            ids = np.zeros((len(need), T), np.int32)
            counts = np.zeros((len(need),), np.int32)
            starts = np.array([r.prefilled for r in need], np.int32)
            for i, r in enumerate(need):
                chunk = r.tokens[r.prefilled : min(r.prefilled + T, self._end(r))]
                ids[i, : chunk.size] = chunk
                counts[i] = chunk.size
            rows, pick = _device.prefill_layout([r.slot for r in need], blocks, per, R // blocks)
            pad, at = pick < 0, np.maximum(pick, 0)
            packed = _device.prefill_rows(rows, np.where(pad, -1, starts[at]), np.where(pad, 0, counts[at]),
                                          np.where(pad[:, None], 0, ids[at]))

            def chunk_op(state, fn=prefill, packed=packed):
                state, logits["chunk"] = fn(self._tparams, self._dparams, state, packed)
                logits["packed"] = packed[:, :_device.PREFILL_FIELDS]  # (the activation compiles per rows, not tokens)
                return state

            self._ops.append(chunk_op)
            for r, c in zip(need, counts, strict=True):
                r.prefilled += int(c)
        ready = [r for r in batch if r.prefilled == self._end(r)]
        if ready:
            self._activate(ready, logits)

    @staticmethod
    def _new(r: _Request) -> bool:
        """Whether ``r`` has no token yet: its prefill takes its whole prompt and draws its first
        token there (``_device.activate_first``). A resumed request's context (prompt and tokens
        so far) is prefilled but its last token, the root of its next round."""
        return not r.out

    def _end(self, r: _Request) -> int:
        """The positions of ``r.tokens`` its prefill puts in the slot's caches."""
        return r.tokens.size - (0 if self._new(r) else 1)

    def _activate(self, reqs: list[_Request], logits: dict) -> None:
        R = self.slots  # one compiled activation whatever the number of newcomers (a cheap scatter)
        stop_ids = np.full((len(reqs), self.max_stop_ids), NO_STOP, np.int32)
        for i, r in enumerate(reqs):
            stop_ids[i, : len(r.stop_ids)] = r.stop_ids
        pad = lambda x: self._pad(np.asarray(x), R)
        sampling = SamplingBatch(*(pad(np.array([getattr(r.sampling, f) for r in reqs], dtype))
                                   for f, dtype in (("temperature", np.float32), ("top_k", np.int32),
                                                    ("top_p", np.float32), ("min_p", np.float32))),
                                 seed=pad(np.array([r.sampling.seed or 0 for r in reqs], np.uint32)),
                                 has_seed=pad(np.array([r.sampling.seed is not None for r in reqs], bool)))
        packed = _device.activation_rows(
            self._rows([r.slot for r in reqs], R), pad([-1 if self._new(r) else r.tokens[-1] for r in reqs]),
            pad(np.array([self._end(r) for r in reqs], np.int32)),
            pad(np.array([r.max_tokens - len(r.out) for r in reqs], np.int32)), pad(stop_ids), sampling,
            pad(np.array([r.handle.request_id for r in reqs], np.uint32)),
            pad(np.array([r.rounds_done for r in reqs], np.int32)))

        # New requests without log-probabilities get their first token as soon as it is drawn
        early = [r for r in reqs if self._new(r) and r.logprobs is None]
        found = concurrent.futures.Future() if early else None
        if early:
            self._early.append((early, found, self._launches))

        def activate(state, packed=packed):
            try:
                if "chunk" not in logits:  # resumed requests only (a new one's prompt ends in this step's chunk)
                    return _device.activate(state, packed)
                k = self.max_logprobs  # (launched in order: the rounds after it read the entries)
                state, entries = _device.activate_first(
                    state, packed, logits["packed"], logits["chunk"], self._base_key,
                    self._first_logprobs if k else None, backend=self.plan.backend, rows=self._row_mesh, k=k)
                if k:
                    self._first_logprobs = entries
                if found is not None:
                    found.set_result(_device.first_column(state))
                return state
            except BaseException as e:
                if found is not None and not found.done():
                    found.set_exception(e)
                raise

        self._ops.append(activate)
        if self.page_size is not None:
            for r in reqs:  # the context's full pages join the prefix cache
                table, n = self._tables[r.slot], self._end(r)
                table.commit(n, keep=self._cover(r, n))
                table.publish(r.tokens[:n])
        with self._lock:
            for r in reqs:
                r.running = True
                r.early = False
                self._admitted.remove(r)

    def _early_tokens(self) -> list[Emit]:
        """The first tokens of the requests whose activation the launcher has launched, read back:
        that waits for the device to run their prefill and activation, not for the rounds after
        them, so a first token goes out a dispatch earlier than the rounds' harvest would bring
        it. It never waits for the launcher (``step`` does, when it reads no round back), nor for
        dispatches launched before the activation that are not read back yet (read two steps late:
        the device runs them first; their read-back comes first): such a first token, and one whose
        activation is not launched yet, goes out from a later step, or with its harvest."""
        items = []
        while self._early and self._early[0][1].done():
            reqs, found, after = self._early[0]
            if self._reads < after and not found.result().is_ready():
                break
            self._early.popleft()
            column = np.asarray(self._fetch(found.result()))
            for r in reqs:
                if r.retired or r.out:  # (cancelled, or its harvest came first)
                    continue
                t = int(column[r.slot])
                r.out.append(t)
                r.early = True
                items.append(Emit(r, [t], [], None))
        return items

    def _prepare_rounds(self):
        """The host's decisions for the next dispatch, on the engine thread: the running slots, their
        pages (preempting if the pool runs short), the rounds of the dispatch and, with
        ``budget="auto"``, the budget. Returns ``(snapshot, auto budget index or None, rounds)``, or
        ``None`` when no slot is running."""
        with self._lock:
            snapshot = [r if r is not None and r.running and not r.retired else None for r in self._slot]
        if self.page_size is not None:
            self._ensure_pages(snapshot)
            self._sync_tables()
        if not any(snapshot):
            return None
        if all(r is None or self._ends_in_flight(i, r) for i, r in enumerate(snapshot)):
            return None  # (another dispatch would run rounds no one reads, ahead of the next prefill)
        rounds = self.dispatch_rounds[0]
        if self._sizer is not None:
            rounds = self._sizer.choose(sum(r is not None for r in snapshot))
        self.metrics.count("dispatches", str(rounds))
        if self.auto_plan is not None:
            costs = self._auto.costs(self.slots, self.auto_costs)
            k = self._auto.choose(sum(r is not None for r in snapshot), costs)
            if self._defer:
                if k > 0 or self._deferred_rounds + rounds > self._defer:
                    self._queue_flush()
                if k == 0:
                    self._deferred_rounds += rounds
            return snapshot, k, rounds
        return snapshot, None, rounds

    def _ends_in_flight(self, slot: int, r: _Request) -> bool:
        """Whether the dispatches in flight commit request ``r``'s last allowed token (in slot
        ``slot``) for sure: a running row commits at least one token a round, so a request with no
        more tokens left than its rounds in flight ends within them (a stop token cannot be
        foreseen; a first token not read back yet counts as left)."""
        flight = sum(n for _, snap, *_, n in self._inflight if snap is not None and snap[slot] is r)
        return r.max_tokens - len(r.out) <= flight

    def _run_ops(self) -> None:
        """Launch the queued programs on the state (``_ops``) on this thread, in order, once no
        launch is running."""
        self._settle()
        ops, self._ops = self._ops, []
        self._launch_rounds(ops, None)

    def _submit_launch(self, rounds) -> None:
        """Hand the step's queued programs (``_ops``) and, given ``_prepare_rounds``'s
        ``(snapshot, auto budget, rounds)``, its rounds to the launcher (in the engine thread with several
        processes); the launch joins ``_inflight`` (without rounds, with no snapshot: its read-back
        only waits for it)."""
        ops, self._ops = self._ops, []
        if rounds is None and not ops:
            return
        snapshot, auto_budget, n = rounds if rounds is not None else (None, None, 0)
        plan = None if rounds is None else self.plan if auto_budget is None else self._auto_plans[auto_budget]
        if self._launcher is not None:
            future = self._launcher.submit(self._launch_rounds, ops, plan, n)
        else:
            future = concurrent.futures.Future()
            future.set_result(self._launch_rounds(ops, plan, n))
        # (a dispatch with programs before its rounds does not time its rounds; a flush before
        # them is part of what its budget costs)
        self._inflight.append((future, snapshot, auto_budget, all(op == self._flush for op in ops), n))
        self._launches += 1

    def _launch_rounds(self, ops: list[Callable[[DecodeState], DecodeState]], plan: DecodePlan | None,
                       rounds: int = 1):
        """Launch ``ops`` on the state, in order, then (given ``plan``) ``rounds`` rounds of it,
        not waiting for any; returns the packed harvest on the device (``None`` without rounds),
        which ``_read_back`` copies once it is computed (starting the copy here, before the rounds
        ran, costs the launcher more host time than the small copy takes later: 0.17-0.24 ms per
        launch on an H200 host, docs/serving.md). Touches nothing but ``_state`` (and metrics
        counters), so that it can run beside ``_read_back`` and the emitter."""
        t0 = time.perf_counter()
        for op in ops:
            self._state = op(self._state)
        self.metrics.count("state_ops_seconds", n=time.perf_counter() - t0)
        if plan is None:
            return None
        self._state, packed = self._rounds(plan, self._state, rounds)
        self.metrics.count("launch_seconds", n=time.perf_counter() - t0)
        return packed

    def _read_back(self, launch: concurrent.futures.Future, snapshot: list[_Request | None] | None,
                   auto_budget: int | None = None, clean: bool = False, rounds: int = 1) -> list[Emit]:
        """Wait for a dispatch's launch and its harvest (one transfer) and turn it into emitter
        items; slots whose request ended on the device are freed on the host (on the device they
        no longer run: their finish code says why they ended until a new request's activation
        replaces it). ``auto_budget``: the index of the budget of a ``budget="auto"`` dispatch,
        whose tally (the harvest's last columns; at budget 0 ``auto_round.plain_tally`` of its rounds
        column) goes to the chooser and the metrics; when it and
        the dispatch read back before it were ``clean`` (rounds alone, one step apart), the time
        between their read-backs is what a round at its budget costs the engine, host work
        included (``AutoChooser.observe``), and with ``sync_every="auto"`` what a round costs at
        the dispatch's ``rounds`` and load (``DispatchSizer.observe``). A dispatch of programs
        without rounds (``snapshot`` None) only waits for its launch."""
        t0 = time.perf_counter()
        packed = launch.result()
        if packed is None:
            self._waited += time.perf_counter() - t0
            self._last_read = None
            return []
        got = np.asarray(self._fetch(packed))
        now = time.perf_counter()
        self._waited += now - t0
        if clean and self._last_read is not None:
            if auto_budget is not None:
                self._auto.observe(self.slots, auto_budget, (now - self._last_read) / rounds)
            if self._sizer is not None:
                self._sizer.observe(sum(r is not None for r in snapshot), rounds, (now - self._last_read) / rounds)
        self._last_read = now if clean else None
        n_new, n_rounds, finish = got[:, 0], got[:, 1], got[:, 2]
        T = rounds * self.tokens_per_round + 1  # (+ a new request's first token, from its activation)
        live = np.array([r is not None and not r.retired for r in snapshot])
        if auto_budget is not None:
            K = len(self.auto_plan.budgets)
            tally = (plain_tally(n_rounds, K) if auto_budget == 0 else
                     np.ascontiguousarray(got[:, -tally_width(K):]).view(np.float32))
            costs = self._auto.costs(self.slots, self.auto_costs)
            self.metrics.record_auto(self._auto.record(auto_budget, np.where(live[:, None], tally, 0.0)), costs)
        n_rounds = np.where(live, n_rounds, 0)
        self.metrics.count("rounds", n=int(n_rounds.sum()))
        accept = got[:, _device.HARVEST_FIELDS + T : _device.HARVEST_FIELDS + T + rounds]
        self.metrics.observe_many("accept", accept[np.arange(rounds)[None] < n_rounds[:, None]])
        items, done = [], []
        first = _device.HARVEST_FIELDS
        rows = got[:, : first + T + rounds].tolist()  # one conversion, then list slices
        for s in np.flatnonzero(live & ((n_new > 0) | (finish != RUNNING))).tolist():
            r, row = snapshot[s], rows[s]
            reason = None if row[2] == RUNNING else FINISH_REASONS[row[2]]
            tokens = row[first : first + row[0]]
            if r.early:  # (its first token went out from its activation)
                tokens, r.early = tokens[1:], False
            r.out += tokens
            r.rounds_done += row[1]
            items.append(Emit(r, tokens, row[first + T : first + T + row[1]], reason,
                              None if r.logprobs is None else self._logprobs(got[s], r, row[0], rounds)))
            if reason is not None:
                done.append(r)
        if done:
            if self.page_size is not None:
                for r in done:
                    self._release_pages(r, publish=True)
            with self._lock:
                for r in done:
                    r.retired = True
                    if self._slot[r.slot] is r:
                        self._slot[r.slot] = None
        return items

    def _logprobs(self, row: np.ndarray, r: _Request, n: int, rounds: int) -> TokenLogprobs:
        """The log-probabilities of a slot's ``n`` new tokens from its harvest row of a dispatch of
        ``rounds`` rounds (after the tokens and acceptance columns: ``_device.rounds_and_harvest``),
        for a request that asked (``r.logprobs`` set)."""
        K = self.max_logprobs
        start = _device.HARVEST_FIELDS + rounds * (self.tokens_per_round + 1) + 1
        block = row[start:].reshape(-1, 1 + 2 * K)[:n]
        return TokenLogprobs(block[:, 0].view(np.float32), block[:, 1 : 1 + r.logprobs],
                             block[:, 1 + K : 1 + K + r.logprobs].view(np.float32))

    # ------------------------------------------------------------------------------------ thread

    def start(self) -> Engine:
        """Step in a background thread while there is work (idle otherwise); with
        ``config.freeze_gc``, first take what is alive out of the garbage collector's scans."""
        if self._thread is None:
            if self.config.freeze_gc:
                gc.collect()
                gc.freeze()
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ddtree-engine", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._work.wait_for(lambda: self._stopping or bool(self._queue) or bool(self._inflight)
                                    or any(r is not None for r in self._slot))
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a failed device step fails the requests in it, not the engine
                log.exception("engine step failed")
                self._fail_all(f"error: engine step failed: {type(e).__name__}: {e}")

    def _fail_all(self, reason: str) -> None:
        self._settle()
        self._inflight.clear()
        self._ops = []
        self._early.clear()  # (a launch that failed before an activation never resolves its future)
        with self._lock:
            active = [r for r in self._slot if r is not None]
            self._slot = [None] * self.slots
            self._admitted.clear()
        for r in active:
            r.retired = True
        self._emitter.submit([Emit(r, [], [], reason) for r in active], time.perf_counter())
        if self.page_size is not None:
            for table in self._tables:
                if table.admitted is not None:
                    table.release_all()
            self._dirty.clear()
        self._state = self._empty_state()

    def set_emitter(self, emitter: Emitter) -> None:
        """Replace the emitter before ``start`` (``ddtree_jax.serving.engine_process`` gives the
        engine one that sends token ids to the front-end process, which detokenises)."""
        self._emitter = emitter

    def stop(self) -> None:
        """Stop the background thread; requests still queued or running finish with ``"abort"``
        (after every token already committed for them). Prefill shapes not compiled yet are
        compiled when next needed, no longer in the background (a running compilation is waited
        for)."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._prefill.close()
        self.drain()
        with self._lock:
            pending = list(self._queue) + [r for r in self._slot if r is not None and not r.retired]
            self._queue.clear()
        self._emitter.submit([Emit(r, [], [], "abort") for r in pending], time.perf_counter())

    def warmup(self) -> None:
        """Compile before serving: a round, the activation, the prefill of every power-of-two number
        of newcomers up to ``prefill_batch`` with the smallest prompt chunk, the largest prefill
        shape (which covers any other until that one has compiled in the background), the full
        chunk of one newcomer (a long prompt on its own would otherwise run its chunks on the
        largest shape, ``prefill_batch`` times the work, until its own compiles) and, before
        ``start``, the flush of budget 0's held-back context (``budget="auto"``), the dispatch of
        every size ``sync_every="auto"`` may choose (whose measurements then start afresh) and,
        paged, the page-table upload of every power-of-two number of slots."""
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
        blocks = self._row_blocks  # a full prefill batch spread over the devices' blocks
        self._prefill.warm(blocks * _pow2(-(-self.prefill_batch // blocks)), self.prefill_chunk)
        self._prefill.warm(blocks, self.prefill_chunk)  # one long prompt on its own: its full chunks
        if self._sizer is not None and self._thread is None:  # every dispatch size, on slots that do not run
            self._settle()
            for rounds in self.dispatch_rounds:
                jax.block_until_ready(self._launch_rounds([], self.plan, rounds))
            self._sizer = DispatchSizer(self.dispatch_rounds)  # (the warm-up's timings include compiling)
        if self._defer and self._thread is None:  # the flush of budget 0's held-back context
            self._ops.append(self._flush)
            self._run_ops()
        if self.page_size is not None and self._thread is None:  # page-table uploads of 1, 2, 4, ... slots
            R = 1
            while R <= self.slots:
                self._dirty.update(range(R))  # rewrites rows the device already holds
                self._sync_tables()
                self._run_ops()
                R *= 2
        self.metrics = self._new_metrics()  # the warm-up requests are not traffic
        self._emitter.metrics = self.metrics
