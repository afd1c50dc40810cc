"""Engine metrics: counters, gauges and histograms kept by the engine, read by the server.

Plain Python and numpy: the HTTP server turns a ``snapshot()`` into the prometheus text
format (``ddtree_jax.serving.server``). Histograms have fixed bucket bounds (cumulative counts as
prometheus expects), a sum and a count.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
import time

import numpy as np

__all__ = ["EngineMetrics", "Histogram"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACCEPT_BUCKETS = tuple(float(x) for x in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32))


@dataclasses.dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)  # per bucket (not cumulative), + one for +Inf
    total: float = 0.0
    count: int = 0
    _edges: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self._edges = np.asarray(self.bounds, np.float64)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.count)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n
        self.count += n

    def observe_many(self, values, counts=None) -> None:
        """Observe every value of ``values`` (a numpy array), each ``counts`` times (default once)."""
        values = np.asarray(values, np.float64).ravel()
        if not values.size:
            return
        weights = None if counts is None else np.asarray(counts, np.int64).ravel()
        per_bucket = np.bincount(np.searchsorted(self._edges, values, side="left"), weights,
                                 minlength=len(self.counts)).tolist()
        self.counts = [c + int(n) for c, n in zip(self.counts, per_bucket, strict=True)]
        if weights is None:
            self.total += float(values.sum())
            self.count += values.size
        else:
            self.total += float(values @ weights)
            self.count += int(weights.sum())

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, ``+Inf`` last."""
        out, run = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            run += c
            out.append((bound, run))
        return out

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


class EngineMetrics:
    """Thread-safe metrics of one engine (the engine thread writes, anyone reads a snapshot)."""

    def __init__(self, slots: int, rate_window_s: float = 10.0, auto_budgets: tuple[int, ...] = ()):
        self._lock = threading.Lock()
        self.slots = slots
        # budget="auto": per budget of the set, request-batch rounds run at it and the running
        # rows' expected (draft path probabilities) and realized (accepted) tokens in them
        self.auto_budgets = tuple(auto_budgets)
        self.budget_rounds = [0] * len(self.auto_budgets)
        self.budget_expected = [0.0] * len(self.auto_budgets)
        self.budget_realized = [0.0] * len(self.auto_budgets)
        self.budget_costs: list[float] = []  # seconds per round the choice uses now (RunCosts)
        self.queue_length = 0
        self.running = 0
        self.prefilling = 0
        self.requests = collections.Counter()  # finished requests by finish reason
        self.rejected = collections.Counter()  # refused at submission: "invalid" / "overloaded"
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.rounds = 0  # request-rounds (one request running one round)
        self.engine_steps = 0
        self.dispatches = collections.Counter()  # dispatches of rounds by their rounds ("1", "2", "4", ...)
        self.host_seconds = 0.0  # engine-thread time in steps, not counting waits for the device
        self.wait_seconds = 0.0  # engine-thread time blocked reading rounds back from the device
        self.prefill_seconds = 0.0  # engine-thread time preparing prefill steps (their launches: launch_seconds)
        self.launch_seconds = 0.0  # launcher time launching the step's programs (beside the read-back)
        self.state_ops_seconds = 0.0  # of launch_seconds: the programs before the rounds (prefill, activation, ...)
        self.emit_seconds = 0.0  # engine-thread time in the emitter (text, stop strings, chunks)
        self.preemptions = 0  # paged caches: requests preempted for pages (each resumes later)
        self.kv_pages: dict | None = None  # paged caches: the page pool's counts (PagePool.stats)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)  # submission to a slot
        self.prefill_time = Histogram(LATENCY_BUCKETS)  # a slot to the first token
        self.itl = Histogram(LATENCY_BUCKETS)
        self.accept = Histogram(ACCEPT_BUCKETS)
        self._window = rate_window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def set_load(self, queue_length: int, running: int, prefilling: int) -> None:
        with self._lock:
            self.queue_length, self.running, self.prefilling = queue_length, running, prefilling

    def set_pages(self, stats: dict) -> None:
        with self._lock:
            self.kv_pages = dict(stats)

    def tokens(self, n: int, now: float) -> None:
        with self._lock:
            self.generated_tokens += n
            self._recent.append((now, n))

    def record_step(self, tokens: int, now: float, ttft, itl_values, itl_counts, prefill=()) -> None:
        """One engine step's streamed tokens and latencies: ``ttft`` and ``prefill`` (a slot to the
        first token) values, and ``itl_values`` each observed ``itl_counts`` times (one lock
        acquisition for the step)."""
        with self._lock:
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            if ttft:
                self.ttft.observe_many(ttft)
            if prefill:
                self.prefill_time.observe_many(prefill)
            if itl_values:
                self.itl.observe_many(itl_values, itl_counts)

    def observe(self, name: str, value: float, n: int = 1) -> None:
        with self._lock:
            getattr(self, name).observe(value, n)

    def observe_many(self, name: str, values) -> None:
        with self._lock:
            getattr(self, name).observe_many(values)

    def record_auto(self, report, costs) -> None:
        """Adds ``budget="auto"`` rounds: ``report [3, K]`` = rounds, expected tokens and realized
        tokens at each budget (``auto_budget.AutoChooser.record``); ``costs``: the seconds per
        round at each budget the choice uses now."""
        rounds, expected, realized = np.asarray(report, np.float64).tolist()
        with self._lock:
            self.budget_costs = [float(c) for c in costs]
            for i in range(len(self.auto_budgets)):
                self.budget_rounds[i] += int(rounds[i])
                self.budget_expected[i] += expected[i]
                self.budget_realized[i] += realized[i]

    def count(self, field: str, key: str | None = None, n: int = 1) -> None:
        with self._lock:
            if key is None:
                setattr(self, field, getattr(self, field) + n)
            else:
                getattr(self, field)[key] += n

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window

    def snapshot(self) -> dict:
        tps = self.tokens_per_second()
        with self._lock:
            return dict(
                slots=self.slots, queue_length=self.queue_length, running=self.running, prefilling=self.prefilling,
                free_slots=self.slots - self.running - self.prefilling, requests=dict(self.requests),
                rejected=dict(self.rejected), prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens, rounds=self.rounds, engine_steps=self.engine_steps,
                dispatches=dict(self.dispatches),
                host_seconds=self.host_seconds, wait_seconds=self.wait_seconds, prefill_seconds=self.prefill_seconds,
                launch_seconds=self.launch_seconds, state_ops_seconds=self.state_ops_seconds,
                emit_seconds=self.emit_seconds, preemptions=self.preemptions,
                kv_pages=None if self.kv_pages is None else dict(self.kv_pages),
                tokens_per_second=tps, mean_acceptance_length=self.accept.mean,
                ttft=self.ttft.copy(), queue_time=self.queue_time.copy(), prefill_time=self.prefill_time.copy(),
                itl=self.itl.copy(), accept=self.accept.copy(),
                auto_budget=None if not self.auto_budgets else dict(
                    budgets=list(self.auto_budgets), rounds=list(self.budget_rounds),
                    expected_tokens=list(self.budget_expected), realized_tokens=list(self.budget_realized),
                    seconds_per_round=list(self.budget_costs)),
            )
