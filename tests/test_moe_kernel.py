"""The MoE grouped-matmul kernel (Pallas interpret mode on the CPU) against the dense reference,
the routing metadata it runs on, and the model's logits through it. (Expert parallelism of the
kernel path on 8 CPU devices: tests/test_sharded_generate.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.backend import Backend
from ddtree_jax.config import ExecutionConfig
from ddtree_jax.models.moe import experts_reference, route_tokens, routed_experts
from pallas_kernels.triton.moe_grouped_matmul import choose_blocks, max_row_tiles
from tests._model_fixtures import VOCAB, random_tree, tiny_kimi

KERNEL = Backend(kernels=True, interpret=True)
RAGGED = Backend(kernels=False)


def random_moe(seed, n, e, k, h, i, *, dtype=jnp.float32, route="random", invalid=0.0):
    """Tokens, weights and a routing; ``route``: "random" (k distinct experts per token, some
    experts empty when e > n*k), "one" (every token's first copy to expert 3), "few" (only
    experts 0..k-1 used)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, h))
    gate_up = rng.normal(size=(e, h, 2 * i)) / np.sqrt(h)
    down = rng.normal(size=(e, i, h)) / np.sqrt(i)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    if route == "one":
        ids = np.stack([np.concatenate([[3], rng.choice(np.setdiff1d(np.arange(e), [3]), k - 1, replace=False)])
                        for _ in range(n)])
    elif route == "few":
        ids = np.stack([rng.permutation(k) for _ in range(n)])
    weights = rng.random((n, k)) * 2
    valid = rng.random(n) >= invalid
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(x), cast(gate_up), cast(down), jnp.asarray(weights, jnp.float32), jnp.asarray(ids, jnp.int32),
            jnp.asarray(valid))


@jax.jit
def _kernel(x, gate_up, down, weights, ids, valid):
    return routed_experts(x, gate_up, down, weights, ids, backend=KERNEL, valid=valid)


@jax.jit
def _ragged(x, gate_up, down, weights, ids, valid):
    return routed_experts(x, gate_up, down, weights, ids, backend=RAGGED, valid=valid)


CASES = [  # n, e, k, h, i, route, invalid fraction
    (1, 8, 2, 64, 32, "random", 0.0),     # one token: one row tile per touched expert
    (37, 8, 2, 64, 32, "random", 0.3),    # N*k not a multiple of the tile; invalid tokens
    (13, 64, 4, 32, 16, "few", 0.0),      # E=64, only experts 0-3 used: 60 empty experts
    (24, 8, 1, 64, 32, "one", 0.0),       # every token to one expert (two row tiles of it)
    (200, 8, 2, 32, 48, "random", 0.1),   # ~50 copies per expert: block_m 64, several tiles each
]


@pytest.mark.parametrize("n,e,k,h,i,route,invalid", CASES)
def test_kernel_equals_reference_float32(n, e, k, h, i, route, invalid):
    x, gate_up, down, weights, ids, valid = random_moe(n + e, n, e, k, h, i, route=route, invalid=invalid)
    want = experts_reference(x, gate_up, down, weights, ids, valid)
    got = _kernel(x, gate_up, down, weights, ids, valid)
    scale = float(jnp.abs(want).max()) or 1.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * scale, rtol=0)
    assert not np.asarray(got)[~np.asarray(valid)].any()  # invalid tokens: exactly zero
    ragged = _ragged(x, gate_up, down, weights, ids, valid)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(want), atol=2e-6 * scale, rtol=0)
    none_valid = jnp.zeros_like(valid)  # every token invalid: no tile runs, the output is zero
    assert not np.asarray(_kernel(x, gate_up, down, weights, ids, none_valid)).any()


def test_kernel_bfloat16_within_rounding_of_float32_reference():
    """bf16 weights and activations, float32 accumulation: within 2% of the largest output of
    the float32 reference on the same (bf16-rounded) inputs; the ragged_dot path (bf16 outputs
    between the matmuls, bf16 scatter-add) is held to the same bound."""
    x, gate_up, down, weights, ids, valid = random_moe(5, 40, 8, 2, 64, 32, dtype=jnp.bfloat16, invalid=0.2)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want = np.asarray(experts_reference(f32(x), f32(gate_up), f32(down), weights, ids, valid))
    for got in (_kernel(x, gate_up, down, weights, ids, valid), _ragged(x, gate_up, down, weights, ids, valid)):
        assert got.dtype == jnp.bfloat16
        assert np.abs(np.asarray(got, np.float32) - want).max() <= 0.02 * np.abs(want).max()


_route = jax.jit(route_tokens, static_argnames=("num_experts", "block_m"))


