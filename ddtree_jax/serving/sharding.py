"""Sharding in one place: the device mesh from a spec like ``expert=4,tensor=2``, and where the
engine's slots live.

Mesh axes: ``data`` (slots: each data shard decodes its own slots), ``expert`` (routed experts,
expert parallelism; by default the slots split over it too: data-parallel attention) and
``tensor`` (the tensor-parallel dimensions the models declare). The models' logical axes map onto
the mesh by ``ddtree_jax.mesh_axes.DEFAULT_MESH_AXES`` (``"expert"`` -> ``expert``, ``"tensor"``
-> ``tensor``, ``"rows"`` -> ``("data", "expert")``; ``NO_DP_ATTENTION`` keeps every slot on every
device of the expert axis); weights are replicated over ``data``. One size may be
``-1``: whatever the other axes leave of the devices. The product must use every device given.

    mesh = make_mesh("expert=4,tensor=2")                       # 8 devices
    target = load_target(path, mesh=mesh)                       # experts over 4, tensors over 2
    engine = Engine(target, drafter, EngineConfig(slots=16), shard_state=state_sharding(mesh))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ddtree_jax.mesh_axes import NO_DP_ATTENTION

__all__ = ["MESH_AXES", "NO_DP_ATTENTION", "make_mesh", "parse_mesh_spec", "state_sharding"]

MESH_AXES = ("data", "expert", "tensor")


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """``"expert=4,tensor=2"`` -> ``{"expert": 4, "tensor": 2}`` (axes from ``MESH_AXES``, sizes
    >= 1, or -1 once for "the rest")."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            raise ValueError(f"mesh spec {spec!r}: expected axis=size with axis in {MESH_AXES}, got {part!r}")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be an integer, got {value!r}") from None
        if size < 1 and size != -1:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be >= 1 (or -1: the rest), got {size}")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may be -1")
    return sizes


def make_mesh(spec: str | dict[str, int] | None, devices: Sequence | None = None):
    """The mesh of ``spec`` over ``devices`` (default: all of ``jax.devices()``, every process's),
    axes in ``MESH_AXES`` order with ``AxisType.Auto``; ``None`` or ``""`` gives ``None`` (one
    device, no sharding)."""
    import jax
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    if not spec:
        return None
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    known = math.prod(s for s in sizes.values() if s != -1)
    for name, s in sizes.items():
        if s == -1:
            if len(devices) % known:
                raise ValueError(f"mesh {sizes}: {len(devices)} devices do not divide by {known}")
            sizes[name] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices; there are {len(devices)} "
                         f"(use -1 for one axis to take the rest)")
    names = tuple(a for a in MESH_AXES if a in sizes)
    shape = tuple(sizes[a] for a in names)
    if len({d.process_index for d in devices}) > 1:
        # Several hosts: hosts along the leading axis, each host's devices together after it.
        arr = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    else:
        try:
            arr = mesh_utils.create_device_mesh(shape, devices)
        except Exception:  # noqa: BLE001 - fall back to the given order (CPU devices, odd shapes)
            arr = np.array(devices).reshape(shape)
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))


def state_sharding(mesh, mesh_axes: dict | None = None) -> Callable | None:
    """A function placing a ``DecodeState`` on ``mesh``: every per-slot array split over the row
    axes (``ddtree_jax.rows.RowMesh.of(mesh, mesh_axes)``; default
    ``ddtree_jax.mesh_axes.DEFAULT_MESH_AXES``: ``data`` and ``expert``, the layout the models
    loaded with the same ``mesh_axes`` compute in) along its row axis (caches included), the rest
    replicated. ``None`` when the mesh has no row axis of more than one device (the state then
    follows the compiler's placement). The slots must split over every row device."""
    from ddtree_jax.mesh_axes import DEFAULT_MESH_AXES
    from ddtree_jax.rows import RowMesh, place_state

    rows = RowMesh.of(mesh, DEFAULT_MESH_AXES if mesh_axes is None else mesh_axes)
    if rows is None:
        return None

    def shard(state):
        B = state.batch_size
        if B % rows.devices:
            sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in rows.axes)
            raise ValueError(f"slots={B} must be a multiple of the {rows.devices} devices the slots split over "
                             f"({sizes}; without data-parallel attention only 'data' splits them)")
        return place_state(state, rows, rows.axes)

    return shard
