"""Log-probabilities of committed tokens (``EngineConfig.max_logprobs``): for greedy and sampled
requests, with ddtree and ar, each token's value and its top alternatives equal the request's law
(``target_logprobs``; greedy: the plain ``log_softmax``) computed from the target's own forward
pass over the output, in float32; the alternatives' probabilities sum to at most 1; stop tokens
keep tokens and log-probabilities aligned; requests that do not ask get none; too many asked is a
``RequestError`` naming ``logprobs``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ddtree_jax as dt
from ddtree_jax.sampling import batch_sampling, target_logprobs
from ddtree_jax.serving import Engine, RequestError

K = 4
PROMPT = [5, 17, 33, 2, 90]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engines(models):
    """One engine per method (built on first use: each compiles its own rounds)."""
    target, drafter = models
    built = {}

    def get(method: str) -> Engine:
        if method not in built:
            config = dt.EngineConfig(decode=dt.DecodeConfig(method=method, budget=6), slots=2, max_model_len=64,
                                     prefill_chunk=16, prefill_batch=1, max_logprobs=K)
            built[method] = Engine(target, drafter if method != "ar" else None, config)
        return built[method]

    return get


@pytest.fixture(scope="module")
def reference_logits(models):
    """``tokens -> [len(tokens), V]`` logits of one uncached forward pass (compiled once: the
    tokens are padded to a fixed length, which a causal pass does not see)."""
    graph, state = nnx.split(models[0])
    forward = jax.jit(lambda state, ids: nnx.merge(graph, state)(ids)[0])

    def logits(tokens):
        ids = np.zeros((1, 32), np.int32)
        ids[0, : len(tokens)] = tokens
        return forward(state, ids)[: len(tokens)]

    return logits


def reference_law(logits, sampling: dt.SamplingParams) -> np.ndarray:
    """``[n, V]``: the reported law of ``logits [n, V]`` (greedy: the plain log-softmax)."""
    if sampling.is_greedy:
        return np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return np.asarray(target_logprobs(logits[None], batch_sampling(sampling, 1))[0])


def run(eng, handles):
    while not all(h.done for h in handles):
        eng.step()
    return [h.result() for h in handles]


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_logprobs_are_the_request_law_at_the_committed_token(engines, reference_logits, method):
    eng = engines(method)
    cases = [(dt.SamplingParams(temperature=0.0), K),
             (dt.SamplingParams(temperature=0.8, top_k=3, seed=1), K),  # alternatives beyond the top-3 are removed
             (dt.SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, seed=2), 2),
             (dt.SamplingParams(temperature=1.0, seed=3), 0),
             (dt.SamplingParams(temperature=1.0, seed=3), None)]
    handles = [eng.submit(PROMPT, s, max_tokens=MAX_TOKENS, logprobs=k) for s, k in cases]
    results = run(eng, handles)
    for (sampling, k), res in zip(cases, results, strict=True):
        if k is None:
            assert res.logprobs is None
            continue
        lp = res.logprobs
        n = len(res.tokens)
        assert n == MAX_TOKENS and len(lp) == n and lp.top_ids.shape == lp.top_logprobs.shape == (n, k)
        law = reference_law(reference_logits(PROMPT + res.tokens[:-1])[len(PROMPT) - 1 :], sampling)
        np.testing.assert_allclose(lp.logprob, law[np.arange(n), res.tokens], atol=2e-5, rtol=0)
        top, ids = jax.lax.top_k(jnp.asarray(law), k)
        np.testing.assert_array_equal(lp.top_ids, np.asarray(ids))
        np.testing.assert_allclose(lp.top_logprobs, np.asarray(top), atol=2e-5, rtol=0)
        assert np.all(np.exp(lp.top_logprobs).sum(axis=1) <= 1 + 1e-5)
        assert np.all(np.isfinite(lp.logprob))
        if sampling.is_greedy:
            np.testing.assert_array_equal(lp.top_ids[:, 0], res.tokens)
        if sampling.top_k == 3:
            assert np.all(np.isneginf(lp.top_logprobs[:, 3:]))
    # The same seeded request without log-probabilities commits the same tokens.
    assert results[3].tokens == results[4].tokens


def test_stops_keep_tokens_and_logprobs_aligned_and_limits_name_the_field(models, engines):
    target, drafter = models
    eng = engines("ddtree")
    full = eng.generate([PROMPT], max_tokens=MAX_TOKENS, logprobs=1)[0]
    stop = full.tokens[4]
    cut = eng.generate([PROMPT], max_tokens=MAX_TOKENS, logprobs=1, stop_token_ids=[stop])[0]
    n = full.tokens.index(stop) + 1
    assert cut.finish_reason == "stop" and cut.tokens == full.tokens[:n] and len(cut.logprobs) == n
    np.testing.assert_array_equal(cut.logprobs.logprob, full.logprobs.logprob[:n])
    handle = eng.submit(PROMPT, max_tokens=MAX_TOKENS, logprobs=1)
    run(eng, [handle])
    streamed = list(handle.stream())
    assert sum(len(c.logprobs) for c in streamed) == MAX_TOKENS
    assert all(len(c.logprobs) == len(c.token_ids) for c in streamed)
    np.testing.assert_array_equal(np.concatenate([c.logprobs.logprob for c in streamed]), full.logprobs.logprob)
    for bad in (K + 1, -1, 1.5):
        with pytest.raises(RequestError) as err:
            eng.submit(PROMPT, max_tokens=2, logprobs=bad)
        assert err.value.field == "logprobs"
    off = Engine(target, drafter, dt.EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=6), slots=2,
                                                  max_model_len=64, prefill_chunk=16))
    with pytest.raises(RequestError, match="max_logprobs is 0") as err:
        off.submit(PROMPT, max_tokens=2, logprobs=0)
    assert err.value.field == "logprobs" and off.plan.logprobs == 0
    with pytest.raises(dt.ConfigError, match="max_logprobs"):
        Engine(target, drafter, dt.EngineConfig(max_logprobs=target.config.vocab_size + 1))
