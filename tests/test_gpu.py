"""The compiled Pallas kernels on a GPU against their plain-JAX references (``-m gpu``; skipped
without a GPU). Interpret mode (the other kernel tests) does not check backend rules: these do.

    python -m pytest -m gpu -q
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.sampling import SamplingBatch, target_logprobs
from pallas_kernels.triton.fused_sample import fused_sample_debug
from tests._model_fixtures import tiny_dflash, tiny_kimi
from tests._random_inputs import random_draft_logits

pytestmark = pytest.mark.gpu

TREE_FIELDS = ["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"]


@pytest.mark.parametrize("B,L,V,budget", [(16, 15, 163_840, 256), (3, 7, 1000, 100), (2, 5, 37, 300), (1, 1, 7, 3)])
def test_tree_builder_equals_reference(B, L, V, budget):
    """The kernel build with the reference's normaliser (``lse="xla"``) == the reference build, bit
    for bit; the compiled default (the normaliser fused into the top-k) == the reference pop loop
    on ``lax.top_k`` of the log-probabilities under the kernel's own normaliser."""
    from ddtree_jax import tree as tree_mod
    from ddtree_jax.backend import resolve_backend
    from pallas_kernels.triton.vocab_top_k import vocab_top_k, vocab_top_k_with_stats

    backend = resolve_backend("pallas")
    k = min(budget, V)
    for logits in (random_draft_logits(B + V, B, L, V), np.round(random_draft_logits(budget, B, L, V))):
        x = jnp.asarray(logits)
        ref = dt.build_draft_tree(x, budget, impl="reference")
        ker = tree_mod._tree_from_tables(*vocab_top_k(x, k, lse="xla"), budget, backend)
        for f in TREE_FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)
        fused = dt.build_draft_tree(x, budget, impl="pallas")
        stats = vocab_top_k_with_stats(x, k, lse="kernel")
        lq = (x.astype(jnp.float32) - stats["max"][..., None]) - stats["lse"][..., None]
        top_lq, top_ids = jax.lax.top_k(lq, k)
        fields = jax.vmap(lambda a, i: tree_mod._best_first_one(a, i, budget=budget))(top_lq, top_ids)
        fields["ancestor_mask"] = tree_mod.ancestor_mask_from_parents(fields["parents"], fields["valid"], L)
        for f in TREE_FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(fused, f)), np.asarray(fields[f]), err_msg=f"fused {f}")


@pytest.mark.parametrize("lse", ["xla", "kernel"])
def test_vocab_top_k_full_vocabulary(lse):
    """Triton vocab top-k at the tree's real size (B*L = 240 rows of 163,840 bf16), Gaussian and
    rounded rows: lse="xla" == lax.top_k(draft_logprobs) bit for bit; lse="kernel" is exact for its own
    normaliser, which is within 1e-6 of XLA's."""
    from pallas_kernels.triton.vocab_top_k import vocab_top_k_with_stats

    raw = random_draft_logits(163_840, 16, 15, 163_840)
    for logits in (raw, np.round(raw * 2) / 2):
        x = jnp.asarray(logits).astype(jnp.bfloat16)
        out = vocab_top_k_with_stats(x, 256, lse=lse)
        x32 = x.astype(jnp.float32)
        if lse == "xla":
            want = jax.lax.top_k(dt.draft_logprobs(x32), 256)
        else:
            want = jax.lax.top_k((x32 - out["max"][..., None]) - out["lse"][..., None], 256)
            ref_lse = jnp.log(jnp.sum(jnp.exp(x32 - out["max"][..., None]), -1))
            np.testing.assert_allclose(np.asarray(out["lse"]), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out["indices"]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(out["values"]), np.asarray(want[0]))


