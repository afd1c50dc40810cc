"""The models through paged caches: the Kimi target's prefill, verify/commit rounds and decode step
over a ``PagedKVCache`` and the DFlash drafter's context over a ``PagedDraftCache`` give the
outputs and committed contents (gathered view) of the same calls on contiguous caches, on random
tables whose pages are shuffled across rows and cover exactly what each row writes."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import ExecutionConfig
from ddtree_jax.models.paged_cache import gather_positions
from tests._model_fixtures import commit, path_to, prefill, random_tree, tiny_dflash, tiny_kimi, verify
from tests._paged_layouts import random_page_table

PROMPTS = (5, 20, 2)  # tokens prefilled per row
TREE = 5  # nodes per verify block
ROUNDS = 2


def _script(rng):
    """The rounds' trees ``(depths [B,T], ancestor masks [B,T,T], accepted [B,T], counts [B])``
    and each row's highest written position + 1 (prefill, each verify block, the decode step)."""
    lengths, need, rounds = np.array(PROMPTS), np.array(PROMPTS), []
    for _ in range(ROUNDS):
        depths, masks, accepted, counts = [], [], np.full((len(PROMPTS), TREE), -1, np.int32), []
        for b in range(len(PROMPTS)):
            parents, d, m = random_tree(rng, TREE)
            path = path_to(parents, int(rng.integers(0, TREE)))
            accepted[b, :len(path)] = path
            depths.append(d)
            masks.append(m)
            counts.append(len(path))
        need = np.maximum(need, lengths + TREE)
        lengths = lengths + np.array(counts)
        rounds.append((np.stack(depths), np.stack(masks), accepted, np.array(counts, np.int32)))
    return rounds, np.maximum(need, lengths + 1)


def _paged_table(rng, need, page_size):
    """A random table whose row b owns exactly the pages of its ``need[b]`` positions (null entries
    after them, up to a row length that is a whole number of the contiguous cache's slot multiple
    of 8), and the pool size and pages per slot."""
    owned = [-(-int(n) // page_size) for n in need]
    pages_per_slot = -(-max(owned) * page_size // 8) * 8 // page_size
    table, num_pages = random_page_table(rng, owned, pages_per_slot)
    return jnp.asarray(table), num_pages, pages_per_slot


def _assert_same(got, want, exact):
    for g, w in zip(got, want, strict=True):
        if exact:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _assert_committed(paged, contiguous, exact):
    """The committed positions of every row and layer agree (the paged cache's gathered view)."""
    lengths = np.asarray(contiguous.lengths)
    np.testing.assert_array_equal(np.asarray(paged.lengths), lengths)
    for pools, bufs in ((paged.latent, contiguous.latent), (paged.k_rope, contiguous.k_rope)):
        for pool, buf in zip(pools, bufs, strict=True):
            view = gather_positions(pool, paged.page_table, paged.max_len)
            _assert_same([view[b, :n] for b, n in enumerate(lengths)], [buf[b, :n] for b, n in enumerate(lengths)],
                         exact)


def _prompt_rows(logits, hidden):
    """Each row's logits and hidden states at its prompt's positions (the rest is padding)."""
    return [x[r, :n] for r, n in enumerate(PROMPTS) for x in (logits, *hidden)]


@pytest.mark.parametrize("impl,page_size,exact", [("reference", 4, True), ("pallas", 16, False)])
def test_target_rounds_through_a_paged_cache(impl, page_size, exact):
    """Reference attention over equally long caches computes the same arithmetic (exact); the
    kernel through pages of 16 takes key tiles of 16 where the contiguous one takes 32 (rounding)."""
    rng = np.random.default_rng(7)
    model = tiny_kimi(execution=ExecutionConfig(impl=impl), num_hidden_layers=2)  # one dense, one MoE layer
    rounds, need = _script(rng)
    table, num_pages, pages_per_slot = _paged_table(rng, need, page_size)
    max_len = pages_per_slot * page_size
    b, layers = len(PROMPTS), (0, 1)
    contiguous = model.init_cache(b, max_len)
    assert contiguous.max_len == max_len  # the same cache length: the same attention shapes
    paged = dataclasses.replace(model.init_paged_cache(num_pages, page_size, pages_per_slot, b), page_table=table)

    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, (b, max(PROMPTS))), jnp.int32)
    lengths = jnp.asarray(PROMPTS, jnp.int32)
    *want, contiguous = prefill(model, ids, lengths, contiguous, hidden_layer_ids=layers)
    *got, paged = prefill(model, ids, lengths, paged, hidden_layer_ids=layers)
    _assert_same(_prompt_rows(*got), _prompt_rows(*want), exact)
    _assert_committed(paged, contiguous, exact)

    for depths, masks, accepted, counts in rounds:
        tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (b, TREE)), jnp.int32)
        args = (tokens, jnp.asarray(depths), jnp.asarray(masks))
        *want, contiguous = verify(model, *args, contiguous, hidden_layer_ids=layers)
        *got, paged = verify(model, *args, paged, hidden_layer_ids=layers)
        _assert_same([got[0], *got[1]], [want[0], *want[1]], exact)
        contiguous = commit(contiguous, jnp.asarray(accepted), jnp.asarray(counts))
        paged = commit(paged, jnp.asarray(accepted), jnp.asarray(counts))
        _assert_committed(paged, contiguous, exact)

    step = jnp.asarray(rng.integers(0, model.config.vocab_size, (b, 1)), jnp.int32)
    *want, contiguous = prefill(model, step, jnp.ones((b,), jnp.int32), contiguous)
    *got, paged = prefill(model, step, jnp.ones((b,), jnp.int32), paged)
    _assert_same([got[0]], [want[0]], exact)
    _assert_committed(paged, contiguous, exact)


