"""Stage 4: the shippable pair. ``python -m ddtree_jax.training.export --out RUN --dest DIR [--pack PARTS_DIR]``

Reads ``RUN/target_best`` and ``RUN/drafter_best`` (float32), writes ``DIR/target`` and
``DIR/drafter`` as HF checkpoints in bfloat16 (the MoE routers stay float32, as the model keeps
them), ``DIR/tokenizer.json``, ``DIR/data.json`` (the data record of stage 1) and
``DIR/training.json`` (sizes, held-out loss, acceptance per depth, steps). Checks the 40 MB cap.
Without a drafter yet (``--target-only``) it ships the target alone, as a safety copy.

``--pack PARTS_DIR`` also writes ``DIR`` as one tar split into parts below 15 MiB
(``pair.tar.part-aa``, ``-ab``, ...): the GPU machine brings back at most 8 files of 16 MiB per
command. Reassemble with ``cat PARTS_DIR/pair.tar.part-* | tar -x -C DIR``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tarfile

import jax.numpy as jnp

from ddtree_jax.training.data import write_json
from ddtree_jax.training.state import MAX_SHARD_BYTES, read_info

__all__ = ["SHIP_LIMIT_BYTES", "export_pair", "main", "pack"]

SHIP_LIMIT_BYTES = 40_000_000


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def pack(src: str, parts_dir: str, part_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """``src`` as an uncompressed tar (paths relative to it) split into ``pair.tar.part-aa`` ... ."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d, dirs, files in sorted(os.walk(src)):
            dirs.sort()
            for f in sorted(files):
                full = os.path.join(d, f)
                tar.add(full, arcname=os.path.relpath(full, src), recursive=False)
    data = buf.getvalue()
    os.makedirs(parts_dir, exist_ok=True)
    names = []
    for i in range(0, len(data), part_bytes):
        k = i // part_bytes
        name = os.path.join(parts_dir, f"pair.tar.part-{chr(97 + k // 26)}{chr(97 + k % 26)}")
        with open(name, "wb") as f:
            f.write(data[i : i + part_bytes])
        names.append(name)
    return names


def export_pair(run: str, dest: str, *, target_only: bool = False, log=print) -> dict:
    from ddtree_jax.checkpoints import load_drafter, load_target, save_checkpoint

    tdir, ddir = os.path.join(run, "target_best"), os.path.join(run, "drafter_best")
    if not os.path.isdir(tdir):
        raise SystemExit(f"{tdir}: missing; train the target first")
    if not target_only and not os.path.isdir(ddir):
        raise SystemExit(f"{ddir}: missing; train the drafter first (or pass --target-only)")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    target = load_target(tdir, dtype=jnp.bfloat16, impl="reference")
    save_checkpoint(target, os.path.join(dest, "target"), max_shard_bytes=MAX_SHARD_BYTES)
    record = {"target": {k: v for k, v in (read_info(os.path.join(run, "target_state")) or {}).items()
                         if k in ("step", "best_heldout", "best_step", "hyper", "params", "evals", "data_position")}}
    if not target_only:
        drafter = load_drafter(ddir, target, dtype=jnp.bfloat16)
        save_checkpoint(drafter, os.path.join(dest, "drafter"), max_shard_bytes=MAX_SHARD_BYTES)
        record["drafter"] = {k: v for k, v in (read_info(os.path.join(run, "drafter_state")) or {}).items()
                             if k in ("step", "best_tau", "best_step", "hyper", "params", "evals")}
    for name in ("tokenizer.json", "data.json"):
        shutil.copy(os.path.join(run, name), os.path.join(dest, name))
    with open(os.path.join(run, "data.json")) as f:
        eos = json.load(f)["tokenizer"]["eos_id"]
    write_json(os.path.join(dest, "generation_config.json"), {"eos_token_id": eos})
    write_json(os.path.join(dest, "training.json"), record)
    size = _folder_bytes(dest)
    roles = [os.path.join(dest, r) for r in ("target", "drafter")]
    weights = sum(_folder_bytes(r) for r in roles if os.path.isdir(r))
    log(f"[export] {dest}: target{'' if target_only else ' + drafter'} in bfloat16, {weights / 1e6:.1f} MB of "
        f"checkpoints ({size / 1e6:.1f} MB with tokenizer and records)")
    if weights > SHIP_LIMIT_BYTES:
        raise SystemExit(f"[export] the checkpoints take {weights / 1e6:.1f} MB, over the "
                         f"{SHIP_LIMIT_BYTES / 1e6:.0f} MB cap")
    return dict(dest=dest, bytes=size, checkpoint_bytes=weights)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.training.export", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run folder")
    p.add_argument("--dest", required=True, help="where to write target/, drafter/, tokenizer.json (replaced)")
    p.add_argument("--target-only", action="store_true")
    p.add_argument("--pack", metavar="PARTS_DIR", help="also write DEST as tar parts below 15 MiB here")
    a = p.parse_args(argv)
    export_pair(a.out, a.dest, target_only=a.target_only)
    if a.pack:
        names = pack(a.dest, a.pack)
        print(f"[export] packed into {len(names)} part(s) in {a.pack}: cat {a.pack}/pair.tar.part-* | tar -x -C DIR")


if __name__ == "__main__":
    main()
