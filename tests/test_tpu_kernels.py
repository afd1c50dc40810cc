"""Mosaic TPU kernels (``pallas_kernels/mosaic_tpu``) in TPU interpret mode on the CPU, against the
plain-JAX references (and, for the random stream, the Triton sampler's contract).

TPU interpret mode simulates every grid step and DMA and compiles each kernel per input shape,
so the tests share a few shapes: (32 rows, V=300, tile 128: one row block, three vocabulary tiles)
for the sampler's thresholds, invalid rows and the random stream (max_rounds is traced: one
compile); one stacked batch of
5 x 2048 rows (V=40) for the chi-square law tests; B=8 / L=4 / V=37 for the tree and the walk;
12 rows of V=3000 in 512-column tiles for the vocabulary top-k (k = 200, V, and 1; its launches are
jitted apart, so the stats pass compiles once per dtype and lse mode, the top-k pass once per k).
No TPU timing exists for these kernels: this file checks what they compute, not how fast.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.backend import Backend, has_kernel, resolve_backend
from ddtree_jax.sampling import target_logprobs
from pallas_kernels.mosaic_tpu import fused_sample as tpu_sample
from pallas_kernels.mosaic_tpu import vocab_top_k as tpu_topk
from pallas_kernels.mosaic_tpu.fused_sample import PATH_NONE, PATH_REJECT, PATH_SLOW, PATH_TEMPERATURE
from tests._law_checks import row_law, sampling_batch
from tests._random_inputs import MIXED_BAD_ROWS, mixed_top_k_rows, random_draft_logits
from tests._reference import chisquare_pvalue

TPU = "pallas:mosaic_tpu"
R, V, TILE = 32, 300, 128


def _seeds(n, s):
    return jnp.asarray(np.random.default_rng(s).integers(0, 2**32, (n, 2), dtype=np.uint32))


def _run(x, pb, seeds, **kw):
    out = tpu_sample.fused_sample_debug(jnp.asarray(x), pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds,
                                        interpret=True, **kw)
    return jax.tree.map(np.asarray, out)


# 32 rows x V=300: columns temperature, top-k, top-p, min-p. Every filter alone and in
# combination; top-k both <= 128 and > 128 (the Triton version's candidate and rejection paths).
CFG = np.array([
    # T, k, p, m
    [0.0, 0, 1.0, 0.0], [0.7, 0, 1.0, 0.0], [1.0, 5, 1.0, 0.0], [0.5, 150, 1.0, 0.0],
    [1.3, 0, 0.8, 0.0], [0.7, 0, 0.95, 0.0], [1.0, 0, 1.0, 0.1], [0.9, 0, 1.0, 0.02],
    [0.8, 10, 0.9, 0.0], [1.2, 200, 0.7, 0.0], [1.0, 40, 1.0, 0.05], [0.6, 0, 0.6, 0.1],
    [1.1, 3, 0.5, 0.05], [0.0, 7, 0.9, 0.1], [1.0, 1, 1.0, 0.0], [0.7, 250, 0.9, 0.05],
] * 2, np.float32)


# row -> (columns, value): greedy, temperature, top-p, min-p, top-k + top-p, all filters
INVALID = {16: (17, np.nan), 17: (250, np.inf), 20: (299, np.nan), 22: (slice(None), -np.inf), 25: (0, np.inf),
           28: (140, np.nan)}


@functools.cache
def _fixed_run(max_rounds):
    """The sampler on ``_inputs()`` with seeds ``_seeds(R, 0)``: one run per ``max_rounds`` for
    the tests that read it (interpret mode executes slowly; the inputs are fixed)."""
    x, pb = _inputs()
    return _run(x, pb, _seeds(R, 0), tile=TILE, block_rows=R, max_rounds=max_rounds)  # (max_rounds traced: one compile)


def _inputs():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((R, V)) * rng.uniform(0.5, 3, (R, 1))).astype(np.float32)
    x[3] = np.round(x[3])  # ties at the top-k boundary (all kept) and the greedy argmax
    x[13] = np.round(x[13])  # greedy on ties: the lowest index
    x[16:20] = np.round(x[16:20] * 2) / 2  # tie groups at the top-p / min-p boundaries
    x[5, : V // 3] = -np.inf  # masked vocabulary
    for r, (col, v) in INVALID.items():  # rows with no law: NaN / +inf anywhere, or all -inf
        x[r, col] = v
    return x, sampling_batch(*CFG.T)


def _kept_from_thresholds(x_row, T, out, r):
    z = (x_row - x_row.max()).astype(np.float32) / np.float32(T)
    with np.errstate(all="ignore"):
        q = np.exp(z.astype(np.float64)) / out["norm"][r]
        kept = (z >= out["tau"][r]) & (z > -np.inf) & (q >= out["q_thr"][r])
        band = np.abs(q - out["q_thr"][r]) <= 1e-5 * out["q_thr"][r]  # the boundary value itself
    return kept, band


@pytest.mark.parametrize("max_rounds", [tpu_sample.MAX_ROUNDS, 0])
def test_kept_sets_and_greedy(max_rounds):
    """Rows with NaN / +inf / all -inf logits: -1 on every path. Greedy rows: the reference's
    argmax (lowest index on ties), bit for bit. Sampled rows: with
    ``max_rounds=0`` every filtered row takes the full-row threshold searches, and the kept set
    rebuilt from the returned thresholds equals the reference's for each filter and combination
    (outside a 1e-5 relative band at the min-p boundary); on the rejection path the thresholds
    describe a superset (checked: no kept token outside it) and the draw is in the kept set."""
    x, pb = _inputs()
    out = _fixed_run(max_rounds)
    ref_keep = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0] > -np.inf
    T, k, p, m = CFG.T
    filtered = (k > 0) | (p < 1) | (m > 0)
    want_path = np.where(T == 0, PATH_NONE, np.where(filtered, PATH_REJECT if max_rounds else PATH_SLOW,
                                                     PATH_TEMPERATURE))
    bad = sorted(INVALID)
    want_path[bad] = PATH_NONE
    np.testing.assert_array_equal(out["path"], want_path)
    assert out["token"][bad].tolist() == [-1] * len(bad)
    for r in range(R):
        if r in INVALID:
            continue
        if T[r] == 0:
            assert out["token"][r] == np.argmax(x[r]), r
            continue
        assert ref_keep[r, out["token"][r]], f"row {r}: draw outside the reference's kept set"
        kept, band = _kept_from_thresholds(x[r], T[r], out, r)
        if out["path"][r] == PATH_REJECT:
            assert not (ref_keep[r] & ~kept)[~band].any(), r
        elif out["path"][r] == PATH_SLOW:
            np.testing.assert_array_equal(kept[~band], ref_keep[r][~band], err_msg=f"row {r} {CFG[r]}")
    if max_rounds:
        rej = out["path"] == PATH_REJECT
        assert (out["rounds"][rej] >= 1).all() and (out["rounds"][~rej] == 0).all()
        assert (out["rounds"][rej] > 1).any()  # some first draws are rejected


def test_random_stream_is_the_triton_contract():
    """The uniforms are the Triton sampler's (same hash, same streams), and the draws follow its
    contract: a temperature-only row picks its tile with stream 0 over the per-tile masses and the
    element with stream 1 (recomputed here in numpy); a rejection row's rounds use streams 2 + 2i,
    3 + 2i (reproduced by the number of rounds and the final pivot below)."""
    from pallas_kernels.triton.fused_sample import _uniform as triton_uniform

    s = _seeds(64, 9)
    for stream in (0, 1, 2, 7, 33):
        np.testing.assert_array_equal(np.asarray(tpu_sample._uniform(s[:, 0], s[:, 1], stream)),
                                      np.asarray(triton_uniform(s[:, 0], s[:, 1], stream)))
    x, pb = _inputs()
    seeds = _seeds(R, 0)
    out = _fixed_run(tpu_sample.MAX_ROUNDS)  # test_kept_sets_and_greedy's run
    u = [np.asarray(tpu_sample._uniform(seeds[:, 0], seeds[:, 1], i)) for i in (0, 1)]
    for r in np.flatnonzero(out["path"] == PATH_TEMPERATURE):
        z = ((x[r] - x[r].max()) / CFG[r, 0]).astype(np.float64)
        e = np.exp(z)
        tiles = np.pad(e, (0, 3 * TILE - V)).reshape(3, TILE).sum(1)
        t = np.searchsorted(np.cumsum(tiles), u[0][r] * tiles.sum(), side="right")
        w = np.pad(e, (0, 3 * TILE - V))[t * TILE:(t + 1) * TILE]
        j = np.searchsorted(np.cumsum(w), u[1][r] * w.sum(), side="right")
        assert out["token"][r] == t * TILE + j, r


LAW_CFG = [(1.0, 0, 1.0, 0.0), (0.8, 6, 0.85, 0.02), (0.6, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 20, 0.9, 0.0)]
LAW_N = 2048


@pytest.mark.parametrize("max_rounds", [tpu_sample.MAX_ROUNDS, 1])
def test_chi_square_law(max_rounds):
    """n = 2048 draws of one V=40 bf16 row (Gaussian logits x 1.5, fixed seeds) per setting, all five
    settings in ONE batch of 10,240 rows (one compile; max_rounds is traced): temperature only;
    top-k + top-p + min-p; top-p alone; min-p alone; top-k + top-p. With max_rounds = 1 a row whose
    first draw is rejected falls back to the exact threshold searches: the mixture must still be
    the exact law. Pass: no draw outside the reference's support, every token expected >= 10 times
    drawn, chi-square p > 1e-3 (bins with expected count < 5 pooled). Negative control: the same
    counts against the law at 1.5 x the temperature must give p < 1e-6 (or put mass outside its
    support)."""
    n, Vs = LAW_N, 40
    base = jnp.asarray(np.random.default_rng(7).standard_normal(Vs).astype(np.float32) * 1.5, jnp.bfloat16)
    cfg = np.repeat(np.array(LAW_CFG, np.float32), n, axis=0)
    x = jnp.broadcast_to(base, (len(cfg), Vs))  # bf16 logits, as a target emits them
    base = np.asarray(base.astype(jnp.float32))
    out = _run(x, sampling_batch(*cfg.T), _seeds(len(cfg), 3), tile=TILE, block_rows=2048, max_rounds=max_rounds)
    paths = set(out["path"].tolist())
    assert paths == ({PATH_TEMPERATURE, PATH_REJECT, PATH_SLOW} if max_rounds == 1 else {PATH_TEMPERATURE,
                                                                                        PATH_REJECT})
    for i, (T, k, p, m) in enumerate(LAW_CFG):
        tok = out["token"][i * n:(i + 1) * n]
        counts = np.bincount(tok, minlength=Vs)
        prob = row_law(base, T, k, p, m)
        sup = prob > 0
        assert counts[~sup].sum() == 0, (T, k, p, m)
        assert (counts[prob * n >= 10] > 0).all(), (T, k, p, m)
        pv = chisquare_pvalue(counts[sup], (prob[sup] / prob[sup].sum()) * n)
        assert pv > 1e-3, f"p = {pv:.3g} for {(T, k, p, m)}"
        wrong = row_law(base, T * 1.5, k, p, m)
        wsup = wrong > 0
        if counts[~wsup].sum() == 0:
            pw = chisquare_pvalue(counts[wsup], (wrong[wsup] / wrong[wsup].sum()) * n)
            assert pw < 1e-6, f"negative control p = {pw:.3g} for {(T, k, p, m)}"


def test_dispatch(monkeypatch):
    """impl strings and Backend instances pick the family; "pallas" keeps meaning the Triton
    kernels interpreted on a CPU; on a TPU (platform name patched) "auto" and "pallas" pick the
    compiled TPU kernels, on a GPU the Triton ones. (The public functions' use of it: the generate
    test below.)"""
    assert resolve_backend(TPU) == Backend(kernels=True, interpret=True, family="mosaic_tpu")
    assert resolve_backend("pallas") == Backend(kernels=True, interpret=True, family="triton")
    assert resolve_backend("pallas:triton") == Backend(kernels=True, interpret=True, family="triton")
    assert resolve_backend("auto") == Backend(kernels=False)  # the CPU: references
    with pytest.raises(ValueError, match="family"):
        Backend(kernels=True, family="cuda")
    with pytest.raises(ValueError, match="impl"):
        resolve_backend("pallas:cuda")
    import ddtree_jax.backend as backend_module

    tpu, gpu = Backend(kernels=True, family="mosaic_tpu"), Backend(kernels=True)
    for name in ("fused_sample", "tree_builder", "accept_walk", "vocab_top_k"):
        assert backend_module.has_kernel(tpu, name) and backend_module.has_kernel(gpu, name), name
    assert not backend_module.has_kernel(tpu, "no_such_kernel") and not backend_module.has_kernel(
        Backend(kernels=False), "fused_sample")

    for platform, family in (("tpu", "mosaic_tpu"), ("gpu", "triton")):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)  # resolve_backend imports jax late
        native = Backend(kernels=True, interpret=False, family=family)
        assert resolve_backend("auto") == native and resolve_backend("pallas") == native
        other = "triton" if family == "mosaic_tpu" else "mosaic_tpu"
        assert resolve_backend(f"pallas:{other}") == Backend(kernels=True, interpret=True, family=other)


# ----------------------------------------------------------------------------- tree and walk

FIELDS = ["tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"]


def _tree_inputs():
    """[8, 4, 37]: random, 90% masked (-inf), rounded (score ties), all-equal with a NaN row."""
    B, L, Vt = 2, 4, 37
    rand = random_draft_logits(1, B, L, Vt)
    ties = np.zeros((B, L, Vt), np.float32)
    ties[1, 1] = np.nan
    return np.concatenate([rand, random_draft_logits(2, B, L, Vt, mask_frac=0.9), np.round(rand), ties])


def test_tree_builder_matches_reference():
    """Budget 40 > V = 37 (K = V, a frontier that fills up on the masked rows) on random, masked,
    tied and NaN inputs: every field equal to the reference build. The per-depth tables come from
    the TPU ``vocab_top_k`` (k = V = 37: one tile of one-element chunks, all kept)."""
    assert has_kernel(resolve_backend(TPU), "vocab_top_k")
    budget = 40
    logits = jnp.asarray(_tree_inputs())
    ker, ref = dt.build_draft_tree(logits, budget, impl=TPU), dt.build_draft_tree(logits, budget, impl="reference")
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)


def test_accept_walk_matches_reference():
    rng = np.random.default_rng(0)
    tree = dt.build_draft_tree(jnp.asarray(_tree_inputs()), 40, impl="reference")
    tree = tree.with_root_tokens(jnp.asarray(rng.integers(0, 37, 8)))
    tk, fc, ns = (np.asarray(a) for a in (tree.tokens, tree.first_child, tree.next_sibling))
    follow = np.where(fc >= 0, np.take_along_axis(tk, np.maximum(fc, 0), 1), 0)
    second = np.where(fc >= 0, np.take_along_axis(ns, np.maximum(fc, 0), 1), -1)
    follow = np.where((rng.random(tk.shape) < 0.3) & (second >= 0),
                      np.take_along_axis(tk, np.maximum(second, 0), 1), follow)
    smp = np.where(rng.random(tk.shape) < 0.85, follow, rng.integers(0, 37, tk.shape)).astype(np.int32)
    smp[0, 0] = -1  # an invalid draw at the root is a bonus of -1
    ker = dt.accept_path(tree, jnp.asarray(smp), impl=TPU)
    ref = dt.accept_path(tree, jnp.asarray(smp), impl="reference")
    assert np.asarray(ref.num_accepted).max() >= 3
    for f in ("path", "num_accepted", "bonus", "committed"):
        np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)


# ----------------------------------------------------------------------------- vocabulary top-k


def _lax_top_k(x, k, lse=None, m=None):
    """``lax.top_k(draft_logprobs(x), k)``, or with a given normaliser: ``lax.top_k((x - m) - lse, k)``."""
    x = jnp.asarray(x).astype(jnp.float32)
    z = dt.draft_logprobs(x) if lse is None else (x - jnp.asarray(m)[:, None]) - jnp.asarray(lse)[:, None]
    return [np.asarray(a) for a in jax.lax.top_k(z, k)]


def _topk_rows():
    """[12, 3000] f32: ``mixed_top_k_rows`` (every tie, mask and bad-row case) and two rows of
    distinct logits whose log-probabilities tie (|x| < 1e-6 around lse ~ 8: a few float32 values of
    z): equal values, not equal logits, decide which chunks hold the top-k."""
    rng = np.random.default_rng(11)
    near = -rng.uniform(0, 1e-6, (2, 3000)).astype(np.float32)
    near[1, ::7] = -5.0
    return np.concatenate([mixed_top_k_rows(4), near])


def _check_top_k(out, x, k, ref=None):
    """Rows with a law: ``out`` (values, indices) equal ``ref`` (default ``lax.top_k(draft_logprobs(x))``)
    bit for bit; NaN / +inf / all -inf rows (``MIXED_BAD_ROWS``): NaN values and indices 0..k-1
    (lax.top_k's order of NaNs follows their signs: not compared, as in tests/test_vocab_top_k.py)."""
    bad = MIXED_BAD_ROWS
    good = np.setdiff1d(np.arange(x.shape[0]), bad)
    vals, idx = (np.asarray(a) for a in out)
    ref = ref or [a[good] for a in _lax_top_k(x, k)]
    np.testing.assert_array_equal(idx[good], ref[1], err_msg="indices")
    np.testing.assert_array_equal(vals[good], ref[0], err_msg="values")
    assert np.isnan(vals[bad]).all() and (idx[bad] == np.arange(k)).all()


@pytest.mark.parametrize("k", [200, 3000])
def test_vocab_top_k_equals_lax_top_k(k):
    """``lse="xla"`` == ``lax.top_k(draft_logprobs(x))`` bit for bit, on 12 rows of V = 3000 (f32) in
    512-column tiles (6 tiles, the last one part padding; 768 chunks of 4): k = 200 (the chunk
    bisection, ties at it broken by tile, candidates of 3 slot windows) and k = V (every chunk
    kept, whole rows ordered). The stats pass compiles once for both."""
    x = jnp.asarray(_topk_rows())
    _check_top_k(tpu_topk.vocab_top_k(x, k, lse="xla", interpret=True, tile=512), x, k)


def test_vocab_top_k_fused_lse_and_k_1():
    """``lse="kernel"`` at k = 1 on the rows above as bf16: the fused normaliser is within about 4
    ulp of the exact one (float64), and the result is exactly ``lax.top_k`` of ``(x - m) - lse`` with
    the kernel's own ``m`` and ``lse``."""
    x = jnp.asarray(_topk_rows(), jnp.bfloat16)
    out = jax.tree.map(np.asarray, tpu_topk.vocab_top_k_with_stats(x, 1, lse="kernel", interpret=True, tile=512))
    good = np.setdiff1d(np.arange(x.shape[0]), MIXED_BAD_ROWS)
    xg = np.asarray(x[good].astype(jnp.float32), np.float64)
    lse64 = np.log(np.sum(np.exp(xg - xg.max(1, keepdims=True)), axis=1))
    np.testing.assert_allclose(out["lse"][good], lse64, rtol=4 * 2.0**-23, atol=4 * 2.0**-24)
    ref = _lax_top_k(x[good], 1, out["lse"][good], out["max"][good])
    _check_top_k((out["values"], out["indices"]), x, 1, ref)


def test_vocab_top_k_bad_arguments():
    x = jnp.zeros((2, 300))
    for k in (0, 301):
        with pytest.raises(ValueError, match="k <= V"):
            tpu_topk.vocab_top_k(x, k, interpret=True)
    with pytest.raises(ValueError, match="lse"):
        tpu_topk.vocab_top_k(x, 3, lse="cpu", interpret=True)
    with pytest.raises(ValueError, match="tile"):
        tpu_topk.vocab_top_k(x, 3, tile=100, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        tpu_topk.vocab_top_k(x, 3, block_rows=12, interpret=True)


def test_generate_with_the_tpu_kernels_equals_the_reference(default_dir):
    """The issue's "done when": greedy DDTree generation on the small default model (``default_dir``,
    tests/conftest.py: trained once per session, shared with tests/test_cli.py) with every TPU kernel
    interpreted (the tree's top-k and pop loop, the sampler, the walk) gives exactly the reference
    decoding: plain-JAX autoregressive greedy (cheaper to compile than a reference DDTree run, and
    the same tokens: tests/test_generate.py). Corpus prompts, so the trained drafter's trees get
    draft tokens accepted (checked: a round commits more than its bonus token)."""
    from tokenizers import Tokenizer

    target = dt.load_target(f"{default_dir}/target")
    drafter = dt.load_drafter(f"{default_dir}/drafter", target)
    tok = Tokenizer.from_file(f"{default_dir}/tokenizer.json")
    prompts = [tok.encode(p).ids for p in ("A small drafter proposes a block of tokens; the", "The quick brown")]
    kw = dict(max_new_tokens=8, max_len=64)
    ker = dt.generate(target, drafter, prompts, method="ddtree", budget=8, impl=TPU, **kw)
    ref = dt.generate(target, None, prompts, method="ar", impl="reference", **kw)
    assert ker.tokens == ref.tokens
    assert max(max(r.acceptance_lengths) for r in ker.requests) >= 2


def test_kernels_lower_for_tpu():
    """Interpret mode does not check Mosaic's rules, so each kernel is also lowered for a TPU
    (``jax.export`` with ``platforms=["tpu"]`` runs Pallas' Mosaic TPU lowering on the CPU) at the
    target's sizes: 64 rows of 163,840 bf16 logits, budget 256 at L = 15, and the tree's top-k over
    B x L = 16 x 15 rows of 163,840 bf16 draft logits, k = 256 (both lse modes). This checks block shapes,
    grid specs and that every primitive has a Mosaic lowering; the Mosaic compiler's own passes
    (layouts, VMEM limits) run only on a TPU and are not checked here."""
    from jax import export

    from pallas_kernels.mosaic_tpu import accept_walk, tree_builder

    rows, vocab, sd = 64, 163_840, jax.ShapeDtypeStruct
    vec = lambda dtype: sd((rows,), dtype)  # noqa: E731
    export.export(jax.jit(tpu_sample.fused_sample), platforms=["tpu"])(
        sd((rows, vocab), jnp.bfloat16), vec(jnp.float32), vec(jnp.int32), vec(jnp.float32), vec(jnp.float32),
        sd((rows, 2), jnp.uint32))
    table = lambda dtype: sd((4, 15, 256), dtype)  # noqa: E731
    export.export(jax.jit(lambda a, b: tree_builder.build_tree(a, b, budget=256)), platforms=["tpu"])(
        table(jnp.float32), table(jnp.int32))
    nodes = lambda dtype: sd((4, 257), dtype)  # noqa: E731
    export.export(jax.jit(lambda *a: accept_walk.accept_walk(*a, draft_len=15)), platforms=["tpu"])(
        nodes(jnp.int32), nodes(jnp.int32), nodes(jnp.bool_), nodes(jnp.int32))
    for lse in tpu_topk.LSE_MODES:
        exp = export.export(jax.jit(lambda x, lse=lse: tpu_topk.vocab_top_k(x, 256, lse=lse)), platforms=["tpu"])(
            sd((16, 15, vocab), jnp.bfloat16))
        assert exp.mlir_module().count("tpu_custom_call") == 2, lse  # stats, top-k: both Mosaic
