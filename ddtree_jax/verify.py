"""Deprecated module name: the accept walk lives in ``ddtree_jax.accept`` ("verify" now names only
the target's forward pass over the tree). This alias goes away in the next release."""

import warnings

from ddtree_jax.accept import AcceptResult, accept_path

warnings.warn("ddtree_jax.verify is deprecated: import AcceptResult and accept_path from ddtree_jax.accept "
              "(or ddtree_jax)", DeprecationWarning, stacklevel=2)

__all__ = ["AcceptResult", "accept_path"]
