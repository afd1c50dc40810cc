"""Which implementation runs the hot loops: the Pallas kernels or the plain-JAX references.

Public functions take ``impl="auto" | "pallas" | "reference"`` (or an already resolved
``Backend``) and resolve it ONCE; everything below them receives the ``Backend``.

* ``"auto"``: the kernels of the platform's backend (Triton on NVIDIA GPUs), the references where
  no kernel backend exists (CPU; TPU until its kernels exist).
* ``"pallas"``: the kernels; off their platform they run in Pallas' interpret mode (tests).
* ``"reference"``: the plain-JAX references.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["IMPLS", "Backend", "resolve_backend"]

IMPLS = ("auto", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved ``impl`` (hashable: a static argument of compiled functions).

    Attributes:
      kernels: run the Pallas kernels (else the plain-JAX references).
      interpret: run them in Pallas' interpret mode (off their platform).
      family: the kernel folder under ``pallas_kernels`` ("triton").
    """

    kernels: bool
    interpret: bool = False
    family: str = "triton"


REFERENCE = Backend(kernels=False)


def resolve_backend(impl: str | Backend) -> Backend:
    """``impl`` -> ``Backend``; a ``ValueError`` names the argument for anything else."""
    if isinstance(impl, Backend):
        return impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (or a Backend), got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "reference" or (impl == "auto" and not on_gpu):
        return REFERENCE
    return Backend(kernels=True, interpret=not on_gpu)
