"""``impl`` keyword shared by the dispatching entry points (no imports of ddtree_jax here)."""

from __future__ import annotations

import jax

IMPLS = ("auto", "pallas", "reference")


def resolve_impl(impl: str) -> tuple[bool, bool]:
    """``impl`` -> (use the Pallas kernel, run it with ``interpret=True``).

    "auto": the kernels when ``jax.default_backend() == "gpu"``, the plain-JAX references
    elsewhere; "pallas": the kernels (interpret mode off GPU); "reference": the references.
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "reference" or (impl == "auto" and not on_gpu):
        return False, False
    return True, not on_gpu