@nnx.jit
def _append_and_propose(target, drafter, cache, hidden, counts, last):
    cache = drafter.append_context(cache, hidden, counts)
    return cache, drafter.propose(target, cache, last)


def test_drafter_context_through_a_paged_cache():
    """``append_context`` then ``propose``, three times: the same draft logits and context."""
    rng = np.random.default_rng(3)
    target = tiny_kimi()
    drafter = tiny_dflash(target)
    page_size, b = 4, len(PROMPTS)
    appends = [np.array([5, 8, 2]), np.array([3, 1, 8]), np.array([8, 5, 1])]  # 8 positions written (one compile)
    # each append writes max(counts) positions after every row's context
    starts = np.cumsum([np.zeros(b, int)] + appends[:-1], axis=0)
    need = np.max([start + counts.max() for start, counts in zip(starts, appends, strict=True)], axis=0)
    table, num_pages, pages_per_slot = _paged_table(rng, need, page_size)
    max_len = pages_per_slot * page_size
    contiguous = drafter.init_cache(b, max_len)
    paged = dataclasses.replace(drafter.init_paged_cache(num_pages, page_size, pages_per_slot, b), page_table=table)
    features = len(drafter.config.target_layer_ids) * target.config.hidden_size
    for counts in appends:
        hidden = jnp.asarray(rng.standard_normal((b, int(counts.max()), features)), jnp.float32)
        last = jnp.asarray(rng.integers(0, target.config.vocab_size, (b,)), jnp.int32)
        contiguous, want = _append_and_propose(target, drafter, contiguous, hidden, jnp.asarray(counts), last)
        paged, got = _append_and_propose(target, drafter, paged, hidden, jnp.asarray(counts), last)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        lengths = np.asarray(contiguous.lengths)
        np.testing.assert_array_equal(np.asarray(paged.lengths), lengths)
        for pool, buf in zip(paged.k + paged.v, contiguous.k + contiguous.v, strict=True):
            view = np.asarray(gather_positions(pool, table, max_len))
            for r, n in enumerate(lengths):
                np.testing.assert_array_equal(view[r, :n], np.asarray(buf[r, :n]))
