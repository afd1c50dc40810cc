"""``generate`` one dispatch ahead: the next call of rounds is launched before the current one's
done flags are read back (docs/usage.md, "How it runs"); with ``on_progress`` the calls run one
after the other. Both give the same tokens, through compactions and a last call launched after
every row finished; so do calls of a loop of known trip count (generate's form on GPUs)."""

import jax

import ddtree_jax as dt
from ddtree_jax import generation

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1], [2, 2, 2, 5, 6]]
SAMPLING = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.9, top_p=0.9, seed=3),
            dt.SamplingParams(temperature=1.0, top_k=5, seed=4), dt.SamplingParams(temperature=0.0),
            dt.SamplingParams(temperature=0.7, seed=8)]


def test_dispatching_one_ahead_changes_no_token(models, monkeypatch):
    events = []
    run_rounds, device_get = generation.run_rounds, jax.device_get

    def launch(*a, **k):
        events.append("launch")
        return run_rounds(*a, **k)

    def read(x):
        events.append("read")
        return device_get(x)

    monkeypatch.setattr(generation, "run_rounds", launch)
    monkeypatch.setattr(jax, "device_get", read)
    # Limits of 30, 5, 17, 9 and 24 tokens: the batch of 5 compacts twice (to 2 rows, then 1).
    kw = dict(method="ddtree", budget=6, sampling=SAMPLING, max_new_tokens=[30, 5, 17, 9, 24], sync_every=2)
    ahead = dt.generate(*models, PROMPTS, **kw)
    assert events[:3] == ["launch", "launch", "read"], events[:6]
    assert len(ahead.batch_sizes) >= 3, ahead.batch_sizes
    # (each compaction's host time, from its read-back to the next launch)
    assert len(ahead.compaction_seconds) == len(ahead.batch_sizes) - 1 and min(ahead.compaction_seconds) >= 0
    events.clear()
    progress = []
    one_by_one = dt.generate(*models, PROMPTS, on_progress=lambda out, n: progress.append(n.sum()), **kw)
    assert events[:3] == ["launch", "read", "read"], events[:6]  # (each call's flags, then its rows)
    assert one_by_one.tokens == ahead.tokens
    assert len(one_by_one.compaction_seconds) == len(one_by_one.batch_sizes) - 1
    assert [r.acceptance_lengths for r in one_by_one.requests] == [r.acceptance_lengths for r in ahead.requests]
    assert progress[-1] == sum(len(t) for t in ahead.tokens)


def test_calls_of_known_trip_count_change_no_token(models, monkeypatch):
    """With ``FIXED_CALLS`` (the default on GPUs) a call runs all its rounds where the rows are
    expected to need them and ends early where they may not: the same tokens and acceptance lengths
    as calls that all end early, and no fixed rounds past the most a row's limit leaves (each
    round commits at least one token per running row)."""
    forms = []
    run_rounds = generation.run_rounds

    def launch(*a):
        forms.append((a[6], a[7]))
        return run_rounds(*a)

    monkeypatch.setattr(generation, "run_rounds", launch)
    kw = dict(method="ddtree", budget=6, sampling=SAMPLING, max_new_tokens=[30, 5, 17, 9, 24], sync_every=2)
    monkeypatch.setattr(generation, "FIXED_CALLS", False)
    loop = dt.generate(*models, PROMPTS, **kw)
    assert forms and not any(fixed for _, fixed in forms)
    monkeypatch.setattr(generation, "FIXED_CALLS", True)
    forms.clear()
    fixed = dt.generate(*models, PROMPTS, **kw)
    assert any(f for _, f in forms), forms
    assert sum(n for n, f in forms if f) <= 30, forms
    assert fixed.tokens == loop.tokens
    assert [r.acceptance_lengths for r in fixed.requests] == [r.acceptance_lengths for r in loop.requests]


def test_row_rates_follow_each_row_from_the_batch_rate():
    """A call's form follows the slowest row: each slot's tokens per round is its own count past
    the first token, starting from ``RATE_PRIOR`` rounds of the used slots' rate, at least 1."""
    import numpy as np

    generated = np.array([41, 11, 1, 99])  # (the first token of each came from the prefill)
    rounds = np.array([10, 10, 0, 1])
    used = np.array([True, True, True, False])
    batch = (40 + 10) / 20
    rates = generation._row_rates(generated, rounds, used)
    prior = generation.RATE_PRIOR
    np.testing.assert_allclose(rates[:3], [(40 + prior * batch) / (10 + prior), (10 + prior * batch) / (10 + prior),
                                           batch])
    assert rates[1] < batch < rates[0]
    np.testing.assert_allclose(generation._row_rates(np.array([3, 5]), np.array([4, 4]), np.array([True, True])),
                               [1.0, 1.0])


def test_read_backs_pack_and_split_the_state_fields_and_the_tally():
    """The packed read-backs (``_harvested``, ``_progress`` with an auto dispatch's tally) give back
    each field exactly: the tally's float32 bits through int32, the state's int32 fields (their
    functions run on a stand-in with the state's fields, uncompiled)."""
    import numpy as np

    rng = np.random.default_rng(0)
    B, C, W = 3, 5, 7
    ints = lambda *shape: jax.numpy.asarray(rng.integers(-9, 99, shape), jax.numpy.int32)  # noqa: E731
    state = type("S", (), {})()
    state.out, state.accept_lengths = ints(B, C), ints(B, C)
    state.generated, state.finish, state.rounds = ints(B), ints(B), ints(B)
    state.done = state.finish > 50
    tally = rng.standard_normal((B, W)).astype(np.float32)
    fields = generation._host_fields(np.asarray(generation._harvested.__wrapped__(state)), C)
    for name, got in fields.items():
        np.testing.assert_array_equal(got, np.asarray(getattr(state, name)))
    got_tally, (done, generated, rounds) = generation._read_progress(
        generation._progress.__wrapped__(state, jax.numpy.asarray(tally)))
    np.testing.assert_array_equal(got_tally, tally)  # bit for bit
    np.testing.assert_array_equal(done, np.asarray(state.done).astype(np.int32))
    np.testing.assert_array_equal(generated, np.asarray(state.generated))
    np.testing.assert_array_equal(rounds, np.asarray(state.rounds))
    assert generation._read_progress(generation._progress.__wrapped__(state))[0] is None