def test_accept_walk_equals_reference():
    rng = np.random.default_rng(0)
    tree = dt.build_draft_tree(jnp.asarray(random_draft_logits(1, 8, 15, 500)), 128, impl="reference")
    tree = tree.with_root_tokens(jnp.zeros((8,), jnp.int32))
    tk, fc = np.asarray(tree.tokens), np.asarray(tree.first_child)
    deep = np.where(fc >= 0, np.take_along_axis(tk, np.maximum(fc, 0), 1), 7)
    smp = jnp.asarray(np.where(rng.random(tk.shape) < 0.85, deep, rng.integers(0, 500, tk.shape)).astype(np.int32))
    ker, ref = dt.accept_path(tree, smp, impl="pallas"), dt.accept_path(tree, smp, impl="reference")
    for f in ("path", "num_accepted", "bonus", "committed"):
        np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)


# (temperature, top_k, top_p, min_p); 1e-6 reaches the kernel as a sampled temperature (the
# greedy threshold is applied by ddtree_jax before the kernel): it must stay finite.
CONFIGS = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.7, 50, 0.9, 0.0), (0.6, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.1),
           (0.7, 1000, 1.0, 0.0), (1e-6, 0, 1.0, 0.0), (1e-6, 0, 0.9, 0.0)]


@pytest.mark.parametrize("V,dtype", [(163_840, jnp.bfloat16), (50_000, jnp.float32), (37, jnp.float32)])
def test_fused_sampler_keeps_the_reference_set(V, dtype):
    """Greedy tokens equal the argmax; every draw lies in the reference's kept set."""
    rng = np.random.default_rng(V)
    rows = len(CONFIGS) * 4
    x = jnp.asarray((rng.standard_normal((rows, V)) * rng.uniform(0.5, 4, (rows, 1))).astype(np.float32)).astype(dtype)
    temp, topk, topp, minp = (np.repeat(np.array(c, dtype=np.float32 if i != 1 else np.int32), 4)
                              for i, c in enumerate(zip(*CONFIGS, strict=True)))
    params = SamplingBatch(jnp.asarray(temp), jnp.asarray(topk), jnp.asarray(topp), jnp.asarray(minp),
                           jnp.zeros(rows, jnp.uint32), jnp.zeros(rows, bool))
    seeds = jnp.asarray(rng.integers(0, 2**32, (rows, 2), dtype=np.uint32))
    out = fused_sample_debug(x, params.temperature, params.top_k, params.top_p, params.min_p, seeds)
    tok = np.asarray(out["token"])
    logp = np.asarray(target_logprobs(x[:, None, :], params))[:, 0]
    assert (logp[np.arange(rows), tok] > -np.inf).all(), "a draw outside the reference's kept set"
    greedy = temp == 0
    np.testing.assert_array_equal(tok[greedy], np.argmax(np.asarray(x.astype(jnp.float32)), axis=-1)[greedy])
    # round 1's pass in the select program (not in a second check launch): the same tokens
    one = np.asarray(fused_sample_debug(x, params.temperature, params.top_k, params.top_p, params.min_p, seeds,
                                        check_rounds=1)["token"])
    np.testing.assert_array_equal(one, tok, err_msg="check_rounds=1 and 2 give different tokens")


def test_fused_sampler_rows_do_not_depend_on_the_batch():
    """A row's outputs (token, thresholds, masses, path, passes) are the same bits whether it is
    sampled among 16 rows or among 512: launch parameters must not follow the row count, since a
    block reduction's rounding follows the warps holding the block."""
    rng = np.random.default_rng(7)
    V, small, big = 163_840, 16, 512
    x = jnp.asarray((rng.standard_normal((big, V)) * rng.uniform(0.5, 4, (big, 1))).astype(np.float32))
    x = x.astype(jnp.bfloat16)
    cfg = np.array(CONFIGS * (big // len(CONFIGS) + 1))[:big]
    temp, topk, topp, minp = (jnp.asarray(cfg[:, i].astype(np.int32 if i == 1 else np.float32)) for i in range(4))
    seeds = jnp.asarray(rng.integers(0, 2**32, (big, 2), dtype=np.uint32))
    a = fused_sample_debug(x[:small], temp[:small], topk[:small], topp[:small], minp[:small], seeds[:small])
    b = fused_sample_debug(x, temp, topk, topp, minp, seeds)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key])[:small], err_msg=key)


