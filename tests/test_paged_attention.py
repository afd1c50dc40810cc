"""MLA attention over paged caches: the Triton kernel through its page table (interpret mode) ==
the dense reference on the contiguous caches gathered position by position, for decode, tree
verify and causal prefill blocks, float32 and bf16, several page sizes, random tables (pages
shuffled across rows, a shared prefix page); ``paged_latent_attention``'s dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.backend import Backend
from ddtree_jax.models.latent_attention import latent_attention, latent_attention_reference
from ddtree_jax.models.paged_attention import paged_latent_attention, paged_latent_attention_reference
from ddtree_jax.models.tree_cache import BlockMask
from pallas_kernels.triton.mla_attention import mla_attention
from tests._model_fixtures import random_tree
from tests._paged_layouts import plain_gather, random_page_table, random_pool

KERNELS = Backend(kernels=True, interpret=True)
REFERENCE = Backend(kernels=False)


def _inputs(rng, b, t, h, r, dr, page_size, pages, starts, tree, dtype):
    """Queries, pools and a table whose rows own the pages their ``start + T`` positions need
    (row 1 shares row 0's first page when both rows start past it); the block mask."""
    need = [-(-(s + t) // page_size) for s in starts]
    shared = 1 if len(starts) > 1 and min(starts[:2]) >= page_size else 0
    table, num_pages = random_page_table(rng, need, pages, shared=shared)

    def cast(x):
        return jnp.asarray(x, jnp.float32).astype(dtype)

    ql, qr = (cast(rng.standard_normal((b, t, h, d))) for d in (r, dr))
    lat, kr = (cast(random_pool(rng, num_pages, page_size, d)) for d in (r, dr))
    within = jnp.asarray(np.stack([random_tree(rng, t)[2] for _ in range(b)])) if tree else None
    return ql, qr, lat, kr, jnp.asarray(table), BlockMask(jnp.asarray(starts, jnp.int32), within)


def _reference(ql, qr, lat, kr, table, mask, scale):
    """The float32 dense reference on the position-by-position gathered caches."""
    s = table.shape[1] * lat.shape[1]
    f32 = [jnp.asarray(x, jnp.float32) for x in (ql, qr, plain_gather(np.asarray(lat, np.float32), table, s),
                                                  plain_gather(np.asarray(kr, np.float32), table, s))]
    return latent_attention_reference(*f32, mask, scale=scale)


# (B, T, H, r, dr, page size, pages per slot, starts, tree, split_keys, dtype, tolerance); 16 x 16 tiles.
# A float32 prefill runs in the dispatch test below.
CASES = {
    "decode-split-f32": (3, 1, 8, 32, 8, 16, 5, [20, 37, 79], False, 32, jnp.float32, 2e-6),
    "decode-bf16": (3, 1, 8, 32, 8, 32, 3, [0, 40, 95], False, 0, jnp.bfloat16, 2e-2),
    "verify-f32": (3, 7, 3, 32, 8, 32, 2, [33, 40, 0], True, 0, jnp.float32, 2e-6),
    "verify-split-bf16": (3, 7, 3, 32, 8, 16, 4, [18, 20, 57], True, 32, jnp.bfloat16, 2e-2),
    "prefill-bf16": (2, 20, 2, 16, 4, 64, 1, [0, 30], False, 0, jnp.bfloat16, 2e-2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_kernel_matches_reference(name):
    b, t, h, r, dr, page_size, pages, starts, tree, split, dtype, tol = CASES[name]
    rng = np.random.default_rng(len(name) + t)
    ql, qr, lat, kr, table, mask = _inputs(rng, b, t, h, r, dr, page_size, pages, starts, tree, dtype)
    scale = 0.7 / np.sqrt(r)
    out = mla_attention(ql, qr, lat, kr, mask.start, mask.within, scale=scale, causal=mask.causal, block_m=16,
                        block_k=16, split_keys=split, interpret=True, page_table=table)
    assert out.shape == (b, t, h, r) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(_reference(ql, qr, lat, kr, table, mask, scale)),
                               atol=tol, rtol=0)


def test_dispatch_kernel_equals_contiguous_kernel_bitwise():
    """``paged_latent_attention`` with kernels == ``latent_attention``'s Triton kernel over the
    gathered caches, bit for bit (same tiles, split and segments: 32-key segments in groups of 2
    over 96 positions), for a causal prefill block after a shared prefix; the reference backend ==
    the dense reference."""
    b, t, h, r, dr, page_size, pages = 3, 12, 2, 32, 8, 32, 3
    rng = np.random.default_rng(21)
    ql, qr, lat, kr, table, mask = _inputs(rng, b, t, h, r, dr, page_size, pages, [40, 33, 0], False, jnp.float32)
    kw = dict(scale=0.2, segment_keys=32, segment_group=2)
    paged = paged_latent_attention(ql, qr, lat, kr, table, mask, backend=KERNELS, **kw)
    s = pages * page_size
    contiguous = latent_attention(ql, qr, jnp.asarray(plain_gather(lat, table, s)),
                                  jnp.asarray(plain_gather(kr, table, s)), mask, backend=KERNELS, hopper=False, **kw)
    np.testing.assert_array_equal(np.asarray(paged), np.asarray(contiguous))
    want = _reference(ql, qr, lat, kr, table, mask, 0.2)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(want), atol=2e-6, rtol=0)
    ref = paged_latent_attention(ql, qr, lat, kr, table, mask, backend=REFERENCE, **kw)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(
        paged_latent_attention_reference(ql, qr, lat, kr, table, mask, scale=0.2)))


@pytest.mark.parametrize("causal", [True, False])
def test_paged_kernel_lowers_to_triton(causal):
    """The Triton lowering rules (no GPU needed) for the paged kernel at K2 ranks, bf16 tiles,
    fixed segments and splits."""
    b, t, h, r, dr, n, page_size, pages = 2, 1 if causal else 17, 64, 512, 64, 40, 64, 16
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, r), jnp.bfloat16), sd((b, t, h, dr), jnp.bfloat16), sd((n, page_size, r), jnp.bfloat16),
            sd((n, page_size, dr), jnp.bfloat16), sd((b,), jnp.int32), None if causal else sd((b, t, t), jnp.bool_),
            sd((b, pages), jnp.int32))

    def attend(ql, qr, lat, kr, start, within, table):
        return mla_attention(ql, qr, lat, kr, start, within, scale=0.1, causal=causal, split_keys=512,
                             segment_keys=512, segment_group=1, page_table=table)

    text = jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_attention" in text


