"""Paged caches (``ddtree_jax/models/paged_cache.py``): each operation == the contiguous one on the
gathered view, scattered back through the table (position by position, ``tests/_paged_layouts.py``),
on random tables whose pages are shuffled across rows, with a shared read-only prefix page, writes
that reach null entries and writes past the table."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models._layers import write_rows
from ddtree_jax.models.paged_cache import (
    NULL_PAGE,
    PagedDraftCache,
    PagedKVCache,
    commit_path,
    gather_positions,
    read_tokens,
    write_tokens,
)
from ddtree_jax.models.tree_cache import commit_accepted
from tests._model_fixtures import path_to, random_tree
from tests._paged_layouts import plain_gather, plain_scatter, random_page_table, random_pool

PAGES_PER_SLOT = 4


def _layout(rng, page_size, tail):
    """Three rows over 4-entry tables: rows 0 and 1 own 3 pages (row 1's first is row 0's first,
    shared), row 2 all 4; a float32 pool of random entries. Starts: row 0 writes inside its pages,
    row 1 into its null 4th entry, row 2 past the table (all above the shared page)."""
    table, num_pages = random_page_table(rng, [3, 3, 4], PAGES_PER_SLOT, shared=1)
    pool = random_pool(rng, num_pages, page_size, *tail)
    start = np.array([page_size + 1, 2 * page_size + 2, 3 * page_size + 1], np.int32)
    return pool, table, start


@pytest.mark.parametrize("page_size,tail,dtype", [(4, (3,), jnp.float32), (8, (2, 3), jnp.bfloat16)])
def test_write_tokens_is_write_rows_on_the_view(page_size, tail, dtype):
    rng = np.random.default_rng(page_size)
    pool, table, start = _layout(rng, page_size, tail)
    pool = np.asarray(jnp.asarray(pool, dtype))
    t = page_size + 3  # crosses a page boundary in every row
    values = rng.standard_normal((3, t, *tail)).astype(np.float32)
    got = write_tokens(jnp.asarray(pool), jnp.asarray(table), jnp.asarray(start), jnp.asarray(values))
    view = plain_gather(pool, table, PAGES_PER_SLOT * page_size + t)
    want = plain_scatter(pool, table, write_rows(jnp.asarray(view), jnp.asarray(values), jnp.asarray(start)))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.asarray(got[NULL_PAGE], np.float32).any()


@pytest.mark.parametrize("page_size", [2, 8])
def test_commit_path_is_commit_accepted_on_the_view(page_size):
    rng = np.random.default_rng(10 + page_size)
    pool, table, start = _layout(rng, page_size, (5,))
    t, a = 6, 4
    accepted = np.full((3, a), -1, np.int32)
    for b in range(3):
        parents = random_tree(rng, t)[0]
        path = path_to(parents, int(rng.integers(0, t)))[:a]
        accepted[b, :len(path)] = path
    accepted[0] = [0, 2, 3, 5]  # a path as long as the commit
    got = commit_path(jnp.asarray(pool), jnp.asarray(table), jnp.asarray(start), jnp.asarray(accepted))
    view = plain_gather(pool, table, PAGES_PER_SLOT * page_size + t)
    want = plain_scatter(pool, table, commit_accepted(jnp.asarray(view), jnp.asarray(start), jnp.asarray(accepted)))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert not np.asarray(got[NULL_PAGE]).any()


def test_gather_and_read_positions():
    rng = np.random.default_rng(3)
    page_size = 4
    pool, table, _ = _layout(rng, page_size, (2, 3))
    pool_j, table_j = jnp.asarray(pool), jnp.asarray(table)
    for length in (0, 5, 8, PAGES_PER_SLOT * page_size):
        np.testing.assert_array_equal(np.asarray(gather_positions(pool_j, table_j, length)),
                                      plain_gather(pool, table, length))
    with pytest.raises(ValueError, match="length"):
        gather_positions(pool_j, table_j, PAGES_PER_SLOT * page_size + 1)
    span = PAGES_PER_SLOT * page_size + 6
    positions = rng.integers(0, span, (3, 9)).astype(np.int32)
    want = np.take_along_axis(plain_gather(pool, table, span), positions[..., None, None], axis=1)
    np.testing.assert_array_equal(np.asarray(read_tokens(pool_j, table_j, jnp.asarray(positions))), want)


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_caches_rows_act_on_tables_and_lengths(kind):
    """``init`` shapes and dtypes; ``take_rows`` / ``put_rows`` (the engine's prefill pattern: take
    rows, write through them, put them back) move tables and lengths, the pools stay shared."""
    if kind == "target":
        cache = PagedKVCache.init(7, 4, 3, 2, num_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, dtype=jnp.bfloat16)
        pools, tails = ("latent", "k_rope"), [(8,), (4,)]
    else:
        cache = PagedDraftCache.init(7, 4, 3, 2, num_layers=2, kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
        pools, tails = ("k", "v"), [(2, 8), (2, 8)]
    for name, tail in zip(pools, tails, strict=True):
        assert [(a.shape, a.dtype) for a in getattr(cache, name)] == [((7, 4, *tail), jnp.bfloat16)] * 2
    assert cache.page_size == 4 and cache.pages_per_slot == 3 and cache.max_len == 12
    assert cache.page_table.shape == (2, 3) and not cache.page_table.any() and not cache.lengths.any()
    cache = dataclasses.replace(cache, page_table=jnp.asarray([[1, 2, 0], [3, 4, 5]], jnp.int32),
                                lengths=jnp.asarray([5, 9], jnp.int32))
    rows = jnp.asarray([1])
    sub = jax.jit(lambda c: c.take_rows(rows))(cache)
    np.testing.assert_array_equal(sub.page_table, [[3, 4, 5]])
    np.testing.assert_array_equal(sub.lengths, [9])
    assert all(x.shape == y.shape for x, y in zip(getattr(sub, pools[0]), getattr(cache, pools[0]), strict=True))

    def append(c):
        new = {name: tuple(write_tokens(a, c.page_table, c.lengths, jnp.ones((1, 2, *tail)))
                           for a in getattr(c, name)) for name, tail in zip(pools, tails, strict=True)}
        return dataclasses.replace(c, lengths=c.lengths + 2, **new)

    back = jax.jit(lambda c, s: c.put_rows(rows, append(s)))(cache, sub)
    np.testing.assert_array_equal(back.page_table, cache.page_table)
    np.testing.assert_array_equal(back.lengths, [5, 11])
    for name in pools:
        for before, after in zip(getattr(cache, name), getattr(back, name), strict=True):
            views = [np.asarray(gather_positions(x, cache.page_table, 12), np.float32) for x in (before, after)]
            np.testing.assert_array_equal(views[1][0], views[0][0])  # row 0 untouched
            assert (views[1][1, 9:11] == 1).all() and not views[1][1, :9].any()
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache.init(7, 6, 3, 2, num_layers=1, kv_lora_rank=8, qk_rope_head_dim=4, dtype=jnp.float32)
    with pytest.raises(ValueError, match="reserved"):
        PagedDraftCache.init(1, 4, 3, 2, num_layers=1, kv_heads=2, head_dim=8, dtype=jnp.float32)
