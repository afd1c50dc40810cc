"""``DirectCall``: a compiled program whose calls hand their buffers straight to the runtime.

A ``jax.jit`` call does host work for every argument leaf before the device sees anything: it
reads each leaf's type, shape, dtype, weak type, sharding and committedness to build the call's
signature, hashes the static arguments, looks the program up, then gathers the buffers. At the
engine's round (about 120 leaves for the shipped pair: the target's parameters, the decoding
state, the key) that is a large part of launching a round, and it holds the interpreter lock
(docs/serving.md, "Launch cost"). The engine calls the same program thousands of times with
arguments whose structure, shapes, dtypes and placement never change, so ``DirectCall``
compiles the program once for them (``jit(...).lower(...).compile()``), checks them once, and
from then on passes each call's flat buffers to the compiled executable.

Contract:

* **One device.** Every argument lives on the one device the program was compiled for. With
  several devices ``DirectCall.create`` returns ``None`` and the caller keeps the jit call: a
  sharded argument laid out unlike the program expects is only caught by the checks skipped here.
* **Same arguments.** Each call's arguments have the structure, shapes and dtypes of the ones the
  program was built for (the caller's guarantee: the engine's state is only ever replaced by its
  own programs' outputs, which keep them). ``check=True`` verifies them on every call (tests).
* **Same results.** Outputs, donation (the jit's ``donate_argnames``) and the device's work are
  the compiled program's; only the host's bookkeeping is skipped.
* It reads JAX's compiled-executable internals (``Compiled._executable``, its
  ``xla_executable``, ``unsafe_call.out_handler``, ``_kept_var_idx``). Where a JAX version lacks
  one of them, or debugging checks (``jax_debug_nans``, ``jax_debug_infs``) are on, ``create``
  returns ``None``, and the caller keeps the jit call.
"""

from __future__ import annotations

import logging

import jax

__all__ = ["DirectCall"]

_log = logging.getLogger(__name__)


class DirectCall:
    """``jitted(*args, **static)`` compiled for given arguments and called with flat buffers
    (module docstring). Positions in ``bound`` are bound at creation (the models' parameters:
    flattened once); positions in ``static_args`` are the jit's static arguments; a call passes
    the other positional arguments, in order."""

    def __init__(self, exe, handlers, out_tree, kept: list[int], parts: list, avals: list):
        self._exe, self._handlers, self._out_tree = exe, handlers, out_tree
        self._kept = None if kept == list(range(len(kept))) and len(kept) == len(avals) else list(kept)
        self._parts, self._avals = parts, avals

    @classmethod
    def create(cls, jitted, args: tuple, *, static_args: tuple[int, ...] = (), bound: tuple[int, ...] = (),
               **static) -> DirectCall | None:
        """Compile ``jitted(*args, **static)`` for these arguments; ``None`` where a direct call is
        not possible (several devices, debugging checks, a JAX without the internals)."""
        dynamic = [i for i in range(len(args)) if i not in static_args]
        leaves = jax.tree.leaves([args[i] for i in dynamic])
        devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
        if len(devices) > 1 or jax.config.jax_debug_nans or jax.config.jax_debug_infs:
            return None
        compiled = jitted.lower(*args, **static).compile()
        try:
            mesh_exe = compiled._executable
            run = mesh_exe.unsafe_call
            if run.ordered_effects or run.has_unordered_effects or run.has_host_callbacks or run.mut:
                return None
            exe, handlers = mesh_exe.xla_executable, list(run.out_handler.handlers)
            kept = sorted(mesh_exe._kept_var_idx)
        except AttributeError as e:
            _log.info("DirectCall unavailable on jax %s (%s): using the jit call", jax.__version__, e)
            return None
        # parts: per dynamic position, its bound buffers or the structure a call's argument must have
        parts = [[_buffer(x) for x in jax.tree.leaves(args[i])] if i in bound else jax.tree.structure(args[i])
                 for i in dynamic]
        return cls(exe, handlers, compiled.out_tree, kept, parts, [(x.shape, x.dtype) for x in leaves])

    def __call__(self, *args, check: bool = False):
        """The program's outputs for the unbound dynamic arguments ``args`` (``check``: first
        verify their structure, shapes and dtypes against the compiled program's)."""
        flat, it = [], iter(args)
        for part in self._parts:
            if isinstance(part, list):
                flat += part
                continue
            leaves, tree = jax.tree.flatten(next(it))
            if check:
                self._check(tree, part, leaves, len(flat))
            flat += [_buffer(x) for x in leaves]
        if self._kept is not None:
            flat = [flat[i] for i in self._kept]
        outs = self._exe.execute_sharded(flat).consume_with_handlers(self._handlers)
        return jax.tree.unflatten(self._out_tree, outs)

    def _check(self, tree, expected, leaves, offset: int) -> None:
        if tree != expected:
            raise ValueError(f"DirectCall: an argument is {tree}, the compiled program takes {expected}")
        for i, x in enumerate(leaves):
            shape, dtype = self._avals[offset + i]
            if not isinstance(x, jax.Array) or x.shape != shape or x.dtype != dtype:
                raise ValueError(f"DirectCall: argument leaf {offset + i} is {type(x).__name__} "
                                 f"{getattr(x, 'shape', None)} {getattr(x, 'dtype', None)}; the program takes "
                                 f"{shape} {dtype}")


def _buffer(x):
    """The runtime buffer of an argument leaf: a typed key's underlying array."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x._base_array
    return x
