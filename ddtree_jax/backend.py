"""Which implementation runs the hot loops: the Pallas kernels of one backend, or the plain-JAX
references.

Public functions take ``impl`` (a string below, or an already resolved ``Backend``) and resolve it
ONCE; everything below them receives the ``Backend``. Importing this module does not import JAX
(``ddtree_jax.config`` validates ``impl`` through it); ``resolve_backend`` does.

* ``"auto"``: the kernels of the platform's backend (``pallas_kernels/triton`` on NVIDIA GPUs,
  ``pallas_kernels/mosaic_tpu`` on TPUs), the references elsewhere (CPU).
* ``"pallas"``: the platform's kernels; off a GPU or TPU, the Triton kernels in Pallas' interpret
  mode (tests).
* ``"pallas:triton"``, ``"pallas:mosaic_tpu"``: that backend's kernels, compiled on its platform
  and in interpret mode elsewhere (so a CPU can check the TPU kernels: ``"pallas:mosaic_tpu"``,
  or ``Backend(kernels=True, interpret=True, family="mosaic_tpu")``).
* ``"reference"``: the plain-JAX references.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

__all__ = ["FAMILIES", "IMPLS", "Backend", "has_kernel", "kernel_module", "resolve_backend"]

# Kernel backends: folder under ``pallas_kernels`` -> the ``jax.default_backend()`` it compiles for.
FAMILIES = {"triton": "gpu", "mosaic_tpu": "tpu"}
IMPLS = ("auto", "pallas", "reference") + tuple(f"pallas:{f}" for f in FAMILIES)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved ``impl`` (hashable: a static argument of compiled functions).

    Attributes:
      kernels: run the Pallas kernels (else the plain-JAX references).
      interpret: run them in Pallas' interpret mode (off their platform).
      family: the kernel folder under ``pallas_kernels``: "triton" or "mosaic_tpu".
    """

    kernels: bool
    interpret: bool = False
    family: str = "triton"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"Backend.family must be one of {tuple(FAMILIES)}, got {self.family!r}")


REFERENCE = Backend(kernels=False)


def resolve_backend(impl: str | Backend) -> Backend:
    """``impl`` -> ``Backend``; a ``ValueError`` names the argument for anything else."""
    if isinstance(impl, Backend):
        return impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (or a Backend), got {impl!r}")
    import jax

    platform = jax.default_backend()
    native = next((f for f, p in FAMILIES.items() if p == platform), None)
    if impl == "reference" or (impl == "auto" and native is None):
        return REFERENCE
    family = impl.partition(":")[2] or native or "triton"
    return Backend(kernels=True, interpret=FAMILIES[family] != platform, family=family)


def kernel_module(backend: Backend, name: str):
    """The module ``pallas_kernels.<backend.family>.<name>`` (imported on first use)."""
    return importlib.import_module(f"pallas_kernels.{backend.family}.{name}")


def has_kernel(backend: Backend, name: str) -> bool:
    """Whether ``backend`` runs kernels and its family has ``pallas_kernels/<family>/<name>.py``.
    A caller whose kernel exists for one family only (say, a Triton-only model kernel) checks this
    instead of ``backend.kernels`` and runs its reference on the other families."""
    return backend.kernels and importlib.util.find_spec(f"pallas_kernels.{backend.family}.{name}") is not None
