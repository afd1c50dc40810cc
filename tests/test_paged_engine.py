"""serving.Engine on paged caches (``EngineConfig.page_size``): the same tokens as the contiguous
engine for greedy and seeded requests, with prefix hits, preemption and resumption, and no page
leaked after a run of random arrivals and cancellations (``PagePool.check`` after every step).

The tiny models, float32: max_model_len 64, prefill chunks of 16 (the scratch block), pages of 16
positions, so a request's table has at most 5 pages.
"""

import dataclasses

import jax
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.config import ConfigError
from ddtree_jax.serving import Engine
from ddtree_jax.serving._device import page_bytes

DECODE = dt.DecodeConfig(method="ddtree", budget=6)
SHAPE = dt.EngineConfig(decode=DECODE, slots=4, max_model_len=64, prefill_chunk=16, prefill_batch=2)
SHARED = list(range(30, 64))  # two full pages of 16 shared by the prompts that start with it
PROMPTS = [SHARED + [1, 2], [7, 8, 9], SHARED + [5], list(range(70, 90)), SHARED + [3, 4, 5, 6], [11] * 17]
SAMPLING = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=1.0, top_p=0.9, seed=7),
            dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.8, seed=3),
            dt.SamplingParams(temperature=1.0, top_k=5, seed=11), dt.SamplingParams(temperature=0.0)]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference(models):
    """The contiguous engine's tokens, each request alone in the engine (seeded and greedy rows
    do not depend on their neighbours in float32)."""
    eng = Engine(*models, SHAPE)
    return [r.tokens for r in eng.generate(PROMPTS, SAMPLING, max_tokens=MAX_TOKENS)]


def paged(models, **kw):
    return Engine(*models, dataclasses.replace(SHAPE, page_size=16, **kw))


def run(eng, handles, check=True):
    while not all(h.done for h in handles):
        eng.step()
        if check:
            eng._pool.check()
    return [h.result() for h in handles]


def assert_no_page_held(eng):
    eng._pool.check()
    stats = eng._pool.stats()
    assert stats["used"] == 0 and stats["free"] == eng.kv_pages, stats


def test_paged_engine_equals_the_contiguous_one_with_prefix_hits(models, reference):
    eng = paged(models)
    assert eng.kv_pages == 4 * 5 and eng.pages_per_slot == 5  # the contiguous caches' memory by default
    # Three requests starting with SHARED arrive together: the first prefills it, the other two wait
    # for its two full pages and compute only the rest.
    together = [0, 2, 4]
    got = run(eng, [eng.submit(PROMPTS[i], SAMPLING[i], max_tokens=MAX_TOKENS) for i in together])
    assert [r.tokens for r in got] == [reference[i] for i in together]
    assert eng.metrics.snapshot()["kv_pages"]["prefix_hit_tokens"] == 2 * 32
    # Later arrivals match the published pages too.
    got = run(eng, [eng.submit(p, s, max_tokens=MAX_TOKENS) for p, s in zip(PROMPTS, SAMPLING, strict=True)])
    assert [r.tokens for r in got] == reference
    m = eng.metrics.snapshot()
    assert m["kv_pages"]["prefix_hit_tokens"] >= 2 * 32 + 3 * 32
    assert m["preemptions"] == 0
    assert_no_page_held(eng)


