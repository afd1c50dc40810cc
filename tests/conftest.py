"""Test-wide setup: the ``gpu`` marker runs only where JAX sees a GPU (reported as skipped elsewhere)."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (compiled Pallas kernels); run `python -m pytest -m gpu` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
