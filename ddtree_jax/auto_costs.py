"""The cost table of ``budget="auto"``: seconds per round at each budget, measured and cached.

``cost_key`` names what a round's cost depends on: the device kind, the models (a hash of their
configurations, execution settings and parameter shapes and dtypes), the decode backend, the
batch rows, the cache positions per row, the rounds per compiled call, the budget set and the JAX
version, and how the rounds were timed (``TIMING``). ``measure`` times the compiled rounds of
each budget (after one untimed call that compiles and warms them; repetitions interleaved across
budgets; the median), each repetition a burst of ``BURST`` calls launched back to back and waited
for at the end, as the runs launch them (a call ahead of the one read back), so that a call whose
launch overlaps the device is priced at the device's pace and one that holds the host pays for
it; the callers time them on running rows (a round's cost includes what committing costs) and put
the rows back before every call. ``measure_restart`` prices a pipeline restart: what a call of
budget 0 costs launched and waited for alone beyond its rounds in a burst (its launch and
read-back, which a call ahead hides); a run that then pays a restart (``generate``'s first probe
alone) stores what it observed (``CostTable.observe_restart``), which later runs decide with
(``auto_budget.restart_price``); a run that compacts its batch from the key's rows stores what
the compaction cost the host (``CostTable.observe_compaction``), which later runs weigh against
what a smaller batch saves (``generate``). ``CostTable`` keeps measured costs, both restarts and
the compaction in memory and, with a folder, one JSON file per key (``{"key": ..., "costs": [...],
"restart": s, "observed_restart": s, "observed_compaction": s}``), so a later process with the
same key loads them instead of timing again.
``default_table()`` keeps its files under the compilation cache folder
(``compilation_cache.resolve()``, ``auto_budget_costs/``; memory only when that cache is off).
Nothing here is specific to a device: every number comes from a measurement. Design note: docs/auto-budget.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import jax

from ddtree_jax import compilation_cache

__all__ = ["BURST", "FOLDER", "TIMING", "CostTable", "cost_key", "default_table", "measure", "measure_restart",
           "models_digest"]

FOLDER = "auto_budget_costs"

BURST = 4
"""``measure``: calls launched back to back per timed repetition."""

TIMING = f"bursts of {BURST} calls; budget 0 untallied; drafted rounds drafting their own depths"
"""How ``measure`` times and what (part of ``cost_key``: tables timed another way, or of rounds
compiled another way, are not reused)."""


def models_digest(target, drafter, params=None) -> str:
    """A hash of the models' configurations, execution settings and parameter shapes and dtypes.
    ``params``: the two modules' parameters already split (``decode_round.Models.split``'s
    ``(target params, drafter params)``), read instead of walking the modules again (the walk
    costs tens of milliseconds for a model of a few thousand nodes); the same digest."""
    from flax import nnx

    parts = []
    for i, model in enumerate((target, drafter)):
        if params is not None and params[i] is not None:
            leaves = list(params[i].leaves)
        else:
            leaves = jax.tree.leaves(nnx.state(model)) if isinstance(model, nnx.Module) else []
        parts.append(repr((getattr(model, "config", None), getattr(model, "execution", None),
                           [(tuple(x.shape), str(x.dtype)) for x in leaves])))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def cost_key(models: str, *, backend, rows: int, cache_len: int, per_call: int, budgets: tuple[int, ...]) -> dict:
    """What a round's cost depends on (module docstring), as a JSON-able dict; ``models``: the
    models' ``models_digest``; ``per_call``: rounds per compiled call."""
    return dict(device=jax.devices()[0].device_kind, devices=jax.device_count(), models=models,
                backend=repr(backend), rows=int(rows), cache_len=int(cache_len), per_call=int(per_call),
                budgets=[int(b) for b in budgets], jax=jax.__version__, timing=TIMING)


def measure(run: Callable[[int], object], count: int, reps: int = 3, per_call: int = 1,
            before: Callable[[], object] | None = None) -> tuple[float, ...]:
    """Seconds per round of ``run(k)`` (``per_call`` rounds) for ``k < count``: one untimed call
    each (compilation, warm-up), waited for, then ``reps`` timed bursts each, interleaved across
    ``k``: ``BURST`` calls launched back to back, waited for (``jax.block_until_ready``) after the
    last; the median per ``k`` over ``BURST * per_call``. ``before``, if given, runs before every
    call (waited for before a burst, launched in line within it): e.g. to put the rows back where
    the timing started."""

    def burst(k, calls):
        if before is not None:
            jax.block_until_ready(before())
        t0 = time.perf_counter()
        for i in range(calls):
            if i and before is not None:
                before()
            out = run(k)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    for k in range(count):
        burst(k, 1)
    times = [[] for _ in range(count)]
    for _ in range(reps):
        for k in range(count):
            times[k].append(burst(k, BURST))
    return tuple(statistics.median(t) / (BURST * per_call) for t in times)


def measure_restart(run: Callable[[int], object], cost: float, reps: int = 3, per_call: int = 1,
                    before: Callable[[], object] | None = None) -> float:
    """Seconds a call of ``run(0)`` (``per_call`` rounds of budget 0) costs launched and waited
    for alone beyond its rounds at ``cost`` seconds each (``measure``'s price, launched in a
    burst): after one untimed call (compilation, warm-up), the median over ``reps`` calls, at
    least 0. ``before`` as in ``measure`` (waited for before each call)."""
    times = []
    for i in range(reps + 1):
        if before is not None:
            jax.block_until_ready(before())
        t0 = time.perf_counter()
        jax.block_until_ready(run(0))
        if i:
            times.append(time.perf_counter() - t0)
    return max(0.0, statistics.median(times) - per_call * cost)


