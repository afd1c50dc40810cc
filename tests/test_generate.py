"""generate(): greedy equality across methods, whole-block acceptance, the sampling law, stops,
limits and bad inputs, on tiny random models (CPU).

Compilation dominates on the CPU, so the tests share shapes: batch 3, max_len 64 and
max_new_tokens 12 unless a test needs otherwise.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import ddtree_jax as dt
from ddtree_jax.generation import generate
from ddtree_jax.testing import BigramOracleDrafter, make_bigram
from tests._model_fixtures import tiny_dflash, tiny_kimi, tiny_pair
from tests._reference import chisquare_pvalue, filtered_probs

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 10, 11]]
SHAPES = dict(max_new_tokens=12, max_len=64)


@pytest.fixture(scope="module")
def greedy_ar(models):
    return generate(models[0], None, PROMPTS, method="ar", **SHAPES)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 6), ("ddtree", 23)])
def test_greedy_equals_autoregressive(models, greedy_ar, method, budget):
    out = generate(*models, PROMPTS, method=method, budget=budget or 1, **SHAPES)
    assert out.tokens == greedy_ar.tokens
    assert all(len(t) == 12 for t in out.tokens)
    assert [r.finish_reason for r in out.requests] == ["length"] * 3
    L = models[1].config.block_size - 1
    for r in out.requests:  # the statistics describe the rounds that made the tokens (after the prefill's)
        assert all(1 <= a <= L + 1 for a in r.acceptance_lengths)
        assert 1 + sum(r.acceptance_lengths[:-1]) < 12 <= 1 + sum(r.acceptance_lengths)


def test_budget_below_the_draft_depth_with_the_default_cache(models, greedy_ar):
    """A tree smaller than the drafter's block still commits a path of draft_len + 1 positions:
    the default cache must leave room for it (it left only budget + 1, and the last rounds'
    writes were clamped onto earlier positions)."""
    drafter = tiny_dflash(models[0], 1, block_size=16)
    out = generate(models[0], drafter, PROMPTS, method="ddtree", budget=1, max_new_tokens=12)
    assert out.tokens == greedy_ar.tokens


def test_profiled_run_gives_same_tokens_and_a_time_split(models, greedy_ar):
    out = generate(*models, PROMPTS, method="ddtree", budget=6, profile=True, **SHAPES)
    assert out.tokens == greedy_ar.tokens
    assert set(out.time_split) == {"draft", "tree", "verify", "sample", "commit"}
    assert all(v > 0 for v in out.time_split.values())


# --- a drafter that agrees with the target -------------------------------------------------


def bigram_target():
    return make_bigram(tiny_kimi(2))


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_agreeing_drafter_accepts_whole_blocks(method):
    target, drafter = bigram_target(), BigramOracleDrafter(block_size=5)
    out = generate(target, drafter, PROMPTS, method=method, budget=8, **SHAPES)
    ar = generate(target, None, PROMPTS, method="ar", **SHAPES)
    assert out.tokens == ar.tokens
    for r in out.requests:
        assert r.acceptance_lengths == [5] * r.rounds  # L = 4 drafts + the bonus, every round
    assert out.mean_tau == 5.0
    assert out.requests[0].rounds == 3  # 12 tokens in blocks of 5


# --- the sampling law -------------------------------------------------------------------------

LAW_VOCAB, LAW_N = 12, 5_000
LAW_SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=4, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.1),
]


def _two_token_law(target, prompt, params):
    """Exact law of the first two generated tokens under the target's own sampling rule."""
    V = target.config.vocab_size
    first = np.asarray(target(jnp.asarray([prompt])))[0, -1]
    p1 = filtered_probs(first, **params)
    seconds = np.asarray(target(jnp.asarray([prompt + [t] for t in range(V)])))[:, -1]
    return p1[:, None] * np.stack([filtered_probs(seconds[t], **params) for t in range(V)])


def test_sampling_law_of_the_first_two_tokens():
    """DDTree's first two tokens follow the target's law: chi-square at N = 5,000 per setting,
    three settings in one mixed batch, pass at p > 1e-4 (fixed seed). Cells of expected count < 5
    (the untruncated setting's rarest pairs) are pooled into one (``chisquare_pvalue``). (Power at
    this N, from the noncentral chi-square, against the law at temperature x 1.25: 0.999, 0.50 and
    0.68 for the three settings; at the former N = 10,000, 1.0, 0.98 and 0.999.)"""
    target = tiny_kimi(3, vocab_size=LAW_VOCAB)
    drafter = tiny_dflash(target, 4, mask_token_id=LAW_VOCAB - 1)
    prompt = [1, 5, 2]
    params = [dt.SamplingParams(**s) for s in LAW_SETTINGS for _ in range(LAW_N)]
    out = generate(
        target, drafter, [prompt] * len(params), method="ddtree", budget=6, sampling=params, max_new_tokens=2, seed=11
    )
    tokens = np.array(out.tokens)
    assert out.mean_tau > 1.1, "drafts must be accepted for the test to mean something"
    for i, s in enumerate(LAW_SETTINGS):
        law = _two_token_law(target, prompt, s).ravel()
        got = tokens[i * LAW_N : (i + 1) * LAW_N]
        codes = got[:, 0] * LAW_VOCAB + got[:, 1]
        assert (law[codes] > 0).all(), f"a token outside the filtered support was emitted ({s})"
        p = chisquare_pvalue(np.bincount(codes, minlength=law.size)[law > 0], law[law > 0] * LAW_N)
        assert p > 1e-4, f"chi-square p = {p:.3g} for {s}"


