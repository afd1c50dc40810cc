"""Triton fused sampling kernel (interpret mode) against the canonical pipeline ``target_logprobs``.

Small V (37, 40, 300, 700) with tiles of 64/128 columns, so V is not a multiple of the tile and the
kernel's sampling paths (temperature-only, top-k candidates, pivot rejection, and the full-row
bisections: the rejection path's fallback, forced with ``max_rounds`` 0 or 1) all run.
Interpret mode spends most of its time compiling one program per input shape (and static
argument), so the tests share shapes: (24 rows, V=37, tile 64) for the kept-set, invalid-row and
dispatch tests, (3000, 40) and (3000, 300) for the statistical tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.sampling import target_logprobs
from pallas_kernels.triton.fused_sample import (
    MAX_ROUNDS,
    PATH_CANDIDATES,
    PATH_NONE,
    PATH_REJECT,
    PATH_SLOW,
    PATH_TEMPERATURE,
    fused_sample_debug,
)
from tests._law_checks import row_law, sampling_batch
from tests._reference import chisquare_pvalue


def _seeds(R, s):
    return jnp.asarray(np.random.default_rng(s).integers(0, 2**32, (R, 2), dtype=np.uint32))


def _run(x, pb, seeds, tile, **kw):
    out = fused_sample_debug(
        jnp.asarray(x), pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds, interpret=True, tile=tile, **kw
    )
    return jax.tree.map(np.asarray, out)


def _kept_from_thresholds(x_row, T, out, r):
    z = (x_row - x_row.max()).astype(np.float32) / np.float32(T)  # IEEE (XLA:CPU may use a reciprocal)
    with np.errstate(all="ignore"):
        q = np.exp(z.astype(np.float64)) / out["norm"][r]
        kept = (z >= out["tau"][r]) & (z > -np.inf) & (q >= out["q_thr"][r])
        band = np.abs(q - out["q_thr"][r]) <= 1e-5 * out["q_thr"][r]  # the boundary value itself
    return kept, band


def _check_kept(x_row, T, out, r, ref_keep):
    """Exact paths: the kept set rebuilt from the thresholds equals the reference's (outside the
    boundary band). Rejection path: the thresholds describe a superset (necessary conditions), so
    only inclusion is checked here; the law itself is checked by the chi-square tests."""
    kept, band = _kept_from_thresholds(x_row, T, out, r)
    if out["path"][r] == PATH_REJECT:
        assert not (ref_keep & ~kept)[~band].any(), f"row {r}: a kept token outside the described set"
    else:
        np.testing.assert_array_equal(kept[~band], ref_keep[~band], err_msg=f"row {r}")
    assert ref_keep[out["token"][r]], f"row {r}: draw outside the reference support"


@pytest.mark.parametrize(
    "V,tile,dtype,compact,max_rounds",
    [
        (37, 64, np.float32, "scatter", MAX_ROUNDS),
        (37, 64, np.float32, "scatter", 0),  # rejection off: the full-row bisections (its fallback)
        (700, 128, jnp.bfloat16, "scatter", MAX_ROUNDS),
        (700, 128, jnp.bfloat16, "loop", MAX_ROUNDS),
    ],
)
def test_kept_set_greedy_and_support(V, tile, dtype, compact, max_rounds):
    rng = np.random.default_rng(V)
    R = 24
    x = (rng.standard_normal((R, V)) * rng.uniform(0.5, 3, (R, 1))).astype(np.float32)
    x[3] = np.round(x[3])  # ties (greedy takes the lowest index; top-k keeps all tied)
    x[4, : V // 3] = -np.inf
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    temp = np.array([0, 0.7, 1.0, 0.5, 1.3, 0.7] * 4, np.float32)
    # second half: k = 200 / 300 (> CAND_CHUNKS: rejection at V = 700; >= V, i.e. off, at V = 37)
    topk = np.array([0, 0, 5, 1, 3, 0, 10, 0, 2, 0, 40, 0] + [0, 0, 200, 1, 300, 0, 10, 0, 200, 0, 300, 0], np.int32)
    topp = np.array([1, 1, 1, 0.9, 0.8, 0.6, 1, 0.95, 0.5, 1, 0.9, 0.7] * 2, np.float32)
    minp = np.array([0, 0.05, 0, 0, 0.1, 0] * 4, np.float32)
    pb = sampling_batch(temp, topk, topp, minp)
    # (static arguments left at their defaults where possible: an explicit default is another
    # compile; the candidate chunks are listed by scatter by default)
    kw = ({} if max_rounds == MAX_ROUNDS else dict(max_rounds=max_rounds)) | (
        {} if compact == "scatter" else dict(compact=compact)
    )
    out = _run(jnp.asarray(x).astype(dtype), pb, _seeds(R, 0), tile, **kw)
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    other = PATH_REJECT if max_rounds else PATH_SLOW
    assert {PATH_TEMPERATURE, PATH_CANDIDATES, other} <= set(out["path"].tolist())
    if V > 128:  # top-k > CAND_CHUNKS takes the rejection path
        assert (out["path"][topk > 128] == PATH_REJECT).all()
    if max_rounds:
        rej = out["path"] == PATH_REJECT
        assert (out["rounds"][rej] >= 1).all() and (out["rounds"][~rej] == 0).all()
    if "compact" in kw:  # either listing: identical outputs
        ref_out = _run(jnp.asarray(x).astype(dtype), pb, _seeds(R, 0), tile)
        for key in out:
            np.testing.assert_array_equal(out[key], ref_out[key], err_msg=key)
    for r in range(R):
        if temp[r] == 0:
            assert out["token"][r] == np.argmax(x[r]) and out["path"][r] == PATH_NONE, r
            continue
        _check_kept(x[r], temp[r], out, r, lp[r] > -np.inf)


def test_invalid_rows_and_mixed_batch():
    """NaN / +inf / all -inf rows give -1 on every path; greedy rows give the argmax; rows taking
    the four paths share one batch. (24 rows, V=37, tile 64: the shape of
    test_kept_set_greedy_and_support[37], no extra compile.)"""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 37)).astype(np.float32)
    x[0, 7] = np.nan  # temperature row
    x[1, 3] = np.inf  # greedy row
    x[2, :] = -np.inf  # candidate row
    x[3, 5] = np.inf  # top-p row
    x[5, :] = -np.inf  # top-p + min-p row
    x[6, :] = np.nan  # min-p row
    x[15, 2] = np.nan  # top-k + top-p row
    # columns: T, top-k (temperature, greedy, candidates, top-p, candidates, top-p + min-p, min-p, top-p)
    cfg = [
        [0.7, 0, 1.0, 0.6, 0.9, 1.2, 1.0, 0.7],
        [0, 0, 5, 0, 5, 0, 0, 0],
        [1, 1, 0.9, 0.95, 0.9, 0.5, 1, 0.95],
        [0, 0, 0, 0, 0, 0.1, 0.1, 0],
    ]
    pb = sampling_batch(*[c * 3 for c in cfg])
    out = _run(x, pb, _seeds(24, 1), 64)
    tok = out["token"]
    bad = [0, 1, 2, 3, 5, 6, 15]
    assert tok[bad].tolist() == [-1] * len(bad)
    assert (out["path"][bad] == PATH_NONE).all()
    T_, N_, C_, J_ = PATH_TEMPERATURE, PATH_NONE, PATH_CANDIDATES, PATH_REJECT
    want_path = np.array([T_, N_, C_, J_, C_, J_, J_, J_] * 3)
    want_path[bad] = PATH_NONE
    np.testing.assert_array_equal(out["path"], want_path)
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    for r in range(24):
        if r in bad:
            continue
        if np.asarray(pb.temperature)[r] == 0:
            assert tok[r] == np.argmax(x[r]), r
        else:
            assert lp[r, tok[r]] > -np.inf, r


def _draws(base, n, T, k, p, m, tile, seed, **kw):
    pb = sampling_batch([T] * n, [k] * n, [p] * n, [m] * n)
    return _run(jnp.broadcast_to(jnp.asarray(base), (n, len(base))), pb, _seeds(n, seed), tile, **kw)


def _assert_law(base, tok, T, k, p, m, wrong_t=1.25):
    """No draw outside the reference support, every kept token with expected count >= 10 drawn,
    chi-square p-value > 1e-3. Negative control: the same counts against a wrong law
    (temperature times ``wrong_t``) must give p < 1e-6 (or put mass outside its support)."""
    n, V = len(tok), len(base)
    counts = np.bincount(tok, minlength=V)
    prob = row_law(base, T, k, p, m)
    sup = prob > 0
    assert counts[~sup].sum() == 0
    assert (counts[prob * n >= 10] > 0).all()  # kept tokens expected >= 10 times all show up
    assert chisquare_pvalue(counts[sup], (prob[sup] / prob[sup].sum()) * n) > 1e-3
    wrong = row_law(base, T * wrong_t, k, p, m)
    wsup = wrong > 0
    if counts[~wsup].sum() == 0:  # otherwise the wrong law is rejected outright
        assert chisquare_pvalue(counts[wsup], (wrong[wsup] / wrong[wsup].sum()) * n) < 1e-6


@pytest.mark.parametrize(
    "T,k,p,m,paths,max_rounds",
    [
        (1.0, 0, 1.0, 0.0, {PATH_TEMPERATURE}, MAX_ROUNDS),
        (0.8, 6, 0.85, 0.02, {PATH_CANDIDATES}, MAX_ROUNDS),
        (1.3, 0, 0.8, 0.05, {PATH_REJECT}, MAX_ROUNDS),  # top-p + min-p
        (0.6, 0, 0.95, 0.0, {PATH_REJECT}, MAX_ROUNDS),  # top-p alone
        (1.0, 0, 1.0, 0.1, {PATH_REJECT}, MAX_ROUNDS),  # min-p alone
        (1.3, 0, 0.5, 0.05, {PATH_REJECT, PATH_SLOW}, 1),  # one round, then the bisections
    ],
)
def test_chi_square_law(T, k, p, m, paths, max_rounds):
    """n = 3000 draws of one V=40 row (fixed seeds; one compile per max_rounds) vs the exact
    law (see ``_assert_law``). With max_rounds = 1 a row whose first draw is rejected falls back
    to the full-row bisections: the mixture must still be the exact law."""
    V, n = 40, 3000
    rng = np.random.default_rng(7)
    base = rng.standard_normal(V).astype(np.float32) * 1.5
    out = _draws(base, n, T, k, p, m, 64, 3, **({} if max_rounds == MAX_ROUNDS else dict(max_rounds=max_rounds)))
    assert set(out["path"].tolist()) == paths
    if PATH_REJECT in paths and k == 0 and p < 1:
        # top-p: one pass per round; rounds beyond the first are rejections
        rej = out["path"] == PATH_REJECT
        np.testing.assert_array_equal(out["passes"][rej], out["rounds"][rej])
    if max_rounds == MAX_ROUNDS and p == 1.0 and m > 0:  # min-p alone: a pass only after a rejection
        assert set(out["passes"].tolist()) <= {0, 1} and (out["rounds"] == out["passes"] + 1).all()
    _assert_law(base, out["token"], T, k, p, m)


def test_chi_square_large_top_k_and_ties():
    """Top-k > CAND_CHUNKS (the rejection path), alone, with top-p (the exact S_k bisection when
    the bounds do not decide) and with min-p, on a V=300 row of half-integer logits: large tie
    groups at the top-k, top-p and min-p boundaries (the reference keeps whole tie groups).
    n = 3000 draws each (one compile), same checks as ``test_chi_square_law`` (the negative
    control with the temperature off by 50%: 25% gives a median p-value of only ~1e-7 here)."""
    V, n = 300, 3000
    rng = np.random.default_rng(11)
    base = (np.round(rng.standard_normal(V) * 2) / 2).astype(np.float32)
    for T, k, p, m in [(0.7, 150, 1.0, 0.0), (0.7, 150, 0.9, 0.0), (1.0, 200, 1.0, 0.05)]:
        out = _draws(base, n, T, k, p, m, 64, 5)
        assert (out["path"] == PATH_REJECT).all()
        assert (out["rounds"] > 1).any()  # some first draws are rejected
        if p < 1:
            assert (out["passes"] > 33).any()  # the exact S_k bisection ran
        _assert_law(base, out["token"], T, k, p, m, wrong_t=1.5)


def test_sample_tree_nodes_dispatch():
    """impl="pallas" (interpret) vs "reference": greedy equal, support respected, and a seeded
    request draws the same tokens whatever else shares the batch."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((3, 5, 90)).astype(np.float32))
    sp = [
        dt.SamplingParams(temperature=0.0),
        dt.SamplingParams(temperature=0.8, top_k=7, seed=5),
        dt.SamplingParams(temperature=1.1, top_p=0.8, seed=9),
    ]
    key = jax.random.key(0)
    ker = np.asarray(dt.sample_tree_nodes(logits, sp, key, impl="pallas"))
    ref = np.asarray(dt.sample_tree_nodes(logits, sp, key, impl="reference"))
    assert ker.shape == (3, 5) and ker.dtype == np.int32
    np.testing.assert_array_equal(ker[0], ref[0])
    lp = np.asarray(target_logprobs(logits, dt.batch_sampling(sp, 3)))
    assert (np.take_along_axis(lp, ker[..., None], -1) > -np.inf).all()
    # batch independence: seeded requests at other positions with other neighbours, same draws
    # (same shape as above: no second compile)
    sp2 = [sp[2], sp[1], dt.SamplingParams(temperature=0.5, top_k=3)]
    moved = np.asarray(dt.sample_tree_nodes(jnp.stack([logits[2], logits[1], logits[0]]), sp2, key, impl="pallas"))
    np.testing.assert_array_equal(moved[1], ker[1])
    np.testing.assert_array_equal(moved[0], ker[2])
    with pytest.raises(ValueError, match="impl"):
        dt.sample_tree_nodes(logits, sp, key, impl="fast")


