"""What one stage command works in: its run folder, its wall-clock budget, its compilation cache.

``RunFolder`` reads stage 1's records (``data.json``, token streams) and appends a stage's log
lines; ``Clock`` tells a command when to stop so that it ends before its ``--minutes``;
``enable_compilation_cache`` lets a resumed command load its compiled steps from disk.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

__all__ = ["Clock", "RunFolder", "enable_compilation_cache"]


def enable_compilation_cache(flag: str | None) -> None:
    """JAX's persistent cache (``ddtree_jax.compilation_cache``): a resumed stage loads its compiled steps."""
    from ddtree_jax import compilation_cache

    path = compilation_cache.enable(compilation_cache.resolve(flag))
    print(f"[training] compilation cache: {path or 'off'}")


class Clock:
    """Wall-clock budget of one command: ``should_stop(next_cost)`` once ``next_cost`` seconds more
    would pass the limit of ``minutes`` less a reserve (for the final evaluation and save)."""

    def __init__(self, minutes: float, reserve_s: float):
        self.minutes = minutes
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + minutes * 60.0 - reserve_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def should_stop(self, next_cost: float = 0.0) -> bool:
        return time.perf_counter() + next_cost > self.deadline


class RunFolder:
    """The run folder of the stages: data.json, tokenizer.json and token streams from stage 1."""

    def __init__(self, path: str):
        self.path = path
        data = os.path.join(path, "data.json")
        if not os.path.isfile(data):
            raise SystemExit(f"{path}: no data.json; run `python -m ddtree_jax.training.tokenizer --out {path}` first")
        with open(data) as f:
            self.data = json.load(f)

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.file(f"{split}_tokens.npy")).astype(np.int32)

    @property
    def vocab_size(self) -> int:
        return self.data["tokenizer"]["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.data["tokenizer"]["eos_id"]

    @property
    def mask_id(self) -> int:
        return self.data["tokenizer"]["mask_id"]

    def log_line(self, name: str, record: dict) -> None:
        with open(self.file(f"{name}_log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
