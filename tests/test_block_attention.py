"""The draft block's attention: the Triton kernel (interpret mode) against the plain-JAX reference
on fresh random inputs (context lengths from 0 to the whole cache, GQA, causal and sliding
layers, contexts over several of the kernel's chunks), and the kernel's rows independent of the
batch they run in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.backend import Backend
from ddtree_jax.models.block_attention import block_attention, block_attention_reference

KERNEL = Backend(kernels=True, interpret=True, family="triton")


def _inputs(seed, b, s, t, n, k, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32).at[0].set(s).at[-1].set(0)
    return arr(b, t, n, d), arr(b, s, k, d), arr(b, s, k, d), arr(b, t, k, d), arr(b, t, k, d), lengths


@pytest.mark.parametrize("s,t,n,k,d,causal,window", [
    (64, 16, 6, 2, 64, False, None),   # the shipped drafter's shapes
    (40, 5, 4, 2, 16, False, None),    # a cache length no tile divides (padded), a short block
    (48, 5, 4, 4, 16, True, None),     # causal, no grouping
    (80, 7, 6, 3, 32, False, 9),       # sliding window
    (1100, 4, 2, 1, 16, True, 300),    # over two chunks, causal and windowed
])
def test_kernel_matches_reference(s, t, n, k, d, causal, window):
    args = _inputs(s + t, 3, s, t, n, k, d)
    kw = dict(causal=causal, window=window, scale=d**-0.5)
    got = block_attention(*args, backend=KERNEL, **kw)
    want = block_attention_reference(*args, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_rows_result_does_not_depend_on_the_batch_or_the_cache_length():
    q, kc, vc, kb, vb, lengths = _inputs(7, 4, 64, 16, 6, 2, 64, jnp.bfloat16)
    kw = dict(causal=False, window=None, scale=0.125, backend=KERNEL)
    whole = block_attention(q, kc, vc, kb, vb, lengths, **kw)
    pad = ((0, 0), (0, 64), (0, 0), (0, 0))  # the same rows in a longer cache, alone
    alone = block_attention(q[1:2], jnp.pad(kc[1:2], pad), jnp.pad(vc[1:2], pad), kb[1:2], vb[1:2], lengths[1:2], **kw)
    np.testing.assert_array_equal(np.asarray(whole[1:2].astype(jnp.float32)), np.asarray(alone.astype(jnp.float32)))


def test_context_past_the_length_is_never_read():
    q, kc, vc, kb, vb, lengths = _inputs(3, 2, 64, 16, 6, 2, 64)
    kw = dict(causal=False, window=None, scale=0.125, backend=KERNEL)
    stale = jnp.arange(64)[None, :, None, None] >= lengths[:, None, None, None]
    got = block_attention(q, jnp.where(stale, jnp.nan, kc), jnp.where(stale, jnp.nan, vc), kb, vb, lengths, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(block_attention(q, kc, vc, kb, vb, lengths, **kw)),
                               rtol=1e-6, atol=1e-6)
    assert not jax.numpy.isnan(got).any()


@pytest.mark.parametrize("page_size,pages", [(16, 5), (64, 20)])
def test_paged_context_matches_the_contiguous_one(page_size, pages):
    """The context read through a page table (rows on scattered pages of one pool) gives the
    contiguous result, for the kernel (which reads the pages in place) and for the reference."""
    b, t, n, k, d = 3, 5, 4, 2, 16
    s = pages * page_size
    q, kc, vc, kb, vb, lengths = _inputs(page_size, b, s, t, n, k, d)
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.permutation(b * pages + 3)[: b * pages].reshape(b, pages), jnp.int32)
    pool_k = jnp.zeros((b * pages + 3, page_size, k, d)).at[table].set(kc.reshape(b, pages, page_size, k, d))
    pool_v = jnp.zeros((b * pages + 3, page_size, k, d)).at[table].set(vc.reshape(b, pages, page_size, k, d))
    kw = dict(causal=False, window=None, scale=d**-0.5)
    want = block_attention_reference(q, kc, vc, kb, vb, lengths, **kw)
    for backend in (KERNEL, Backend(kernels=False)):
        got = block_attention(q, pool_k, pool_v, kb, vb, lengths, page_table=table, backend=backend, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
