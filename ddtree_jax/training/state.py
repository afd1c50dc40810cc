"""Resumable training state on disk: every variable of a model and its optimizer, plus a JSON record.

``save_state(folder, trees, info)`` writes ``state.json`` (``info``: step, data position, config,
log) and the arrays of each named pytree (e.g. ``{"model": nnx.state(model), "opt":
nnx.state(opt)}``) as safetensors shards below ``max_shard_bytes`` (default 15 MiB, under the
GPU machine's 16 MiB limit on files brought back). It writes a sibling folder first and swaps it
in, so a run killed mid-save keeps its previous state. ``load_state`` fills trees of the same
structure (built fresh from the same config) by name.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np

__all__ = ["MAX_SHARD_BYTES", "load_state", "read_info", "save_state"]

MAX_SHARD_BYTES = 15 * 2**20


def _flat(tree) -> dict[str, jax.Array]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def save_state(folder: str, trees: dict, info: dict, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    from safetensors.numpy import save_file

    tmp, old = folder + ".tmp", folder + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    arrays = {f"{name}/{key}": np.asarray(v) for name, tree in trees.items() for key, v in _flat(tree).items()}
    shards, size = [{}], 0
    for key, a in arrays.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        if a.nbytes > max_shard_bytes:
            raise ValueError(f"{key}: {a.nbytes} bytes, more than max_shard_bytes={max_shard_bytes}")
        shards[-1][key] = np.array(a, order="C")  # (np.ascontiguousarray would make scalars 1-d)
        size += a.nbytes
    files = []
    for i, shard in enumerate(shards):
        name = f"state-{i + 1:03d}-of-{len(shards):03d}.safetensors"
        save_file(shard, os.path.join(tmp, name))
        files.append(name)
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({**info, "files": files}, f, indent=2)
    if os.path.exists(folder):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def read_info(folder: str) -> dict | None:
    """``state.json`` of the state in ``folder``, or None if there is none."""
    path = os.path.join(folder, "state.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_state(folder: str, trees: dict) -> tuple[dict, dict]:
    """``(trees with every leaf read from folder, info)``; the trees give structure, shapes and dtypes."""
    from safetensors.numpy import load_file

    info = read_info(folder)
    if info is None:
        raise FileNotFoundError(f"no state.json in {folder}")
    arrays = {}
    for name in info["files"]:
        arrays.update(load_file(os.path.join(folder, name)))
    out = {}
    for name, tree in trees.items():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        new = []
        for path, leaf in leaves:
            key = f"{name}/{jax.tree_util.keystr(path)}"
            if key not in arrays:
                raise KeyError(f"{folder}: the saved state has no {key!r} (different config?)")
            a = arrays.pop(key)
            if a.shape != tuple(np.shape(leaf)):
                raise ValueError(f"{folder}: {key!r} has shape {a.shape}, expected {np.shape(leaf)}")
            new.append(jax.numpy.asarray(a, dtype=getattr(leaf, "dtype", None)))
        out[name] = jax.tree_util.tree_unflatten(treedef, new)
    return out, info
