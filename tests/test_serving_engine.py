"""serving.Engine: greedy outputs equal generate()'s whatever the arrival order and slot count,
seeded sampling does not depend on the slot or the batch, chunked prefill, cancellation, overload,
bad requests failing alone, stop strings and streaming text, the background thread.

Compilation dominates on the CPU: every engine here shares one shape (ddtree, budget 6, 2 slots,
max_model_len 64, prefill chunks of 16, at most 2 prefilled per step); generate() runs 5 rows.
"""

import collections
import dataclasses
import itertools
import threading

import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.decode_state import RUNNING
from ddtree_jax.serving import Engine, EngineOverloaded, RequestError
from ddtree_jax.serving.shapes import ShapeCache
from ddtree_jax.serving.text import TextStream
from tests._serving_fixtures import char_tokenizer

# The 40-token prompt takes three 16-token prefill chunks.
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 10, 11], list(range(20, 60)), [5, 6]]
MAX_TOKENS = 12
DECODE = dt.DecodeConfig(method="ddtree", budget=6)
SHAPE = dt.EngineConfig(decode=DECODE, slots=2, max_model_len=64, prefill_chunk=16, prefill_batch=2)


@pytest.fixture(scope="module")
def reference(models):
    return dt.generate(*models, PROMPTS, method="ddtree", budget=6, max_new_tokens=MAX_TOKENS, compact=False,
                       max_len=80)


def engine(models, slots=2, tokenizer=None, seed=0, **kw):
    config = dataclasses.replace(SHAPE, slots=slots, decode=dataclasses.replace(DECODE, seed=seed), **kw)
    return Engine(*models, config, tokenizer=tokenizer)


def run(eng, handles):
    while not all(h.done for h in handles):
        eng.step()
    return [h.result() for h in handles]


def test_greedy_equals_generate_whatever_the_arrival_order_and_slot(models, reference):
    eng = engine(models, slots=2)
    assert (eng.method, eng.budget, eng.sync_every, eng.prefill_batch) == ("ddtree", 6, 1, 2)  # the resolved settings
    order = [3, 1, 4, 0, 2]
    got = {i: r for i, r in zip(order, eng.generate([PROMPTS[i] for i in order], max_tokens=MAX_TOKENS),
                                strict=True)}
    assert [got[i].tokens for i in range(5)] == reference.tokens
    assert all(got[i].finish_reason == "length" for i in range(5))
    # Staggered arrivals: requests join while others run, in other slots than before.
    eng = engine(models, slots=2)
    handles = {}
    for i in [2, 0, 4, 1, 3]:
        handles[i] = eng.submit(PROMPTS[i], max_tokens=MAX_TOKENS)
        eng.step()
    assert [r.tokens for r in run(eng, [handles[i] for i in range(5)])] == reference.tokens
    m = eng.metrics.snapshot()
    assert m["requests"] == {"length": 5} and m["generated_tokens"] == 5 * MAX_TOKENS
    assert m["ttft"].count == 5 and m["itl"].count == 5 * (MAX_TOKENS - 1) and m["free_slots"] == 2
    # A first token's wait splits into the queue (staggered arrivals: some wait for a slot) and the
    # time from its slot to the token.
    assert m["queue_time"].count == m["prefill_time"].count == 5 and m["queue_time"].total > 0
    assert m["queue_time"].total + m["prefill_time"].total == pytest.approx(m["ttft"].total, rel=1e-9, abs=1e-9)
    assert m["accept"].count == m["rounds"] > 0 and 1 <= m["mean_acceptance_length"] <= 5
    # The step's parts: the launches include the programs before the rounds (prefill, activation).
    assert 0 < m["state_ops_seconds"] < m["launch_seconds"]
    assert m["prefill_seconds"] > 0 and m["emit_seconds"] > 0 and m["host_seconds"] > 0


def test_seeded_sampling_does_not_depend_on_slot_or_batch(models, reference):
    p = dt.SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    others = [dt.SamplingParams(temperature=0.7, seed=4), dt.SamplingParams(temperature=1.0, top_k=5),
              dt.SamplingParams(temperature=0.0)]
    eng = engine(models, slots=2, seed=5)
    alone = eng.generate([PROMPTS[0]], [p], max_tokens=MAX_TOKENS)[0].tokens
    mixed = eng.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[4]], others[:2] + [p, others[2]],
                         max_tokens=MAX_TOKENS)
    assert mixed[2].tokens == alone
    again = engine(models, slots=2, seed=5).generate([PROMPTS[3], PROMPTS[0], PROMPTS[0]], [others[1], p, p],
                                                     max_tokens=MAX_TOKENS)
    assert again[1].tokens == again[2].tokens == alone
    # generate() with the same seed gives the same tokens (same shapes as the `reference` fixture's run).
    ref = dt.generate(*models, PROMPTS, sampling=[p, *others, p], method="ddtree", budget=6, seed=5,
                      max_new_tokens=MAX_TOKENS, compact=False, max_len=80)
    assert ref.tokens[0] == alone