def test_generate_greedy_speculative_equals_autoregressive_with_kernels():
    """float32 with full-precision matmuls (GPU matmuls default to TF32, whose rounding differs
    between the verify block and the one-token step)."""
    with jax.default_matmul_precision("highest"):
        _greedy_speculative_equals_autoregressive()


def _greedy_speculative_equals_autoregressive():
    target = tiny_kimi(0)
    drafter = tiny_dflash(target, 1)
    prompts = [[1, 2, 3, 4, 5], [7], [9, 10, 11]]
    kw = dict(max_new_tokens=16, impl="pallas")
    ar = dt.generate(target, None, prompts, method="ar", **kw)
    for method in ("dflash", "ddtree"):
        assert dt.generate(target, drafter, prompts, method=method, budget=12, **kw).tokens == ar.tokens, method
    # budget="auto": its rounds draft only their own budget's depths (a separate compiled program)
    auto = dt.generate(target, drafter, prompts, max_new_tokens=16, config=dt.DecodeConfig(
        method="ddtree", budget="auto", auto_max_budget=8, auto_costs=(1.0, 1.1, 1.2), impl="pallas"))
    assert auto.tokens == ar.tokens and sum(auto.auto.rounds[1:]) > 0
    sampled = dt.generate(target, drafter, prompts, method="ddtree", budget=12, seed=3,
                          sampling=dt.SamplingParams(temperature=0.8, top_p=0.9, seed=4), **kw)
    assert all(len(t) == 16 for t in sampled.tokens)
    assert jax.default_backend() == "gpu"


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several GPUs")
def test_engine_on_gpu_meshes_matches_one_gpu(tmp_path):
    """The sharded serving engine over every local GPU (expert, tensor and data meshes) against
    one GPU, float32 products (tests/_mesh_check.py says what must be equal)."""
    from tests._mesh_check import check_runs, mesh_runs, one_device_tokens

    n = jax.device_count()
    meshes = [f"expert={n}", f"tensor={n}"] + ([f"data=2,expert={n // 2}"] if n % 2 == 0 else [])
    with jax.default_matmul_precision("highest"):
        with jax.default_device(jax.devices()[0]):
            plain = one_device_tokens()
        check_runs(mesh_runs(str(tmp_path), meshes, plain), meshes)


@pytest.mark.parametrize("n,e,k,h,i", [(1, 8, 2, 64, 32), (37, 64, 4, 256, 128), (700, 8, 2, 128, 64)])
def test_moe_grouped_matmul_equals_reference(n, e, k, h, i):
    """float32: the Triton dot must run in IEEE float32 (tf32 would miss 1e-5); invalid tokens zero."""
    from ddtree_jax.backend import Backend
    from ddtree_jax.models.moe import experts_reference, routed_experts
    from tests.test_moe_kernel import random_moe

    x, gate_up, down, weights, ids, valid = random_moe(n, n, e, k, h, i, invalid=0.2)
    got = jax.jit(lambda *a: routed_experts(*a, backend=Backend(kernels=True), valid=valid))(
        x, gate_up, down, weights, ids)
    with jax.default_matmul_precision("highest"):  # the reference in IEEE float32, not tf32
        want = experts_reference(x, gate_up, down, weights, ids, valid)
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())
    assert not np.asarray(got)[~np.asarray(valid)].any()


@pytest.mark.parametrize("n,e,k,h,i,symmetric", [(1, 8, 2, 256, 128, True), (37, 64, 4, 512, 256, False),
                                                  (200, 16, 2, 256, 128, False), (700, 8, 2, 256, 128, True)])
