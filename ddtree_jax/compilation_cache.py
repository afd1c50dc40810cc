"""JAX's persistent compilation cache for the command line and the examples, and a compile watch.

``enable(path)`` turns on JAX's on-disk cache of compiled programs, so a second process that runs
the same programs loads them instead of compiling them again (on a 2-core CPU that is most of a
first run's start-up). The folder comes from, in order: the ``--compilation-cache`` flag, the
``DDTREE_JAX_COMPILATION_CACHE`` environment variable, or ``$XDG_CACHE_HOME/ddtree_jax/jax_cache``
(``~/.cache/ddtree_jax/jax_cache`` without ``XDG_CACHE_HOME``); ``off`` (or an empty value)
disables it. Only the command line and ``examples/`` turn it on: importing ``ddtree_jax`` changes
no JAX setting.

``CompileWatch`` counts, while it is active, the seconds JAX spends tracing, lowering and compiling
(or loading compiled programs from the cache) and how many programs came from the persistent
cache, through ``jax.monitoring`` events; it can announce compilations that take more than a few
seconds while they run, so long compiles are not silent.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["ENV_VAR", "CompileWatch", "default_dir", "enable", "resolve"]

ENV_VAR = "DDTREE_JAX_COMPILATION_CACHE"
_OFF = ("", "off", "none", "0", "false")

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_explained = False  # whether an announcement has said what the persistent cache does


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddtree_jax", "jax_cache")


def resolve(flag: str | None = None) -> str | None:
    """The cache folder to use (``None``: disabled): the flag, else the environment, else the default."""
    value = flag if flag is not None else os.environ.get(ENV_VAR)
    if value is None:
        return default_dir()
    if value.strip().lower() in _OFF:
        return None
    return os.path.abspath(os.path.expanduser(value))


def enable(path: str | None) -> str | None:
    """Points JAX's persistent compilation cache at ``path`` (``None``: leaves it off). Call before
    the first compilation. Every program is cached, however small or quick to compile: on a CPU
    the many small programs add up. Returns ``path``."""
    if path is None:
        return None
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class CompileWatch:
    """Context manager: compile seconds and persistent-cache hits while active (see module doc).

    Attributes (read after or during the ``with`` block):
      seconds: wall seconds inside tracing, lowering or backend compilation (overlaps counted once;
        a backend "compilation" served by the persistent cache counts its loading time).
      compiles: backend compilations requested (each a program not yet compiled in this process).
      cache_hits: how many of those were loaded from the persistent cache instead of compiled.

    With ``log`` and ``announce_after`` seconds, a compilation still running after that long is
    announced (``compiling <name> ...``) and its end reported, so long compiles are not silent.
    """

    def __init__(self, log: Callable[[str], None] | None = None, announce_after: float = 3.0, prefix: str = ""):
        self.log, self.announce_after, self.prefix = log, announce_after, prefix
        self.compiles = 0
        self.cache_hits = 0
        self._spans: list[tuple[float, float]] = []
        self._timers: dict[str, threading.Timer] = {}
        self._announced: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(self._spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def summary(self) -> str:
        """What the watched time includes, e.g. ``"incl. 12.3s compiling 4 programs (none were in the
        persistent cache)"`` or ``"incl. 2.1s tracing 4 programs and loading them compiled from the
        persistent cache"``."""
        n, hits, sec = self.compiles, self.cache_hits, self.seconds
        if not n:
            return "no compilation: every program was already compiled in this process"
        if hits == n:
            return f"incl. {sec:.1f}s tracing {n} programs and loading them compiled from the persistent cache"
        if hits:
            return f"incl. {sec:.1f}s compiling {n - hits} programs and loading {hits} from the persistent cache"
        why = "none were in the persistent cache" if _cache_on() else "persistent cache off"
        return f"incl. {sec:.1f}s compiling {n} programs ({why})"

    def code(self) -> str:
        """Where the programs came from, in a few words."""
        n, hits = self.compiles, self.cache_hits
        if not n:
            return "already compiled"
        if hits == n:
            return "from the cache"
        return f"{hits}/{n} from the cache" if hits else "compiled now"

    # -- jax.monitoring listeners --

    def _on_span(self, event, start, end, **kwargs):
        if event in (_TRACE, _LOWER, _COMPILE):
            with self._lock:
                self._spans.append((start, end))
            if event == _COMPILE:
                self.compiles += 1
                self._finish(kwargs.get("fun_name", "?"), end - start)

    def _on_event(self, event, **kwargs):
        if event == _HIT:
            self.cache_hits += 1

    def _on_scalar(self, event, value, **kwargs):
        # Recorded when a backend compilation starts (value: its start time).
        if event == _COMPILE and self.log is not None:
            name = kwargs.get("fun_name", "?")
            timer = threading.Timer(self.announce_after, self._announce, (name,))
            timer.daemon = True
            with self._lock:
                old = self._timers.pop(name, None)
                self._timers[name] = timer
            if old is not None:
                old.cancel()
            timer.start()

    def _announce(self, name):
        with self._lock:
            if self._timers.pop(name, None) is None:
                return
            self._announced[name] = time.time()
        global _explained
        where = ""
        if not _explained:  # said once per process
            where = (" (not in the persistent cache yet; written there for later runs)" if _cache_on()
                     else " (persistent compilation cache off)")
            _explained = True
        self.log(f"{self.prefix}compiling {name}{where} ...")

    def _finish(self, name, seconds):
        with self._lock:
            timer = self._timers.pop(name, None)
            announced = self._announced.pop(name, None)
        if timer is not None:
            timer.cancel()
        if announced is not None and self.log is not None:
            self.log(f"{self.prefix}compiled {name} in {seconds:.1f}s")

    def __enter__(self):
        import jax.monitoring as mon

        mon.register_event_time_span_listener(self._on_span)
        mon.register_event_listener(self._on_event)
        mon.register_scalar_listener(self._on_scalar)
        return self

    def __exit__(self, *exc):
        import jax.monitoring as mon

        mon.unregister_event_time_span_listener(self._on_span)
        mon.unregister_event_listener(self._on_event)
        mon.unregister_scalar_listener(self._on_scalar)
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for t in timers:
            t.cancel()
        return False


def _cache_on() -> bool:
    import jax

    return bool(jax.config.jax_compilation_cache_dir)
