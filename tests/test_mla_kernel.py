"""MLA attention kernel (Triton, interpret mode) == the dense reference, and the model through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import ExecutionConfig
from ddtree_jax.models.latent_attention import latent_attention_reference
from ddtree_jax.models.tree_cache import BlockMask
from pallas_kernels.triton.mla_attention import auto_split_keys, merge_block, mla_attention
from tests._model_fixtures import forward_uncached, prefill, random_tree, tiny_kimi, verify


def _random_tree_masks(rng, b, t):
    """``[b,t,t]`` ancestor masks, diagonal included, of random trees (parents precede children)."""
    return jnp.asarray(np.stack([random_tree(rng, t)[2] for _ in range(b)]))


def _inputs(rng, b, t, h, r, dr, s, dtype):
    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    return arr(b, t, h, r), arr(b, t, h, dr), arr(b, s, r), arr(b, s, dr)


def _check(case, dtype, split_keys, rng, block_m=16, block_k=16, tol=None):
    b, t, h, r, dr, s, starts, tree = case
    ql, qr, lat, kr = _inputs(rng, b, t, h, r, dr, s, dtype)
    start = jnp.asarray(starts, jnp.int32)
    within = _random_tree_masks(rng, b, t) if tree else None
    scale = 0.7 / np.sqrt(r)
    out = mla_attention(ql, qr, lat, kr, start, within, scale=scale, causal=not tree, block_m=block_m,
                        block_k=block_k, split_keys=split_keys, interpret=True)
    assert out.shape == (b, t, h, r) and out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in (ql, qr, lat, kr)]
    ref = latent_attention_reference(*f32, BlockMask(start, within), scale=scale)
    atol = tol if tol is not None else 2e-6
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=atol, rtol=0)


# (B, T, H, r, dr, S, starts, tree). Tiles of 16 rows x 16 keys; S is never a multiple of 16.
DECODE = (3, 1, 8, 32, 8, 70, [0, 37, 69], False)  # contexts of 1 (start 0), 38 and 70 (= S) keys
VERIFY = (3, 7, 3, 32, 8, 45, [0, 13, 38], True)  # 21 rows: a token straddles the two row tiles
PREFILL = (2, 20, 2, 16, 4, 50, [0, 5], False)  # causal prefill into an empty row and after a prefix


# Each case compiles once (interpret-mode compiles dominate the runtime): the split-keys path runs
# causal (decode) and with a tree (bf16 verify), the one-pass path causal (prefill) and with a
# tree (f32 verify, and the shipped tiles below).
@pytest.mark.parametrize("case,split_keys", [(DECODE, 32), (VERIFY, 0), (PREFILL, 0)],
                         ids=["decode-split", "verify", "prefill"])
def test_kernel_matches_reference_f32(case, split_keys):
    _check(case, jnp.float32, split_keys, np.random.default_rng(case[1]))


def test_kernel_matches_reference_bf16_split():
    # bf16 inputs against the float32 reference on the same rounded inputs: the kernel rounds the
    # probabilities to bf16 for the value product and the output to bf16 (outputs are O(1)).
    _check(VERIFY, jnp.bfloat16, 32, np.random.default_rng(5), tol=2e-2)


def test_kernel_wide_tiles_k2_heads():
    # The bf16 shipped row tile (64 rows = one token's 64 heads) with 64-key tiles: a decode step
    # and a 3-token tree over a context that is not a multiple of the tile, in one call.
    _check((2, 3, 64, 16, 16, 100, [0, 97], True), jnp.float32, 0, np.random.default_rng(6), 64, 64)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape,causal,split_keys,segment_keys", [
    ((2, 17, 64, 512, 64, 1000), False, 512, 512),  # K2 shapes, tree, one program per segment
    ((2, 1, 64, 512, 64, 1000), True, 0, 512),  # K2 decode step, the segments in turn
    ((2, 1, 64, 512, 64, 3000), True, 2048, 512),  # one program per group of 4 segments
    ((3, 5, 3, 24, 6, 140), False, 64, 0),  # ranks that are not powers of two (masked columns), 3 splits
    ((3, 5, 3, 24, 6, 40), True, 0, 0),
])
def test_kernel_lowers_to_triton(shape, causal, split_keys, segment_keys, dtype):
    """Interpret mode skips the Triton lowering rules; lowering for CUDA (no GPU needed) runs them
    (it does not compile to PTX, so shared-memory limits are left to the GPU tests)."""
    b, t, h, r, dr, s = shape
    sd = jax.ShapeDtypeStruct
    args = (sd((b, t, h, r), dtype), sd((b, t, h, dr), dtype), sd((b, s, r), dtype), sd((b, s, dr), dtype),
            sd((b,), jnp.int32), None if causal else sd((b, t, t), jnp.bool_))

    def attend(*a):
        return mla_attention(*a, scale=0.1, causal=causal, split_keys=split_keys, segment_keys=segment_keys,
                             segment_group=4 if segment_keys else 1)

    text = jax.jit(attend).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mla_attention" in text


def test_split_keys_heuristic():
    assert auto_split_keys(1, 64, 32768) == 512  # decode, B=1: 64 splits
    assert auto_split_keys(16, 64, 32768) == 2048  # 16 rows x 16 splits
    assert auto_split_keys(16, 257 * 64, 32768) == 0  # 4112 programs: no split
    assert auto_split_keys(1, 64, 512) == 0  # a short cache is one split


def test_merge_tiles_heuristic_and_bits():
    """The split merge's tiles: the attention's rows and 64 columns when the launch fills the GPU,
    smaller at small batch (K2 decode at B=1: 8 programs otherwise); the output's bits do not
    depend on them (a causal verify block: rows of one tile reach different splits)."""
    assert merge_block(1, 64, 512, 64) == (16, 16)  # decode B=1: 128 programs, not 8
    assert merge_block(16, 64, 512, 64) == (64, 16)  # decode B=16: 512 programs
    assert merge_block(16, 257 * 64, 512, 64) == (64, 64)
    b, t, h, r, dr, s = 2, 5, 8, 80, 8, 90  # r = 80: several column blocks, the last one masked
    ql, qr, lat, kr = _inputs(np.random.default_rng(11), b, t, h, r, dr, s, jnp.float32)
    start = jnp.asarray([3, 80], jnp.int32)
    outs = [np.asarray(mla_attention(ql, qr, lat, kr, start, scale=0.1, causal=True, block_m=32, block_k=16,
                                     split_keys=32, merge_tiles=tiles, interpret=True))
            for tiles in [(32, 64), (16, 16), (32, 16), (16, 32)]]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(ValueError, match="merge_tiles"):
        mla_attention(ql, qr, lat, kr, start, scale=0.1, causal=True, block_m=32, block_k=16, split_keys=32,
                      merge_tiles=(64, 16), interpret=True)


def test_bad_arguments():
    ql, qr, lat, kr = _inputs(np.random.default_rng(0), 1, 2, 2, 16, 16, 8, jnp.float32)
    start = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="exactly one"):
        mla_attention(ql, qr, lat, kr, start, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="shapes"):
        mla_attention(ql, qr[..., :8], lat, kr, start, scale=1.0, causal=True, interpret=True)


def test_model_prefill_verify_through_kernel():
    """KimiForCausalLM(impl="pallas") == impl="reference" (float32): prefill, then a tree verify,
    and the cache-free forward (the reference keeps its transformers parity: tests/test_kimi.py)."""
    base = tiny_kimi(3)
    rng = np.random.default_rng(7)
    b, t, n = 2, 9, 6
    prompt = jnp.asarray(rng.integers(0, base.config.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.asarray([t, 4], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, base.config.vocab_size, (b, n)), jnp.int32)
    trees = [random_tree(rng, n) for _ in range(b)]
    depths = jnp.asarray(np.stack([tr[1] for tr in trees]))
    anc = jnp.asarray(np.stack([tr[2] & ~np.eye(n, dtype=bool) for tr in trees]))
    results = {}
    for impl in ("reference", "pallas"):
        model = base.with_execution(ExecutionConfig(impl=impl))
        logits_p, _, cache = prefill(model, prompt, lengths, model.init_cache(b, 24))
        logits_v, _, cache = verify(model, tokens, depths, anc, cache)
        results[impl] = (logits_p, logits_v, jnp.stack(cache.latent), forward_uncached(model, prompt)[0])
    for got, want in zip(results["pallas"], results["reference"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-4)])
@pytest.mark.parametrize("t,split_keys,tree", [(1, 512, False), (65, 0, True), (17, 512, True), (256, 0, False)])
def test_compiled_kernel_k2_shapes(t, split_keys, tree, dtype, tol):
    """The compiled kernel (shipped tiles) at Kimi K2 attention shapes against the float32 reference."""
    b, h, r, dr, s = 2, 64, 512, 64, 3000
    rng = np.random.default_rng(t)
    ql, qr, lat, kr = _inputs(rng, b, t, h, r, dr, s, dtype)
    start = jnp.asarray([0, s - t - 3], jnp.int32)
    within = _random_tree_masks(rng, b, t) if tree else None
    out = mla_attention(ql, qr, lat, kr, start, within, scale=0.13, causal=not tree, split_keys=split_keys)
    f32 = [x.astype(jnp.float32) for x in (ql, qr, lat, kr)]
    with jax.default_matmul_precision("highest"):
        ref = latent_attention_reference(*f32, BlockMask(start, within), scale=0.13)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=0)


def test_segments_make_rows_batch_invariant():
    """With fixed ``segment_keys`` a row's bits do not depend on the batch, the block length or the
    split: the root of a 5-token tree block in a batch of 3 (one program per segment, and the
    segments in turn) == the same row alone as a one-token decode step, and so do the rows of a
    chain block (its tokens in consecutive slots); all near the reference. r = 96: the merge runs
    in two column programs, the second half masked."""
    rng = np.random.default_rng(11)
    b, t, h, r, dr, s, seg = 3, 5, 16, 96, 8, 100, 16
    ql, qr, lat, kr = _inputs(rng, b, t, h, r, dr, s, jnp.float32)
    start = jnp.asarray([0, 40, 90], jnp.int32)
    within = _random_tree_masks(rng, b, t)
    kw = dict(scale=0.3, block_m=16, block_k=16, segment_keys=seg, segment_group=3, interpret=True)
    whole = mla_attention(ql, qr, lat, kr, start, within, **kw)
    for split in (seg, 3 * seg):  # a program per segment, per group of 3 segments
        got = mla_attention(ql, qr, lat, kr, start, within, split_keys=split, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(whole))
    chain = mla_attention(ql, qr, lat, kr, start, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)),
                          **kw)
    for row in range(b):
        sl = slice(row, row + 1)
        one = mla_attention(ql[sl, :1], qr[sl, :1], lat[sl], kr[sl], start[sl], causal=True, **kw)
        np.testing.assert_array_equal(np.asarray(one[0, 0]), np.asarray(whole[row, 0]))
        for d in range(1, t):  # a chain's rows (consecutive slots) == decode steps at start + d
            if start[row] + d < s:
                one = mla_attention(ql[sl, d:d + 1], qr[sl, d:d + 1], lat[sl], kr[sl], start[sl] + d, causal=True,
                                    split_keys=seg, **kw)
                np.testing.assert_array_equal(np.asarray(one[0, 0]), np.asarray(chain[row, d]))
    ref = latent_attention_reference(ql, qr, lat, kr, BlockMask(start, within), scale=0.3)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(ref), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="segment_keys"):
        mla_attention(ql, qr, lat, kr, start, within, split_keys=2 * seg, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_segments_bitwise_k2_shapes(dtype):
    """Compiled, K2 shapes: with 512-key segments, one program per segment == the segments in
    turn, bit for bit, and a 17-token chain block's rows == 17 decode steps at B=1 over the same
    cache (the compiler must contract the fold's float32 expressions alike in both kernels)."""
    b, t, h, r, dr, s, seg = 4, 17, 64, 512, 64, 3000, 512
    rng = np.random.default_rng(1)
    ql, qr, lat, kr = _inputs(rng, b, t, h, r, dr, s, dtype)
    start = jnp.asarray([0, 700, 2047, s - t], jnp.int32)
    kw = dict(scale=0.13, segment_keys=seg, segment_group=4)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    whole = mla_attention(ql, qr, lat, kr, start, chain, **kw)
    for split in (seg, 4 * seg):
        got = mla_attention(ql, qr, lat, kr, start, chain, split_keys=split, **kw)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(whole, np.float32))
    for row in range(b):
        sl = slice(row, row + 1)
        for d in (0, 5, t - 1):
            one = mla_attention(ql[sl, d:d + 1], qr[sl, d:d + 1], lat[sl], kr[sl], start[sl] + d, causal=True,
                                split_keys=seg, **kw)
            np.testing.assert_array_equal(np.asarray(one[0, 0], np.float32), np.asarray(whole[row, d], np.float32))