def test_moe_grouped_matmul_int4_equals_reference(n, e, k, h, i, symmetric):
    """The W4A16 kernel compiled (decode, verify (16- and 32-row tiles) and prefill block sizes;
    group 32, as Kimi K2 Thinking): float32 within 1e-5 of the IEEE float32 reference on the
    dequantised weights, bf16 within 2%; invalid tokens zero."""
    from ddtree_jax.backend import Backend
    from ddtree_jax.models.int4 import Int4Format, dequantize, quantize_int4
    from ddtree_jax.models.moe import experts_reference, routed_experts
    from pallas_kernels.triton.moe_grouped_matmul import choose_blocks
    from tests.test_moe_kernel import random_moe

    x, gate_up, down, weights, ids, valid = random_moe(n, n, e, k, h, i, invalid=0.2 if n > 1 else 0.0)
    assert valid.any()
    fmt = Int4Format(32, symmetric)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 0.02)):
        gu, dn = quantize_int4(gate_up, fmt, dtype), quantize_int4(down, fmt, dtype)
        blocks = choose_blocks(n * k, e, int4=True, act_bytes=jnp.dtype(dtype).itemsize)
        got = jax.jit(lambda *a, blocks=blocks: routed_experts(*a, backend=Backend(kernels=True), valid=valid,
                                                               blocks=blocks))(x.astype(dtype), gu, dn, weights, ids)
        with jax.default_matmul_precision("highest"):  # the reference in IEEE float32, not tf32
            want = experts_reference(x.astype(dtype).astype(jnp.float32), dequantize(gu, jnp.float32),
                                     dequantize(dn, jnp.float32), weights, ids, valid)
        err = float(jnp.abs(got.astype(jnp.float32) - want).max())
        assert err <= tol * float(jnp.abs(want).max()), (dtype, err)
        assert not np.asarray(got.astype(jnp.float32))[~np.asarray(valid)].any()


def test_int4_packed_bf16_dequantisation_equals_float32_path():
    """The INT4 kernel's packed-bf16 PTX (``_dequant_words(asm=True)``) gives the float32 path's
    weights bit for bit: every nibble value in every position of random words, bf16 scales of
    both signs from 1e-30 to 1e30, zero scales."""
    import functools

    from jax.experimental import pallas as pl

    from pallas_kernels.triton.moe_grouped_matmul import _dequant_words

    rng = np.random.default_rng(7)
    w_shape = (16, 128)
    words = jnp.asarray(rng.integers(-2**31, 2**31, w_shape, dtype=np.int64).astype(np.int32))
    scale = rng.choice([-1, 1], w_shape) * 10.0 ** rng.uniform(-30, 30, w_shape)
    scale[0, :8] = 0.0
    scale = jnp.asarray(scale, jnp.bfloat16)

    def kernel(w_ref, s_ref, o_ref, *, asm):
        for p, tile in enumerate(_dequant_words(w_ref[...], s_ref[...], None, jnp.bfloat16, asm)):
            o_ref[p] = tile

    def run(asm):
        return pl.pallas_call(functools.partial(kernel, asm=asm),
                              out_shape=jax.ShapeDtypeStruct((8, *w_shape), jnp.bfloat16))(words, scale)

    got, want = run(True), run(False)
    q = (np.asarray(words)[None] >> (4 * np.arange(8))[:, None, None]) & 0xF
    exact = ((q - 8) * np.asarray(scale, np.float32)[None]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(want).view(np.uint16), np.asarray(exact).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("dtype,hopper", [(jnp.bfloat16, True), (jnp.bfloat16, False), (jnp.float32, False)])
@pytest.mark.parametrize("b,t,s,starts,tree,segment_keys", [
    (2, 1, 3000, [0, 2999], False, 512),  # decode steps over contexts of 1 and 3,000 keys
    (2, 17, 3000, [100, 2983], True, 512),  # tree verifies, the second ending at the cache's end
    (2, 17, 1000, [0, 500], True, 0),  # the older shape-dependent split
    (1, 300, 304, [0], False, 512),  # causal prefill of 300 tokens
])
def test_mla_attention_equals_reference(b, t, s, starts, tree, segment_keys, dtype, hopper):
    """The compiled MLA kernels (K2 heads and ranks, the model's dispatch and default tiles) against
    the IEEE float32 dense reference on the same rounded inputs: float32 within 1e-4, bf16 within
    2e-2 (the kernel rounds probabilities and the output to bf16; outputs are O(1)). ``hopper``:
    the Mosaic GPU kernel where it runs (bf16 on an H100/H200), else the Triton kernel."""
    from ddtree_jax.backend import resolve_backend
    from ddtree_jax.models.latent_attention import hopper_runs, latent_attention, latent_attention_reference
    from ddtree_jax.models.tree_cache import BlockMask, tree_block_mask
    from tests.test_mla_kernel import _inputs, _random_tree_masks

    rng = np.random.default_rng(t * 7 + s)
    h, r, dr = 64, 512, 64
    ql, qr, lat, kr = _inputs(rng, b, t, h, r, dr, s, dtype)
    mask = BlockMask(jnp.asarray(starts, jnp.int32), tree_block_mask(_random_tree_masks(rng, b, t)) if tree else None)
    scale = 1.0 / np.sqrt(r + dr)
    backend = resolve_backend("pallas")
    if hopper and not hopper_runs(backend, t, h, r, dr, dtype, s):
        pytest.skip("the Hopper kernel does not run here (needs an sm_90 GPU)")
    got = jax.jit(lambda *a: latent_attention(*a, mask, scale=scale, backend=backend, segment_keys=segment_keys,
                                              hopper=hopper))(ql, qr, lat, kr)
    with jax.default_matmul_precision("highest"):
        want = latent_attention_reference(*[x.astype(jnp.float32) for x in (ql, qr, lat, kr)], mask, scale=scale)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=0)