def test_split_row_stats_combine_exactly():
    """Few rows: the stats launch splits each row over several programs (here V=300, tile 64: 5
    tiles over 4 programs, the last one empty). Lowest-index argmax across splits, invalid rows
    (NaN or +inf in the last split, all -inf), and sampled rows' kept sets are unchanged."""
    from pallas_kernels.triton.fused_sample import _splits_for

    assert _splits_for(6, 5) == 4
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[0, 100] = x[0, 250] = 9.0  # tie across splits 0 and 2: the lower index wins
    x[1, 260] = 9.0  # max in the last non-empty split
    x[2, 290] = np.nan
    x[3] = -np.inf
    x[4, 299] = np.inf
    pb = sampling_batch([0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0] * 6, [1.0] * 6, [0.0] * 6)
    out = _run(x, pb, _seeds(6, 2), 64)
    np.testing.assert_array_equal(out["token"][:5], [100, 260, -1, -1, -1])
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    assert lp[5, out["token"][5]] > -np.inf


def test_bad_tuning_knob_is_refused_by_name():
    with pytest.raises(ValueError, match="compact"):
        fused_sample_debug(jnp.zeros((2, 8)), jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2),
                           jnp.zeros((2, 2), jnp.uint32), interpret=True, compact="sort")


def test_rows_do_not_depend_on_the_batch():
    """A row's outputs are the same bits among 4 rows and among 64, although the stats launch
    splits each row over 8 programs at 4 rows and 4 at 64 (interpret mode: the logic; the warps'
    rounding is checked on the GPU by tests/test_gpu.py)."""
    rng = np.random.default_rng(11)
    R, V, tile = 64, 1024, 128
    x = (rng.standard_normal((R, V)) * rng.uniform(0.5, 3, (R, 1))).astype(np.float32)
    x[1] = np.round(x[1])
    pb = sampling_batch(
        rng.choice([0.0, 0.7, 1.3], R), rng.choice([0, 5, 200], R), rng.choice([1.0, 0.9], R), rng.choice([0.0, 0.1], R)
    )
    seeds = _seeds(R, 5)
    small = jax.tree.map(lambda a: a[:4], pb)
    a, b = _run(x[:4], small, seeds[:4], tile), _run(x, pb, seeds, tile)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key][:4], err_msg=key)