def test_seeded_request_does_not_depend_on_the_batch(models):
    p = dt.SamplingParams(temperature=1.0, seed=99)
    others = [dt.SamplingParams(temperature=0.5, seed=1), dt.SamplingParams(top_k=3)]
    mixed = generate(
        *models,
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        sampling=[others[0], p, others[1]],
        method="ddtree",
        budget=6,
        seed=5,
        **SHAPES,
    )
    shuffled = generate(
        *models,
        [PROMPTS[0], PROMPTS[2], PROMPTS[1]],
        sampling=[p, others[1], others[0]],
        method="ddtree",
        budget=6,
        seed=5,
        **SHAPES,
    )
    assert mixed.tokens[1] == shuffled.tokens[0]
    alone = generate(
        *models,
        [PROMPTS[0]] * 3,
        sampling=[p, dt.SamplingParams(temperature=0.0), p],
        method="ddtree",
        budget=6,
        seed=5,
        **SHAPES,
    )
    assert alone.tokens[0] == alone.tokens[2] == mixed.tokens[1]


# --- stops, limits, errors -------------------------------------------------------------------


def test_stop_tokens(models, greedy_ar):
    ref = greedy_ar.tokens[0]
    stop = ref[4]
    k = ref.index(stop)
    out = generate(*models, PROMPTS, method="ddtree", budget=6, stop_tokens=[stop], **SHAPES)
    r0 = out.requests[0]
    assert r0.tokens == ref[: k + 1] and r0.finish_reason == "stop"
    for b in (1, 2):  # the others stop at their own first occurrence, or run to the length limit
        ref_b = greedy_ar.tokens[b]
        want = ref_b[: ref_b.index(stop) + 1] if stop in ref_b else ref_b
        assert out.requests[b].tokens == want
        assert out.requests[b].finish_reason == ("stop" if stop in ref_b else "length")


