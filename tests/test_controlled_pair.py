"""The benchmarks' controlled-acceptance pair (bench/_controlled.py) sets the laws it says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench._common import k2_models
from bench._controlled import LEVELS, Acceptance, guess, successor


@pytest.fixture(scope="module")
def pair():
    return k2_models(1, smoke=True, acceptance=LEVELS["medium"])


def test_target_prefers_the_successor_with_the_set_probability(pair):
    target, _ = pair
    V = target.config.vocab_size
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 9)), jnp.int32)
    probs = jax.nn.softmax(target(ids), axis=-1)
    succ = successor(ids, V)
    assert bool(jnp.all(jnp.argmax(probs, -1) == succ))
    p = jnp.take_along_axis(probs, succ[..., None], -1)
    np.testing.assert_allclose(np.asarray(p), LEVELS["medium"].target_p, atol=2e-3)


def test_drafter_follows_its_guess_chain_with_the_set_probability(pair):
    target, drafter = pair
    V = target.config.vocab_size
    roots = jnp.asarray([3, 77, 200, 511], jnp.int32)
    cache = drafter.init_cache(4, 32)
    probs = jax.nn.softmax(drafter.propose(target, cache, roots), axis=-1)  # [B, L, V]
    chain, x = [], roots
    for _ in range(probs.shape[1]):
        x, _ = guess(x, V, LEVELS["medium"].hit_rate)
        chain.append(x)
    chain = jnp.stack(chain, axis=1)
    assert bool(jnp.all(jnp.argmax(probs, -1) == chain))
    np.testing.assert_allclose(np.asarray(jnp.take_along_axis(probs, chain[..., None], -1)),
                               LEVELS["medium"].draft_p, atol=2e-3)
    # the share of hits (drafted == successor) follows hit_rate over many tokens
    xs = jnp.arange(V, dtype=jnp.int32)
    hits = float(jnp.mean(guess(xs, V, 0.7)[0] == successor(xs, V)))
    assert abs(hits - 0.7) < 0.06


def test_levels_are_named_and_checked():
    with pytest.raises(ValueError, match="Acceptance.target_p"):
        Acceptance(hit_rate=0.5, target_p=1.0, draft_p=0.5)
    with pytest.raises(ValueError, match="Acceptance.hit_rate"):
        Acceptance(hit_rate=-0.1, target_p=0.5, draft_p=0.5)