@pytest.mark.parametrize("n,e,k,block_m", [(1, 8, 2, 16), (37, 8, 2, 16), (100, 64, 4, 16), (300, 8, 2, 64)])
def test_routing_tiles_cover_each_valid_copy_once(n, e, k, block_m):
    rng = np.random.default_rng(n)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    valid = rng.random(n) > 0.25
    r = _route(jnp.ones((n, k)), jnp.asarray(ids), e, valid=jnp.asarray(valid), block_m=block_m)
    assert r.tile_expert.shape == (max_row_tiles(n * k, e, block_m),)
    want_sizes = np.bincount(ids[valid].ravel(), minlength=e)
    np.testing.assert_array_equal(np.asarray(r.group_sizes), want_sizes)
    covered = np.zeros(n * k + block_m, int)
    token, te, ts, tend = (np.asarray(a) for a in (r.sorted_token, r.tile_expert, r.tile_start, r.tile_end))
    flat_ids = ids.ravel()
    for t in range(len(te)):
        assert 0 <= tend[t] - ts[t] <= block_m
        covered[ts[t]:tend[t]] += 1
        for row in range(ts[t], tend[t]):  # every row of a tile is a copy routed to its expert
            assert ids[token[row]].tolist().count(te[t]) == 1
    n_valid = int(valid.sum()) * k
    assert (covered[:n_valid] == 1).all() and not covered[n_valid:].any()
    assert sorted(set(te[ts < tend].tolist())) == sorted(np.flatnonzero(want_sizes).tolist())  # empty: no tile
    slot_row = np.asarray(r.slot_row)
    assert sorted(slot_row.ravel().tolist()) == list(range(n * k))
    for nn in np.flatnonzero(valid):
        for j in range(k):
            row = slot_row[nn, j]
            assert token[row] == nn and row < n_valid and flat_ids[nn * k + j] in ids[nn]


def test_block_choice():
    assert choose_blocks(8, 384).block_m == 16          # decode: one token, top-8 of 384
    assert choose_blocks(16 * 8, 384).block_m == 16     # a 16-node tree
    assert choose_blocks(16384 * 8, 384).block_m == 128  # prefill
    assert max_row_tiles(8, 384, 16) == 8
    # INT4: wide column blocks with 16-row tiles, and with 32-row tiles of bf16 activations only
    # (float32 ones would overflow the H200's shared memory)
    assert choose_blocks(8, 384, int4=True).block_n_gate_up == 128
    assert choose_blocks(1040 * 8, 384, int4=True).block_n_gate_up == 128
    assert choose_blocks(1040 * 8, 384, int4=True, act_bytes=4).block_n_gate_up == 64
    assert choose_blocks(16384 * 8, 384, int4=True).block_n_gate_up == 64


def _tree_inputs(b, t, seed):
    rng = np.random.default_rng(seed)
    _, depths, mask = random_tree(rng, t)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (b, t)), jnp.int32)
    valid = jnp.arange(t)[None] < jnp.asarray(rng.integers(1, t + 1, (b, 1)))  # parents come first: a subtree
    return tokens, jnp.asarray(np.broadcast_to(depths, (b, t))), jnp.asarray(np.broadcast_to(mask, (b, t, t))), valid


@nnx.jit
def _verify(model, tokens, depths, mask, cache, valid):
    return model.verify(tokens, depths, mask, cache, valid=valid)[0]


def test_model_logits_through_kernel_equal_reference():
    """KimiForCausalLM (float32) verify with impl="pallas" (interpret) and the tree's ``valid``
    == impl="reference" without it, at every valid node (the invalid slots route nowhere)."""
    model = tiny_kimi(2)
    tokens, depths, mask, valid = _tree_inputs(2, 9, 1)
    cache = model.init_cache(2, 32)
    want = _verify(model.with_execution(ExecutionConfig(impl="reference")), tokens, depths, mask, cache, None)
    got = _verify(model.with_execution(ExecutionConfig(impl="pallas")), tokens, depths, mask, cache, valid)
    v = np.asarray(valid)
    assert 0 < v.sum() < v.size
    np.testing.assert_allclose(np.asarray(got)[v], np.asarray(want)[v], atol=2e-5 * float(jnp.abs(want).max()))


def test_pinned_blocks_make_rows_batch_invariant():
    """A row's routed output depends on the blocks, never on the other rows: with the blocks
    pinned, the first 3 tokens alone == the same tokens among 136 (where ``choose_blocks`` would
    pick block_m 64 / block_k 64 instead of 16 / 128)."""
    from pallas_kernels.triton.moe_grouped_matmul import MoEBlocks

    n, e, k, h, i = 136, 8, 2, 256, 32
    assert choose_blocks(n * k, e) != choose_blocks(3 * k, e)
    x, gate_up, down, weights, ids, _ = random_moe(3, n, e, k, h, i)
    pinned = jax.jit(lambda *a: routed_experts(*a, backend=KERNEL, blocks=MoEBlocks(block_m=16)))
    few = pinned(x[:3], gate_up, down, weights[:3], ids[:3])
    many = pinned(x, gate_up, down, weights, ids)
    np.testing.assert_array_equal(np.asarray(few), np.asarray(many)[:3])