@pytest.mark.parametrize("read_lag,kv_pages,seed", [(1, 6, 0), (2, 8, 1)])
def test_random_arrivals_cancellations_and_preemptions_leak_no_page(models, reference, read_lag, kv_pages, seed):
    """6 or 8 pages: one request at full length (5 pages) always fits, four running do not, so
    requests are preempted and resume, each while its next dispatch (with ``read_lag`` 2, its next
    two) is in flight. (Read back two steps late, a table covers more rounds ahead, so a request
    takes more of its pages at admission: the pool and arrivals are chosen so that some are
    preempted.)"""
    rng = np.random.default_rng(seed)
    eng = paged(models, kv_pages=kv_pages, read_lag=read_lag)
    handles, cancelled = [], set()
    for _ in range(60):
        if rng.random() < 0.4 and len(handles) < 14:
            i = int(rng.integers(len(PROMPTS)))
            handles.append((i, eng.submit(PROMPTS[i], SAMPLING[i], max_tokens=MAX_TOKENS)))
        if rng.random() < 0.08 and handles:
            k = int(rng.integers(len(handles)))
            handles[k][1].cancel()
            cancelled.add(k)
        eng.step()
        eng._pool.check()
    results = run(eng, [h for _, h in handles])
    for k, ((i, _), r) in enumerate(zip(handles, results, strict=True)):
        if k in cancelled and r.finish_reason == "cancelled":
            assert r.tokens == reference[i][: len(r.tokens)]
        else:
            assert r.tokens == reference[i], (k, i)
    eng.drain()
    assert eng.metrics.snapshot()["preemptions"] > 0  # resumed requests are among those compared
    assert_no_page_held(eng)


def test_paged_settings_are_checked(models):
    with pytest.raises(ConfigError, match="page_size"):
        dt.EngineConfig(page_size=24)
    with pytest.raises(ConfigError, match="kv_pages"):
        dt.EngineConfig(kv_pages=8)
    with pytest.raises(ConfigError, match="kv_pages"):
        paged(models, kv_pages=4)  # one request of max_model_len with its scratch needs 5
    with pytest.raises(ConfigError, match="one device"):
        Engine(*models, dataclasses.replace(SHAPE, page_size=16), shard_state=lambda state: state)

    # --kv-cache-memory divides by one page's bytes: the pools' bytes per page of a real engine.
    eng = paged(models, kv_pages=5)
    caches = (eng._state.target_cache, eng._state.draft_cache)
    pools = sum(x.nbytes for c in caches for x in jax.tree.leaves(c)) - sum(
        c.page_table.nbytes + c.lengths.nbytes for c in caches)
    assert page_bytes(*models, 16) == pools // (eng.kv_pages + 1) > 0


@pytest.mark.parametrize("page_size", [None, 16])
def test_traffic_after_warmup_compiles_nothing(models, page_size):
    """After ``warmup`` a run of short requests (prompts within the smallest prefill chunk) with
    every number of newcomers and finishes compiles no program: a compile inside traffic stalls
    every stream (found on the GPU: the paged engine's first page-table upload after a round
    compiled again, because the fresh state's arrays were not committed to the device)."""
    from ddtree_jax.compilation_cache import CompileWatch

    eng = Engine(*models, dataclasses.replace(SHAPE, page_size=page_size))
    eng.warmup()
    prompts = [[7, 8, 9], list(range(70, 84)), [11] * 15, [5, 6], [40 + i for i in range(9)], [3]]
    with CompileWatch() as watch:
        got = run(eng, [eng.submit(p, s, max_tokens=m) for p, s, m in
                        zip(prompts, SAMPLING, (3, 9, 14, 5, 20, 7), strict=True)], check=False)
    assert [len(r.tokens) for r in got] == [3, 9, 14, 5, 20, 7]
    assert watch.compiles == 0


def test_any_number_of_newcomers_compiles_nothing_after_warmup(models):
    """Three newcomers activated together (the warm-up admits 1, 2 and 4): their first tokens are
    read back through one program whatever their number (an eager gather of their slots compiled
    again for every new count, a stall of every stream on the GPU)."""
    from ddtree_jax.compilation_cache import CompileWatch

    eng = Engine(*models, dataclasses.replace(SHAPE, prefill_batch=4))
    eng.warmup()
    with CompileWatch() as watch:
        got = run(eng, [eng.submit(p, s, max_tokens=m) for p, s, m in
                        zip(([7, 8, 9], [5, 6], [3]), SAMPLING[:3], (2, 4, 1), strict=True)], check=False)
    assert [len(r.tokens) for r in got] == [2, 4, 1]
    assert watch.compiles == 0