class CostTable:
    """Round costs by key, in memory and (with ``folder``) on disk (module docstring)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder
        self._memory: dict[str, tuple[float, ...]] = {}
        self._restart: dict[str, float] = {}
        self._observed: dict[str, float] = {}
        self._compaction: dict[str, float] = {}

    @staticmethod
    def digest(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def path(self, key: dict) -> str | None:
        """The file that holds ``key``'s costs (``None`` without a folder)."""
        return None if self.folder is None else os.path.join(self.folder, f"{self.digest(key)}.json")

    def get(self, key: dict) -> tuple[float, ...] | None:
        """The costs stored for ``key``, or ``None``; a file for another key (a hash collision)
        or with the wrong number of positive costs counts as none."""
        digest = self.digest(key)
        if digest in self._memory:
            return self._memory[digest]
        path = self.path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                got = json.load(f)
            costs = tuple(float(c) for c in got["costs"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if got.get("key") != json.loads(json.dumps(key)) or len(costs) != len(key["budgets"]) or \
                not all(c > 0 for c in costs):
            return None
        self._memory[digest] = costs
        for name, kept in (("restart", self._restart), ("observed_restart", self._observed),
                           ("observed_compaction", self._compaction)):
            value = got.get(name)
            if isinstance(value, (int, float)) and 0 <= value < float("inf"):
                kept[digest] = float(value)
        return costs

    def restart(self, key: dict) -> float | None:
        """The restart price stored for ``key`` (``measure_restart``), or ``None``."""
        return self._restart.get(self.digest(key)) if self.get(key) is not None else None

    def observed_restart(self, key: dict) -> float | None:
        """The restart a run observed for ``key`` (``observe_restart``), or ``None``."""
        return self._stored(self._observed, key)

    def observe_restart(self, key: dict, seconds: float) -> None:
        """Stores what a pipeline restart cost a run with ``key``'s stored costs (``_observe``)."""
        self._observe(self._observed, key, seconds)

    def observed_compaction(self, key: dict) -> float | None:
        """The host's seconds a run's compaction from ``key``'s rows cost (``observe_compaction``),
        or ``None``."""
        return self._stored(self._compaction, key)

    def observe_compaction(self, key: dict, seconds: float) -> None:
        """Stores what compacting a batch of ``key``'s rows cost the host (``_observe``)."""
        self._observe(self._compaction, key, seconds)

    def _stored(self, kept: dict[str, float], key: dict) -> float | None:
        """``key``'s entry of one of the observations ``kept``, or ``None`` (none for a key without
        costs)."""
        return kept.get(self.digest(key)) if self.get(key) is not None else None

    def _observe(self, kept: dict[str, float], key: dict, seconds: float) -> None:
        """Stores an observation of ``key``'s (seconds, >= 0: negative counts as 0; the latest
        replaces the one before) in ``kept``, in memory and, with a folder, on disk with the key's
        costs. Nothing is stored for a key without costs."""
        costs = self.get(key)
        if costs is not None:
            kept[self.digest(key)] = max(0.0, float(seconds))
            self.put(key, costs, self._restart.get(self.digest(key)))

    def put(self, key: dict, costs, restart: float | None = None) -> None:
        """Stores ``costs`` (one per budget of the key) and the ``restart`` price (if given) in
        memory and, with a folder, on disk (with the restart and the compaction observed for the
        key, if any)."""
        costs, digest = tuple(float(c) for c in costs), self.digest(key)
        self._memory[digest] = costs
        entry = dict(key=key, costs=list(costs))
        if restart is not None:
            self._restart[digest] = entry["restart"] = float(restart)
        if digest in self._observed:
            entry["observed_restart"] = self._observed[digest]
        if digest in self._compaction:
            entry["observed_compaction"] = self._compaction[digest]
        path = self.path(key)
        if path is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)

    def get_or_measure(self, key: dict, run: Callable[[int], object], reps: int = 3, per_call: int = 1,
                       before: Callable[[], object] | None = None, restart: bool = False) -> tuple[float, ...]:
        """The stored costs of ``key``, else ``measure(run, len(budgets), reps, per_call, before)``;
        with ``restart`` also the restart price, else ``measure_restart`` (a table stored without
        one gets it); what was measured is stored."""
        costs = self.get(key)
        if costs is not None and (not restart or self.restart(key) is not None):
            return costs
        if costs is None:
            costs = measure(run, len(key["budgets"]), reps, per_call, before)
        self.put(key, costs, measure_restart(run, costs[0], reps, per_call, before) if restart else None)
        return costs


_default: CostTable | None = None


def default_table() -> CostTable:
    """The process's table: files under the compilation cache folder (``DDTREE_JAX_COMPILATION_CACHE``
    or its default; memory only when that is ``off``)."""
    global _default
    if _default is None:
        root = compilation_cache.resolve()
        _default = CostTable(None if root is None else os.path.join(root, FOLDER))
    return _default