def test_cancel_frees_the_slot_for_the_next_request(models, reference):
    eng = engine(models, slots=2)
    long = [eng.submit(PROMPTS[i], max_tokens=40) for i in (0, 1)]
    queued = eng.submit(PROMPTS[4], max_tokens=MAX_TOKENS)
    eng.step()
    eng.step()
    assert eng.metrics.snapshot()["queue_length"] == 1
    long[0].cancel()
    eng.step()
    cancelled = long[0].result(timeout=0)
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.tokens) < 40
    assert eng.metrics.snapshot()["queue_length"] == 0
    assert run(eng, [queued])[0].tokens == reference.tokens[4]
    assert run(eng, [long[1]])[0].finish_reason == "length"
    # Cancelling a request still in the queue.
    a, b, c = (eng.submit(PROMPTS[0], max_tokens=4) for _ in range(3))
    c.cancel()
    assert [r.finish_reason for r in run(eng, [a, b, c])] == ["length", "length", "cancelled"]
    assert eng.metrics.snapshot()["requests"]["cancelled"] == 2


def test_full_queue_refuses_clearly(models):
    eng = engine(models, slots=2, max_queue=2)
    eng.submit([1], max_tokens=2)
    eng.submit([1], max_tokens=2)
    with pytest.raises(EngineOverloaded, match="queue is full"):
        eng.submit([1], max_tokens=2)
    assert eng.metrics.snapshot()["rejected"] == {"overloaded": 1}


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=[1, 500]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="hello"), "prompt"),
    (dict(prompt=[1] * 64), "prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt=[1] * 60, max_tokens=5), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(9))), "stop_token_ids"),
    (dict(stop=["x"]), "stop"),  # no tokenizer
])
def test_bad_request_fails_alone(models, reference, kwargs, field):
    eng = engine(models, slots=2)
    good = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS)
    kwargs = {"prompt": [1, 2], **kwargs}
    with pytest.raises(RequestError) as err:
        eng.submit(kwargs.pop("prompt"), **kwargs)
    assert err.value.field == field and str(err.value).startswith(field)
    assert run(eng, [good])[0].tokens == reference.tokens[0]


def test_stop_strings_truncate_text_and_stream_joins_up(models):
    tok = char_tokenizer()
    eng = engine(models, slots=2, tokenizer=tok)
    full = eng.generate([PROMPTS[0]], max_tokens=MAX_TOKENS)[0]
    assert full.text == tok.decode(full.tokens) and len(full.text) >= 6
    stop = full.text[3:5]
    cut = full.text.find(stop)
    h = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS, stop=["never-there", stop])
    chunks = []
    while not h.done:
        eng.step()
    chunks = list(h.stream(timeout=0))
    res = chunks[-1].result
    assert res.finish_reason == "stop" and res.text == full.text[:cut]
    assert "".join(c.text for c in chunks) == res.text
    assert [t for c in chunks for t in c.token_ids] == res.tokens == full.tokens[: len(res.tokens)]
    assert stop in tok.decode(res.tokens) and stop not in tok.decode(res.tokens[:-1])
    # A stop token ends the request with the token kept.
    h = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS, stop_token_ids=[full.tokens[5]])
    res = run(eng, [h])[0]
    assert res.finish_reason == "stop" and res.tokens == full.tokens[: full.tokens.index(full.tokens[5]) + 1]


class _Chars:
    """A tokenizer whose ids are code points; 0xD800 stands for half a character (decodes to U+FFFD)."""

    def decode(self, ids):
        return "".join("\ufffd" if i == 0xD800 else chr(i) for i in ids)


def test_admission_in_groups_holds_free_slots_at_most_admit_wait_steps(models, reference):
    """While requests queue and slots run, free slots wait for ``admit_group`` of them (here 2)
    for at most ``admit_wait`` steps; the tokens stay generate()'s."""
    eng = engine(models, slots=4, admit_group=2, admit_wait=3)
    assert (eng.admit_group, eng.admit_wait) == (2, 3)
    lengths = [1, 12, 12, 12, 2, 12, 12, 12, 3, 12]
    handles = [eng.submit(PROMPTS[i % len(PROMPTS)], max_tokens=n) for i, n in enumerate(lengths)]
    steps, held = [], 0
    while not all(h.done for h in handles):
        free, queued = sum(r is None for r in eng._slot), len(eng._queue)
        running = free < eng.slots
        eng.step()
        admitted = queued - len(eng._queue)
        if free and queued and running:
            if admitted:
                assert admitted >= min(2, queued) or held == 3, (free, queued, admitted, held)
                held = 0
            else:
                held += 1
                assert held <= 3
            steps.append((free, queued, admitted))
    for i, (n, h) in enumerate(zip(lengths, handles, strict=True)):
        assert h.result().tokens == reference.tokens[i % len(PROMPTS)][:n]
    assert any(not a for _, _, a in steps), steps  # some step held a free slot
    assert any(a == 1 and q >= 2 for _, q, a in steps), steps  # and some hold ended by admit_wait


