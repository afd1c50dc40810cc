"""One compiled call over nnx modules: their graphs split once, their state passed as arrays.

``CompiledFn(body, updates=(model, opt), reads=(target,), **static)`` compiles
``body(*updates, *reads, *args, **static)`` with ``jax.jit``; ``fn(*args)`` returns the body's
output. It is how training runs its steps and how the benchmarks time a model pass.

Contract:

* The modules' graphs are split once, at construction, and are static in the compiled program
  (``nnx.jit`` walks them on the host at every call instead). A module whose structure or static
  attributes change later (another kernel implementation, a new mesh) needs a new ``CompiledFn``.
* ``reads``: their state is taken at construction and passed as it is to every call; what the body
  writes into them is dropped.
* ``updates``: their state is donated to each call and the body's changes are carried to the next
  one. Between calls the modules' own variables are stale (their arrays were donated): ``sync()``
  writes the carried state back; call it before anything else reads those modules.
* ``static`` keyword arguments are fixed for the program (dtypes, rates); ``args`` are traced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from flax import nnx

__all__ = ["CompiledFn"]


class CompiledFn:
    """``body(*updates, *reads, *args, **static)`` compiled once on the modules' split state (module docstring)."""

    def __init__(self, body: Callable, *, updates: Sequence[nnx.Module] = (), reads: Sequence[nnx.Module] = (),
                 **static):
        self._updates = tuple(updates)
        graph, self._state = nnx.split(self._updates)
        read_graph, self._reads = nnx.split(tuple(reads))

        def pure(state, read_state, *args):
            updates = nnx.merge(graph, state)
            out = body(*updates, *nnx.merge(read_graph, read_state), *args, **static)
            return nnx.state(updates), out

        self._call = jax.jit(pure, donate_argnums=0)

    def __call__(self, *args):
        self._state, out = self._call(self._state, self._reads, *args)
        return out

    def sync(self) -> None:
        """Writes the carried state of ``updates`` back into those modules."""
        nnx.update(self._updates, self._state)
