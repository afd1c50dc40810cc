"""generate(page_size=...): paged caches give the contiguous run's tokens (greedy and seeded rows in
one batch, through a compaction that pads), prompts sharing full pages of a prefix share them
(``cached_prompt_tokens``) with the same outputs, and a bad page size names the field. Two-layer
models: compilation dominates."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import ConfigError
from ddtree_jax.decode_state import DecodeState
from ddtree_jax.generation import generate
from ddtree_jax.models.paged_cache import NULL_PAGE, PagedDraftCache, PagedKVCache
from ddtree_jax.paged_generate import prefix_waves, without_pages
from ddtree_jax.sampling import SamplingParams, batch_sampling
from tests._model_fixtures import tiny_dflash, tiny_kimi

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 10, 11] * 7]
PAGE = 16


@pytest.fixture(scope="module")
def models():
    target = tiny_kimi(0, num_hidden_layers=2)
    return target, tiny_dflash(target, 1)


SAMPLING = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
            SamplingParams(temperature=0.8, top_p=0.9, seed=4)]


def _sharing_prompts():
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 100, 40).tolist()
    return [prefix + [5, 6], [3, 4], prefix + [8, 9, 10, 11], prefix[:20] + [1], [7], [9, 10, 11] * 7]


SHARING_KW = dict(method="ddtree", budget=6, max_new_tokens=[12, 2, 12, 2, 12, 2], sampling=SAMPLING * 2, seed=5,
                  sync_every=2)


@pytest.fixture(scope="module")
def contiguous_sharing_run(models):
    """The contiguous run of ``_sharing_prompts`` (the reference drafter): the paged run's
    reference, and the reference drafter's greedy tokens for the drafter-kernel test."""
    return generate(*models, _sharing_prompts(), **SHARING_KW)


def test_prompts_sharing_a_prefix_share_its_full_pages(models, contiguous_sharing_run):
    """ddtree, greedy and seeded rows: the paged run equals the contiguous one token for token and
    round for round, with the prefix's full pages prefilled once and matched by the later prompts
    (the tree's shape does not touch the caches: dflash's and ar's take the same paths); three
    requests finish early, so the rounds go on at a batch of four whose padding row repeats a
    running one (its table is nulled: it cannot write that row's pages)."""
    prompts = _sharing_prompts()
    assert prefix_waves([np.asarray(p) for p in prompts], PAGE) == [[0, 1, 4, 5], [2, 3]]
    want = contiguous_sharing_run
    got = generate(*models, prompts, page_size=PAGE, **SHARING_KW)
    assert 4 in want.batch_sizes and got.batch_sizes == want.batch_sizes
    assert got.tokens == want.tokens
    assert [r.acceptance_lengths for r in got.requests] == [r.acceptance_lengths for r in want.requests]
    # the first prompt publishes the prefix's two full pages; the later ones match what they share
    assert [r.cached_prompt_tokens for r in got.requests] == [0, 0, 32, 16, 0, 0]
    assert got.cached_prompt_tokens == 48


def test_the_drafters_attention_kernel_reads_pages_as_it_reads_rows(models, contiguous_sharing_run):
    """The drafter's attention kernel (interpret mode) reading a paged context: the contiguous
    kernel run's tokens and acceptance, round for round; the greedy row keeps the reference
    drafter's tokens (the target's law does not depend on the draft): its prompt is the first of
    ``_sharing_prompts``, whose contiguous run (greedy there too) the module has already made."""
    from ddtree_jax.config import ExecutionConfig

    target, drafter = models
    kernel_drafter = drafter.with_execution(ExecutionConfig(impl="pallas"))
    prompts = [_sharing_prompts()[0], [7, 8], [9, 10, 11] * 7]
    kw = dict(method="ddtree", budget=6, max_new_tokens=10, sampling=SAMPLING, seed=5, sync_every=2)
    contiguous = generate(target, kernel_drafter, prompts, **kw)
    paged = generate(target, kernel_drafter, prompts, page_size=PAGE, **kw)
    assert paged.tokens == contiguous.tokens
    assert [r.acceptance_lengths for r in paged.requests] == [r.acceptance_lengths for r in contiguous.requests]
    assert SAMPLING[0].temperature == 0 and contiguous_sharing_run.requests[0].finish_reason == "length"
    assert contiguous.tokens[0] == contiguous_sharing_run.tokens[0][:10]  # the greedy row


@pytest.mark.parametrize("page_size", [8, 24, 16.0, "16"])
def test_bad_page_size_names_the_field(models, page_size):
    with pytest.raises(ConfigError) as err:
        generate(*models, PROMPTS, method="ar", max_new_tokens=2, page_size=page_size)
    assert err.value.field == "page_size"


def test_without_pages_nulls_the_given_rows_of_both_tables():
    table = jnp.arange(1, 13, dtype=jnp.int32).reshape(4, 3)
    caches = [dataclasses.replace(cls.init(13, 16, 3, 4, num_layers=1, dtype=jnp.float32, **dims), page_table=table)
              for cls, dims in ((PagedKVCache, dict(kv_lora_rank=2, qk_rope_head_dim=1)),
                                (PagedDraftCache, dict(kv_heads=1, head_dim=2)))]
    state = DecodeState.start(*caches, jnp.zeros((4,), jnp.int32), capacity=2, max_new_tokens=jnp.ones((4,), jnp.int32),
                              stop_ids=jnp.full((4, 1), -2, jnp.int32), sampling=batch_sampling(SamplingParams(), 4),
                              request_ids=jnp.arange(4, dtype=jnp.uint32))
    pad = np.array([False, True, False, True])
    state = without_pages(state, jnp.asarray(pad))
    for cache in (state.target_cache, state.draft_cache):
        np.testing.assert_array_equal(np.asarray(cache.page_table), np.where(pad[:, None], NULL_PAGE, table))
