"""``generate`` with calls in flight: the next call of rounds is launched before the current one's
finish flags are read back (docs/usage.md, "How it runs"); with ``on_progress`` the calls run one
after the other. Both give the same tokens, through compactions and calls launched after every
row finished; no call is launched that could only run finished rows."""

import jax

import ddtree_jax as dt
from ddtree_jax import generation

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [3, 1], [2, 2, 2, 5, 6]]
SAMPLING = [dt.SamplingParams(temperature=0.0), dt.SamplingParams(temperature=0.9, top_p=0.9, seed=3),
            dt.SamplingParams(temperature=1.0, top_k=5, seed=4), dt.SamplingParams(temperature=0.0),
            dt.SamplingParams(temperature=0.7, seed=8)]


def test_calls_in_flight_change_no_token(models, monkeypatch):
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
    events.clear()
    progress = []
    one_by_one = dt.generate(*models, PROMPTS, on_progress=lambda out, n: progress.append(n.sum()), **kw)
    assert events[:3] == ["launch", "read", "read"], events[:6]  # (each call's flags, then its rows)
    assert one_by_one.tokens == ahead.tokens
    assert [r.acceptance_lengths for r in one_by_one.requests] == [r.acceptance_lengths for r in ahead.requests]
    assert progress[-1] == sum(len(t) for t in ahead.tokens)


def test_no_call_past_the_last_token(models, monkeypatch):
    """Autoregressive rows commit one token a round, so the host knows when every row is done:
    as many rounds are launched as the longest limit, none more (with calls in flight)."""
    launched = []
    run_rounds = generation.run_rounds

    def launch(*a, **k):
        launched.append(a[-1] if len(a) > 6 else k["rounds"])
        return run_rounds(*a, **k)

    monkeypatch.setattr(generation, "run_rounds", launch)
    out = dt.generate(*models, PROMPTS, method="ar", max_new_tokens=[7, 3, 5, 2, 6], compact=False)
    assert [len(t) for t in out.tokens] == [7, 3, 5, 2, 6]
    assert sum(launched) == 7, launched
