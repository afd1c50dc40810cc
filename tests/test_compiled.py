"""``ddtree_jax.compiled.CompiledFn``: the same results as the module called directly; read
modules are left as they were, updated ones carry their state from call to call and get it back
on ``sync``."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.compiled import CompiledFn


class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros((), jnp.int32))
        self.weight = nnx.Param(jnp.arange(3.0))

    def bump(self, by):
        self.count[...] = self.count[...] + by
        return self.count[...]


def test_reads_give_the_direct_result_and_stay_unchanged():
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = jnp.arange(6.0).reshape(2, 3)

    def body(m, x, *, scale):
        out = scale * m(x)
        m.kernel[...] = m.kernel[...] * 0  # a write into a read module is dropped
        return out

    fn = CompiledFn(body, reads=(lin,), scale=2.0)
    expected = 2.0 * lin(x)
    np.testing.assert_allclose(fn(x), expected, rtol=1e-6)
    np.testing.assert_allclose(fn(x), expected, rtol=1e-6)  # the second call sees the original state
    np.testing.assert_allclose(lin(x), expected / 2.0, rtol=1e-6)


def test_updates_are_carried_between_calls_and_synced_back():
    counter, reader = Counter(), Counter()
    fn = CompiledFn(lambda c, r, by: c.bump(by) + r.count[...], updates=(counter,), reads=(reader,))
    assert [int(fn(jnp.int32(k))) for k in (1, 2, 3)] == [1, 3, 6]
    with pytest.raises(RuntimeError, match="deleted"):  # donated: stale until sync
        counter.count[...] + 0
    fn.sync()
    assert int(counter.count[...]) == 6 and int(reader.count[...]) == 0
    np.testing.assert_array_equal(counter.weight[...], jnp.arange(3.0))
