"""The serving engine on meshes against one device, shared by the CPU-device test
(tests/test_serving_sharded.py, 8 host devices in a subprocess) and the GPU test (tests/test_gpu.py,
every local GPU).

Expert and data parallelism do not change any sum, so their tokens must equal one device's
exactly. Tensor parallelism sums partial results in another order, so a divergence is allowed only
where the sharded and the unsharded target's logits for the common prefix differ by at most
``LOGIT_TOL`` (float32 rounding, not a wrong model); and on every mesh each device's copy of the
committed tokens must be identical (no shard commits a different token). Greedy and seeded
sampling; one prompt long enough for chunked prefill. The pair: ``tests/_model_fixtures.tiny_pair``
(every kind of layer once)."""

from __future__ import annotations

import re

from ddtree_jax.config import DecodeConfig, EngineConfig
from tests._model_fixtures import tiny_pair

PROMPTS = [[1, 2, 3, 4, 5], [7], list(range(20, 45)), [9, 10, 11]]
SAMPLING = [dict(temperature=0.0)] * 3 + [dict(temperature=0.9, top_p=0.9, seed=5)]
CONFIG = EngineConfig(decode=DecodeConfig(method="ddtree", budget=6), slots=8, max_model_len=64, prefill_chunk=16,
                      prefill_batch=2)
MAX_TOKENS = 10
LOGIT_TOL = 1e-4


def one_device_tokens() -> list[list[int]]:
    import ddtree_jax as dt
    from ddtree_jax.serving import Engine

    eng = Engine(*tiny_pair(), CONFIG)
    return [r.tokens for r in eng.generate(PROMPTS, [dt.SamplingParams(**s) for s in SAMPLING], max_tokens=MAX_TOKENS)]


def mesh_runs(path: str, meshes: list[str], plain: list[list[int]]) -> list[dict]:
    """Decode ``PROMPTS`` on each mesh of ``meshes`` (over every device JAX sees) from checkpoints
    written under ``path``; one record per mesh: tokens equal to ``plain``, replicas consistent,
    the logit gap at each divergence."""
    import jax.numpy as jnp
    import numpy as np

    import ddtree_jax as dt
    from ddtree_jax.serving import Engine
    from ddtree_jax.serving.sharding import make_mesh, state_sharding

    target, drafter = tiny_pair()
    dt.save_checkpoint(target, path + "/target")
    dt.save_checkpoint(drafter, path + "/drafter")
    ref = dt.load_target(path + "/target", dtype=jnp.float32)
    runs = []
    for spec in meshes:
        mesh = make_mesh(spec)
        st = dt.load_target(path + "/target", mesh=mesh, dtype=jnp.float32)
        sd = dt.load_drafter(path + "/drafter", st, mesh=mesh)
        eng = Engine(st, sd, CONFIG, shard_state=state_sharding(mesh))
        params = [dt.SamplingParams(**s) for s in SAMPLING]
        tokens = [r.tokens for r in eng.generate(PROMPTS, params, max_tokens=MAX_TOKENS)]
        eng.drain()  # (the last step's launch may still hold the state it donates)
        copies = {}
        for shard in eng._state.out.addressable_shards:
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        consistent = all(all((c == cs[0]).all() for c in cs) for cs in copies.values())
        diffs = []
        for prompt, got, want in zip(PROMPTS, tokens, plain, strict=True):
            j = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            if j is not None:
                ids = jnp.asarray([prompt + got[:j]])
                diffs.append(float(jnp.max(jnp.abs(st(ids)[0, -1] - ref(ids)[0, -1]))))
        chunk = _compiled_chunk(eng)
        runs.append(dict(spec=spec, equal=tokens == plain, consistent=consistent, logit_diffs=diffs,
                         prefill_cache_collectives=prefill_cache_collectives(chunk, eng),
                         first_token_collectives=first_token_collectives(chunk, eng)))
    return runs


