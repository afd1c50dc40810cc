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
