"""``generate`` one dispatch ahead: the next call of rounds is launched before the current one's
done flags are read back (docs/usage.md, "How it runs"); with ``on_progress`` the calls run one
after the other. Both give the same tokens, through compactions and a last call launched after
every row finished."""

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
    events.clear()
    progress = []
    one_by_one = dt.generate(*models, PROMPTS, on_progress=lambda out, n: progress.append(n.sum()), **kw)
    assert events[:3] == ["launch", "read", "read"], events[:6]  # (each call's flags, then its rows)
    assert one_by_one.tokens == ahead.tokens
    assert [r.acceptance_lengths for r in one_by_one.requests] == [r.acceptance_lengths for r in ahead.requests]
    assert progress[-1] == sum(len(t) for t in ahead.tokens)
