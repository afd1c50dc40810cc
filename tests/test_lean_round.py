"""The compiled decode loop does no needless work. It never copies a whole cache: each layer's cache is its own buffer,
updated in place where a block lands (verify), where accepted rows move (commit) and where the
drafter's context grows. Checked on the optimised HLO of ``run_rounds`` (tiny models, a cache
length no other array shares): no copy or concatenate produces an array that holds a whole
layer's cache buffer (or a stack of them). Rows that commit nothing route no token to an expert."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ddtree_jax as dt
from ddtree_jax.backend import resolve_backend
from ddtree_jax.decode_round import DecodePlan, Models, prefill, run_rounds
from ddtree_jax.sampling import batch_sampling
from tests._model_fixtures import tiny_dflash, tiny_kimi

MAX_LEN = 2999  # distinctive: no other dimension of the round has this size


def _greedy_rows(budget, prompts, *, max_len, capacity, max_new_tokens):
    """``(models, tparams, dparams, plan, state)``: tiny models, a reference DDTree plan of
    ``budget`` and every row of ``prompts [B, P]`` prefilled (its last token the root), greedy."""
    target = tiny_kimi(0)
    drafter = tiny_dflash(target, 1)
    (tg, tp), (dg, dp) = nnx.split(target), nnx.split(drafter)
    models = Models(tg, dg)
    plan = DecodePlan(method="ddtree", budget=budget, backend=resolve_backend("reference"),
                      hidden_layer_ids=tuple(drafter.config.target_layer_ids))
    b, p = prompts.shape
    state = prefill(models, tp, dp, plan, prompts, jnp.full((b,), p), prompts[:, -1], max_len=max_len,
                    capacity=capacity, max_new_tokens=jnp.full((b,), max_new_tokens), stop_ids=jnp.full((b, 1), -2),
                    sampling=batch_sampling([dt.SamplingParams(temperature=0.0)] * b, b), request_ids=jnp.arange(b))
    return models, tp, dp, plan, state


def test_round_updates_caches_in_place():
    models, tp, dp, plan, state = _greedy_rows(6, jnp.ones((2, 4), jnp.int32), max_len=MAX_LEN, capacity=32,
                                               max_new_tokens=16)
    buffers = {tuple(a.shape) for a in jax.tree.leaves((state.target_cache, state.draft_cache)) if MAX_LEN in a.shape}
    assert buffers, "the caches should hold arrays of the cache length"
    hlo = run_rounds.lower(models, tp, dp, plan, state, jax.random.key(0), max_rounds=2).compile().as_text()
    offenders = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\w+\[([\d,]*)\]\S*\s+(copy|concatenate)\(", line)
        if m:
            shape = tuple(int(d) for d in m.group(1).split(",") if d)
            if any(shape[-len(buf):] == buf for buf in buffers):
                offenders.append(line.strip()[:200])
    assert not offenders, "whole-cache copies in the round:\n" + "\n".join(offenders)


def test_rows_that_commit_nothing_route_no_token_to_an_expert(monkeypatch):
    """A finished row's tree (and a free slot's) goes through the verify pass with every token
    marked invalid for the MoE, so a round reads only the experts its running rows pick; the
    running rows' outputs do not change."""
    from ddtree_jax.decode_state import STOP
    from ddtree_jax.models.kimi import KimiForCausalLM

    seen = []
    verify = KimiForCausalLM.verify

    def spy(self, *args, valid=None, **kw):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), valid)
        return verify(self, *args, valid=valid, **kw)

    monkeypatch.setattr(KimiForCausalLM, "verify", spy)
    prompts = jnp.asarray(np.random.default_rng(0).integers(1, 60, (3, 6)), jnp.int32)
    models, tp, dp, plan, state = _greedy_rows(4, prompts, max_len=64, capacity=16, max_new_tokens=8)
    done = dataclasses.replace(state, finish=state.finish.at[1].set(STOP))
    both = [run_rounds(models, tp, dp, plan, jax.tree.map(jnp.copy, s), jax.random.key(0), max_rounds=1)
            for s in (state, done)]  # (the round donates its state)
    jax.effects_barrier()
    all_running, one_done = seen[-2], seen[-1]
    assert all_running[0].any() and all_running[1].any() and all_running[2].any()
    assert not one_done[1].any() and (one_done[[0, 2]] == all_running[[0, 2]]).all()
    for field in ("out", "generated", "root"):
        a, c = (np.asarray(getattr(s, field)) for s in both)
        np.testing.assert_array_equal(a[[0, 2]], c[[0, 2]])
    assert int(both[1].generated[1]) == 0
