"""Random inputs shared by the tree, walk and kernel tests."""

import numpy as np


def random_draft_logits(seed, B, L, V, mask_frac=0.0):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 4.0, size=(B, L, 1))
    logits = (rng.standard_normal((B, L, V)) * scale).astype(np.float32)
    if mask_frac:
        logits[rng.random((B, L, V)) < mask_frac] = -np.inf
        logits[..., 0] = np.maximum(logits[..., 0], 0.0)  # every depth keeps at least one token
    return logits


MIXED_BAD_ROWS = [4, 5, 6]  # rows of mixed_top_k_rows whose log-softmax is all NaN


def mixed_top_k_rows(seed, V=3000):
    """[10, V] f32 rows for the vocabulary top-k kernels: Gaussian, rounded (ties), 97% -inf (fewer
    finite than k), all equal (every entry tied), NaN row, +inf row, all -inf, a -inf run over
    whole chunks, coarse ties with a few large values, Gaussian with a different scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((10, V)).astype(np.float32) * rng.uniform(0.5, 4, (10, 1)).astype(np.float32)
    x[1] = np.round(x[1] * 2) / 2
    x[2, rng.random(V) < 0.97] = -np.inf
    x[3] = 1.5
    x[4, 7] = np.nan
    x[5, 11] = np.inf
    x[6] = -np.inf
    x[7, 100:2500] = -np.inf
    x[8] = np.round(x[8])
    x[8, rng.integers(0, V, 5)] = 9.0
    return x
