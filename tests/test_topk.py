"""exact_top_k == jax.lax.top_k (values and tie order), through its fast path and its fallback."""

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.topk import exact_top_k


def test_exact_top_k_matches_lax():
    rng = np.random.default_rng(0)
    for ties in (False, True):
        x = rng.standard_normal((2, 3, 4096)).astype(np.float32)
        if ties:
            x = np.round(x * 2) / 2  # the chunk bound cannot certify: falls back, still exact
        v, i = exact_top_k(jnp.asarray(x), 100)
        v2, i2 = jax.lax.top_k(jnp.asarray(x), 100)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
        np.testing.assert_array_equal(np.asarray(i), np.asarray(i2))
