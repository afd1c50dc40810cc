"""DecodeState.take_rows / put_rows: slots move with their caches, whatever the cache layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from ddtree_jax.backend import REFERENCE
from ddtree_jax.decode_round import DecodePlan, Models, prefill, run_rounds
from ddtree_jax.decode_state import FREE, NO_STOP, DecodeState
from tests._model_fixtures import tiny_dflash, tiny_kimi


def _state(target, drafter, prompts, seed_offset=0) -> DecodeState:
    B = len(prompts)
    plan = DecodePlan(method="ddtree", budget=4, hidden_layer_ids=drafter.config.target_layer_ids, backend=REFERENCE)
    tgraph, tparams = nnx.split(target)
    dgraph, dparams = nnx.split(drafter)
    lengths = np.array([len(p) - 1 for p in prompts], np.int32)
    padded = np.zeros((B, max(lengths)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p) - 1] = p[:-1]
    return prefill(Models(tgraph, dgraph), tparams, dparams, plan, jnp.asarray(padded), jnp.asarray(lengths),
                   jnp.asarray([p[-1] for p in prompts]), max_len=32, capacity=6,
                   max_new_tokens=jnp.full((B,), 6), stop_ids=jnp.full((B, 1), NO_STOP),
                   sampling=dt.batch_sampling(dt.SamplingParams(seed=seed_offset + 1), B),
                   request_ids=jnp.arange(B, dtype=jnp.uint32) + seed_offset)


def test_take_and_put_rows_move_whole_slots():
    target = tiny_kimi(0)
    drafter = tiny_dflash(target, 1)
    a = _state(target, drafter, [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    b = _state(target, drafter, [[10, 11], [12, 13, 14, 15]], seed_offset=100)
    # Slot 2 of `a` and slot 0 of `b` swapped in; every leaf of the moved slot follows.
    merged = a.put_rows(jnp.array([0]), b.take_rows(jnp.array([1])))
    for got, want in ((merged.take_rows(jnp.array([0])), b.take_rows(jnp.array([1]))),
                      (merged.take_rows(jnp.array([1, 2])), a.take_rows(jnp.array([1, 2])))):
        jax.tree.map(np.testing.assert_array_equal, got, want)
    # The caches' batch axis is found by the caches themselves (layer-major arrays: axis 1).
    assert [x.shape for x in merged.target_cache.latent] == [x.shape for x in a.target_cache.latent]
    np.testing.assert_array_equal(merged.target_cache.lengths, [3, 1, 3])
    np.testing.assert_array_equal(merged.draft_cache.lengths, [3, 1, 3])
    # Rows may repeat (padding of a compacted batch).
    assert a.take_rows(jnp.array([1, 1, 1, 1])).batch_size == 4


def test_free_slots_commit_nothing():
    target = tiny_kimi(0)
    drafter = tiny_dflash(target, 1)
    # (prompts padded to the shape of test_take_and_put_rows_move_whole_slots's second state: its
    # compiled prefill serves)
    state = _state(target, drafter, [[1, 2, 3], [4, 5, 6, 7]])
    state = dataclasses.replace(state, finish=jnp.array([0, FREE]))
    plan = DecodePlan(method="ddtree", budget=4, hidden_layer_ids=drafter.config.target_layer_ids, backend=REFERENCE)
    tgraph, tparams = nnx.split(target)
    dgraph, dparams = nnx.split(drafter)
    before = state.take_rows(jnp.array([1]))
    after = run_rounds(Models(tgraph, dgraph), tparams, dparams, plan, state, jax.random.key(0), 2)
    assert int(after.generated[0]) > 0
    moved = after.take_rows(jnp.array([1]))
    # Everything but cache scratch (positions at and past a row's length) is untouched.
    no_caches = dict(target_cache=None, draft_cache=None)
    jax.tree.map(np.testing.assert_array_equal, dataclasses.replace(moved, **no_caches),
                 dataclasses.replace(before, **no_caches))
    n = int(before.target_cache.lengths[0])
    for cache in ("target_cache", "draft_cache"):
        got, want = getattr(moved, cache), getattr(before, cache)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        for g, w in zip(jax.tree.leaves(got)[:-1], jax.tree.leaves(want)[:-1], strict=True):
            np.testing.assert_array_equal(g[:, :n], w[:, :n])  # each layer: [rows, positions, ...]
