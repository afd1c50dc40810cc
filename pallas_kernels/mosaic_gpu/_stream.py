"""The memory warpgroup's loop of the Mosaic GPU kernels (``mla_prefix`` uses it): stream
``n`` tiles through ``stages`` shared-memory slots.

``fetch(t, slot)`` starts the TMA copies of tile ``t`` into ``slot`` (arriving on that slot's
"ready" barrier); the consumers arrive on ``consumed.at[slot]`` when they are done with a slot.
The first ``stages`` tiles are fetched at once; tile ``t >= stages`` waits until its slot's
previous tile was consumed. The last loop waits for the final consumption of every slot, so that
each barrier phase is observed (the Mosaic GPU interpreter checks this; on the GPU it keeps the
CTA alive until its shared memory is no longer read). ``n`` may be traced (a run-time tile count)
or a Python int.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["stream_tiles"]


def stream_tiles(fetch, n, stages: int, consumed) -> None:
    for i in range(stages):
        pl.when(i < n)(functools.partial(fetch, i, i))

    def refill(t, _):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(consumed.at[slot])
        fetch(t, slot)

    lax.fori_loop(stages, jnp.maximum(n, stages), refill, None)

    def drain(t, _):
        plgpu.barrier_wait(consumed.at[lax.rem(t, stages)])

    lax.fori_loop(jnp.maximum(n - stages, 0), n, drain, None)