@pytest.mark.parametrize("t", [256, 1000, 2048])
def test_per_head_prefill_with_cudnn_equals_the_absorbed_reference(t):
    """The per-head causal prefill through cuDNN's flash attention (K2 heads and ranks, bf16)
    against the absorbed float32 reference on the same inputs (1,000 tokens: padded to a multiple of
    128), within 1% of the largest output
    (keys, values and probabilities are rounded to bf16; XLA's bf16 implementation at T=128 on the
    CPU was 0.4% off)."""
    from ddtree_jax.models.latent_attention import latent_attention_reference, per_head_causal_attention
    from ddtree_jax.models.tree_cache import BlockMask

    rng = np.random.default_rng(t)
    b, h, r, dr, dn, dv = 1, 64, 512, 64, 128, 128

    def arr(*shape, s=1.0):
        return jnp.asarray(rng.standard_normal(shape) * s, jnp.float32).astype(jnp.bfloat16)

    q_nope, q_rope, lat, kr = arr(b, t, h, dn), arr(b, t, h, dr), arr(b, t, r), arr(b, t, dr)
    w_k, w_v = arr(r, h, dn, s=r ** -0.5), arr(r, h, dv, s=r ** -0.5)
    scale = 1.0 / np.sqrt(dn + dr)
    got = per_head_causal_attention(q_nope, q_rope, lat, kr, w_k, w_v, scale=scale, implementation="cudnn")
    f32 = [x.astype(jnp.float32) for x in (q_nope, q_rope, lat, kr, w_k, w_v)]
    with jax.default_matmul_precision("highest"):
        q_latent = jnp.einsum("btnd,rnd->btnr", f32[0], f32[4])
        out_latent = latent_attention_reference(q_latent, f32[1], f32[2], f32[3], BlockMask(jnp.zeros((b,), jnp.int32)),
                                                scale=scale)
        want = jnp.einsum("btnr,rnd->btnd", out_latent, f32[5])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=1e-2 * float(jnp.abs(want).max()),
                               rtol=0)


@pytest.mark.parametrize("k,n,dtype", [(7168, 1536, jnp.bfloat16), (1536, 12288, jnp.bfloat16),
                                       (7168, 384, jnp.float32)])
