"""The Hopper MLA kernel (Mosaic GPU, in its interpreter on the CPU) == plain references.

The interpreter runs the kernel's TMA copies, barriers, key splits, masks and online softmax; it
has no rules for ``wgmma``, so the two products run as plain dots there (the compiled kernel's
``wgmma`` is checked on the GPU: tests/test_gpu.py). Each interpreted call takes seconds: the
cases are few and small.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.backend import Backend
from ddtree_jax.models.latent_attention import (
    cache_slots,
    hopper_runs,
    latent_attention_reference,
    prefix_block_attention,
)
from ddtree_jax.models.tree_cache import BlockMask, tree_block_mask
from pallas_kernels.mosaic_gpu.mla_prefix import auto_splits, prefix_attention, split_size, supports

_LOG2E = float(np.log2(np.e))


@pytest.fixture(autouse=True, scope="module")
def _compile_each_thread_program_once():
    """The interpreter runs a kernel call's CTAs one after another, each as concurrent thread
    programs (one jaxpr per call, the grid point and thread id among its arguments), and its
    ``thread_map._run_jaxpr`` traces and compiles that jaxpr again for every thread of every CTA.
    Here each (jaxpr, thread id) is compiled once and the executable reused by every CTA: the same
    programs run on the same inputs, only the recompilation is skipped. One executable per thread
    id, not one for all: the threads of a CTA wait on each other at barriers, and concurrent runs
    of one executable do not get that far. Applied only where the interpreter has that function."""
    from jax._src import core

    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        thread_map = None
    if not hasattr(thread_map, "_run_jaxpr"):
        yield
        return
    compiled, lock = {}, threading.Lock()

    def run(jaxpr, consts, thread_id, *args):
        key = (jaxpr, int(thread_id))
        with lock:
            program = compiled.get(key)
        if program is None:
            traced = jax.jit(core.eval_jaxpr, static_argnums=0).trace(jaxpr, consts, thread_id, *args)
            program = traced.lower().compile()
            with lock:
                compiled[key] = program
        program(consts, thread_id, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thread_map, "_run_jaxpr", run)
        yield


def _interpreter():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _arr(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(jnp.bfloat16)


def test_splits_equal_a_plain_softmax_per_split():
    """Every written split's normalised output and log-sum-exp against float32 numpy: rows of
    several lengths (one ending at the cache's last slot, where the last tile is moved back to
    stay inside a cache that is not a multiple of 64 slots; one of a single key), splits a row
    does not reach left alone."""
    rng = np.random.default_rng(0)
    b, rows, r, dr, s = 3, 128, 128, 64, 392
    qn, qr, lat, kr = _arr(rng, b, rows, r), _arr(rng, b, rows, dr), _arr(rng, b, s, r), _arr(rng, b, s, dr)
    end = jnp.asarray([392, 1, 300], jnp.int32)
    n, scale = 2, 0.07
    split = split_size(end, n)
    assert int(split[0]) == 256  # ceil(392 / 2) = 196 -> whole tiles -> at least MIN_SPLIT_KEYS
    o, lse = prefix_attention(qn, qr, lat, kr, end, split, scale=scale, n_split=n, interpret=_interpreter())
    f = [np.asarray(x, np.float32) for x in (qn, qr, lat, kr)]
    scores = (np.einsum("bqr,bkr->bqk", f[0], f[2]) + np.einsum("bqd,bkd->bqk", f[1], f[3])) * scale * _LOG2E
    for row in range(b):
        for sp in range(n):
            lo, hi = sp * 256, min(sp * 256 + 256, int(end[row]))
            if hi <= lo:
                continue
            x = scores[row, :, lo:hi]
            m = x.max(-1, keepdims=True)
            p = np.exp2(x - m)
            want_o = (p @ f[2][row, lo:hi]) / p.sum(-1, keepdims=True)
            np.testing.assert_allclose(np.asarray(o[row, sp]), want_o, atol=2e-2, rtol=0)  # P rounded to bf16
            np.testing.assert_allclose(np.asarray(lse[row, sp]), m[:, 0] + np.log2(p.sum(-1)), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("t,tree,starts,n", [
    (1, False, [250, 0], 3),  # decode steps: the token's own key read by the kernel; a row at slot 0
    (3, True, [250, 0], 3),  # tree blocks: a prefix in several splits, and no prefix at all
    (3, False, [100, 389], 1),  # causal blocks, one split; the second ends at the cache's last slot
])
def test_prefix_block_attention_equals_the_reference(t, tree, starts, n):
    """The kernel's splits merged with the block part against the dense float32 reference."""
    rng = np.random.default_rng(t * 10 + n)
    b, h, r, dr, s = 2, 64, 128, 64, 392
    ql, qr, lat, kr = _arr(rng, b, t, h, r), _arr(rng, b, t, h, dr), _arr(rng, b, s, r), _arr(rng, b, s, dr)
    anc = np.zeros((b, t, t), bool)
    if tree:
        anc[0, 1:, 0] = True  # node 0 with two children
        anc[1, 1, 0] = anc[1, 2, 0] = anc[1, 2, 1] = True  # a chain
    within = tree_block_mask(jnp.asarray(anc)) if tree else None
    start = jnp.asarray(starts, jnp.int32)
    got = prefix_block_attention(ql, qr, lat, kr, start, within, scale=0.07, n_split=n, interpret=_interpreter())
    want = latent_attention_reference(*[x.astype(jnp.float32) for x in (ql, qr, lat, kr)], BlockMask(start, within),
                                      scale=0.07)
    assert got.shape == (b, t, h, r) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=0)