def _rejection_batch():
    """8 rows of V=1000 (tile 64: 16 tiles, 4 segments of CHECK_SEG tiles) on the rejection path:
    top-p alone, min-p alone, top-k > CAND_CHUNKS with and without top-p, on Gaussian and on
    rounded (tied) logits; high temperatures for the top-k rows, whose first pivots then fall near
    rank k, where the count decides."""
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((8, 1000)) * 2).astype(np.float32)
    x[4:] = np.round(x[4:])
    pb = sampling_batch([0.6, 1.0, 3.0, 2.5] * 2, [0, 0, 150, 140] * 2, [0.95, 1.0, 1.0, 0.9] * 2,
                        [0.0, 0.2, 0.0, 0.0] * 2)
    return x, pb


def test_first_check_pass_splits_give_the_same_bits():
    """The rejection path's first check pass spread over 1 or 4 programs per row (V=1000,
    tile 64: 16 tiles, 4 segments of CHECK_SEG tiles): every output field the same bits, since
    every value it stores is one tile's or one fixed segment's. Rows: top-p alone, min-p alone,
    top-k > CAND_CHUNKS with and without top-p, on Gaussian and on rounded (tied) logits."""
    from pallas_kernels.triton.fused_sample import CHECK_SEG

    R, V, tile = 8, 1000, 64
    assert -(-V // tile) == 4 * CHECK_SEG
    x, pb = _rejection_batch()
    outs = [_run(x, pb, _seeds(R, 9), tile, check_splits=c) for c in (1, 4)]
    assert (outs[0]["path"] == PATH_REJECT).all()
    for out in outs[1:]:
        for key in out:
            np.testing.assert_array_equal(out[key], outs[0][key], err_msg=key)
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    assert (lp[np.arange(R), outs[0]["token"]] > -np.inf).all()


def test_chi_square_later_rounds_over_segments():
    """Rounds after the check launch's run in the select program, over a row of several segments
    (V=1024, tile 64: 16 tiles, 4 segments), where each round's per-tile weights steer the next
    draw: top-p 0.5 alone and top-k 160 alone at T=1.5 (many first and second draws rejected).
    n = 3000 draws each against the exact law (``_assert_law``: p > 1e-3, every token expected
    >= 10 times drawn, the negative control with the temperature off by 25% at p < 1e-6). A
    select pass that stores each tile's mass at the mirrored tile fails it (no other test here
    does: the other law tests' rows are one or two segments long)."""
    V, n = 1024, 3000
    rng = np.random.default_rng(13)
    base = (rng.standard_normal(V) * 1.5).astype(np.float32)
    for T, k, p in [(1.0, 0, 0.5), (1.5, 160, 1.0)]:
        out = _draws(base, n, T, k, p, 0.0, 64, 8)
        assert (out["path"] == PATH_REJECT).all()
        assert (out["rounds"] >= 3).sum() >= 100, np.bincount(out["rounds"])  # in-program passes steer draws
        _assert_law(base, out["token"], T, k, p, 0.0)


def test_second_check_launch_serves_round_one():
    """check_rounds=2 (the default: a second check launch runs round 1's pass for rows whose first
    pivot was rejected, spread over programs) against check_rounds=1 (round 1 in the select
    program): the same tokens, paths, rounds and passes on the rejection batch, with 1 and 4
    programs per row (the rounds' draws are the same; only where the pass runs changes)."""
    x, pb = _rejection_batch()
    one = _run(x, pb, _seeds(8, 9), 64, check_rounds=1)
    assert (one["rounds"] >= 2).sum() >= 2, one["rounds"]  # round 1 is served for some rows
    for c in (1, 4):
        two = _run(x, pb, _seeds(8, 9), 64, check_splits=c, check_rounds=2)
        for key in ("token", "path", "rounds", "passes"):
            np.testing.assert_array_equal(two[key], one[key], err_msg=f"check_splits={c} {key}")


def test_exact_div_argument_reaches_the_cuda_lowering():
    """``exact_div_asm`` is threaded to every launch: lowered for CUDA (on the CPU: the Triton
    lowering rules run, no GPU needed), the default divides with inline ``div.rn.f32`` and
    ``exact_div_asm=False`` lowers without it (Triton's own division)."""
    R, V = 4, 37
    x = jnp.asarray(np.random.default_rng(0).standard_normal((R, V)).astype(np.float32))
    pb = sampling_batch([0.7, 1.0, 0.8, 1.2], [0, 5, 0, 20], [1.0, 0.9, 0.8, 1.0], [0.0, 0.0, 0.1, 0.0])

    def lowered(**kw):
        f = jax.jit(lambda *a: fused_sample_debug(*a, tile=64, **kw))
        args = (x, pb.temperature, pb.top_k, pb.top_p, pb.min_p, _seeds(R, 0))
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert lowered().count("div.rn.f32") > 0
    assert lowered(exact_div_asm=False).count("div.rn.f32") == 0