def test_bad_arguments():
    rng = np.random.default_rng(0)
    ql, qr, lat, kr, table, mask = _inputs(rng, 2, 1, 2, 16, 16, 16, 2, [3, 5], False, jnp.float32)
    with pytest.raises(ValueError, match="multiple of block_k"):
        mla_attention(ql, qr, lat, kr, mask.start, scale=1.0, causal=True, block_k=32, interpret=True,
                      page_table=table)
    with pytest.raises(ValueError, match="shapes"):
        mla_attention(ql, qr, lat, kr, mask.start, scale=1.0, causal=True, interpret=True, page_table=table[:1])
    small = [x[:, :8] for x in (lat, kr)]
    with pytest.raises(ValueError, match="power of two"):
        paged_latent_attention(ql, qr, *small, table, mask, scale=1.0, backend=KERNELS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-4)])
@pytest.mark.parametrize("t,tree", [(1, False), (17, True), (256, False)])
@pytest.mark.parametrize("hopper", [False, True])
def test_compiled_paged_kernel_k2_shapes(t, tree, dtype, tol, hopper):
    """The compiled dispatch (shipped tiles, the model's segments) at Kimi K2 attention shapes over
    64-position pages: bit for bit ``latent_attention``'s kernel on the gathered caches (the
    Triton kernel; with ``hopper``, the Hopper kernel where ``latent_attention`` takes it: bf16),
    and near the float32 reference."""
    b, h, r, dr, page_size, pages = 2, 64, 512, 64, 64, 48
    rng = np.random.default_rng(t)
    starts = [page_size + 5, pages * page_size - t - 3]
    ql, qr, lat, kr, table, mask = _inputs(rng, b, t, h, r, dr, page_size, pages, starts, tree, dtype)
    gpu = Backend(kernels=True)
    paged = paged_latent_attention(ql, qr, lat, kr, table, mask, scale=0.13, backend=gpu, hopper=hopper)
    s = pages * page_size
    contiguous = latent_attention(ql, qr, jnp.asarray(plain_gather(lat, table, s)),
                                  jnp.asarray(plain_gather(kr, table, s)), mask, scale=0.13, backend=gpu, hopper=hopper)
    np.testing.assert_array_equal(np.asarray(paged, np.float32), np.asarray(contiguous, np.float32))
    with jax.default_matmul_precision("highest"):
        want = _reference(ql, qr, lat, kr, table, mask, 0.13)
    np.testing.assert_allclose(np.asarray(paged, np.float32), np.asarray(want), atol=tol, rtol=0)
