"""Near-zero temperatures (issue 9): below ``GREEDY_BELOW`` (1e-5) is greedy on every path.

The references (``target_logprobs``, the reference sampler, the numpy ``filtered_probs``), the
fused kernel (interpret mode) and ``generate`` all treat ``T < 1e-5`` as the argmax, and no
path produces NaN, an invalid token or an overflow at T = 1e-6, nor just above the threshold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.generation import generate
from ddtree_jax.sampling import GREEDY_BELOW, SamplingBatch, batch_sampling, canonical_temperature, target_logprobs
from pallas_kernels.triton import fused_sample as fs
from tests._model_fixtures import tiny_pair
from tests._reference import filtered_probs

TEMPS = [0.0, 1e-30, 1e-8, 1e-6, 9.99e-6, 1e-5, 1.2e-5, 3e-5]
GREEDY = [True, True, True, True, True, False, False, False]


def _batch(temp, top_k=0, top_p=1.0, min_p=0.0):
    r = len(temp)
    return SamplingBatch(
        jnp.asarray(np.asarray(temp, np.float32)),
        jnp.full((r,), top_k, jnp.int32),
        jnp.full((r,), top_p, jnp.float32),
        jnp.full((r,), min_p, jnp.float32),
        jnp.zeros((r,), jnp.uint32),
        jnp.zeros((r,), bool),
    )


def _logits(rows, v=37, seed=0):
    """Wide logits (spread ~1e3, so (x - max) / 1e-6 ~ 1e9) with a tie at the max in row 1."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, v)) * 300).astype(np.float32)
    x[1, [4, 9]] = x[1].max() + 1.0  # a tie: greedy takes index 4
    return x


def test_one_rule_in_params_batches_and_numpy_reference():
    assert GREEDY_BELOW == 1e-5
    params = [dt.SamplingParams(temperature=t) for t in TEMPS]
    assert [p.is_greedy for p in params] == GREEDY
    zeroed = np.asarray(canonical_temperature(batch_sampling(params, len(params)).temperature)) == 0
    assert zeroed.tolist() == GREEDY
    x = _logits(2)[1]  # the row with a tie at the max
    for t, greedy in zip(TEMPS, GREEDY, strict=True):
        if greedy:
            assert filtered_probs(x, t, 0, 1.0, 0.0)[4] == 1.0


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 0.9, 0.05)])
def test_reference_law(top_k, top_p, min_p):
    """``target_logprobs``: greedy rows are the point mass on the argmax; the rest finite, no NaN."""
    x = _logits(len(TEMPS))
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], _batch(TEMPS, top_k, top_p, min_p)))[:, 0]
    assert not np.isnan(lp).any()
    for r, greedy in enumerate(GREEDY):
        if greedy:
            want = np.full(x.shape[1], -np.inf)
            want[np.argmax(x[r])] = 0.0
            np.testing.assert_array_equal(lp[r], want)
        else:
            assert np.isclose(np.logaddexp.reduce(lp[r]), 0.0, atol=1e-5)
            assert lp[r, np.argmax(x[r])] > -1e-3  # a near-greedy law
    near_zero = [dt.SamplingParams(temperature=1e-6)]
    tok = np.asarray(dt.sample_tree_nodes(jnp.asarray(x)[None], near_zero, jax.random.key(0), impl="reference"))[0]
    assert tok.tolist() == np.argmax(x, axis=-1).tolist()


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.9, 0.05)])
def test_kernel(top_k, top_p, min_p):
    """The fused kernel (interpret mode) fed the canonical temperatures, as ``sample_tree_nodes``
    feeds it: argmax on greedy rows (lowest index on the tie), valid tokens of the reference
    support elsewhere; paths: 0 for greedy rows."""
    x = _logits(len(TEMPS))
    pb = _batch(TEMPS, top_k, top_p, min_p)
    seeds = jnp.asarray(np.random.default_rng(1).integers(0, 2**32, (len(TEMPS), 2), dtype=np.uint32))
    temp = canonical_temperature(pb.temperature)
    out = jax.tree.map(
        np.asarray,
        fs.fused_sample_debug(jnp.asarray(x), temp, pb.top_k, pb.top_p, pb.min_p, seeds, interpret=True, tile=64),
    )
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    for r, greedy in enumerate(GREEDY):
        assert 0 <= out["token"][r] < x.shape[1] and lp[r, out["token"][r]] > -np.inf, r
        if greedy:
            assert out["token"][r] == np.argmax(x[r]) and out["path"][r] == 0, r
        else:
            assert out["path"][r] > 0, r


def test_kernel_alone_is_finite_at_1e_6():
    """The kernel itself has no threshold (T == 0 is its greedy): fed T = 1e-6 as a sampled
    temperature, its exp2/division stay finite and it returns the (overwhelmingly likely) argmax."""
    x = _logits(4, v=45, seed=2)  # a shape of its own: nothing cached from the wrapper with the threshold
    x[1, 9] = x[1, 4] - 1.0  # no exact tie here: the sampled law is (numerically) a point mass
    temp = jnp.full((4,), 1e-6, jnp.float32)
    seeds = jnp.asarray(np.random.default_rng(3).integers(0, 2**32, (4, 2), dtype=np.uint32))
    for k, p in ((0, 1.0), (3, 1.0), (0, 0.9)):
        out = fs.fused_sample_debug(
            jnp.asarray(x),
            temp,
            jnp.full((4,), k, jnp.int32),
            jnp.full((4,), p, jnp.float32),
            jnp.zeros((4,), jnp.float32),
            seeds,
            interpret=True,
            tile=64,
        )
        out = jax.tree.map(np.asarray, out)
        assert (out["path"] > 0).all()
        assert out["token"].tolist() == np.argmax(x, axis=-1).tolist()
        assert np.isfinite(out["norm"]).all()


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_generate_at_1e_6_equals_greedy(impl):
    """``generate`` with T = 1e-6 gives the T = 0 tokens (ddtree), with the references and with
    the kernels (interpret mode)."""
    target, drafter = tiny_pair()  # (the depth does not matter here)
    prompts = [[1, 2, 3, 4, 5], [7]]
    kw = dict(method="ddtree", budget=6, max_new_tokens=6, max_len=32, impl=impl)
    greedy = generate(target, drafter, prompts, sampling=dt.SamplingParams(temperature=0.0), **kw)
    tiny = generate(target, drafter, prompts, sampling=dt.SamplingParams(temperature=1e-6, top_k=5), **kw)
    assert tiny.tokens == greedy.tokens
    assert [r.finish_reason for r in tiny.requests] == ["length", "length"]