def test_kernel_lowers_for_cuda():
    """Pallas' Mosaic GPU lowering of the compiled kernel (wgmma, TMA, barriers, layouts) at K2
    ranks: the lowering rules run on the CPU; ptxas and resource limits only on the GPU."""
    sd = jax.ShapeDtypeStruct
    b, rows, s = 2, 128, 4096
    args = (sd((b, rows, 512), jnp.bfloat16), sd((b, rows, 64), jnp.bfloat16), sd((b, s, 512), jnp.bfloat16),
            sd((b, s, 64), jnp.bfloat16), sd((b,), jnp.int32), sd((1,), jnp.int32))
    text = jax.jit(lambda *a: prefix_attention(*a, scale=0.1, n_split=4)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("t,tree", [(1, False), (3, True)])
def test_paged_kernel_equals_the_contiguous_kernel_on_the_gathered_view(t, tree):
    """Through a page table (pages of 64 positions, shuffled over a pool, a row's tail on a page
    it shares with nothing) the kernel reads the same tiles in the same order as over the gathered
    contiguous cache: the same bits, for decode steps and tree blocks, two splits."""
    from ddtree_jax.models.paged_cache import gather_positions, write_tokens

    rng = np.random.default_rng(7 + t)
    b, h, r, dr, page, pages = 2, 64, 128, 64, 64, 4
    num = 1 + b * pages
    table = jnp.asarray(1 + rng.permutation(b * pages).reshape(b, pages), jnp.int32)
    pool_lat, pool_kr = _arr(rng, num, page, r), _arr(rng, num, page, dr)
    start = jnp.asarray([190, 61], jnp.int32)
    ql, qr = _arr(rng, b, t, h, r), _arr(rng, b, t, h, dr)
    # the block's own latents are in the pools at [start, start + t), as the models write them
    pool_lat = write_tokens(pool_lat, table, start, _arr(rng, b, t, r))
    pool_kr = write_tokens(pool_kr, table, start, _arr(rng, b, t, dr))
    anc = np.zeros((b, t, t), bool)
    if tree:
        anc[:, 1:, 0] = True
    within = tree_block_mask(jnp.asarray(anc)) if tree else None
    paged = prefix_block_attention(ql, qr, pool_lat, pool_kr, start, within, scale=0.07, n_split=2,
                                   interpret=_interpreter(), page_table=table)
    s = pages * page
    lat, kr = gather_positions(pool_lat, table, s), gather_positions(pool_kr, table, s)
    plain = prefix_block_attention(ql, qr, lat, kr, start, within, scale=0.07, n_split=2, interpret=_interpreter())
    np.testing.assert_array_equal(np.asarray(paged, np.float32), np.asarray(plain, np.float32))
    want = latent_attention_reference(*[x.astype(jnp.float32) for x in (ql, qr, lat, kr)], BlockMask(start, within),
                                      scale=0.07)
    np.testing.assert_allclose(np.asarray(paged, np.float32), np.asarray(want), atol=2e-2, rtol=0)


def test_paged_kernel_lowers_for_cuda_and_refuses_pages_off_the_tile():
    sd = jax.ShapeDtypeStruct
    b, rows, n, page = 2, 128, 65, 64
    args = (sd((b, rows, 512), jnp.bfloat16), sd((b, rows, 64), jnp.bfloat16), sd((n, page, 512), jnp.bfloat16),
            sd((n, page, 64), jnp.bfloat16), sd((b,), jnp.int32), sd((1,), jnp.int32), sd((b, 32), jnp.int32))
    text = jax.jit(lambda *a: prefix_attention(*a, scale=0.1, n_split=4)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    z = jnp.zeros
    with pytest.raises(ValueError, match="pages of 32 positions"):
        prefix_attention(z((1, 64, 128), jnp.bfloat16), z((1, 64, 64), jnp.bfloat16), z((4, 32, 128), jnp.bfloat16),
                         z((4, 32, 64), jnp.bfloat16), z((1,), jnp.int32), z((1,), jnp.int32), z((1, 4), jnp.int32),
                         scale=1.0, n_split=1)


def test_paged_attention_takes_the_hopper_kernel_where_latent_attention_would(monkeypatch):
    """On a Hopper GPU (pretended) paged attention over pages of whole 64-key tiles dispatches to
    the Hopper kernel with its table, as ``latent_attention`` does for a contiguous cache; smaller
    pages, and ``hopper=False`` (the batch-invariant mode), keep the Triton kernel."""
    import ddtree_jax.models.latent_attention as la
    import ddtree_jax.models.paged_attention as pa
    import pallas_kernels.triton.mla_attention as triton_mla

    monkeypatch.setattr(la, "_hopper_gpu", lambda: True)
    calls = []
    monkeypatch.setattr(pa, "prefix_block_attention", lambda *a, **k: calls.append(("hopper", k["page_table"])) or a[0])
    monkeypatch.setattr(triton_mla, "mla_attention", lambda *a, **k: calls.append(("triton", k["page_table"])) or a[0])
    compiled = Backend(kernels=True, interpret=False)
    z = jnp.zeros
    q, qr = z((1, 1, 64, 512), jnp.bfloat16), z((1, 1, 64, 64), jnp.bfloat16)
    mask = BlockMask(z((1,), jnp.int32))
    for page, hopper, want in ((64, True, "hopper"), (128, True, "hopper"), (32, True, "triton"),
                               (64, False, "triton")):
        table = z((1, 256 // page), jnp.int32)
        pa.paged_latent_attention(q, qr, z((5, page, 512), jnp.bfloat16), z((5, page, 64), jnp.bfloat16), table,
                                  mask, scale=0.1, backend=compiled, hopper=hopper)
        assert calls[-1][0] == want and calls[-1][1] is table, (page, hopper, calls[-1])


def test_split_heuristics_and_shape_rules():
    s = 36864
    assert auto_splits(1, 64, s) == 132 and auto_splits(16, 64, s) == 8 and auto_splits(1, 65 * 64, s) == 2
    assert auto_splits(16, 16 * 64, s) == 1
    assert auto_splits(1, 64, 4096) == 16  # a 4k cache holds 16 splits of MIN_SPLIT_KEYS: no more CTAs
    assert auto_splits(1, 64, 100) == 1
    assert int(split_size(jnp.asarray([32769]), 132)[0]) == 256  # 249 -> a whole tile -> 256
    assert int(split_size(jnp.asarray([32769, 5]), 8)[0]) == 4160  # the longest row, in whole tiles
    assert supports(64, 512, 64, jnp.bfloat16) and not supports(64, 512, 64, jnp.float32)
    assert not supports(48, 512, 64, jnp.bfloat16)  # not whole 64-row tiles
    assert not supports(64, 512, 64, jnp.bfloat16, stages=3)  # three 72 KiB slots do not fit
    # off an sm_90 GPU (here: interpret mode, the CPU) latent_attention keeps the Triton kernel
    assert not hopper_runs(Backend(kernels=True, interpret=True), 1, 64, 512, 64, jnp.bfloat16, 4096)
    assert not hopper_runs(Backend(kernels=False), 1, 64, 512, 64, jnp.bfloat16, 4096)


def test_caches_are_allocated_in_whole_tma_tiles():
    """Any max_len takes the kernel: init_cache rounds the slots up to a multiple of 8 (the TMA
    tiling), and the rounded cache gives the same logits (the extra slots are never read)."""
    from ddtree_jax.models.kimi import KVCache
    from tests._model_fixtures import tiny_kimi

    assert [cache_slots(n) for n in (1, 8, 9, 1089, 32833)] == [8, 8, 16, 1096, 32840]
    model = tiny_kimi()
    cache = model.init_cache(2, 13)
    assert cache.max_len == 16 and all(a.shape[1] == 16 for a in (*cache.latent, *cache.k_rope))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 5)), jnp.int32)
    lens = jnp.asarray([5, 3], jnp.int32)
    got = model.prefill(ids, lens, cache)[0]
    exact = KVCache(tuple(a[:, :13] for a in cache.latent), tuple(a[:, :13] for a in cache.k_rope), cache.lengths)
    want = model.prefill(ids, lens, exact)[0]  # a cache of exactly 13 slots (not allocated by init_cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_cache_the_hopper_kernel_refuses_is_said(monkeypatch):
    """On a Hopper GPU (pretended here) a cache not in whole TMA tiles keeps the Triton kernel, and
    says so once instead of silently running the slower path."""
    import ddtree_jax.models.latent_attention as la

    monkeypatch.setattr(la, "_hopper_gpu", lambda: True)
    compiled = Backend(kernels=True, interpret=False)
    assert hopper_runs(compiled, 1, 64, 512, 64, jnp.bfloat16, 1096)
    with pytest.warns(UserWarning, match="a cache of 1089 slots takes the Triton kernel"):
        assert not hopper_runs(compiled, 1, 64, 512, 64, jnp.bfloat16, 1089)
    assert not hopper_runs(compiled, 1, 64, 512, 64, jnp.bfloat16, 40)  # too short for the kernel: no warning


def test_bad_shapes_are_refused_by_name():
    z = jnp.zeros
    with pytest.raises(ValueError, match="a cache of 100 slots"):
        prefix_attention(z((1, 64, 128), jnp.bfloat16), z((1, 64, 64), jnp.bfloat16), z((1, 100, 128), jnp.bfloat16),
                         z((1, 100, 64), jnp.bfloat16), z((1,), jnp.int32), z((1,), jnp.int32), scale=1.0, n_split=1)
    with pytest.raises(ValueError, match="do not agree"):
        prefix_attention(z((1, 64, 128), jnp.bfloat16), z((1, 64, 32), jnp.bfloat16), z((1, 128, 128), jnp.bfloat16),
                         z((1, 128, 64), jnp.bfloat16), z((1,), jnp.int32), z((1,), jnp.int32), scale=1.0, n_split=1)
