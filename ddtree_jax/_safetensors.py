"""Reading and checking safetensors headers and sharded indexes, with the standard library only.

The one integrity check that the checkpoint loader (``ddtree_jax.checkpoints``) and the command
line's preflight (``ddtree_jax._preflight``, which may not import numpy or JAX) share:

* ``read_header(path)`` -> ``Header``: the tensors' entries of a safetensors file and the byte at
  which their data starts, after checking that the file holds the 8-byte header length and a
  header of that length; that the header is a UTF-8 JSON object whose entries (besides
  ``__metadata__``) each have a ``dtype`` of ``DTYPE_SIZES``, a ``shape`` of integers >= 0 and
  ``data_offsets`` ``[begin, end]`` with ``end - begin`` = the dtype's size times the shape's
  product; that every tensor's bytes lie inside the file; and that no two tensors overlap.
* ``read_index(folder)`` -> ``{tensor name: shard file name}`` from ``model.safetensors.index.json``,
  after checking that it is a JSON object with a ``weight_map`` of names to file names and that
  every shard it lists exists.

Each failure raises ``SafetensorsError``: ``file`` (the path at fault), ``problem`` (what is
wrong, naming the tensor when one is at fault); ``str()`` is ``"<file>: <problem>"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

__all__ = ["DTYPE_SIZES", "INDEX", "MAX_HEADER_BYTES", "Header", "SafetensorsError", "read_header", "read_index"]

# Bytes per element of the dtypes the loader reads (``ddtree_jax.checkpoints._DTYPES`` maps the
# same names to numpy dtypes; tests/test_checkpoints.py checks that both agree).
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1}
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


class SafetensorsError(ValueError):
    """A safetensors file or index that cannot be read as one: ``file`` and ``problem`` say which
    and why."""

    def __init__(self, file: str, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = file, problem


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked header: ``tensors`` maps each name to its entry (``dtype``, ``shape``,
    ``data_offsets`` relative to ``data_start``); ``data_bytes`` is the size of the data part."""

    tensors: dict[str, dict]
    data_start: int
    data_bytes: int


def read_header(path: str) -> Header:
    """The checked header of the safetensors file at ``path`` (module doc); ``SafetensorsError``
    otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(path, f"{size} bytes{' (empty)' if size == 0 else ''}: too short for a "
                                             "safetensors file (an 8-byte header length, then the header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise SafetensorsError(path, f"the header length says {n} bytes but the file has {size} bytes: "
                                             "not a safetensors file, or truncated")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(path, f"cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(path, f"the header ({n} bytes) is not valid JSON ({e}): corrupt file") from None
    if not isinstance(header, dict):
        raise SafetensorsError(path, f"the header holds a JSON {type(header).__name__}, expected an object: "
                                     "corrupt file")
    header.pop("__metadata__", None)
    data_start, data_bytes = 8 + n, size - 8 - n
    spans = []
    for name, info in header.items():
        begin, end = _check_entry(path, name, info)
        if end > data_bytes:
            raise SafetensorsError(path, f"tensor {name!r} needs bytes [{begin}, {end}) of the data, but the file "
                                         f"holds only {data_bytes} data bytes ({size} bytes in all, the data "
                                         f"from byte {data_start}): truncated")
        spans.append((begin, end, name))
    reach, last = 0, None  # the furthest end so far, and whose
    for begin, end, name in sorted(s for s in spans if s[0] < s[1]):
        if begin < reach:
            raise SafetensorsError(path, f"tensors {last!r} and {name!r} overlap in the data: corrupt header")
        reach, last = end, name
    return Header(header, data_start, data_bytes)


def _check_entry(path: str, name: str, info) -> tuple[int, int]:
    """The data offsets of one header entry, after checking it."""
    if not isinstance(info, dict):
        raise SafetensorsError(path, f"tensor {name!r}: header entry {info!r} is not an object: corrupt header")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise SafetensorsError(path, f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(path, f"tensor {name!r}: shape {shape!r} is not a list of integers >= 0: "
                                     "corrupt header")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with "
                                     "0 <= begin <= end: corrupt header")
    begin, end = offsets
    need = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != need:
        raise SafetensorsError(path, f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes, but "
                                     f"{dtype} {shape} needs {need}: corrupt header")
    return begin, end


def read_index(folder: str) -> dict[str, str]:
    """``{tensor name: shard file name}`` of ``folder``'s ``model.safetensors.index.json`` (module
    doc); ``SafetensorsError`` naming the index, or the first missing shard."""
    path = os.path.join(folder, INDEX)
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise SafetensorsError(path, f"cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SafetensorsError(path, f"not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(path, "expected a JSON object with a \"weight_map\" of tensor names to file names")
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if absent:
        more = f" (and {len(absent) - 1} more of its {len(shards)} shards)" if len(absent) > 1 else ""
        raise SafetensorsError(path, f"names the shard {absent[0]}{more}, which is missing from {folder}")
    return dict(weight_map)