def test_the_launch_runs_beside_the_read_back_and_the_next_step(models, reference):
    """Each dispatch's programs are launched from the launcher thread, and the engine thread does
    not wait for them: a launch that waits until the engine thread has read back and streamed the
    dispatch before and prepared the next one sees it happen (with the launch on the engine
    thread, or a step that waited for its own launch, it would wait in vain); the tokens stay
    generate()'s. (A step that activates a new request and reads back no round of a running one,
    the first step among them, waits for its launch to stream the first tokens: that launch goes
    at once.)"""
    eng = engine(models, slots=2)
    progress = threading.Condition()
    prepared, rounds_of, saw = [0], collections.deque(), []
    prepare, launch = eng._prepare_rounds, eng._launch_rounds

    def counted_prepare():
        at_once = bool(eng._early) and not any(map(eng._live, eng._inflight))  # (what the step reads back)
        got = prepare()
        with progress:
            prepared[0] += 1
            if got is not None:
                rounds_of.append((prepared[0], at_once))
            progress.notify_all()
        return got

    def launch_after_the_next_prepare(ops, plan, rounds):
        if plan is not None:
            with progress:
                n, at_once = rounds_of.popleft()
                ok = at_once or progress.wait_for(lambda: prepared[0] > n, timeout=2.0)
            saw.append((ok, threading.current_thread().name, at_once))
        return launch(ops, plan, rounds)

    eng._prepare_rounds, eng._launch_rounds = counted_prepare, launch_after_the_next_prepare
    results = run(eng, [eng.submit(p, max_tokens=MAX_TOKENS) for p in PROMPTS])
    assert [r.tokens for r in results] == reference.tokens
    assert saw and all(ok and name.startswith("ddtree-launch") for ok, name, _ in saw), saw
    assert sum(not at_once for *_, at_once in saw) > len(saw) // 2  # (most launches waited for the next step)


def test_text_stream_holds_back_stop_prefixes_and_incomplete_characters():
    s = TextStream(_Chars(), ("END",))
    ids = lambda text: [ord(c) for c in text]
    assert s.add(ids("abcE")) == (ids("abcE"), "abc")
    assert s.add(ids("N")) == (ids("N"), "")
    assert s.add(ids("x")) == (ids("x"), "ENx")  # not a stop after all
    assert s.add([0xD800]) == ([0xD800], "")
    assert s.add(ids("yEN")) == (ids("yEN"), "\ufffdy")
    kept, text = s.add(ids("Dzz"))
    assert kept == ids("D") and text == "" and s.stopped and s.text == "abcENx\ufffdy"
    assert s.add(ids("more")) == ([], "")


def test_background_thread_serves_concurrent_submitters(models, reference):
    eng = engine(models, slots=2).start()
    try:
        results = {}

        def client(i):
            results[i] = eng.submit(PROMPTS[i], max_tokens=MAX_TOKENS).result(timeout=300).tokens

        threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(5)] == reference.tokens
    finally:
        eng.stop()
    assert np.all([h is None for h in eng._slot])
    assert (np.asarray(eng._state.finish) != RUNNING).all()  # retired slots do not run on the device either


def test_lockstep_driver_on_one_process(models, reference):
    """The multi-host driver's message path (encode, broadcast, apply, step) with the broadcast of a
    single process: same tokens, cancellation reaches the engine."""
    from ddtree_jax.serving.multihost import LockstepEngine

    driver = LockstepEngine(engine(models, slots=2), process_index=0, broadcast=lambda x: x).start()
    try:
        handles = [driver.submit(PROMPTS[i], max_tokens=MAX_TOKENS) for i in range(5)]
        doomed = driver.submit(PROMPTS[0], max_tokens=40)
        doomed.cancel()
        assert [h.result(timeout=300).tokens for h in handles] == reference.tokens
        assert doomed.result(timeout=300).finish_reason == "cancelled"
        with pytest.raises(RequestError, match="max_tokens"):
            driver.submit(PROMPTS[0], max_tokens=0)
    finally:
        driver.stop()


