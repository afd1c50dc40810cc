"""Triton fused sampling kernel (interpret mode) against the canonical pipeline ``target_logprobs``.

Small V (37, 40, 700) with tiles of 64/128 columns, so V is not a multiple of the tile and the
kernel's three sampling paths (temperature-only, top-k candidates, full-row bisection) all run.
Interpret mode spends most of its time compiling one program per input shape, so the tests share
shapes: (24 rows, V=37, tile 64) for the kept-set, invalid-row and dispatch tests, (3000, 40) for
the statistical tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import ddtree_jax as dt
from ddtree_jax.sampling import SamplingBatch, target_logprobs
from pallas_kernels.triton.fused_sample import (
    PATH_CANDIDATES,
    PATH_SLOW,
    PATH_TEMPERATURE,
    fused_sample,
    fused_sample_debug,
)


def _batch(temp, topk, topp, minp):
    R = len(temp)
    return SamplingBatch(
        jnp.asarray(np.asarray(temp, np.float32)),
        jnp.asarray(np.asarray(topk, np.int32)),
        jnp.asarray(np.asarray(topp, np.float32)),
        jnp.asarray(np.asarray(minp, np.float32)),
        jnp.zeros(R, jnp.uint32),
        jnp.zeros(R, bool),
    )


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


@pytest.mark.parametrize(
    "V,tile,dtype,compact",
    [(37, 64, np.float32, "loop"), (700, 128, jnp.bfloat16, "loop"), (700, 128, jnp.bfloat16, "scatter")],
)
def test_kept_set_greedy_and_support(V, tile, dtype, compact):
    rng = np.random.default_rng(V)
    R = 24
    x = (rng.standard_normal((R, V)) * rng.uniform(0.5, 3, (R, 1))).astype(np.float32)
    x[3] = np.round(x[3])  # ties (greedy takes the lowest index; top-k keeps all tied)
    x[4, : V // 3] = -np.inf
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    temp = np.array([0, 0.7, 1.0, 0.5, 1.3, 0.7] * 4, np.float32)
    topk = np.array([0, 0, 5, 1, 3, 0, 10, 0, 2, 0, 40, 0] * 2, np.int32)
    topp = np.array([1, 1, 1, 0.9, 0.8, 0.6, 1, 0.95, 0.5, 1, 0.9, 0.7] * 2, np.float32)
    minp = np.array([0, 0.05, 0, 0, 0.1, 0] * 4, np.float32)
    pb = _batch(temp, topk, topp, minp)
    out = _run(
        jnp.asarray(x).astype(dtype), pb, _seeds(R, 0), tile, **({} if compact == "loop" else dict(compact=compact))
    )
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    assert {PATH_TEMPERATURE, PATH_CANDIDATES, PATH_SLOW} <= set(out["path"].tolist())
    if compact != "loop":  # the two ways of listing candidate chunks give identical outputs
        ref_out = _run(jnp.asarray(x).astype(dtype), pb, _seeds(R, 0), tile)
        for key in out:
            np.testing.assert_array_equal(out[key], ref_out[key], err_msg=key)
    for r in range(R):
        if temp[r] == 0:
            assert out["token"][r] == np.argmax(x[r]), r
            continue
        ref_keep = lp[r] > -np.inf
        kept, band = _kept_from_thresholds(x[r], temp[r], out, r)
        np.testing.assert_array_equal(kept[~band], ref_keep[~band], err_msg=f"row {r}")
        assert ref_keep[out["token"][r]], f"row {r}: draw outside the reference support"


def test_invalid_rows_and_mixed_batch():
    """NaN / +inf / all -inf rows give -1; greedy and sampled rows share the batch. (24 rows,
    V=37, tile 64: the shape of test_kept_set_greedy_and_support[37], no extra compile.)"""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((24, 37)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, 3] = np.inf
    x[2, :] = -np.inf
    x[6, :] = np.nan
    cfg = [[0.7, 0, 1.0, 0, 0.9, 1.2], [0, 0, 5, 0, 5, 0], [1, 1, 0.9, 1, 0.9, 0.5], [0, 0, 0, 0, 0, 0.1]]
    pb = _batch(*[c * 4 for c in cfg])
    tok = np.asarray(
        fused_sample(
            jnp.asarray(x), pb.temperature, pb.top_k, pb.top_p, pb.min_p, _seeds(24, 1), interpret=True, tile=64
        )
    )
    assert tok[[0, 1, 2, 6]].tolist() == [-1, -1, -1, -1]
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    for r in range(24):
        if r in (0, 1, 2, 6):
            continue
        if np.asarray(pb.temperature)[r] == 0:
            assert tok[r] == np.argmax(x[r]), r
        else:
            assert lp[r, tok[r]] > -np.inf, r


@pytest.mark.parametrize("T,k,p,m", [(1.0, 0, 1.0, 0.0), (0.8, 6, 0.85, 0.02), (1.3, 0, 0.8, 0.05)])
def test_chi_square_law(T, k, p, m):
    """n = 3000 draws of one V=40 row (fixed seeds; one compile for all three cases) vs the exact
    law: temperature only, top-k + top-p + min-p (candidate path), top-p + min-p (full-row path).
    No draw outside the reference support, every kept token with expected count >= 10 drawn, chi-square
    p-value > 1e-3. Negative control: the same counts against a wrong law (temperature off by
    25%) must give p < 1e-6 (or put mass outside its support)."""
    V, n = 40, 3000
    rng = np.random.default_rng(7)
    base = rng.standard_normal(V).astype(np.float32) * 1.5
    pb = _batch([T] * n, [k] * n, [p] * n, [m] * n)
    tok = np.asarray(
        fused_sample(
            jnp.broadcast_to(jnp.asarray(base), (n, V)),
            pb.temperature,
            pb.top_k,
            pb.top_p,
            pb.min_p,
            _seeds(n, 3),
            interpret=True,
            tile=64,
        )
    )
    counts = np.bincount(tok, minlength=V)

    def law(T_):
        return np.exp(
            np.asarray(target_logprobs(jnp.asarray(base)[None, None], _batch([T_], [k], [p], [m])))[0, 0].astype(
                np.float64
            )
        )

    prob = law(T)
    sup = prob > 0
    assert counts[~sup].sum() == 0
    assert (counts[prob * n >= 10] > 0).all()  # kept tokens expected >= 10 times all show up
    assert stats.chisquare(counts[sup], prob[sup] / prob[sup].sum() * n).pvalue > 1e-3
    wrong = law(T * 1.25)
    wsup = wrong > 0
    if counts[~wsup].sum() == 0:  # otherwise the wrong law is rejected outright
        assert stats.chisquare(counts[wsup], wrong[wsup] / wrong[wsup].sum() * n).pvalue < 1e-6


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
