"""SamplingParams validation, the canonical pipeline against a numpy reference, the sampler."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.sampling import sample_with_noise
from tests._reference import filtered_probs


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(seed=1.0), "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        dt.SamplingParams(**kwargs)


def test_valid_sampling_params():
    p = dt.SamplingParams(temperature=0, top_k=5, top_p=1.0, min_p=1.0, seed=2**32 - 1)
    assert p.is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # frozen
    with pytest.raises(TypeError):
        dt.SamplingParams(0.5)  # keyword-only


def test_batch_sampling():
    b = dt.batch_sampling([dt.SamplingParams(temperature=0.5, seed=3), dt.SamplingParams(top_k=4)], 2)
    chex.assert_shape([b.temperature, b.top_k, b.top_p, b.min_p, b.seed, b.has_seed], (2,))
    np.testing.assert_array_equal(np.asarray(b.has_seed), [True, False])
    with pytest.raises(ValueError, match="2 SamplingParams for a batch of 3"):
        dt.batch_sampling([dt.SamplingParams()] * 2, 3)
    with pytest.raises(TypeError, match="sampling must be"):
        dt.batch_sampling({"temperature": 1.0}, 1)
    with pytest.raises(ValueError, match=r"sampling.top_k must have shape \(3,\)"):
        dt.batch_sampling(dt.SamplingBatch(*(jnp.zeros(3),) + (jnp.zeros(2),) + (jnp.zeros(3),) * 4), 3)


def _random_rows(rng, B, M, V, integer=False):
    if integer:  # small integers: many exact ties, to exercise the tie rules
        return rng.integers(-3, 3, size=(B, M, V)).astype(np.float32)
    return (rng.standard_normal((B, M, V)) * rng.uniform(0.3, 3.0, size=(B, 1, 1))).astype(np.float32)


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_target_logprobs_matches_numpy_reference(seed, integer):
    rng = np.random.default_rng(seed)
    B, M, V = 24, 3, 17
    logits = _random_rows(rng, B, M, V, integer)
    params = [
        dt.SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 1.0, 1.7])),
            top_k=int(rng.choice([0, 1, 2, 5, 17, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 0.1])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
        )
        for _ in range(B)
    ]
    got = np.exp(np.asarray(dt.target_logprobs(jnp.asarray(logits), dt.batch_sampling(params, B))))
    for b, p in enumerate(params):
        for m in range(M):
            want = filtered_probs(logits[b, m], p.temperature, p.top_k, p.top_p, p.min_p)
            np.testing.assert_array_equal(got[b, m] > 0, want > 0, err_msg=f"support, row {b},{m}, {p}")
            np.testing.assert_allclose(got[b, m], want, rtol=1e-5, atol=1e-7)


def test_bf16_logits():
    logits = jnp.asarray(_random_rows(np.random.default_rng(2), 2, 2, 300)).astype(jnp.bfloat16)
    lp = dt.target_logprobs(logits, dt.batch_sampling(dt.SamplingParams(top_k=7), 2))
    chex.assert_type(lp, jnp.float32)
    assert (np.isfinite(np.asarray(lp)).sum(-1) >= 7).all()


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = jnp.array([[[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0], [-jnp.inf, -1.0, -1.0, -jnp.inf]]])
    tokens = dt.sample_tree_nodes(logits, dt.SamplingParams(temperature=0.0), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tokens), [[1, 0, 1]])


def test_mixed_batch_greedy_rows_are_argmax():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(_random_rows(rng, 6, 4, 50))
    params = [dt.SamplingParams(temperature=0.0 if b % 2 == 0 else 1.3, top_k=3 * b) for b in range(6)]
    tokens = np.asarray(dt.sample_tree_nodes(logits, params, jax.random.key(1)))
    chex.assert_shape(tokens, (6, 4))
    np.testing.assert_array_equal(tokens[0::2], np.asarray(logits).argmax(-1)[0::2])
    lp = np.asarray(dt.target_logprobs(logits, dt.batch_sampling(params, 6)))
    assert np.isfinite(np.take_along_axis(lp, tokens[..., None], -1)).all()


def test_non_finite_policy():
    """-inf masks tokens; NaN, +inf or all -inf rows give INVALID_TOKEN (-1), never a token."""
    ninf = -jnp.inf
    logits = jnp.array(
        [
            [
                [0.0, ninf, 1.0, ninf],  # fine: -inf entries are masked out
                [0.0, jnp.nan, 1.0, 2.0],
                [0.0, jnp.inf, 1.0, 2.0],
                [ninf, ninf, ninf, ninf],
            ]
        ]
    )
    for temperature in [0.0, 1.0]:
        params = dt.SamplingParams(temperature=temperature, top_k=2)
        tokens = np.asarray(dt.sample_tree_nodes(logits, params, jax.random.key(0)))
        assert tokens[0, 0] in (0, 2)
        np.testing.assert_array_equal(tokens[0, 1:], [dt.INVALID_TOKEN] * 3)
        lp = np.asarray(dt.target_logprobs(logits, dt.batch_sampling(params, 1)))
        assert np.isnan(lp[0, 1:]).all() and not np.isnan(lp[0, 0]).any()


def test_removed_tokens_never_sampled_at_extreme_noise():
    """Gumbel noise at its extremes, and adversarial noise that favours removed tokens, never
    picks a token outside the filtered support."""
    rng = np.random.default_rng(7)
    B, M, V = 8, 4, 40
    logits = jnp.asarray(_random_rows(rng, B, M, V))
    params = dt.batch_sampling([dt.SamplingParams(temperature=1.0, top_k=5, top_p=0.6, min_p=0.1)] * B, B)
    lp = dt.target_logprobs(logits, params)
    support = np.isfinite(np.asarray(lp))
    tiny, below_one = np.finfo(np.float32).tiny, np.float32(1 - 2**-24)
    extremes = [-np.log(-np.log(np.float32(u))) for u in (tiny, below_one)]
    big = np.finfo(np.float32).max
    noises = [np.full((B, M, V), e, np.float32) for e in extremes] + [
        np.where(support, -big, big).astype(np.float32),  # removed tokens get the largest noise
        np.where(support, extremes[0], extremes[1]).astype(np.float32),
    ]
    for noise in noises:
        tokens = np.asarray(sample_with_noise(lp, jnp.asarray(noise)))
        assert np.take_along_axis(support, tokens[..., None], -1).all()


def test_seeded_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(8)
    row = _random_rows(rng, 1, 5, 30)
    others = _random_rows(rng, 3, 5, 30)
    p = dt.SamplingParams(temperature=1.0, seed=1234)
    key = jax.random.key(42)
    alone = dt.sample_tree_nodes(jnp.asarray(row), p, key)
    batch = np.concatenate([others[:2], row, others[2:]])
    params = [dt.SamplingParams(temperature=0.8, seed=7), dt.SamplingParams(), p, dt.SamplingParams(top_k=3)]
    mixed = dt.sample_tree_nodes(jnp.asarray(batch), params, key)
    np.testing.assert_array_equal(np.asarray(mixed[2]), np.asarray(alone[0]))
    # A different key (e.g. the next round) gives a different stream.
    other = dt.sample_tree_nodes(jnp.asarray(np.repeat(row, 64, axis=1)), p, jax.random.key(43))
    again = dt.sample_tree_nodes(jnp.asarray(np.repeat(row, 64, axis=1)), p, key)
    assert (np.asarray(other) != np.asarray(again)).any()


def test_unseeded_rows_are_independent():
    logits = jnp.zeros((64, 1, 1000))
    tokens = np.asarray(dt.sample_tree_nodes(logits, dt.SamplingParams(), jax.random.key(0)))
    assert len(np.unique(tokens)) > 50  # identical rows, independent draws


def test_raw_and_per_row_keys():
    logits = jnp.asarray(_random_rows(np.random.default_rng(3), 2, 3, 10))
    p = dt.SamplingParams(seed=5)
    typed = dt.sample_tree_nodes(logits, p, jax.random.key(9))
    raw = dt.sample_tree_nodes(logits, p, jax.random.key_data(jax.random.key(9)))
    np.testing.assert_array_equal(np.asarray(typed), np.asarray(raw))
    per_row = dt.sample_tree_nodes(logits, p, jax.random.split(jax.random.key(9), 2))
    chex.assert_shape(per_row, (2, 3))
    with pytest.raises(ValueError, match="one per request"):
        dt.sample_tree_nodes(logits, p, jax.random.split(jax.random.key(9), 3))
    with pytest.raises(ValueError, match="key must be a JAX PRNG key"):
        dt.sample_tree_nodes(logits, p, jnp.zeros((3,), jnp.float32))


@pytest.mark.parametrize(
    "shape,dtype,match",
    [
        ((3, 4), jnp.float32, r"\[B, M, V\]"),
        ((1, 2, 3, 4), jnp.float32, r"\[B, M, V\]"),
        ((1, 2, 3), jnp.int32, "floating"),
    ],
)
def test_sample_tree_nodes_bad_inputs(shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        dt.sample_tree_nodes(jnp.zeros(shape, dtype), dt.SamplingParams(), jax.random.key(0))