def test_incremental_text_equals_decoding_everything():
    """Byte-level BPE with multi-byte characters split across tokens: the streamed pieces join up
    to the tokenizer's decoding of all tokens, and every streamed prefix is a prefix of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["héllo wörld, 日本語のテキスト 🙂🙃 naïve café"] * 3, trainer=trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    rng = np.random.default_rng(0)
    for trial in range(20):
        ids = rng.integers(0, tok.get_vocab_size(), size=int(rng.integers(1, 150))).tolist()
        if trial % 2:  # (long enough for the decoding window to start over several times)
            ids = tok.encode("日本語のテキスト 🙂 héllo wörld " * 6).ids
        s, streamed, i = TextStream(tok), "", 0
        while i < len(ids):
            n = int(rng.integers(1, 6))
            _, text = s.add(ids[i : i + n])
            streamed += text
            assert tok.decode(ids).startswith(streamed)
            i += n
        assert streamed + s.flush() == tok.decode(ids) == s.text


def test_deferred_text_equals_the_eager_stream_whatever_the_reading_order():
    """A deferred stream's chunks, read in any order (a later chunk first, the result before the
    last chunk) and from several threads, give exactly the eager stream's pieces, and the
    result's text equals the eager text."""
    import pickle
    import threading

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ddtree_jax.serving.emitter import StreamChunk, request_result, stream_news

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["héllo wörld, 日本語のテキスト 🙂🙃 naïve café"] * 3, trainer=trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))

    class State:  # what stream_news reads and writes of a request
        def __init__(self, deferred):
            self.text = TextStream(tok, deferred=deferred)
            self.acceptance, self.logprobs, self.logprob_parts = [], None, []

    rng = np.random.default_rng(1)
    for trial in range(12):
        ids = tok.encode("日本語のテキスト 🙂 héllo wörld " * 4).ids if trial % 2 else \
            rng.integers(0, tok.get_vocab_size(), size=int(rng.integers(1, 120))).tolist()
        cuts = sorted(set(rng.integers(1, len(ids), size=min(8, len(ids) - 1)).tolist())) if len(ids) > 1 else []
        parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        eager, lazy = State(False), State(True)
        assert lazy.text.deferred and not eager.text.deferred
        want, got = [], []
        for k, part in enumerate(parts):
            finish = "length" if k == len(parts) - 1 else None
            for state, out in ((eager, want), (lazy, got)):
                kept, text, _, reason = stream_news(state, part, [len(part)], finish, None)
                assert kept == part and reason == finish
                out.append(StreamChunk(kept, text, reason))
        assert all(type(c._text) is str for c in want) and all(type(c._text) is not str for c in got)
        result = request_result(lazy, 0, 1, "length", ttft=None, seconds=0.0)
        order = rng.permutation(len(got)).tolist()
        if trial % 3 == 0:
            assert result.text == "".join(c.text for c in want)  # the result first
        threads = [threading.Thread(target=lambda c=got[i]: c.text) for i in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [c.text for c in got] == [c.text for c in want]
        assert result.text == eager.text.text == tok.decode(ids)
        assert result.tokens == ids
    # pickled or copied, a deferred chunk or result carries its decoded text
    stream = State(True)
    chunk = StreamChunk([5, 6], stream_news(stream, [5, 6], [2], "length", None)[1], "length")
    result = request_result(stream, 0, 1, "length", ttft=None, seconds=0.0)
    assert pickle.loads(pickle.dumps(chunk)).text == chunk.text == tok.decode([5, 6])
    assert pickle.loads(pickle.dumps(result)).text == result.text == tok.decode([5, 6])


@pytest.mark.parametrize("settings,match", [
    (dict(method="beam"), "method"),
    (dict(drafter=None), "needs a drafter"),
    (dict(slots=0), "slots"),
    (dict(budget=0), "budget"),
    (dict(max_model_len=1000), "max_model_len"),
    (dict(prefill_batch=-1), "prefill_batch"),
    (dict(stop_token_ids=[128]), "stop_token_ids"),
    (dict(seed=-1), "seed"),
])
def test_bad_engine_settings(models, settings, match):
    """Each bad setting is refused by its config, or by the engine where it needs the models."""
    target, drafter = models
    settings = {"drafter": drafter, **settings}
    drafter = settings.pop("drafter")
    decode = {k: settings.pop(k) for k in ("method", "budget", "stop_token_ids", "seed") if k in settings}
    with pytest.raises(ValueError, match=match):
        Engine(target, drafter, dataclasses.replace(SHAPE, decode=dataclasses.replace(DECODE, **decode), **settings))


def check_streams(eng, tok, reference, requests, stop_every, cancel_every):
    """Submits ``requests`` streams to a started engine (every ``stop_every``-th with a stop string,
    every ``cancel_every``-th cancelled at once) and checks each: its chunks join up to exactly its
    result, whose tokens are a prefix of generate()'s (all of them, or up to the stop string).
    Returns ``(prompt index, stop strings, handle)`` per stream."""
    full = [tok.decode(t) for t in reference.tokens]
    jobs = []
    for n in range(requests):
        i = n % 5
        stop = [full[i][4:6]] if n % stop_every == 3 else []
        jobs.append((i, stop, eng.submit(PROMPTS[i], max_tokens=MAX_TOKENS, stop=stop)))
        if n % cancel_every == 4:
            jobs[-1][2].cancel()
    for i, stop, h in jobs:
        chunks = list(h.stream(timeout=300))
        res = chunks[-1].result
        assert [t for c in chunks for t in c.token_ids] == res.tokens
        assert "".join(c.text for c in chunks) == res.text
        assert res.tokens == reference.tokens[i][: len(res.tokens)]
        if res.finish_reason == "stop":
            assert stop and res.text == full[i][: full[i].find(stop[0])]
        elif res.finish_reason == "length":
            assert not stop and res.tokens == reference.tokens[i]
        else:
            assert res.finish_reason == "cancelled"
    return jobs


def test_overlapped_loop_under_many_streams_loses_and_duplicates_nothing(models, reference):
    """The background loop (rounds dispatched before the previous ones are read back) under 40
    concurrent streams over 2 slots, with stop strings and cancellations
    mid-flight: every finished request has generate()'s tokens, every cancelled one a prefix of them,
    every stream's chunks join up to exactly its result, and the slots end free on the device."""
    tok = char_tokenizer()
    eng = engine(models, slots=2, tokenizer=tok).start()
    try:
        jobs = check_streams(eng, tok, reference, requests=40, stop_every=7, cancel_every=9)
        assert sum(h.result().finish_reason == "cancelled" for _, _, h in jobs) >= 1
    finally:
        eng.stop()
    assert np.all([h is None for h in eng._slot])
    assert (np.asarray(eng._state.finish) != RUNNING).all()


def test_read_back_two_steps_late_gives_the_same_tokens(models, reference):
    """``read_lag=2``: a step with rounds of its own leaves the two newest dispatches in flight and
    reads back the one before; greedy requests arriving while others run get generate()'s
    tokens, seeded ones the same tokens as with ``read_lag=1``, every token once (the metrics), and
    a step without rounds of its own reads back everything; of two read-backs in one step only the
    first is timed (the second's rounds ran during the first's wait). The default: 1 with a fixed
    ``sync_every``; with ``"auto"``, 2 after a dispatch of several rounds and 1 after one."""
    auto = cycling_engine(models)
    assert engine(models).read_lag == 1 and auto.read_lag == "auto"
    assert (auto._lag(1), auto._lag(2), auto._lag(4), engine(models, read_lag=2)._lag(1)) == (1, 2, 2, 2)
    eng = engine(models, slots=2, read_lag=2)
    read_back, untimed = eng._read_back, []

    def recorded(*args):
        untimed.append(eng._last_read is None)
        return read_back(*args)

    eng._read_back = recorded
    handles, depths, reads = {}, [], []
    for i in [2, 0, 4, 1, 3]:  # staggered arrivals
        handles[i] = eng.submit(PROMPTS[i], max_tokens=MAX_TOKENS)
        eng.step()
    untimed.clear()
    while not all(h.done for h in handles.values()):
        before = len(untimed)
        eng.step()
        depths.append(sum(n > 0 for *_, n in eng._inflight))
        assert all(untimed[before + 1 :]), untimed[before:]  # (beyond a step's first read-back)
        reads.append(len(untimed) - before)
    # (a read-back after a step that read nothing back is not timed either)
    assert all(untimed[sum(reads[:i])] for i in range(1, len(reads)) if reads[i - 1] == 0 and reads[i])
    assert [handles[i].result().tokens for i in range(5)] == reference.tokens
    assert max(depths) == 2 and depths[-1] == 0
    m = eng.metrics.snapshot()
    assert m["generated_tokens"] == 5 * MAX_TOKENS and m["itl"].count == 5 * (MAX_TOKENS - 1)
    p = [dt.SamplingParams(temperature=1.0, top_p=0.9, seed=7), dt.SamplingParams(temperature=0.7, seed=8),
         dt.SamplingParams(temperature=1.0, top_k=5, seed=9)]
    want = [r.tokens for r in engine(models, seed=3).generate(PROMPTS[:3], p, max_tokens=MAX_TOKENS)]
    assert [r.tokens for r in engine(models, seed=3, read_lag=2).generate(PROMPTS[:3], p,
                                                                           max_tokens=MAX_TOKENS)] == want


class NotReady(np.ndarray):
    """A first-token column that says it is not computed yet (``jax.Array.is_ready``)."""

    def is_ready(self):
        return False


def test_a_first_token_behind_a_dispatch_not_read_back_waits_for_its_read_back(models, reference, monkeypatch):
    """``read_lag=2``: a newcomer's activation launched behind a dispatch not read back yet runs
    after it on the device; the step does not wait for that dispatch to read the first token (its
    column says it is not ready): the next step, which reads that dispatch back, streams it, and the
    tokens stay generate()'s."""
    from ddtree_jax.serving import _device

    first_column = _device.first_column
    monkeypatch.setattr(_device, "first_column", lambda state: np.asarray(first_column(state)).view(NotReady))
    eng = engine(models, slots=2, read_lag=2)
    first = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS)
    eng.step()  # idle before: nothing launched ahead of the activation, so its first token streams now
    assert [c.token_ids for c in first._chunks] == [reference.tokens[0][:1]]
    eng.step()
    h = eng.submit(PROMPTS[1], max_tokens=MAX_TOKENS)
    eng.step()  # activates h behind two dispatches; reads back the older one only
    eng._settle()  # (the activation launched: what holds its first token back is the dispatch before it)
    assert not eng._early_tokens() and not h._chunks and len(eng._early) == 1
    assert eng._early[0][1].done() and eng._reads < eng._early[0][2]
    eng.step()  # reads back the other one: h's first token follows
    assert [c.token_ids for c in h._chunks][:1] == [reference.tokens[1][:1]] and not eng._early
    assert [r.tokens for r in run(eng, [first, h])] == reference.tokens[:2]


