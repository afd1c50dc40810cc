"""``ShapeCache``: the compiled prefill executables of an engine, one per ``(rows, tokens)`` shape,
so that a shape seen for the first time does not stall the running streams.

The engine's prefill takes ``[R, T]`` chunks with ``R`` and ``T`` powers of two; every new pair
would compile on first use (seconds on a GPU, during which no round runs). Here a call for a shape
that is not compiled yet runs on the smallest compiled shape that covers it (more rows repeat the
first row with identical data, more tokens are right padding: the result is the same), and the
exact shape compiles in a background thread, to be used from then on. Only when no compiled shape
covers the call does it compile in the caller (the first calls before ``warm``).

With several processes (``jax.distributed``) every process must run the same executables in the
same order, which background compilation (finishing at different times per process) would break:
``background=False`` compiles every new shape in the caller instead.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("ddtree_jax.serving")

__all__ = ["ShapeCache"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, let each background thread finish the compilation it is in (a thread still inside
    the compiler while the interpreter shuts down aborts the process) and start no other."""
    for cache in list(_LIVE):
        cache.close()


class ShapeCache:
    """Compiled executables keyed by ``(rows, tokens)``.

    Args:
      compile_shape: ``(rows, tokens) -> executable`` (e.g. ``jit(f).lower(<avals>).compile()``);
        called in the caller's thread or in the background thread.
      background: compile missing shapes in a background thread (else in the caller).
    """

    def __init__(self, compile_shape: Callable[[int, int], Callable], *, background: bool = True):
        self._compile_shape = compile_shape
        self._background = background
        self._lock = threading.Lock()
        self._ready: dict[tuple[int, int], Callable] = {}
        self._pending: set[tuple[int, int]] = set()
        self._jobs: queue.SimpleQueue | None = None
        self._idle = threading.Event()  # set while the background thread is not compiling
        self._idle.set()
        self._closed = False
        self.compile_seconds = 0.0  # total, both threads
        _LIVE.add(self)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The compiled shapes."""
        with self._lock:
            return sorted(self._ready)

    def warm(self, rows: int, tokens: int) -> None:
        """Compile ``(rows, tokens)`` now (in the caller) unless it is compiled."""
        with self._lock:
            if (rows, tokens) in self._ready:
                return
        self._store((rows, tokens), self._compile((rows, tokens)))

    def get(self, rows: int, tokens: int) -> tuple[int, int, Callable]:
        """``(rows', tokens', executable)`` to run a ``[rows, tokens]`` call: the exact shape when
        compiled, else the smallest compiled cover (``rows' >= rows``, ``tokens' >= tokens``) while
        the exact one compiles in the background, else the exact shape compiled now."""
        key = (rows, tokens)
        with self._lock:
            if key in self._ready:
                return rows, tokens, self._ready[key]
            covers = [k for k in self._ready if k[0] >= rows and k[1] >= tokens]
            if self._background and covers:
                best = min(covers, key=lambda k: (k[0] * k[1], k))
                if key not in self._pending:
                    self._pending.add(key)
                    self._submit(key)
                return best[0], best[1], self._ready[best]
        self._store(key, self._compile(key))
        with self._lock:
            return rows, tokens, self._ready[key]

    def _compile(self, key: tuple[int, int]) -> Callable:
        t0 = time.perf_counter()
        fn = self._compile_shape(*key)
        seconds = time.perf_counter() - t0
        with self._lock:
            self.compile_seconds += seconds
        log.info("compiled prefill shape %s in %.2f s", key, seconds)
        return fn

    def _store(self, key: tuple[int, int], fn: Callable) -> None:
        with self._lock:
            self._ready.setdefault(key, fn)
            self._pending.discard(key)

    def _submit(self, key: tuple[int, int]) -> None:  # holds the lock
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(self._jobs,), name="ddtree-compile", daemon=True).start()
        self._jobs.put(key)

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            key = jobs.get()
            with self._lock:
                if self._closed:
                    return
                self._idle.clear()
            try:
                self._store(key, self._compile(key))
            except Exception:  # the cover keeps serving this shape; the next miss retries
                log.exception("background compilation of prefill shape %s failed", key)
                with self._lock:
                    self._pending.discard(key)
            finally:
                self._idle.set()

    def close(self, timeout: float = 120.0) -> None:
        """Start no more background compilations; wait (up to ``timeout`` s) for the running one."""
        with self._lock:
            self._closed = True
            self._background = False
        self._idle.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no background compilation is pending (tests); returns whether none is."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.perf_counter() > deadline:
                return False
            time.sleep(0.01)
