"""Triton vocab top-k (interpret mode) == ``lax.top_k(draft_logprobs(x))`` (the log-softmax with its
normaliser summed in a fixed order) bit for bit: values, order,
tie rule, -inf masks, fewer finite entries than k, NaN / +inf / all--inf rows, V not a power of
two, bf16 and f32; and the tree built through it == the reference build (V < chunk * k and
k == V: tests/test_triton_tree_builder.py, whose kernel builds run through this kernel).

Interpret mode compiles each (shape, k, mode) once and that dominates, so one batch of rows
carries most cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from pallas_kernels.triton.vocab_top_k import vocab_top_k
from tests._random_inputs import MIXED_BAD_ROWS as BAD
from tests._random_inputs import mixed_top_k_rows, random_draft_logits


def _lax(x, k):
    # compiled, as the reference build is: op-by-op XLA:CPU can round exp (so the normaliser) an ulp
    # differently from the same expression in one compiled program (a fuzz row of 5,000 bf16 logits)
    return jax.jit(lambda x: jax.lax.top_k(dt.draft_logprobs(x), k))(jnp.asarray(x))


def _assert_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg="indices")
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg="values")


@pytest.mark.parametrize("part", [2048, 64])
def test_xla_lse_equals_lax_top_k_of_draft_logprobs(part):
    """Bit for bit on every row with a law. All-NaN rows: NaN values both, indices 0..k-1 here;
    lax.top_k orders NaNs by sign and payload, which follow the platform's NaN propagation (on the
    CPU an input NaN is positive and the NaNs that log_softmax makes are negative, so the input
    NaN's index comes first), so those indices are not compared (the tree ignores such rows).
    ``part`` 64: the 188 chunk maxima as three register vectors in the chunks launch."""
    x = mixed_top_k_rows(1).reshape(2, 5, -1)
    got = [np.asarray(a).reshape(10, -1)
           for a in vocab_top_k(jnp.asarray(x), 200, lse="xla", interpret=True, part=part)]
    want = [np.asarray(a).reshape(10, -1) for a in _lax(x, 200)]
    good = np.setdiff1d(np.arange(10), BAD)
    _assert_equal([a[good] for a in got], [a[good] for a in want])
    assert np.isnan(got[0][BAD]).all() and np.isnan(want[0][BAD]).all()
    np.testing.assert_array_equal(got[1][BAD], np.broadcast_to(np.arange(200), (3, 200)))


def test_build_draft_tree_through_the_kernel():
    """impl="pallas" builds with vocab_top_k (the Triton family has it); same tree as the reference.
    bf16 logits with more chunks (94) than k (64): the chunk bisection runs. (Small V, k == V and
    V < 32 k run through the same path in tests/test_triton_tree_builder.py.)"""
    x = random_draft_logits(5, 2, 4, 3000)
    x[1] = np.round(x[1])  # score ties
    x[0, 2, 50:] = -np.inf  # fewer tokens than the budget at one depth
    x = jnp.asarray(x).astype(jnp.bfloat16)
    _assert_equal(vocab_top_k(x, 64, lse="xla", interpret=True), _lax(x, 64))
    # the chunk maxima in six register vectors of 32 lanes (the bisection and the tie scan across them)
    _assert_equal(vocab_top_k(x, 64, lse="xla", interpret=True, part=32), _lax(x, 64))
    ref = dt.build_draft_tree(x, 64, impl="reference")
    ker = dt.build_draft_tree(x, 64, impl="pallas")
    for f in ("tokens", "parents", "depth", "score", "first_child", "next_sibling", "valid", "ancestor_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(ker, f)), np.asarray(getattr(ref, f)), err_msg=f)


def test_lowers_for_cuda():
    """The Triton lowering rules (interpret mode does not check them), at the tree's real size."""
    for shape, k, lse in [((16, 15, 163_840), 256, "kernel"), ((16, 15, 163_840), 256, "xla"), ((1, 1, 7), 3, "xla"),
                          ((2, 5, 37), 37, "kernel")]:
        f = jax.jit(lambda x, k=k, lse=lse: vocab_top_k(x, k, lse=lse))
        text = f.trace(jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert "ddtree_topk_candidates" in text


def test_bad_arguments():
    with pytest.raises(ValueError, match="k <= V"):
        vocab_top_k(jnp.zeros((2, 8)), 9, interpret=True)
    with pytest.raises(ValueError, match="lse"):
        vocab_top_k(jnp.zeros((2, 8)), 3, lse="cpu", interpret=True)


def test_fused_normaliser_is_exact_for_its_own_lse():
    """lse="kernel" (the compiled tree build's default): the top-k of ``(x - max) - lse`` under the
    kernel's own max and normaliser, bit for bit, ties included; the normaliser within 2e-6 of XLA's."""
    from pallas_kernels.triton.vocab_top_k import vocab_top_k_with_stats

    x = random_draft_logits(8, 2, 3, 3000)
    x[1] = np.round(x[1])  # ties
    x = jnp.asarray(x).astype(jnp.bfloat16)
    out = vocab_top_k_with_stats(x, 64, lse="kernel", interpret=True)
    x32 = x.astype(jnp.float32)
    want = jax.lax.top_k((x32 - out["max"][..., None]) - out["lse"][..., None], 64)
    _assert_equal((out["values"], out["indices"]), want)
    ref = jnp.log(jnp.sum(jnp.exp(x32 - out["max"][..., None]), -1))
    np.testing.assert_allclose(np.asarray(out["lse"]), np.asarray(ref), rtol=2e-6, atol=2e-6)