def test_dense_matmul_compiled_equals_reference_and_is_batch_invariant(k, n, dtype):
    """The fixed-order product at K2 projection / router shapes: within float32 rounding of the
    IEEE reference, and a row's bits the same alone and among 16, 65 and 1,040 rows (across
    ``choose_blocks``' row tiles, which the interpret-mode test pins)."""
    from pallas_kernels.triton.dense_matmul import dense_matmul, dense_matmul_reference

    rng = np.random.default_rng(k + n)
    x = jnp.asarray(rng.standard_normal((1040, k)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, w: dense_matmul(x, w, out_dtype=jnp.float32))
    full = f(x, w)
    with jax.default_matmul_precision("highest"):
        want = dense_matmul_reference(x, w, out_dtype=jnp.float32)
    assert float(jnp.abs(full - want).max()) <= 1e-4 * float(jnp.abs(want).max())
    for m in (1, 16, 65):
        np.testing.assert_array_equal(np.asarray(f(x[:m], w)), np.asarray(full)[:m], err_msg=f"{m} rows")


def test_per_head_prefill_dispatch_on_the_gpu():
    """The per-head prefill takes cuDNN only where cuDNN takes the shapes (bf16/fp16, head dim a
    multiple of 8); a float32 model with a 12-dim head keeps the absorbed form, so its prefill
    with the option on runs and gives the absorbed form's bits."""
    from ddtree_jax.models.kimi import _per_head_default
    from tests._model_fixtures import VOCAB, prefill

    assert _per_head_default(jnp.bfloat16, 192) == "cudnn"
    assert _per_head_default(jnp.float32, 192) is None
    assert _per_head_default(jnp.bfloat16, 12) is None
    rng = np.random.default_rng(4)
    prompts = jnp.asarray(rng.integers(0, VOCAB, (2, 12)))
    lens = jnp.asarray([12, 7])
    outs = []
    for n in (0, 4):
        m = tiny_kimi(3, execution=dt.ExecutionConfig(per_head_prefill_min_tokens=n))
        outs.append(np.asarray(prefill(m, prompts, lens, m.init_cache(2, 40))[0]))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several GPUs")
def test_per_head_prefill_on_a_tensor_mesh():
    """The shipped default target in bf16 with its heads split over every local GPU: a 600-token
    prefill takes the per-head form (cuDNN in a shard_map) and agrees with the same model on one
    GPU as bf16 allows: 99.9% of the logits within 10% of the largest and 90% of the rows' argmax
    equal (bf16 alone moves them that much over six layers: on 2 CPU devices the absorbed form's
    sharded and single-device logits differ by 4% at the 99.9th percentile, 98% of argmaxes
    equal; in float32 every pair agrees to 1e-6, which tests/test_sharded_generate.py covers)."""
    from ddtree_jax.default_model import SHIPPED_DIR
    from ddtree_jax.serving.sharding import make_mesh
    from tests._model_fixtures import prefill

    path = os.path.join(SHIPPED_DIR, "target")
    mesh = make_mesh({"tensor": jax.device_count()})
    one, sharded = dt.load_target(path, dtype=jnp.bfloat16), dt.load_target(path, mesh=mesh, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (2, 600)))
    lens = jnp.asarray([600, 600])

    def logits(m):
        return np.asarray(prefill(m, ids, lens, m.init_cache(2, 640))[0], np.float32)

    want, got = logits(one), logits(sharded)
    assert np.quantile(np.abs(got - want), 0.999) <= 0.1 * float(np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_deterministic_engine_seeded_requests_equal_their_solo_runs():
    """The deterministic mode on the GPU (compiled kernels, the shipped bf16 pair): 12 concurrent
    requests over 4 slots, mixed greedy, unseeded and seeded sampling (temperature 0.8, top-p
    0.95, top-k 50); every seeded request's tokens equal its run alone on the same engine."""
    from ddtree_jax.default_model import SHIPPED_DIR
    from ddtree_jax.serving import Engine

    fixed = dt.ExecutionConfig(impl="pallas", batch_invariant=True)
    target = dt.load_target(os.path.join(SHIPPED_DIR, "target"), execution=fixed)
    drafter = dt.load_drafter(os.path.join(SHIPPED_DIR, "drafter"), target, execution=fixed)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, target.config.vocab_size, int(n)).tolist() for n in rng.integers(4, 120, 12)]
    seeded = [0, 3, 6, 9, 10]
    params = [dt.SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=100 + i) if i in seeded
              else dt.SamplingParams(temperature=1.0, top_p=0.9) if i % 2 else dt.SamplingParams(temperature=0.0)
              for i in range(12)]
    config = dt.EngineConfig(decode=dt.DecodeConfig(method="ddtree", budget=16), slots=4, max_model_len=256,
                             prefill_chunk=64, deterministic=True)
    eng = Engine(target, drafter, config)
    mixed = [r.tokens for r in eng.generate(prompts, params, max_tokens=64, ignore_eos=True)]
    for i in seeded:
        alone = eng.generate([prompts[i]], [params[i]], max_tokens=64, ignore_eos=True)[0].tokens
        assert alone == mixed[i], f"request {i}"


