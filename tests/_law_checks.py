"""Helpers the kernels' law tests share: a ``SamplingBatch`` from per-row lists, and the exact
law of one row under the library's canonical pipeline (the quantity the draws are tested against)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ddtree_jax.sampling import SamplingBatch, target_logprobs


def sampling_batch(temp, topk, topp, minp) -> SamplingBatch:
    """Per-row temperature, top-k, top-p, min-p lists -> a ``SamplingBatch`` (seeds 0, no seeded rows)."""
    n = len(temp)
    return SamplingBatch(jnp.asarray(np.asarray(temp, np.float32)), jnp.asarray(np.asarray(topk, np.int32)),
                         jnp.asarray(np.asarray(topp, np.float32)), jnp.asarray(np.asarray(minp, np.float32)),
                         jnp.zeros(n, jnp.uint32), jnp.zeros(n, bool))


def row_law(base, T, k, p, m) -> np.ndarray:
    """The target's sampling law of one row of logits ``base [V]`` (float64 probabilities)."""
    lp = target_logprobs(jnp.asarray(base)[None, None], sampling_batch([T], [k], [p], [m]))
    return np.exp(np.asarray(lp)[0, 0].astype(np.float64))