def test_read_back_two_steps_late_under_many_streams_loses_and_duplicates_nothing(models, reference):
    """The background loop read back one or two steps late as dispatches of 1, 2 and 4 rounds alternate, stop
    strings and cancellations mid-flight: every stream joins up to its result, a prefix of
    generate()'s tokens (all of them when it ran to its length), and the slots end free."""
    tok = char_tokenizer()
    eng = cycling_engine(models, tokenizer=tok)
    assert eng.read_lag == "auto"  # (read back one step late after a dispatch of one round, else two)
    eng.start()
    try:
        check_streams(eng, tok, reference, requests=24, stop_every=5, cancel_every=7)
    finally:
        eng.stop()
    assert all(h is None for h in eng._slot)
    assert (np.asarray(eng._state.finish) != RUNNING).all()


def test_prefill_on_a_cover_gives_generates_tokens(models, reference):
    """A prefill shape not compiled yet runs padded on a compiled cover (more rows, repeating the
    first), then, once compiled in the background, on its own shape: generate()'s tokens both ways."""
    eng = engine(models, slots=2)
    fresh = ShapeCache(eng._prefill._compile_shape)  # nothing compiled but the largest shape
    fresh.warm(2, 16)
    eng._prefill = fresh
    got = [eng.generate([PROMPTS[i]], max_tokens=MAX_TOKENS)[0].tokens for i in (0, 3)]  # one at a time: 1 row
    assert got == [reference.tokens[0], reference.tokens[3]]
    assert fresh.wait(300) and (1, 16) in fresh.shapes
    assert [r.tokens for r in eng.generate([PROMPTS[3], PROMPTS[0]], max_tokens=MAX_TOKENS)] == \
        [reference.tokens[3], reference.tokens[0]]
    assert eng.generate([PROMPTS[1]], max_tokens=MAX_TOKENS)[0].tokens == reference.tokens[1]  # (1, 16) now


