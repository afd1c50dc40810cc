"""Training data every machine has: the Python standard library of the running interpreter.

``list_stdlib`` lists its ``.py`` files (sorted paths relative to ``sysconfig``'s ``stdlib`` dir;
test suites, ``site-packages`` and caches left out) and ``stdlib_manifest`` records what was used:
the Python version, the file count and a sha256 over the paths and contents, so a run on another
machine can tell whether it saw the same data. ``is_heldout`` splits by file with a hash of the
path (stable across machines and versions: a file keeps its side of the split). ``TokenWindows``
serves training batches in a deterministic order that is a function of the step alone, so a run
resumed at step ``s`` sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import sysconfig

import numpy as np

__all__ = ["TokenWindows", "heldout_windows", "is_heldout", "list_stdlib", "read_source", "stdlib_manifest",
           "stdlib_root"]

# Folders whose files are test suites, third-party packages or caches, not the library's own code.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib(root: str | None = None) -> list[str]:
    """Sorted ``/``-separated paths, relative to ``root`` (default: this interpreter's stdlib),
    of its ``.py`` files outside test suites, ``site-packages`` and ``__pycache__``."""
    root = root or stdlib_root()
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("test_")]
        rel = os.path.relpath(folder, root)
        for f in files:
            if f.endswith(".py") and not f.startswith("test_"):
                paths.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(paths)


def read_source(root: str, path: str) -> str:
    """The file's text (UTF-8; undecodable bytes replaced, so every machine reads the same text)."""
    with open(os.path.join(root, path), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def is_heldout(path: str, fraction: float) -> bool:
    """Whether ``path`` is in the held-out split: its sha256 read as a number in [0, 1) below ``fraction``."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def stdlib_manifest(paths: list[str], root: str | None = None) -> dict:
    """What the data is: interpreter version, root, file count, bytes and a sha256 over every
    path and its contents (in list order)."""
    root = root or stdlib_root()
    digest, size = hashlib.sha256(), 0
    for p in paths:
        with open(os.path.join(root, p), "rb") as f:
            data = f.read()
        digest.update(p.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        size += len(data)
    return dict(python=platform.python_version(), implementation=sys.implementation.name, root=root,
                files=len(paths), bytes=size, sha256=digest.hexdigest())


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Non-overlapping windows of ``length`` tokens of ``stream``, reshuffled each epoch.

    Epoch ``e`` shifts the window grid by an offset and permutes the windows, both drawn from
    ``default_rng([seed, e])``; step ``s`` takes the ``s``-th slice of ``batch`` windows of that
    order. Everything depends on ``(seed, s)`` only: no iterator state to save.
    """

    stream: np.ndarray
    length: int
    batch: int
    seed: int = 0

    def __post_init__(self):
        if len(self.stream) < (self.batch + 1) * self.length:
            raise ValueError(f"the stream ({len(self.stream)} tokens) holds fewer than batch + 1 = {self.batch + 1} "
                             f"windows of {self.length} tokens")

    @property
    def steps_per_epoch(self) -> int:
        return (len(self.stream) // self.length - 1) // self.batch

    def position(self, step: int) -> dict:
        return dict(step=step, epoch=step // self.steps_per_epoch, batch_in_epoch=step % self.steps_per_epoch)

    def batch_at(self, step: int) -> np.ndarray:
        """``int32 [batch, length]``: the windows of training step ``step`` (0-based)."""
        epoch, j = divmod(step, self.steps_per_epoch)
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(0, self.length))
        n = (len(self.stream) - offset) // self.length
        order = rng.permutation(n)[j * self.batch : (j + 1) * self.batch]
        starts = offset + order * self.length
        return np.stack([self.stream[s : s + self.length] for s in starts]).astype(np.int32)


def heldout_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """``int32 [<=count, length]``: the first ``count`` non-overlapping windows of the held-out stream,
    spread evenly over it (a fixed evaluation set)."""
    n = len(stream) // length
    if n == 0:
        raise ValueError(f"the held-out stream ({len(stream)} tokens) is shorter than one window of {length}")
    picks = np.unique(np.linspace(0, n - 1, min(count, n)).astype(int))
    return np.stack([stream[i * length : (i + 1) * length] for i in picks]).astype(np.int32)
