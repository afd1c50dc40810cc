"""The fixed-order dense product (``pallas_kernels/triton/dense_matmul.py``, interpret mode) and the
target's batch-invariant mode built on it (``ExecutionConfig.batch_invariant``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import ExecutionConfig
from pallas_kernels.triton.dense_matmul import DenseBlocks, choose_blocks, dense_matmul, dense_matmul_reference
from tests._model_fixtures import tiny_kimi

KERNELS, FIXED = ExecutionConfig(impl="pallas"), ExecutionConfig(impl="pallas", batch_invariant=True)


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (37, 48, 80), (200, 128, 32), (3, 40, 24)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_matmul_equals_reference(m, k, n, dtype):
    """Leading dims kept; rows not a multiple of the tile; K and N not powers of two; float32
    output (the LM head's) and the input's dtype."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _rand(rng, (1, m, k), dtype), _rand(rng, (k, n), dtype)
    for out_dtype in (None, jnp.float32):
        got = dense_matmul(x, w, out_dtype=out_dtype, interpret=True)
        want = dense_matmul_reference(x, w, out_dtype=out_dtype)
        assert got.shape == (1, m, n) and got.dtype == want.dtype
        tol = 1e-5 if got.dtype == jnp.float32 else 1e-2  # bf16 output: one rounding apart at most
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_row_is_the_same_bits_alone_and_among_others(dtype):
    """The batch invariance the kernel exists for: with the tiles fixed, row r's result does not
    depend on how many rows are in the call (the same holds across ``choose_blocks``' row tiles
    on the H200: tests/test_gpu.py)."""
    rng = np.random.default_rng(7)
    x, w = _rand(rng, (130, 96), dtype), _rand(rng, (96, 160), dtype)
    blocks = DenseBlocks(block_m=16)
    full = np.asarray(dense_matmul(x, w, out_dtype=jnp.float32, blocks=blocks, interpret=True))
    for m in (1, 5, 16, 17, 65):
        part = np.asarray(dense_matmul(x[:m], w, out_dtype=jnp.float32, blocks=blocks, interpret=True))
        np.testing.assert_array_equal(part, full[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_per_group_weights_equal_reference_and_rows_are_invariant(dtype):
    """``w [G, K, N]``: group g's rows times ``w[g]`` (the absorbed attention's per-head products,
    ``btnd,rnd->btnr`` with the weight moved to ``[n, d, r]``), equal to the plain per-group
    product, and a row's bits the same alone and among others."""
    rng = np.random.default_rng(11)
    x, w = _rand(rng, (2, 19, 3, 48), dtype), _rand(rng, (3, 48, 40), dtype)
    got = dense_matmul(x, w, out_dtype=jnp.float32, interpret=True)
    want = jnp.einsum("btgk,gkn->btgn", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (2, 19, 3, 40)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    flat = x.reshape(38, 3, 48)
    blocks = DenseBlocks(block_m=16)
    full = np.asarray(dense_matmul(flat, w, out_dtype=jnp.float32, blocks=blocks, interpret=True))
    for m in (1, 17):
        part = np.asarray(dense_matmul(flat[:m], w, out_dtype=jnp.float32, blocks=blocks, interpret=True))
        np.testing.assert_array_equal(part, full[:m], err_msg=f"{m} rows")
    with pytest.raises(ValueError, match=r"\[\.\.\., G, K\] @ \[G, K, N\]"):
        dense_matmul(jnp.zeros((4, 2, 48)), jnp.zeros((3, 48, 40)), interpret=True)


def test_choose_blocks_grow_with_rows_and_bad_shapes_are_named():
    assert [choose_blocks(m).block_m for m in (1, 16, 17, 64, 65, 4096)] == [16, 16, 64, 64, 128, 128]
    with pytest.raises(ValueError, match=r"x \(2, 5\) and w \(4, 8\) do not multiply"):
        dense_matmul(jnp.zeros((2, 5)), jnp.zeros((4, 8)), interpret=True)
    with pytest.raises(ValueError, match="multiples of 16 on the GPU"):
        dense_matmul(jnp.zeros((2, 40)), jnp.zeros((40, 24)), interpret=False)


def test_target_batch_invariant_mode():
    """``batch_invariant``: the LM head's float32 logits and the router's scores of a row are the
    same bits alone and among 16 rows (XLA's dot on the CPU differs there: the row-count
    dependence the mode removes), and the logits stay those of the plain path (to float32
    rounding). It needs the kernels, and says so."""
    base = tiny_kimi(0, hidden_size=128, vocab_size=512)  # smaller: XLA's CPU dot happens to agree across rows
    with pytest.raises(ValueError, match="needs the Triton kernels"):
        base.with_execution(ExecutionConfig(impl="reference", batch_invariant=True))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, base.config.vocab_size, (2, 8)), jnp.int32)
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((16, base.config.hidden_size)), jnp.float32)

    def router(model):
        return next(layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate"))

    def rows_alone_and_among_16(model):
        head, route = jax.jit(model.lm_logits), jax.jit(lambda h: router(model)(h)[0])
        return [(np.asarray(f(hidden[:1])), np.asarray(f(hidden))[:1]) for f in (head, route)]

    plain_model, fixed_model = base.with_execution(KERNELS), base.with_execution(FIXED)
    plain = plain_model(tokens)
    # the control: XLA's dot gives a row other bits among 16 rows (else this test could not fail)
    assert not all(np.array_equal(one, many) for one, many in rows_alone_and_among_16(plain_model))
    np.testing.assert_allclose(np.asarray(fixed_model(tokens)), np.asarray(plain), rtol=1e-5, atol=1e-5)
    for one, many in rows_alone_and_among_16(fixed_model):
        np.testing.assert_array_equal(one, many)
    assert all(m.fixed_order is not None for m in (router(fixed_model), fixed_model.lm_head))
    for model in (base, plain_model):  # the models it was made from are as they were
        assert router(model).fixed_order is None and model.lm_head.fixed_order is None


def _xla_dots(jaxpr) -> list[str]:
    """The ``dot_general`` equations of a jaxpr outside Pallas kernels, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name == "dot_general":
            found.append(str(eqn.outvars[0].aval))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _xla_dots(inner)
    return found


def test_batch_invariant_mode_leaves_no_xla_dot_in_the_target():
    """In the mode, every product of a forward pass (projections, absorbed per-head products,
    routers, experts, attention, LM head) runs in a Pallas kernel: no XLA ``dot_general`` is left,
    whose algorithm could depend on the token count. The control: the plain kernel path has them."""
    plain = tiny_kimi(0, hidden_size=128, vocab_size=512, execution=KERNELS)
    tokens = jnp.zeros((2, 5), jnp.int32)

    def dots(model):
        return _xla_dots(jax.make_jaxpr(lambda t: model(t))(tokens).jaxpr)

    assert len(dots(plain)) > 0
    assert dots(plain.with_execution(FIXED)) == []
    assert len(dots(plain)) > 0