@pytest.mark.parametrize("s,t,n,k,d,causal,window,dtype", [
    (1216, 16, 6, 2, 64, False, None, jnp.bfloat16),  # the shipped drafter in generate's default cache
    (4096, 16, 32, 8, 128, False, None, jnp.bfloat16),  # over four chunks
    (40, 5, 4, 2, 16, True, 9, jnp.float32),
])
def test_block_attention_equals_reference(s, t, n, k, d, causal, window, dtype):
    """The compiled draft-block attention against its reference, and a row alone against the same
    row in a batch (bit for bit)."""
    from ddtree_jax.backend import resolve_backend
    from ddtree_jax.models.block_attention import block_attention, block_attention_reference

    rng = np.random.default_rng(s)
    b = 5
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    args = (arr(b, t, n, d), arr(b, s, k, d), arr(b, s, k, d), arr(b, t, k, d), arr(b, t, k, d),
            jnp.asarray(rng.integers(0, s + 1, b), jnp.int32).at[0].set(s).at[1].set(0))
    kw = dict(causal=causal, window=window, scale=d**-0.5)
    got = block_attention(*args, backend=resolve_backend("pallas"), **kw)
    with jax.default_matmul_precision("highest"):  # (XLA's float32 products default to TF32 on a GPU)
        want = block_attention_reference(*(a.astype(jnp.float32) for a in args[:5]), args[5], **kw)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
    alone = block_attention(*(a[2:3] for a in args), backend=resolve_backend("pallas"), **kw)
    np.testing.assert_array_equal(np.asarray(got[2:3], np.float32), np.asarray(alone, np.float32))


def test_paged_block_attention_equals_contiguous():
    """The compiled kernel reading the context through a page table: the contiguous kernel's bits."""
    from ddtree_jax.backend import resolve_backend
    from ddtree_jax.models.block_attention import block_attention

    b, t, n, k, d, page, pages = 4, 16, 6, 2, 64, 64, 19
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    q, kc, vc, kb, vb = arr(b, t, n, d), arr(b, pages * page, k, d), arr(b, pages * page, k, d), arr(b, t, k, d), \
        arr(b, t, k, d)
    lengths = jnp.asarray([pages * page, 0, 100, 700], jnp.int32)
    table = jnp.asarray(rng.permutation(b * pages).reshape(b, pages), jnp.int32)
    pool = lambda x: jnp.zeros((b * pages, page, k, d), x.dtype).at[table].set(x.reshape(b, pages, page, k, d))  # noqa: E731
    kw = dict(causal=False, window=None, scale=d**-0.5, backend=resolve_backend("pallas"))
    want = block_attention(q, kc, vc, kb, vb, lengths, **kw)
    got = block_attention(q, pool(kc), pool(vc), kb, vb, lengths, page_table=table, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
