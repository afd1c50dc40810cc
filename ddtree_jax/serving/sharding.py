"""Sharding in one place: the device mesh from a spec like ``expert=4,tensor=2``, and where the
engine's slots live.

Mesh axes: ``data`` (slots: each data shard decodes its own slots), ``expert`` (routed experts,
expert parallelism) and ``tensor`` (the tensor-parallel dimensions the models declare). The models'
logical axes map onto the mesh by ``ddtree_jax.checkpoints.DEFAULT_MESH_AXES`` (``"expert"`` ->
``expert``, ``"tensor"`` -> ``tensor``); weights are replicated over ``data``. One size may be
``-1``: whatever the other axes leave of the devices. The product must use every device given.

    mesh = make_mesh("expert=4,tensor=2")                       # 8 devices
    target = load_target(path, mesh=mesh)                       # experts over 4, tensors over 2
    engine = Engine(target, drafter, EngineConfig(slots=16), shard_state=state_sharding(mesh))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["MESH_AXES", "make_mesh", "parse_mesh_spec", "state_sharding"]

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


def _batch_axes(tree, batch: int):
    """For each leaf of a ``RowCache``, the axis that holds its rows (found by asking the cache
    itself: the axis whose size follows the number of rows ``take_rows`` is given)."""
    import jax
    import jax.numpy as jnp

    bigger = jax.eval_shape(lambda t: t.take_rows(jnp.arange(batch + 1)), tree)

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        return diff[0] if diff else None

    return jax.tree.map(axis, tree, bigger)


def state_sharding(mesh, data_axis: str = "data") -> Callable | None:
    """A function placing a ``DecodeState`` on ``mesh``: every per-slot array split over
    ``data_axis`` along its row axis (caches included), the rest replicated. ``None`` when the mesh
    has no such axis (the state then follows the compiler's placement)."""
    if mesh is None or data_axis not in mesh.axis_names:
        return None

    import dataclasses

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def place(axis, leaf):
        spec = [None] * leaf.ndim
        if axis is not None:
            spec[axis] = data_axis
        return jax.device_put(leaf, NamedSharding(mesh, PartitionSpec(*spec)))

    def shard(state):
        B = state.batch_size
        if B % mesh.shape[data_axis]:
            raise ValueError(f"slots={B} must be a multiple of the mesh's {data_axis!r} size {mesh.shape[data_axis]}")
        caches = {}
        for name in ("target_cache", "draft_cache"):
            cache = getattr(state, name)
            if cache is not None:
                caches[name] = jax.tree.map(place, _batch_axes(cache, B), cache)
        rest = {f.name: jax.tree.map(lambda x: place(0, x), getattr(state, f.name))
                for f in dataclasses.fields(state) if f.name not in ("target_cache", "draft_cache")}
        return dataclasses.replace(state, **rest, **caches)

    return shard
