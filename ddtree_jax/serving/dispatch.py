"""How many rounds one engine dispatch runs (``sync_every="auto"``): ``DispatchSizer``.

A dispatch's launch is host work whose cost hardly depends on how many rounds it holds, while the
rounds' device time grows with them. When a round's launch costs more than the round (a small
model at a large batch: the launch runs beside the read-back and the streaming, and shares the
interpreter with them), the device idles between dispatches and more rounds per dispatch buy
throughput; when the device is the bottleneck they only delay every token by the rounds before
it in its dispatch. The sizer measures instead of guessing: it keeps, per load bucket (the number
of running slots rounded up to a power of two) and per candidate size, the median of the last
``WINDOW`` observations of the engine's wall time per round (the time between two clean
read-backs over the rounds of the later dispatch: a median, because one step held up by the
interpreter's thread switch or a collection is several times the others), tries each candidate
in turn until each has ``MIN_OBS`` observations, and then runs the SMALLEST size whose time per
round is within ``TOLERANCE`` of the best: throughput where more rounds per dispatch pay, latency
where they do not. Every ``REPROBE`` dispatches of a bucket its chosen size's neighbours are
measured ``REPROBE_OBS`` times again (the costs move with the load and the host's other work).
Only a dispatch of rounds alone, read back one step after the last such one, is an observation;
under serving traffic most steps also prefill, admit or release, so a size being measured would
run for as long as its observations take to come: a size is tried at most ``PATIENCE`` times per
observation it still needs, then left with what it has (a size with no observation is never
chosen) until the next re-measurement.
docs/serving.md gives the measurements behind the rule.
"""

from __future__ import annotations

import collections
import statistics

__all__ = ["DispatchSizer", "ROUNDS"]

ROUNDS = (1, 2, 4)  # the candidate rounds per dispatch
TOLERANCE = 0.10  # a larger size must be this much faster per round to be chosen
MIN_OBS = 3  # observations of a size before it is trusted
WINDOW = 5  # the observations a cost is the median of
REPROBE = 64  # dispatches of a bucket between re-measurements of the chosen size's neighbours
REPROBE_OBS = 2  # fresh observations of each neighbour then
PATIENCE = 3  # dispatches of a size being measured per observation it needs, at most


def _bucket(running: int) -> int:
    return 1 << max(running - 1, 0).bit_length()


class DispatchSizer:
    """Chooses the rounds of each dispatch from ``rounds`` (ascending, distinct, >= 1) by the
    measured wall time per round at the dispatch's load (module docstring). Host-only, not
    thread-safe (the engine thread alone calls it)."""

    def __init__(self, rounds: tuple[int, ...] = ROUNDS, *, tolerance: float = TOLERANCE, min_obs: int = MIN_OBS,
                 window: int = WINDOW, reprobe: int = REPROBE, reprobe_obs: int = REPROBE_OBS,
                 patience: int = PATIENCE):
        rounds = tuple(rounds)
        if not rounds or list(rounds) != sorted(set(rounds)) or rounds[0] < 1:
            raise ValueError(f"DispatchSizer: rounds must be ascending distinct integers >= 1, got {rounds!r}")
        if (tolerance < 0 or not 1 <= min_obs <= window or reprobe < 1 or not 1 <= reprobe_obs <= min_obs
                or patience < 1):
            raise ValueError("DispatchSizer: tolerance >= 0, 1 <= min_obs <= window, reprobe >= 1, "
                             "1 <= reprobe_obs <= min_obs and patience >= 1")
        self.rounds, self.tolerance, self.min_obs, self.reprobe = rounds, tolerance, min_obs, reprobe
        self.window, self.reprobe_obs, self.patience = window, reprobe_obs, patience
        self._obs: dict[tuple[int, int], collections.deque] = {}  # (bucket, rounds) -> seconds per round
        self._seen: dict[tuple[int, int], int] = {}  # (bucket, rounds) -> observations since last (re)probe
        self._since: dict[int, int] = {}  # bucket -> dispatches chosen since its last re-probe
        self._tries: dict[tuple[int, int], int] = {}  # (bucket, rounds) -> tries left to measure it

    def choose(self, running: int) -> int:
        """The rounds of the next dispatch, given how many slots run in it (>= 1)."""
        b = _bucket(running)
        for k in self.rounds:  # first measure every size at this load (with bounded patience)
            need = self.min_obs - self._seen.get((b, k), 0)
            if need > 0:
                left = self._tries.setdefault((b, k), self.patience * need)
                if left > 0:
                    self._tries[(b, k)] = left - 1
                    return k
        best = self.best(running)
        self._since[b] = self._since.get(b, 0) + 1
        if self._since[b] >= self.reprobe:  # re-measure the neighbours
            self._since[b] = 0
            i = self.rounds.index(best)
            for j in (i - 1, i + 1):
                if 0 <= j < len(self.rounds):
                    self._seen[(b, self.rounds[j])] = self.min_obs - self.reprobe_obs
                    self._tries.pop((b, self.rounds[j]), None)
        return best

    def best(self, running: int) -> int:
        """The smallest size within ``tolerance`` of the cheapest per round among those measured
        at this load (the largest size before any is)."""
        known = self.costs(running)
        if not known:
            return self.rounds[-1]
        floor = min(known.values())
        return min(k for k, c in known.items() if c <= floor * (1 + self.tolerance))

    def observe(self, running: int, rounds: int, seconds_per_round: float) -> None:
        """Adds the engine's wall time per round of a dispatch of ``rounds`` rounds with
        ``running`` slots running."""
        if rounds not in self.rounds or not seconds_per_round > 0:
            return
        key = (_bucket(running), rounds)
        self._obs.setdefault(key, collections.deque(maxlen=self.window)).append(seconds_per_round)
        self._seen[key] = self._seen.get(key, 0) + 1

    def costs(self, running: int) -> dict[int, float]:
        """The measured seconds per round at this load, per size (for metrics and tests)."""
        b = _bucket(running)
        return {k: statistics.median(self._obs[(b, k)]) for k in self.rounds if (b, k) in self._obs}