def test_a_new_chunk_width_compiles_no_activation(models, reference):
    """The first-token activation reads the chunk's row fields, not its token ids, so it compiles
    per chunk rows: once warmed up, a prompt whose chunk runs on a wider compiled cover, and one
    whose chunk runs on its own width compiled since, activate without compiling; the warm-up
    compiles one newcomer's full chunk."""
    from ddtree_jax.serving import _device

    eng = engine(models, slots=2, prefill_chunk=64)
    eng.warmup()
    assert (1, 64) in eng._prefill.shapes and (1, 16) not in eng._prefill.shapes
    programs = _device.activate_first._cache_size()
    # PROMPTS[0] and [4]: chunks of 16 tokens, on the (1, 64) cover until (1, 16) has compiled
    assert eng.generate([PROMPTS[0]], max_tokens=MAX_TOKENS)[0].tokens == reference.tokens[0]
    assert eng.wait_compiled(300) and (1, 16) in eng._prefill.shapes
    assert eng.generate([PROMPTS[4]], max_tokens=MAX_TOKENS)[0].tokens == reference.tokens[4]
    assert _device.activate_first._cache_size() == programs


def test_histogram_observe_many_equals_observing_one_by_one():
    """``Histogram.observe_many`` (numpy, one call per engine step) keeps the same buckets, sum and
    count as ``observe`` per value, weights included, with values on the bounds and past the last."""
    from ddtree_jax.serving.metrics import ACCEPT_BUCKETS, LATENCY_BUCKETS, Histogram

    rng = np.random.default_rng(0)
    for bounds in (ACCEPT_BUCKETS, LATENCY_BUCKETS):
        for trial in range(20):
            n = int(rng.integers(0, 40))
            values = rng.choice(np.concatenate([bounds, rng.uniform(0, 2 * bounds[-1], 50)]), n)
            weights = rng.integers(1, 5, n) if trial % 2 else None
            many, one = Histogram(bounds), Histogram(bounds)
            many.observe_many(values, weights)
            many.observe_many(values[: n // 2])
            for i, v in enumerate(values):
                one.observe(float(v), 1 if weights is None else int(weights[i]))
            for v in values[: n // 2]:
                one.observe(float(v))
            assert many.counts == one.counts and many.count == one.count
            assert many.total == pytest.approx(one.total, rel=1e-12)
            assert all(type(c) is int for c in many.counts)


def test_one_packed_activation_sets_every_field(models):
    """``activation_rows`` packs ``activate``'s inputs into one int32 array (float32 and uint32
    fields as bits): after the activation each field holds exactly what was packed, including
    seeds and request ids above 2**31 and non-round float settings; other slots are untouched."""
    from ddtree_jax.sampling import SamplingBatch
    from ddtree_jax.serving import _device

    eng = engine(models, slots=4)
    rng = np.random.default_rng(0)
    rows = np.array([2, 0], np.int32)
    sampling = SamplingBatch(temperature=rng.uniform(0.1, 2, 2).astype(np.float32), top_k=np.array([0, 7], np.int32),
                             top_p=rng.uniform(0.1, 1, 2).astype(np.float32),
                             min_p=rng.uniform(0, 0.2, 2).astype(np.float32),
                             seed=np.array([2**32 - 3, 5], np.uint32), has_seed=np.array([True, False]))
    stop = np.array([[3, 9, -1], [4, -1, -1]], np.int32)[:, : eng.max_stop_ids]
    stop = np.pad(stop, ((0, 0), (0, eng.max_stop_ids - stop.shape[1])), constant_values=-1)
    packed = _device.activation_rows(rows, [11, 12], [5, 6], [30, 40], stop, sampling,
                                     np.array([2**31 + 9, 77], np.uint32), [0, 3])
    assert packed.dtype == np.int32 and packed.shape == (2, _device.ACTIVATION_FIELDS + eng.max_stop_ids)
    before = eng._empty_state()
    untouched = {k: np.asarray(v)[[1, 3]] for k, v in (("root", before.root), ("finish", before.finish))}
    state = _device.activate(before, packed)
    for field, want in (("root", [11, 12]), ("max_new_tokens", [30, 40]), ("rounds", [0, 3]),
                        ("request_ids", [2**31 + 9, 77]), ("stop_ids", stop)):
        np.testing.assert_array_equal(np.asarray(getattr(state, field))[rows], np.asarray(want), err_msg=field)
    for f in ("temperature", "top_k", "top_p", "min_p", "seed", "has_seed"):
        np.testing.assert_array_equal(np.asarray(getattr(state.sampling, f))[rows], getattr(sampling, f), err_msg=f)
    assert (np.asarray(state.finish)[rows] == RUNNING).all()
    np.testing.assert_array_equal(np.asarray(state.target_cache.lengths)[rows], [5, 6])
    for k, v in untouched.items():
        np.testing.assert_array_equal(np.asarray(getattr(state, k))[[1, 3]], v, err_msg=k)


def test_astream_batches_gives_every_chunk_once_in_order_and_what_queued_together():
    """``RequestHandle.astream_batches``: the backlog first (cut at the finished chunk), then each
    time everything that arrived while the reader was away, in order, each chunk exactly once,
    ending with the finished chunk; ``astream`` flattens the same."""
    import asyncio

    from ddtree_jax.serving.emitter import StreamChunk
    from ddtree_jax.serving.engine import RequestHandle

    chunks = [StreamChunk([i], str(i)) for i in range(7)] + [StreamChunk([7], "7", finish_reason="length")]

    async def read(flat: bool):
        handle = RequestHandle(engine=None, request_id=0)
        for c in chunks[:2]:  # before the reader registers: the backlog
            handle._push(c)
        got = []
        reader = handle.astream() if flat else handle.astream_batches()
        got.append(await reader.__anext__())
        for c in chunks[2:5]:  # three while the reader waits: one batch
            handle._push(c)
        await asyncio.sleep(0)
        got.append(await reader.__anext__())
        for c in chunks[5:]:
            handle._push(c)
        got += [x async for x in reader]
        return got

    batches = asyncio.run(read(flat=False))
    assert batches == [chunks[:2], chunks[2:5], chunks[5:]]
    assert asyncio.run(read(flat=True)) == chunks


class Cycle:
    """A sizer that runs the sizes in turn (so that the engine meets every change of size), and
    records what it was told."""

    def __init__(self, sizes):
        self.sizes, self.observed = itertools.cycle(sizes), []

    def choose(self, running):
        return next(self.sizes)

    def observe(self, running, rounds, seconds):
        self.observed.append((running, rounds, seconds))


def cycling_engine(models, tokenizer=None, seed=0):
    config = dataclasses.replace(SHAPE, decode=dataclasses.replace(DECODE, sync_every="auto", seed=seed))
    eng = Engine(*models, config, tokenizer=tokenizer)
    assert eng.sync_every == "auto" and eng.dispatch_rounds == (1, 2, 4)
    eng._sizer = Cycle([4, 1, 2, 2, 4])
    return eng


def test_dispatches_of_changing_sizes_give_the_same_tokens(models, reference):
    eng = cycling_engine(models)
    handles = {}
    for i in [2, 0, 4, 1, 3]:  # staggered arrivals
        handles[i] = eng.submit(PROMPTS[i], max_tokens=MAX_TOKENS)
        eng.step()
    assert [r.tokens for r in run(eng, [handles[i] for i in range(5)])] == reference.tokens
    m = eng.metrics.snapshot()
    assert set(m["dispatches"]) == {"1", "2", "4"} and m["generated_tokens"] == 5 * MAX_TOKENS
    assert m["itl"].count == 5 * (MAX_TOKENS - 1) and m["accept"].count == m["rounds"] > 0
    assert eng._sizer.observed and {r for _, r, _ in eng._sizer.observed} <= {1, 2, 4}
    # Seeded sampling: the same tokens as dispatches of one round (a row's stream is keyed by its rounds).
    p = [dt.SamplingParams(temperature=1.0, top_p=0.9, seed=7), dt.SamplingParams(temperature=0.7, seed=8)]
    single = Engine(*models, dataclasses.replace(SHAPE, decode=dataclasses.replace(DECODE, seed=3)))
    want = [r.tokens for r in single.generate(PROMPTS[:2], p, max_tokens=MAX_TOKENS)]
    assert [r.tokens for r in cycling_engine(models, seed=3).generate(PROMPTS[:2], p, max_tokens=MAX_TOKENS)] == want


def test_changing_sizes_under_many_streams_lose_and_duplicate_nothing(models, reference):
    """The background loop with stop strings and cancellations mid-flight, dispatches of 1, 2 and 4
    rounds in turn: every stream joins up to its result, which is a prefix of generate()'s tokens."""
    tok = char_tokenizer()
    eng = cycling_engine(models, tokenizer=tok).start()
    try:
        check_streams(eng, tok, reference, requests=15, stop_every=4, cancel_every=6)
    finally:
        eng.stop()
    assert all(h is None for h in eng._slot)


def test_the_first_token_goes_out_before_the_rounds_after_it(models, reference):
    """A new request's first token is drawn from its prompt's last position by its activation and
    read back as soon as that has run: on an idle engine the step that activates it streams it
    (waiting for its own launch: there is no round to read back; also after a long prompt's
    earlier chunks), while no round of it has been read back (metrics: 0 rounds); its harvest
    does not stream it again, and the tokens stay generate()'s. On a busy engine the step does
    not wait for its launch: with the launcher held back, a newcomer's first token comes from a
    later step."""
    eng = engine(models, slots=2)
    h = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS)
    eng.step()  # admits, prefills, activates, launches the first rounds and streams the first token
    assert [c.token_ids for c in h._chunks] == [reference.tokens[0][:1]]
    assert eng.metrics.snapshot()["rounds"] == 0 and not eng._early
    assert run(eng, [h])[0].tokens == reference.tokens[0]
    assert sum(len(c.token_ids) for c in h._chunks) == MAX_TOKENS

    eng = engine(models, slots=2)  # a prompt of three prefill chunks: two steps prefill, one activates
    h = eng.submit(PROMPTS[3], max_tokens=MAX_TOKENS)
    for _ in range(3):
        eng.step()
    assert [c.token_ids for c in h._chunks] == [reference.tokens[3][:1]]
    assert eng.metrics.snapshot()["rounds"] == 0
    assert run(eng, [h])[0].tokens == reference.tokens[3]

    eng = engine(models, slots=2)
    first = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS)
    eng.step()
    launch, gate = eng._launch_rounds, threading.Event()

    def held(ops, plan, rounds):
        gate.wait(timeout=30.0)
        return launch(ops, plan, rounds)

    eng._launch_rounds = held
    h = eng.submit(PROMPTS[1], max_tokens=MAX_TOKENS)
    eng.step()  # reads the first request's dispatch back; does not wait for the held launch
    assert not h._chunks and len(eng._early) == 1  # (a step that waited would stream it once the gate timed out)
    gate.set()
    assert [r.tokens for r in run(eng, [first, h])] == reference.tokens[:2]


def test_after_a_failed_launch_a_new_request_streams_its_first_token_as_before(models, reference):
    """A launch that fails before the activation it carries fails the step's requests (the
    engine thread's loop calls ``_fail_all`` when a step raises); the activation's first-token
    future never resolves and must not be waited on or stay queued: the next request's first token
    goes out from the step that activates it, and its tokens are generate()'s."""
    eng = engine(models, slots=2)
    launch = eng._launch_rounds

    def broken(ops, plan, rounds):
        raise RuntimeError("device lost")

    eng._launch_rounds = broken
    failed = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(3):
            eng.step()
    eng._fail_all("error: engine step failed: RuntimeError: device lost")
    assert failed.result().finish_reason.startswith("error: engine step failed")
    eng._launch_rounds = launch
    h = eng.submit(PROMPTS[1], max_tokens=MAX_TOKENS)
    eng.step()
    assert [c.token_ids for c in h._chunks] == [reference.tokens[1][:1]] and not eng._early
    assert run(eng, [h])[0].tokens == reference.tokens[1]


def test_a_request_after_one_that_ended_gets_its_first_token_before_any_round(models, reference):
    """A request that arrives while the rounds of one that has ended are still in flight (the
    engine launches a dispatch before it reads back the one that ends a request on a stop token,
    which it cannot foresee) is streaming to no one: the step that activates the newcomer reads
    those rounds back, waits for the launcher to launch the activation and streams the first
    token, whatever the launcher's pace (here it is held back for 0.3 s), not a dispatch later
    behind its first rounds."""
    eng = engine(models, slots=2)
    full = reference.tokens[0]
    k = next(i for i in range(2, MAX_TOKENS - 4) if full.index(full[i]) == i)  # a token's first occurrence
    first = eng.submit(PROMPTS[0], max_tokens=MAX_TOKENS, stop_token_ids=[full[k]])
    assert run(eng, [first])[0].tokens == full[: k + 1]
    assert eng._inflight  # the dispatch launched before the one that ended the request was read back
    launch = eng._launch_rounds

    def held(ops, plan, rounds):
        threading.Event().wait(0.3)
        return launch(ops, plan, rounds)

    eng._launch_rounds = held
    rounds = eng.metrics.snapshot()["rounds"]
    h = eng.submit(PROMPTS[1], max_tokens=MAX_TOKENS)
    eng.step()
    assert [c.token_ids for c in h._chunks] == [reference.tokens[1][:1]] and not eng._early
    assert eng.metrics.snapshot()["rounds"] == rounds  # (no round of the newcomer read back yet)
    eng._launch_rounds = launch
    assert run(eng, [h])[0].tokens == reference.tokens[1]


def test_no_dispatch_for_rows_that_end_within_the_rounds_in_flight(models):
    """A request whose rounds in flight already commit its last allowed token gets no dispatch
    after them (a running row commits at least one token a round): with 2 tokens, the first from
    the prefill and the second from the one round after it, one dispatch, not a second launched
    ahead for rounds no one reads; the tokens are generate()'s."""
    eng = engine(models, slots=2)
    want = dt.generate(*models, [PROMPTS[0]], method="ddtree", budget=6, max_new_tokens=2, max_len=80).tokens
    assert [r.tokens for r in eng.generate([PROMPTS[0]], max_tokens=2)] == want
    m = eng.metrics.snapshot()
    assert m["generated_tokens"] == 2 and sum(m["dispatches"].values()) == 1, m["dispatches"]


def test_a_thread_blocked_on_a_result_wakes_once_not_at_every_chunk():
    """``result()`` waits for the last chunk only: a thread per request blocked on its result (a
    closed-loop client) is not woken by every engine step's chunk, while a ``stream()`` reader is."""
    from ddtree_jax.serving.emitter import StreamChunk
    from ddtree_jax.serving.engine import RequestHandle

    h = RequestHandle(None, 1)
    wakes = []

    class Counting(threading.Condition):
        def notify_all(self):
            wakes.append((h._blocked, h._blocked_results))  # (stream readers, result waiters) waiting
            super().notify_all()

    h._cond = Counting(h._mutex)
    got = []
    waiter = threading.Thread(target=lambda: got.append(h.result(timeout=30)))
    waiter.start()
    while not h._blocked_results:
        threading.Event().wait(0.001)
    for t in range(5):
        h._push(StreamChunk([t], "x"))
    assert wakes == [] and not got
    final = StreamChunk([9], "y", "length", result="the result")
    h._push(final)
    waiter.join(timeout=30)
    assert got == ["the result"] and wakes == [(0, 1)]
    # A stream reader is woken by each chunk.
    h2 = RequestHandle(None, 2)
    reader = threading.Thread(target=lambda: got.extend(c.token_ids[0] for c in h2.stream(timeout=30)))
    reader.start()
    for t in range(3):
        while not h2._blocked:
            threading.Event().wait(0.001)
        h2._push(StreamChunk([t], "x", "length" if t == 2 else None, result="r" if t == 2 else None))
    reader.join(timeout=30)
    assert got == ["the result", 0, 1, 2]