@pytest.mark.parametrize(
    "sampling",
    [
        dt.SamplingParams(temperature=0.0),
        dt.SamplingParams(temperature=1.0),
        dt.SamplingParams(temperature=0.8, top_k=20, seed=4),
    ],
    ids=["greedy", "unseeded", "seeded"],
)
def test_compaction_changes_nothing_but_the_work(models, sampling):
    """Requests 0 and 1 have a limit of 1 token and finish in round one, whatever they sample;
    request 2 then runs alone in a batch of one. Outputs equal those of the uncompacted run."""
    limits = [1, 1, SHAPES["max_new_tokens"]]
    runs = [
        generate(
            *models,
            PROMPTS,
            method="ddtree",
            budget=6,
            sampling=sampling,
            sync_every=1,
            compact=c,
            seed=8,
            max_len=SHAPES["max_len"],
            max_new_tokens=limits,
        )
        for c in (False, True)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert [len(t) for t in runs[1].tokens] == limits
    assert [r.acceptance_lengths for r in runs[0].requests] == [r.acceptance_lengths for r in runs[1].requests]
    assert [r.finish_reason for r in runs[1].requests] == ["length"] * 3
    assert runs[0].batch_sizes == [3] and runs[1].batch_sizes == [3, 1]
    assert runs[0].compaction_seconds == () and len(runs[1].compaction_seconds) == 1
    assert 0 <= runs[1].compaction_seconds[0] <= runs[1].seconds


def test_per_request_limits_equal_separate_runs(models, greedy_ar):
    out = generate(*models, PROMPTS, method="ddtree", budget=6, max_new_tokens=[3, 12, 7], max_len=64)
    assert out.tokens == [greedy_ar.tokens[0][:3], greedy_ar.tokens[1], greedy_ar.tokens[2][:7]]


def test_max_new_tokens_one(models, greedy_ar):
    out = generate(*models, PROMPTS, method="ddtree", budget=6, max_new_tokens=1, max_len=64)
    assert out.tokens == [t[:1] for t in greedy_ar.tokens]
    # the same settings as one DecodeConfig
    config = dt.DecodeConfig(method="ddtree", budget=6)
    assert generate(*models, PROMPTS, config=config, max_new_tokens=1, max_len=64).tokens == out.tokens


def test_prompt_at_the_context_limit(models):
    """prompt + max_new_tokens == max_position_embeddings works; one more is an error."""
    target, drafter = models
    context = target.config.max_position_embeddings
    prompt = list(np.arange(context - 3) % 100)
    out = generate(target, drafter, [prompt], method="ddtree", budget=4, max_new_tokens=3)
    assert len(out.tokens[0]) == 3
    with pytest.raises(ValueError, match=r"prompts\[0\] .* exceeds the target's context"):
        generate(target, drafter, [prompt + [1]], method="ddtree", budget=4, max_new_tokens=3)


def test_non_finite_logits_fail_only_that_request(greedy_ar):
    """A NaN embedding row reached by request 0's root token fails request 0 alone; requests 1 and 2
    (which never meet it) keep the clean models' greedy tokens (``greedy_ar``: the same seeds). The
    batch has the shapes of the module's runs (3 rows, prompts of at most 5 tokens, SHAPES), so
    the poisoned copies reuse their compiled programs."""
    target, drafter = tiny_pair(0)  # (conftest's models, fresh: their embedding is poisoned below)
    # Poison a token that requests 1 and 2 never meet, so their outputs must be unchanged: not in
    # their prompts or outputs, nor (at these seeds) in their drafts (a drafted poison fails the
    # request that verifies it); searched from the top of the vocabulary, below the mask token.
    clean = set(PROMPTS[1] + PROMPTS[2] + greedy_ar.tokens[1] + greedy_ar.tokens[2])
    poison = next(t for t in range(126, 9, -1) if t not in clean)
    emb = target.model.embed_tokens.weight
    emb[...] = emb[...].at[poison].set(jnp.nan)
    out = generate(target, drafter, [[1, 2, 3, 4, poison], PROMPTS[1], PROMPTS[2]], method="ddtree", budget=6,
                   **SHAPES)
    assert out.requests[0].finish_reason.startswith("error") and out.requests[0].tokens == []
    for b in (1, 2):
        assert out.requests[b].finish_reason == "length" and out.requests[b].tokens == greedy_ar.tokens[b]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] must be a non-empty"),
        (dict(prompts=[[1, 128]]), r"prompts\[0\] has token id 128 outside the vocabulary"),
        (dict(prompts=[[-1]]), r"prompts\[0\] has token id -1"),
        (dict(prompts=[]), "prompts must be a non-empty"),
        (dict(prompts=[[1.5, 2.0]]), r"prompts\[0\] must hold integer token ids"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=[3, 0]), "max_new_tokens has 2 entries for 1 prompts"),
        (dict(max_new_tokens=[0]), r"max_new_tokens\[0\] must be an integer >= 1"),
        (dict(method="beam"), "method: must be one of"),
        (dict(budget=0), "budget: must be an integer >= 1"),
        (dict(budget=60, max_len=64), r"budget=60: the verify block and commit \(61 tokens\) do not fit the cache"),
        (dict(stop_tokens=[500]), "stop_token_ids: 500 is outside the vocabulary"),
        (dict(sampling=[dt.SamplingParams()] * 2), "2 SamplingParams for a batch of 1"),
        (dict(drafter=None), "'ddtree' needs a drafter"),
        (dict(sync_every=0), "sync_every: must be None, 'auto' or an integer >= 1"),
        (dict(seed=2**32), r"seed: must be an integer in \[0, 2\*\*32\)"),
        (dict(config=dt.DecodeConfig()), "pass config= or the keywords it holds, not both .* method, budget"),
    ],
)
def test_bad_inputs(models, kwargs, match):
    args = dict(target=models[0], drafter=models[1], prompts=[[1, 2, 3]], method="ddtree", budget=4, max_new_tokens=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(**args)


def test_published_tau_averages_per_request_and_no_round_counts_the_first_token():
    target, drafter = bigram_target(), BigramOracleDrafter(block_size=5)
    out = generate(target, drafter, PROMPTS, method="dflash", **SHAPES)
    for r in out.requests:  # the prefill's token, then the rounds' (before truncation)
        assert r.tau == float(np.mean(r.acceptance_lengths))
        assert 1 + sum(r.acceptance_lengths[:-1]) < len(r.tokens) <= 1 + sum(r.acceptance_lengths)
    assert out.mean_tau_published == float(np.mean([q.tau for q in out.requests]))
    single = generate(target, drafter, PROMPTS, method="dflash", max_new_tokens=1, max_len=64)
    assert all(q.acceptance_lengths == [] and len(q.tokens) == 1 for q in single.requests)
    assert np.isnan(single.mean_tau_published) and single.rounds == 0


def test_a_request_can_end_with_its_first_token(models, greedy_ar):
    """The first token comes from the prefill: a stop token there, or a limit of one token, ends
    the request without a round (and the batch runs none when every request ends so)."""
    first = greedy_ar.tokens[0][0]
    out = generate(*models, PROMPTS, method="ddtree", budget=6, stop_tokens=[first], **SHAPES)
    r = out.requests[0]
    assert r.tokens == [first] and r.finish_reason == "stop" and r.acceptance_lengths == []
    cut = lambda t: t[: t.index(first) + 1] if first in t else t  # noqa: E731
    assert out.tokens == [cut(t) for t in greedy_ar.tokens]
    one = generate(*models, PROMPTS, method="ddtree", budget=6, max_new_tokens=1, max_len=64)
    assert one.tokens == [t[:1] for t in greedy_ar.tokens] and one.rounds == 0
    assert [q.finish_reason for q in one.requests] == ["length"] * len(PROMPTS)
