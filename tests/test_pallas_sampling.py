"""Fused sampling kernel (interpret mode) against the canonical pipeline ``target_logprobs``.

Small V (37..700) with tiles of 64/128 columns, so V is not a multiple of the tile and the
kernel's three sampling paths (temperature-only, top-k candidates, full-row bisection) all run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import ddtree_jax as dt
from ddtree_jax.sampling import SamplingBatch, target_logprobs
from pallas_kernels.fused_sampling import PATH_CANDIDATES, PATH_SLOW, PATH_TEMPERATURE, fused_sample, fused_sample_debug


def _batch(temp, topk, topp, minp):
    R = len(temp)
    return SamplingBatch(
        jnp.asarray(np.asarray(temp, np.float32)), jnp.asarray(np.asarray(topk, np.int32)),
        jnp.asarray(np.asarray(topp, np.float32)), jnp.asarray(np.asarray(minp, np.float32)),
        jnp.zeros(R, jnp.uint32), jnp.zeros(R, bool),
    )


def _seeds(R, s):
    return jnp.asarray(np.random.default_rng(s).integers(0, 2**32, (R, 2), dtype=np.uint32))


def _run(x, pb, seeds, tile):
    out = fused_sample_debug(jnp.asarray(x), pb.temperature, pb.top_k, pb.top_p, pb.min_p, seeds, interpret=True, tile=tile)
    return jax.tree.map(np.asarray, out)


def _kept_from_thresholds(x_row, T, out, r):
    z = np.asarray(jnp.asarray(x_row - x_row.max()) / jnp.float32(T))
    with np.errstate(all="ignore"):
        q = np.exp(z.astype(np.float64)) / out["norm"][r]
        kept = (z >= out["tau"][r]) & (z > -np.inf) & (q >= out["q_thr"][r])
        band = np.abs(q - out["q_thr"][r]) <= 1e-5 * out["q_thr"][r]  # the boundary value itself
    return kept, band


@pytest.mark.parametrize("V,tile,dtype", [(37, 64, np.float32), (300, 128, np.float32), (700, 128, jnp.bfloat16)])
def test_kept_set_greedy_and_support(V, tile, dtype):
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
    out = _run(jnp.asarray(x).astype(dtype), pb, _seeds(R, 0), tile)
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    assert {PATH_TEMPERATURE, PATH_CANDIDATES, PATH_SLOW} <= set(out["path"].tolist())
    for r in range(R):
        if temp[r] == 0:
            assert out["token"][r] == np.argmax(x[r]), r
            continue
        ref_keep = lp[r] > -np.inf
        kept, band = _kept_from_thresholds(x[r], temp[r], out, r)
        np.testing.assert_array_equal(kept[~band], ref_keep[~band], err_msg=f"row {r}")
        assert ref_keep[out["token"][r]], f"row {r}: draw outside the reference support"


def test_invalid_rows_and_mixed_batch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 100)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, 3] = np.inf
    x[2, :] = -np.inf
    pb = _batch([0.7, 0, 1.0, 0, 0.9, 1.2], [0, 0, 5, 0, 5, 0], [1, 1, 0.9, 1, 0.9, 0.5], [0, 0, 0, 0, 0, 0.1])
    tok = np.asarray(fused_sample(jnp.asarray(x), pb.temperature, pb.top_k, pb.top_p, pb.min_p, _seeds(6, 1), interpret=True, tile=64))
    assert tok[:3].tolist() == [-1, -1, -1]
    assert tok[3] == np.argmax(x[3])
    lp = np.asarray(target_logprobs(jnp.asarray(x)[:, None], pb))[:, 0]
    assert lp[4, tok[4]] > -np.inf and lp[5, tok[5]] > -np.inf


def test_many_draws_stay_in_support():
    """2000 draws of one row under top-k + top-p + min-p: never outside the reference support."""
    rng = np.random.default_rng(2)
    base = rng.standard_normal(45).astype(np.float32) * 2
    n = 2000
    pb = _batch([0.8] * n, [12] * n, [0.85] * n, [0.02] * n)
    tok = np.asarray(fused_sample(jnp.broadcast_to(jnp.asarray(base), (n, 45)), pb.temperature, pb.top_k, pb.top_p, pb.min_p, _seeds(n, 2), interpret=True, tile=64))
    lp = np.asarray(target_logprobs(jnp.asarray(base)[None, None], _batch([0.8], [12], [0.85], [0.02])))[0, 0]
    assert (lp[tok] > -np.inf).all()
    assert len(set(tok.tolist())) == int((lp > -np.inf).sum())  # and every kept token shows up


@pytest.mark.parametrize("T,k,p,m,V", [(1.0, 0, 1.0, 0.0, 20), (0.7, 6, 0.9, 0.0, 20), (1.3, 0, 0.8, 0.05, 70)])
def test_chi_square_law(T, k, p, m, V):
    """n = 6000 draws of one row (fixed seeds) vs the exact law; reject at p < 1e-3. Negative
    control: the same counts against a wrong law (temperature off by 15%) must be rejected."""
    rng = np.random.default_rng(int(T * 10) + k + V)
    base = rng.standard_normal(V).astype(np.float32) * 1.5
    n = 6000
    pb = _batch([T] * n, [k] * n, [p] * n, [m] * n)
    tok = np.asarray(fused_sample(jnp.broadcast_to(jnp.asarray(base), (n, V)), pb.temperature, pb.top_k, pb.top_p, pb.min_p, _seeds(n, 3), interpret=True, tile=64))
    counts = np.bincount(tok, minlength=V)

    def law(T_):
        return np.exp(np.asarray(target_logprobs(jnp.asarray(base)[None, None], _batch([T_], [k], [p], [m])))[0, 0].astype(np.float64))

    prob = law(T)
    sup = prob > 0
    assert counts[~sup].sum() == 0
    assert stats.chisquare(counts[sup], prob[sup] / prob[sup].sum() * n).pvalue > 1e-3
    wrong = law(T * 1.15)
    wsup = wrong > 0
    if counts[~wsup].sum() == 0:  # otherwise the wrong law is rejected outright
        assert stats.chisquare(counts[wsup], wrong[wsup] / wrong[wsup].sum() * n).pvalue < 1e-6


def test_sample_tree_nodes_dispatch():
    """impl="pallas" (interpret) vs "reference": greedy equal, support respected, and a seeded
    request draws the same tokens whatever else shares the batch."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((3, 5, 90)).astype(np.float32))
    sp = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.8, top_k=7, seed=5),
          dt.SamplingParams(temperature=1.1, top_p=0.8, seed=9)]
    key = jax.random.key(0)
    ker = np.asarray(dt.sample_tree_nodes(logits, sp, key, impl="pallas"))
    ref = np.asarray(dt.sample_tree_nodes(logits, sp, key, impl="reference"))
    assert ker.shape == (3, 5) and ker.dtype == np.int32
    np.testing.assert_array_equal(ker[0], ref[0])
    lp = np.asarray(target_logprobs(logits, dt.batch_sampling(sp, 3)))
    assert (np.take_along_axis(lp, ker[..., None], -1) > -np.inf).all()
    # batch independence: request with seed 5 alone, at another position, same draws
    alone = np.asarray(dt.sample_tree_nodes(jnp.stack([logits[2], logits[1]]), [sp[2], sp[1]], key, impl="pallas"))
    np.testing.assert_array_equal(alone[1], ker[1])
    np.testing.assert_array_equal(alone[0], ker[2])
    with pytest.raises(ValueError, match="impl"):
        dt.sample_tree_nodes(logits, sp, key, impl="fast")