_COLLECTIVE = re.compile(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")


def _collectives(hlo: str, dim: int) -> list[str]:
    """The collectives of compiled ``hlo`` text whose operand has a dimension of size ``dim``."""
    return [f"{op}[{dims}]" for dims, op in _COLLECTIVE.findall(hlo) if str(dim) in dims.split(",")]


def _compiled_chunk(eng):
    """``(state, packed, compiled)``: the abstract state and ``packed`` of ``eng``'s largest prefill
    chunk (4 rows per device) and ``_device.prefill_chunk`` compiled for them."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.serving import _device

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    packed = jax.ShapeDtypeStruct((4 * eng._row_blocks, _device.PREFILL_FIELDS + eng.prefill_chunk), jnp.int32)
    tparams, dparams, state = jax.tree.map(spec, (eng._tparams, eng._dparams, eng._state))
    return state, packed, _device.prefill_chunk.lower(eng._models, tparams, dparams, eng.plan, state, packed).compile()


def prefill_cache_collectives(chunk, eng) -> list[str]:
    """The collectives of ``eng``'s compiled prefill chunk (``_compiled_chunk``) whose operand
    spans the caches' positions: on a row mesh each device prefills its own slots in place, so
    none (taking slots by global index gathered every taken slot's cache onto every device)."""
    return _collectives(chunk[2].as_text(), eng.cache_len)


def first_token_collectives(chunk, eng) -> list[str]:
    """The collectives of ``eng``'s compiled first-token activation (``_device.activate_first`` on
    the largest prefill chunk's logits, placed as the compiled chunk, ``_compiled_chunk``, leaves
    them) whose operand spans the vocabulary: each device draws its own slots' first tokens, so
    none."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.serving import _device

    state, packed, compiled = chunk
    V = eng._target.config.vocab_size
    logits = jax.ShapeDtypeStruct((packed.shape[0], V), jnp.float32, sharding=compiled.output_shardings[1])
    rows = jax.ShapeDtypeStruct((eng.slots, _device.ACTIVATION_FIELDS + eng.max_stop_ids), jnp.int32)
    hlo = _device.activate_first.lower(state, rows, packed, logits, eng._base_key, backend=eng.plan.backend,
                                       rows=eng._row_mesh).compile().as_text()
    return _collectives(hlo, V)


def check_runs(runs: list[dict], meshes: list[str]) -> None:
    assert [r["spec"] for r in runs] == meshes, runs
    for r in runs:
        assert r["consistent"], f"{r['spec']}: devices hold different committed tokens"
        assert not r["prefill_cache_collectives"], f"{r['spec']}: the prefill moves caches between devices"
        assert not r["first_token_collectives"], f"{r['spec']}: the first-token draw moves logits between devices"
        if "tensor" not in r["spec"] or "tensor=1" in r["spec"]:
            assert r["equal"], f"{r['spec']}: expert/data parallelism changed the tokens"
        else:
            assert all(d <= LOGIT_TOL for d in r["logit_diffs"]), r


def check_round_collectives(target, drafter, *, batch: int = 16, budget: int = 6) -> None:
    """The compiled decoding round of ``batch`` rows on the models' mesh, rows split over every
    device (data-parallel attention, ``ddtree_jax.rows``): its only collectives are each MoE
    layer's exchange of tokens (an all-gather of the expert group's ``N = batch * (budget + 1)``
    token rows and routing, and a reduce-scatter of ``[N / devices, H]`` back) and the loop's
    stop test; nothing gathers logits, drafts or trees, and no device computes the logits of
    rows it does not hold."""
    import re

    import jax
    import jax.numpy as jnp

    import ddtree_jax as dt
    from ddtree_jax.backend import resolve_backend
    from ddtree_jax.decode_round import DecodePlan, Models, prefill, run_rounds
    from ddtree_jax.rows import place_state
    from ddtree_jax.sampling import batch_sampling

    rows = target.row_mesh
    devices = rows.devices
    assert rows.split(batch) == rows.axes and batch % devices == 0
    m, vocab, hidden = budget + 1, target.config.vocab_size, target.config.hidden_size
    plan = DecodePlan(method="ddtree", budget=budget, backend=resolve_backend("reference"),
                      hidden_layer_ids=tuple(drafter.config.target_layer_ids))
    models, tparams, dparams = Models.split(target, drafter)
    full = lambda v: jnp.full((batch,), v, jnp.int32)  # noqa: E731
    state = prefill(models, tparams, dparams, plan, jnp.ones((batch, 4), jnp.int32), full(4), full(1), max_len=64,
                    capacity=16, max_new_tokens=full(16), stop_ids=jnp.full((batch, 1), -1, jnp.int32),
                    sampling=batch_sampling(dt.SamplingParams(temperature=0.7, seed=1), batch),
                    request_ids=jnp.arange(batch, dtype=jnp.uint32))
    state = place_state(state, rows, rows.axes)
    hlo = run_rounds.lower(models, tparams, dparams, plan, state, jax.random.key(0), 1).compile().as_text()
    n = batch * m
    found = re.findall(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                       r"(?:-start)?\(", hlo)
    kinds = {}
    for dtype, dims, op in found:
        shape = tuple(int(d) for d in dims.split(",") if d)
        kinds.setdefault(op, set()).add((dtype, shape))
        if op == "all-gather":
            assert shape[0] == n, (op, dtype, shape)
        elif op == "reduce-scatter":
            assert shape == (n // devices, hidden), (op, dtype, shape)
        else:
            assert op == "all-reduce" and shape == () and dtype == "pred", (op, dtype, shape)
    assert set(kinds) == {"all-gather", "reduce-scatter", "all-reduce"}, kinds
    assert not re.search(rf"\[{batch},{m},{vocab}\]", hlo), "a device computes every row's logits"
    assert re.search(rf"f32\[{batch // devices},{m},{vocab}\]", hlo), "no per-device verify logits found"
