"""Where a batch's rows live on a device mesh, and per-row work run where its rows are.

A model placed on a mesh splits its batch rows (the serving engine's slots, ``generate``'s
requests) over the mesh's *row axes*: by default ``data`` and ``expert``, so that with an expert
mesh every device holds and computes only its own rows (data-parallel attention: the attention,
the dense layers, the LM head, the sampler, the tree build and the walk run per device on its
rows) while the routed experts stay split over the same devices (tokens exchanged around each MoE
layer: ``ddtree_jax.models.moe.experts_expert_parallel``). The logical key ``"rows"`` of a
``mesh_axes`` map (``ddtree_jax.mesh_axes``) names the row axes; ``("data",)``
keeps every row on every device of the expert axis (the layout without data-parallel attention).

A batch splits over the longest leading run of the row axes whose devices divide it (a batch of
one request on eight devices stays whole, as does a prefill group of three): a split never changes
a row's result, only where it is computed. Design note: docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax.mesh_axes import ROW_AXES

__all__ = ["RowMesh", "on_own_rows", "per_rows", "place_state", "row_spec"]


@dataclasses.dataclass(frozen=True)
class RowMesh:
    """``mesh`` with batch rows split over ``axes`` (mesh axes of size > 1, in split order)."""

    mesh: Mesh
    axes: tuple[str, ...]

    @classmethod
    def of(cls, mesh: Mesh | None, mesh_axes: Mapping) -> RowMesh | None:
        """The row layout of a model placed on ``mesh`` under the logical -> mesh axis map
        ``mesh_axes`` (its ``"rows"`` entry, default ``ROW_AXES``); ``None`` without a mesh or
        when no row axis has more than one device."""
        if mesh is None:
            return None
        wanted = mesh_axes.get("rows", ROW_AXES)
        wanted = (wanted,) if isinstance(wanted, str) else tuple(wanted)
        axes = tuple(a for a in wanted if a in mesh.axis_names and mesh.shape[a] > 1)
        return cls(mesh, axes) if axes else None

    @property
    def devices(self) -> int:
        """Devices the rows split over when the batch allows it (the product of the axes' sizes)."""
        return self._count(self.axes)

    def _count(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def split(self, batch: int) -> tuple[str, ...]:
        """The axes a batch of ``batch`` rows splits over: the longest leading run of ``axes``
        whose device count divides ``batch`` (empty: not split)."""
        for n in range(len(self.axes), 0, -1):
            if batch % self._count(self.axes[:n]) == 0:
                return self.axes[:n]
        return ()

    def blocks(self, batch: int) -> int:
        """The devices a batch of ``batch`` rows splits over (``split``; 1: not split): each holds
        one block of ``batch / blocks`` consecutive rows."""
        return self._count(self.split(batch))


def row_spec(axes: tuple[str, ...]) -> P:
    """The ``PartitionSpec`` of an array whose leading dim is rows split over ``axes``."""
    return P(axes if len(axes) > 1 else axes[0]) if axes else P()


def per_rows(fn: Callable, rows: RowMesh | None, batch: int, *args, shared: tuple = ()):
    """``fn(*args, *shared)`` for a ``fn`` that treats rows independently: every leaf of ``args``
    and of the result has rows as its leading dim (``batch`` rows, or a multiple of them in row
    order: a ``[B * T]`` flattening of ``[B, T]``); ``shared`` are whole on every device (weights).
    With ``rows`` (and a batch that splits) ``fn`` runs in a ``shard_map`` on each device's rows,
    so the compiler never gathers rows around it (the Pallas kernels it may call are opaque to the
    partitioner, and XLA's partitioner gathers some ops' rows, such as ``top_k``'s); otherwise it
    is called as it is."""
    axes = rows.split(batch) if rows is not None else ()
    if not axes:
        return fn(*args, *shared)
    spec = row_spec(axes)
    return jax.shard_map(fn, mesh=rows.mesh, in_specs=(spec,) * len(args) + (P(),) * len(shared), out_specs=spec,
                         check_vma=False)(*args, *shared)


def on_own_rows(fn: Callable, rows: RowMesh | None, cache, idx, *args):
    """``fn(cache, idx, *args)`` for a row cache (anything with ``take_rows``) of ``B`` rows split
    over ``rows`` and row indices ``idx [R]`` (with ``args``: ``[R, ...]``) laid out device by
    device: the ``j``-th block of ``R / devices`` entries indexes rows of the cache's ``j``-th
    block of ``B / devices``. ``fn`` then runs in a ``shard_map`` on each device's block, with
    ``idx`` as LOCAL indices into the device's rows, so no device sees another's rows (taking
    rows by global index would gather every taken row's cache onto every device). Without a row
    mesh, or where ``B`` or ``R`` does not split over the same axes, ``fn`` gets the whole cache
    and the global indices. Every leaf of ``fn``'s result has the cache's row axes (``[R, ...]``
    rows of it or ``[B, ...]``)."""
    B, R = cache.lengths.shape[0], idx.shape[0]
    axes = rows.split(B) if rows is not None else ()
    if not axes or rows.split(R) != axes:
        return fn(cache, idx, *args)
    split = row_spec(axes)[0]

    def spec(axis, leaf):
        dims = [None] * leaf.ndim
        if axis is not None:
            dims[axis] = split
        return P(*dims)

    cache_spec = jax.tree.map(spec, _batch_axes(cache, B), cache)
    local_rows = B // rows.blocks(B)
    row = row_spec(axes)
    same = jax.tree.structure(cache)
    arg_specs = tuple(cache_spec if jax.tree.structure(a) == same else row for a in args)  # [R] rows of a cache
    return jax.shard_map(lambda c, i, *a: fn(c, i % local_rows, *a), mesh=rows.mesh,
                         in_specs=(cache_spec, row, *arg_specs), out_specs=cache_spec,
                         check_vma=False)(cache, idx, *args)


def _batch_axes(cache, batch: int):
    """For each leaf of a row cache (anything with ``take_rows``), the axis that holds its rows
    (found by asking the cache itself: the axis whose size follows the number of rows
    ``take_rows`` is given)."""
    import jax.numpy as jnp

    bigger = jax.eval_shape(lambda t: t.take_rows(jnp.arange(batch + 1)), cache)

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]
        return diff[0] if diff else None

    return jax.tree.map(axis, cache, bigger)


def place_state(state, rows: RowMesh, axes: tuple[str, ...]):
    """``state`` (a ``ddtree_jax.decode_state.DecodeState``) on ``rows.mesh``: every per-row array
    split over ``axes`` along its row axis (the caches' found by ``take_rows``, every other field's
    leading one), anything without rows replicated."""
    split = row_spec(axes)[0] if axes else None

    def place(axis, leaf):
        spec = [None] * leaf.ndim
        if axis is not None:
            spec[axis] = split
        return jax.device_put(leaf, NamedSharding(rows.mesh, P(*spec)))

    batch = state.batch_size
    new = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if f.name in ("target_cache", "draft_cache"):
            if value is not None:
                new[f.name] = jax.tree.map(place, _batch_axes(value, batch), value)
        else:
            new[f.name] = jax.tree.map(lambda x: place(0, x), value)
    return dataclasses.replace(state, **new)
