"""``generate``: speculative decoding of a fixed batch of prompts, exact and batched.

Methods: autoregressive decoding ("ar"), linear DFlash ("dflash": the argmax chain of the
drafter's block) and DDTree ("ddtree": the best tree of ``budget`` nodes). Every committed token
is an exact sample of the target's own sampling rule, so all three give the same output law (and,
greedy, the same tokens).

This module does the host-side work only: it checks the inputs, prefills, runs compiled rounds
(``ddtree_jax.decode_round``) ``sync_every`` at a time, and reads results back. The host reads
the rows' progress (one ``[3, B]`` transfer: done flags, tokens, rounds) after each batch of
rounds, to stop when every request has finished, to size the next calls and to report progress.
On GPUs a call whose rounds the rows are expected to need runs a loop of known trip count, so
that it returns before its rounds are done and the next call's launch overlaps them
(``FIXED_CALLS``; a loop ending on a device predicate holds the host each iteration). With
``profile=True`` each stage of a round runs as a separate compiled call timed on the host (slower;
it exists to measure the time split).

Finished requests stop costing work where the shapes allow: inside a batch of rounds they ride
along (fixed shapes), but at a host sync where at most half the slots are still running, the
running ones are gathered into the next smaller power-of-two batch (caches included, through
``DecodeState.take_rows``) and the rounds continue on that; each batch size compiles once.

With ``page_size`` the caches are paged, and prompts sharing full pages of a prefix share those
pages (``ddtree_jax.paged_generate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import auto_costs
from ddtree_jax import auto_round as ar
from ddtree_jax.auto_budget import AutoChooser, AutoPlan, AutoReport, probe_alone, restart_price
from ddtree_jax.auto_round import plain_tally, round_plans, run_fixed_tallied_rounds, run_flush, run_tallied_rounds
from ddtree_jax.backend import Backend, resolve_backend
from ddtree_jax.compilation_cache import CompileWatch
from ddtree_jax.config import AUTO, METHODS, DecodeConfig, auto_budget_set, is_int
from ddtree_jax.decode_round import STAGES, DecodePlan, Models, prefill, run_rounds, run_stage
from ddtree_jax.decode_state import FINISH_REASONS, FREE, NO_STOP, DecodeState
from ddtree_jax.paged_generate import check_page_size, paged_prefill, without_pages
from ddtree_jax.rows import place_state
from ddtree_jax.sampling import SamplingParams, batch_sampling

__all__ = ["METHODS", "GenerateOutput", "RequestOutput", "generate"]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request's result.

    Attributes:
      tokens: generated token ids (prompt excluded), at most ``max_new_tokens``; ends with the
        stop token when ``finish_reason == "stop"``.
      finish_reason: ``"stop"``, ``"length"`` or ``"error: ..."``.
      acceptance_lengths: tokens the target accepted per round, bonus included (1 .. L + 1),
        before truncation at a stop token or the length limit. The first new token is drawn from
        the prefill (the prompt's last position) and counts in no round, as in the published
        DFlash and DDTree loops: ``1 + sum(acceptance_lengths)`` tokens, before truncation.
      cached_prompt_tokens: prompt positions taken from pages another request of the call
        computed (``page_size`` runs; 0 otherwise).
    """

    tokens: list[int]
    finish_reason: str
    acceptance_lengths: list[int]
    cached_prompt_tokens: int = 0

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length over the rounds, bonus token included: new tokens per target
        verify pass, before truncation (the published tables' tau; 0 without a round)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


class Dispatch(NamedTuple):
    """One compiled call of rounds in ``generate``, as the host saw it.

    Attributes:
      budget: the tree budget its rounds verified (0: plain autoregressive rounds; DFlash: its
        block's draft length; a probing dispatch: its probe round's).
      rounds: the rounds it was given (a ``"loop"`` call stops early once every row is done).
      form: ``"fixed"`` (a loop of known trip count: the call returns before its rounds have run),
        ``"loop"`` (a loop that ends once every row is done: on a GPU the call returns when they
        have), ``"probe"`` (one drafted round, then plain ones), ``"alone"`` (``budget="auto"``'s
        first probe as a call of its one round, read back before the next call is launched:
        ``auto_budget.probe_alone``) or ``"profile"``.
      start: seconds from the first call's launch to this one's.
      choose: seconds of host work in the launch before the compiled call: the budget's choice,
        cost lookups, the decision of the call's form.
      launch: seconds the compiled call (and a flush of held-back context before it) took to
        return.
      wait: seconds the read-back of its results waited, from when the host asked for them.
    """

    budget: int
    rounds: int
    form: str
    start: float
    choose: float
    launch: float
    wait: float


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Result of ``generate``.

    Attributes:
      requests: one ``RequestOutput`` per prompt, in order.
      method, budget: what ran (budget: non-root tree nodes, the largest of the set with
        ``budget="auto"``; L for dflash, 0 for ar).
      rounds: rounds the batch ran (the longest request's count).
      seconds: wall time of the decoding rounds (prefill excluded; compilation excluded after
        the first call with the same shapes).
      round_seconds: the part of ``seconds`` spent launching the calls of compiled rounds
        (``budget="auto"``'s choice of each call included) and reading back what the host needs
        after each; the rest is host work between calls: cost-table lookups, harvesting finished
        rows and compaction. ``dispatches`` splits it call by call.
      prefill_seconds: wall time of the prompt prefill.
      time_split: seconds per stage (draft, tree, verify, sample, commit) with ``profile=True``,
        else ``None``.
      batch_sizes: the batch sizes the rounds ran at, in order (compaction shrinks it).
      compaction_seconds: per compaction (``batch_sizes[1:]``), the host's seconds from the
        read-back of the last dispatch on the larger batch to the launch of the first on the
        smaller (its choice excluded): harvesting the rows, gathering the running ones and, with
        ``budget="auto"``, adding the held-back drafter context and looking up (or timing) the new
        batch size's costs; the pipeline of dispatches starts again after it.
      auto: with ``budget="auto"``, the budgets the rounds chose and the expected vs realized
        tokens (``auto_budget.AutoReport``); else ``None``.
      dispatches: the compiled calls of rounds in the order they ran, one ``Dispatch`` each: where
        the wall time went call by call (``seconds`` is their span plus the host work between
        them).
    """

    requests: list[RequestOutput]
    method: str
    budget: int
    rounds: int
    seconds: float
    prefill_seconds: float
    time_split: dict[str, float] | None
    batch_sizes: list[int]
    auto: AutoReport | None = None
    round_seconds: float = 0.0
    dispatches: tuple[Dispatch, ...] = ()
    compaction_seconds: tuple[float, ...] = ()

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]

    @property
    def mean_tau(self) -> float:
        """Mean acceptance length over all rounds of all requests (pooled)."""
        lengths = [a for r in self.requests for a in r.acceptance_lengths]
        return float(np.mean(lengths)) if lengths else 0.0

    @property
    def mean_tau_published(self) -> float:
        """The published tables' tau: each request's ``tau``, averaged over requests (the reference
        benchmark's mean of per-request means), over requests with a round; NaN if none."""
        taus = [r.tau for r in self.requests if r.acceptance_lengths]
        return float(np.mean(taus)) if taus else float("nan")

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt positions served from shared pages, over all requests (not computed again)."""
        return sum(r.cached_prompt_tokens for r in self.requests)


_GREEDY = SamplingParams(temperature=0.0)
# generate's rounds per host sync when its DecodeConfig leaves sync_every to the runner (with
# budget="auto" the budget is chosen once per sync; docs/auto-budget.md: why 8 there too)
_SYNC_EVERY = 8
# Whether generate's calls run a loop of known trip count where the rows still need them (module
# doc); None: where a loop with a data-dependent end holds the host, on GPUs.
FIXED_CALLS: bool | None = None


def _fixed_calls() -> bool:
    return jax.default_backend() == "gpu" if FIXED_CALLS is None else FIXED_CALLS


@dataclasses.dataclass(frozen=True)
class _Checked:
    prompts: list[np.ndarray]
    max_new_tokens: np.ndarray  # i32 [B]
    stop_ids: np.ndarray  # i32 [B, S]
    budget: int
    max_len: int
    needs: np.ndarray  # i32 [B]: positions each request's cache must hold (prompt, output, scratch)


def _decode_config(config: DecodeConfig | None, **keywords) -> DecodeConfig:
    """``config``, or a ``DecodeConfig`` of the keywords given (``None``: its default); both is an
    error naming them."""
    given = {k: v for k, v in keywords.items() if v is not None}
    if config is None:
        return DecodeConfig(**given)
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}")
    if given:
        names = ", ".join("stop_tokens" if k == "stop_token_ids" else k for k in given)
        raise ValueError(f"generate: pass config= or the keywords it holds, not both (got config and {names})")
    return config


def _check_inputs(target, drafter, prompts, decode: DecodeConfig, max_new_tokens, max_len) -> _Checked:
    cfg = target.config
    V = cfg.vocab_size
    if isinstance(prompts, np.ndarray) or not isinstance(prompts, Sequence) or not prompts:
        if not (isinstance(prompts, np.ndarray) and prompts.ndim == 2 and prompts.shape[0] > 0):
            raise ValueError("prompts must be a non-empty list of token-id lists (or a 2-D integer array)")
    checked = []
    for i, p in enumerate(prompts):
        p = np.asarray(p)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {p.shape}")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got {p.dtype}")
        bad = p[(p < 0) | (p >= V)]
        if bad.size:
            raise ValueError(f"prompts[{i}] has token id {int(bad[0])} outside the vocabulary [0, {V})")
        checked.append(p.astype(np.int32))
    B = len(checked)
    limits = [max_new_tokens] * B if is_int(max_new_tokens) else list(max_new_tokens)
    if len(limits) != B:
        raise ValueError(f"max_new_tokens has {len(limits)} entries for {B} prompts")
    for i, m in enumerate(limits):
        if not is_int(m) or m < 1:
            raise ValueError(f"max_new_tokens{'' if is_int(max_new_tokens) else f'[{i}]'} must be an integer >= 1, "
                             f"got {m!r}")
    decode.check_for(V, has_drafter=drafter is not None)
    stop = list(decode.stop_token_ids)
    L = drafter.config.block_size - 1 if decode.uses_drafter else 0
    budget = decode.max_budget if decode.method == "ddtree" else L
    context = cfg.max_position_embeddings
    # Scratch after each row's tokens: the verify block writes budget + 1 positions, a commit
    # writes the L + 1 positions of the accepted path (both caches), whichever is larger.
    scratch = max(budget, L) + 1
    if decode.is_auto:  # the held-back drafter context (P positions) is added in one write
        scratch = max(scratch, _held(decode) - 1)
    for i, (p, m) in enumerate(zip(checked, limits, strict=False)):
        if len(p) + m > context:
            raise ValueError(f"prompts[{i}] ({len(p)} tokens) + max_new_tokens ({m}) exceeds the target's context "
                             f"of {context} positions (max_position_embeddings)")
    needs = np.array([len(p) + m + scratch for p, m in zip(checked, limits, strict=True)], np.int32)
    needed = int(needs.max())
    if max_len is not None and needed > max_len:
        raise ValueError(f"budget={budget}: the verify block and commit ({scratch} tokens) do not fit the cache: a "
                         f"prompt + its max_new_tokens + {scratch} = {needed} > max_len={max_len}")
    return _Checked(prompts=checked, max_new_tokens=np.array(limits, np.int32),
                    stop_ids=np.array([stop or [NO_STOP]] * B, np.int32), budget=budget, max_len=max_len or needed,
                    needs=needs)


def _held(decode: DecodeConfig) -> int:
    """``P``: the positions of drafter context each row holds back with ``budget="auto"``."""
    return ar.HELD_DISPATCHES * (_SYNC_EVERY if decode.sync_every in (None, AUTO) else decode.sync_every)


def _on_rows(state, target):
    """``state`` with its rows where the target computes them (``ddtree_jax.rows``: on a mesh, split
    over the row axes that divide the batch), so the rounds' carry keeps one layout."""
    rows = getattr(target, "row_mesh", None)
    return state if rows is None else place_state(state, rows, rows.split(state.batch_size))


def generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    method: str | None = None,
    budget: int | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] = _GREEDY,
    max_new_tokens: int | Sequence[int] = 64,
    stop_tokens: Sequence[int] | None = None,
    seed: int | None = None,
    max_len: int | None = None,
    sync_every: int | None = None,
    profile: bool = False,
    compact: bool = True,
    impl: str | Backend | None = None,
    on_progress: Callable[[np.ndarray, np.ndarray], None] | None = None,
    config: DecodeConfig | None = None,
    page_size: int | None = None,
) -> GenerateOutput:
    """Generates continuations of ``prompts`` with the target's exact sampling law.

    The decode settings come as ``config`` (a ``DecodeConfig``) or as the keywords ``method``,
    ``budget``, ``stop_tokens``, ``seed``, ``sync_every`` and ``impl`` (each ``None``: the
    ``DecodeConfig`` default), not both; a bad value raises ``ConfigError`` naming the field.

    Args:
      target: a target model (``ddtree_jax.models.TargetModel``, e.g. ``KimiForCausalLM``).
      drafter: a drafter (``ddtree_jax.models.DraftModel``, e.g. ``DFlashDrafter``) sharing the
        target's embedding and LM head; ``None`` for ``method="ar"``.
      prompts: one list of token ids per request (different lengths are fine).
      method: ``"ddtree"`` (default: a tree of ``budget`` nodes), ``"dflash"`` (the argmax chain
        of the drafter's block) or ``"ar"`` (autoregressive, one token per target pass).
      budget: DDTree node budget (non-root nodes per tree; default 64), or ``"auto"``: chosen per
        round (``DecodeConfig.budget``; the ``auto_*`` settings need ``config=``).
      sampling: one ``SamplingParams`` for all, or one per request (greedy and sampled mixed).
      max_new_tokens: one limit for all requests, or one per request.
      stop_tokens: ids that end a request (the stop token is returned as its last token);
        ``DecodeConfig.stop_token_ids``.
      seed: the base key (default 0). A request's random stream is ``(seed, request seed or
        index, round)`` (``ddtree_jax.rng``), so a seeded request's output does not depend on the
        batch.
      max_len: cache size per request; default: just what this call needs.
      sync_every: rounds run on the device between host checks for completion (default, or
        ``"auto"``: 8; with ``budget="auto"`` the budget is chosen on the host once per such chunk).
      profile: time each stage separately (see ``GenerateOutput.time_split``).
      compact: re-pack the running requests into a smaller batch once at most half are running
        (with ``budget="auto"`` timing its costs, only where the cost table says the smaller
        batch's rounds save more than a compaction costs: docs/auto-budget.md, "Compaction,
        priced").
      impl: tree builder, sampler and walk: ``"auto"`` (default: Pallas kernels on GPU and TPU,
        plain-JAX references elsewhere), ``"pallas"``, ``"pallas:triton"``,
        ``"pallas:mosaic_tpu"`` (that backend's kernels, interpreted off its platform),
        ``"reference"`` or a resolved ``Backend`` (``ddtree_jax.backend``).
      on_progress: called after each host sync with ``(tokens [B, max_new], generated [B])``.
      config: the decode settings as one ``DecodeConfig`` instead of the keywords above.
      page_size: ``None`` (default): contiguous caches of ``max_len`` positions per request. Else
        paged caches (``ddtree_jax.models.paged_cache``) of pages of ``page_size`` positions, a
        power of two >= 16 (a ``ConfigError`` naming it otherwise), each request's table covering
        what it needs (``max_len`` then only bounds it); prompts that share full pages of a prefix
        share those pages, computed once
        (``RequestOutput.cached_prompt_tokens``). The outputs are the contiguous run's up to
        floating-point rounding (docs/paged-caches.md, "Paged caches in generate"); one device.

    Returns:
      ``GenerateOutput``.

    Acceptance statistics: the prefill covers the whole prompt and draws the first new token
    from its last position (by the request's own law and key: ``rng.first_token_keys``); every
    round is rooted at a generated token, as in the published DFlash and DDTree loops, and no
    round counts the first token. ``mean_tau`` pools every request's rounds; ``mean_tau_published``
    averages per request first, the way the published tables report tau
    (docs/acceptance-statistics.md).
    """
    decode = _decode_config(config, method=method, budget=budget, stop_token_ids=stop_tokens, seed=seed,
                            sync_every=sync_every, impl=impl)
    checked = _check_inputs(target, drafter, prompts, decode, max_new_tokens, max_len)
    check_page_size(page_size, target)
    if decode.is_auto and profile:
        raise ValueError("generate: profile=True times the stages of one fixed budget; not with budget='auto'")
    method = decode.method
    sync_every = _SYNC_EVERY if decode.sync_every in (None, AUTO) else decode.sync_every
    backend = resolve_backend(decode.impl)
    B = len(checked.prompts)
    sampling_batch = batch_sampling(sampling, B)
    uses_drafter = decode.uses_drafter
    plan = DecodePlan(method=method, budget=checked.budget, backend=backend,
                      hidden_layer_ids=tuple(drafter.config.target_layer_ids) if uses_drafter else ())
    models, tparams, dparams = Models.split(target, drafter if uses_drafter else None)
    capacity = int(checked.max_new_tokens.max())

    t0 = time.perf_counter()
    lengths = np.array([len(p) for p in checked.prompts], np.int32)
    padded = np.zeros((B, max(1, int(lengths.max()) - 1)), np.int32)
    for i, p in enumerate(checked.prompts):
        padded[i, : len(p) - 1] = p[:-1]
    roots = np.array([p[-1] for p in checked.prompts], np.int32)
    per_row = dict(capacity=capacity, max_new_tokens=jnp.asarray(checked.max_new_tokens),
                   stop_ids=jnp.asarray(checked.stop_ids), sampling=sampling_batch,
                   request_ids=jnp.arange(B, dtype=jnp.uint32))
    cached = np.zeros((B,), np.int32)
    base_key = jax.random.key(decode.seed)
    if page_size is None:  # (each request's first token drawn from its prompt's last position)
        state = prefill(models, tparams, dparams, plan, jnp.asarray(padded), jnp.asarray(lengths - 1),
                        jnp.asarray(roots), max_len=checked.max_len, first_key=base_key, **per_row)
    else:
        state, cached = paged_prefill(models, tparams, dparams, plan, target, drafter if uses_drafter else None,
                                      checked.prompts, checked.needs, page_size, jnp.asarray(roots),
                                      first_key=base_key, **per_row)
    if decode.is_auto:  # budget 0 runs no drafter code (auto_round.with_deferred)
        state = ar.with_deferred(state, drafter, _held(decode))
    state = _on_rows(state, target)
    jax.block_until_ready(state)
    prefill_seconds = time.perf_counter() - t0

    split = {name: 0.0 for name, _ in STAGES} if profile else None
    # Host copies of each request's results, by request index; slot_request maps slots to
    # requests (-1: a free slot).
    host = dict(out=np.zeros((B, capacity), np.int32), accept_lengths=np.zeros((B, capacity), np.int32),
                generated=np.zeros((B,), np.int32), finish=np.zeros((B,), np.int32), rounds=np.zeros((B,), np.int32))
    slot_request = np.arange(B)
    batch_sizes = [B]
    digest = None  # (budget="auto" timing its costs: the models' digest, the cost table's key)
    if decode.is_auto:
        auto_plan = AutoPlan(budgets=auto_budget_set(decode.auto_max_budget), probe_every=decode.auto_probe_every,
                             draft_len=drafter.config.block_size - 1)
        chooser, costs, plans = AutoChooser(auto_plan, decode.auto_costs is None), {}, round_plans(plan, auto_plan)
        restarts = {}  # (per batch size: a pipeline restart's price, None where unknown)
        observers = {}  # (per batch size: where a restart observed is stored, None where nowhere)
        digest = (auto_costs.models_digest(target, drafter, (tparams, dparams)) if decode.auto_costs is None
                  else None)
        active = B
        # The budget-0 rounds whose drafter context is held back (at most: rows that finished hold
        # fewer), and each slot's rounds as of the last read (the tally of budget-0 rounds is theirs).
        held, last_rounds, P = [0], np.zeros((B,), np.int32), _held(decode)

    def harvest(state):
        got = _host_fields(np.asarray(jax.device_get(_harvested(state))), capacity)
        used = slot_request >= 0
        for k, v in got.items():
            host[k][slot_request[used]] = v[used]

    t0 = time.perf_counter()
    in_rounds = 0.0
    timeline: list[Dispatch] = []
    compactions: list[float] = []
    watches = contextlib.ExitStack()
    # One dispatch ahead: the next dispatch is launched before the current one's results are read
    # back, so that its launch (host work about as long as the rounds of a small model) runs while
    # the device works (on GPUs only from a loop of known trip count: call_form). After a
    # compaction the pipeline starts again. Not with on_progress (it reads each dispatch's rows
    # before the next takes them) or profile.
    ahead = on_progress is None and not profile
    fixed_calls = ahead and _fixed_calls()
    # What the last read says the rows still need: the new tokens each slot's row may still commit
    # (0: done or free), the rows' tokens per round so far, and the rounds launched since.
    # (each row committed its first token in the prefill, or ended there: a stop token, which the
    # first read shows)
    need = dict(rows=checked.max_new_tokens - 1, rate=np.ones(B), pending=0)
    limits = checked.max_new_tokens

    def priced_compaction(running: int, cur, nxt) -> bool:
        """Whether compacting to the ``running`` rows (the next power of two) pays
        (``_compaction_pays``, with the cost table's costs: ``budget="auto"`` without given costs;
        True otherwise), at the budget of the latest choice (``nxt``'s where one is in flight; a
        probing dispatch's rounds are plain ones)."""
        if digest is None:
            return True
        last = nxt if nxt is not None else cur
        k = 0 if last["form"] == "probe" else last.get("k", 0)
        left = float((need["rows"] / need["rate"]).max()) - need["pending"]
        size = 1 << int(running - 1).bit_length()
        return _compaction_pays(auto_costs.default_table(), cost_key(len(slot_request)), cost_key(size), k, left)

    def cost_key(rows: int) -> dict:
        """The cost table's key of this call's rounds at ``rows`` rows (``_cost_key``)."""
        return _cost_key(digest, plans, rows, checked.max_len, sync_every)

    def flush(state):
        """``state`` with the drafter context its rows hold back added (nothing to do where none is)."""
        if held[0]:
            held[0] = 0
            return run_flush(models, tparams, dparams, state)
        return state

    def call_form(n: int) -> str | None:
        """The form of the next call of ``n`` rounds: ``"fixed"`` (a loop of known trip count)
        where some row is expected to need all ``n`` rounds past those in flight, ``"loop"`` (a
        loop that ends once every row is done) where none may; ``None`` where no row can (every
        running row commits at least one token a round). A row's rounds are its tokens left over
        its own tokens per round: the batch runs until its slowest row is done, and a loop (a
        device-side condition each round) costs more per round than a loop of known trip count."""
        left = need["rows"]
        if int(left.max()) - need["pending"] <= 0:
            return None
        expected = float((left / need["rate"]).max()) - need["pending"]
        return "fixed" if fixed_calls and expected >= n else "loop"

    def synchronous(dispatch) -> bool:
        """Whether ``dispatch``'s launch returned only once its rounds (and those before them) ran:
        a loop whose end the device decides (a probing one too), on GPUs (the backends where
        ``call_form`` gives ``"fixed"``: there such a loop's condition goes to the host each round)."""
        return fixed_calls and (dispatch["form"] == "loop" or dispatch.get("looped", False))

    def launch(state):
        """``(state, the dispatch)``: the next rounds dispatched (not waited for); ``(state, None)``
        where no row can need them."""
        t = time.perf_counter()
        dispatch = dict(t=t, tally=None, n=sync_every, budget=checked.budget)
        if profile:
            dispatch.update(form="profile", chosen=t)
            state = _profiled_round(models, tparams, dparams, plan, state, base_key, split)
            dispatch["n"] = 1
        elif decode.is_auto:
            rows = len(slot_request)
            if rows not in costs:  # (only where the pipeline starts: a new batch size)
                state = flush(state)
                scratch = max(auto_plan.budgets[-1], auto_plan.draft_len) + 1
                state, costs[rows], restarts[rows], observers[rows] = _round_costs(
                    decode, digest, models, tparams, dparams, plans, state, base_key, checked.max_len, scratch,
                    sync_every, fixed_calls)
                dispatch["t"] = t = time.perf_counter()  # (a new batch size's costs are host work)
            if call_form(1) is None:  # (before the choice, which counts the dispatches)
                return state, None
            running = need["rows"] > 0  # (a static batch: the choice that ends it soonest)
            paid = chooser.costs(rows, costs[rows])
            k = chooser.choose(active, paid, finish=(slot_request[running], need["rows"][running]),
                               probe_price=chooser.probe_price(rows))
            n, tally = sync_every, None
            fixed = call_form(n) == "fixed"
            # The first probe alone: its statistics choose the next call (not launched ahead): one
            # tallied round at the budget the chooser gives a first probe (the largest)
            alone = chooser.probing and chooser.drafted == 0 and probe_alone(restarts[rows], paid[0], n)
            if alone:
                n, fixed = 1, False
                # (what it costs is observed through the next launch: not where a program compiles)
                dispatch["watch"] = watches.enter_context(CompileWatch())
            dispatch.update(form="alone" if alone else "fixed" if fixed else "loop", chosen=time.perf_counter(),
                            budget=auto_plan.budgets[k])
            if k == 0:  # plain rounds, their context held back (flushed first if it would not fit)
                if held[0] + n > P:
                    state = flush(state)
                state = run_rounds(models, tparams, dparams, plans[0], state, base_key, n, fixed)
                held[0] += n
            elif chooser.probing and not alone:  # the held context added, one drafted round, then plain ones
                dispatch.update(form="probe", looped=not fixed)
                state, tally = ar.run_probe_rounds(models, tparams, dparams, plans[k], plans[0], state, base_key,
                                                   n, fixed)
                held[0] = n - 1
            else:
                state = flush(state)
                if fixed:
                    state, tally = run_fixed_tallied_rounds(models, tparams, dparams, plans[k], state, base_key, n)
                else:
                    state, tally = run_tallied_rounds(models, tparams, dparams, plans[k], state, base_key, n)
            dispatch.update(k=k, n=n, rows=rows, tally=tally, requests=slot_request)
        else:
            form = call_form(sync_every)
            if form is None:
                return state, None
            dispatch.update(form=form, chosen=time.perf_counter())
            state = run_rounds(models, tparams, dparams, plan, state, base_key, sync_every, form == "fixed")
        need["pending"] += dispatch["n"]
        # (its own array: the next dispatch takes `state`; with the tally, one read-back for both;
        # the tally's buffer is not held past its packing)
        dispatch["progress"] = _progress(state, dispatch.pop("tally"))
        dispatch["launch"] = time.perf_counter() - t
        return state, dispatch

    def retire(dispatch, start) -> tuple[np.ndarray, float]:
        """Reads a dispatch back (the one round-trip per dispatch) and, with ``budget="auto"``,
        records its tally, timing it from ``start`` (``None``: untimed); ``(done, when read)``."""
        nonlocal in_rounds
        t = time.perf_counter()
        tally, (done, generated, rounds) = _read_progress(jax.device_get(dispatch["progress"]))
        done = done.astype(bool)
        now = time.perf_counter()
        in_rounds += dispatch["launch"] + now - t
        chose = dispatch["chosen"] - dispatch["t"]
        timeline.append(Dispatch(int(dispatch["budget"]), dispatch["n"], dispatch["form"], dispatch["t"] - t0, chose,
                                 dispatch["launch"] - chose, now - t))
        used = slot_request >= 0
        left = np.where(done | ~used, 0, limits[np.maximum(slot_request, 0)] - generated)
        need.update(rows=left, rate=_row_rates(generated, rounds, used), pending=need["pending"] - dispatch["n"])
        if decode.is_auto:
            ran = rounds - last_rounds  # (a probing dispatch: its probe round, then plain rounds)
            last_rounds[:] = rounds
            # Full dispatches launched ahead time their budget; not the few rounds of the last
            # dispatch (they would carry a whole launch and read-back). A probing one (one drafted
            # round, then plain ones) is launched while the dispatch before it runs, so its host
            # work falls in that one's time: the two together price the probes.
            full = int(ran.max(initial=0)) == dispatch["n"]
            dispatch["timed"] = start is not None and full and not synchronous(dispatch)
            if dispatch["form"] == "probe":
                # (not ahead: launched after the previous read, its own time holds its launch)
                before = dispatch.get("before") if ahead else dict(n=0, start=start, timed=True, form="")
                # (two probes' rounds would price one twice)
                if dispatch["timed"] and before is not None and before["timed"] and before["form"] != "probe":
                    chooser.observe_probe(dispatch["rows"], before["n"] + dispatch["n"], now - before["start"])
            elif dispatch["timed"] and dispatch["form"] != "alone" and not dispatch.get("probed"):
                chooser.observe(dispatch["rows"], dispatch["k"], (now - start) / dispatch["n"])
            if tally is not None:
                chooser.record(dispatch["k"], tally, rows=dispatch["requests"])
            if dispatch["k"] == 0 or dispatch["form"] == "probe":
                plain = plain_tally(ran if tally is None else ran - tally[:, 0], len(auto_plan.budgets))
                chooser.record(0, plain, rows=dispatch["requests"])
        return done, now

    # (the compile watch of a first probe alone is closed here whatever happens: launch() opens it)
    try:
        state, cur = launch(state)  # (None: every request ended with its first token)
        if cur is None:
            harvest(state)
        last_read = None  # when the previous dispatch of the running pipeline was read back
        while cur is not None:
            nxt = None
            if ahead and cur["form"] != "alone":  # (after a probe too: its statistics serve the choice after next)
                state, nxt = launch(state)
            # One dispatch ahead, a dispatch costs the time between its read-back and the previous
            # one's (its launch hidden); one launched after the previous read is not timed, nor one
            # whose read-backs hold a synchronous launch (its own ran before the first read, the next's
            # rounds before the second).
            start = last_read if ahead else cur["t"]
            if nxt is not None and nxt["form"] == "probe":  # (cur's time holds the probe's launch)
                cur.update(start=start, probed=True)
                nxt["before"] = cur
            done, now = retire(cur, None if nxt is not None and synchronous(nxt) else start)
            last_read = None if nxt is None else now
            active = int((~done).sum())
            if on_progress is not None or done.all():
                harvest(state)  # (one dispatch ahead, the rounds ahead changed no finished row)
                if on_progress is not None:
                    on_progress(host["out"].copy(), host["generated"].copy())
            if done.all():
                break
            running = np.flatnonzero(~done)
            compacted = None  # (the read-back the compaction started from)
            if compact and len(running) <= len(slot_request) // 2 and priced_compaction(len(running), cur, nxt):
                compacted = now
                if digest is not None:  # (its cost is observed through the next launch; not where a program compiles)
                    compaction_watch = watches.enter_context(CompileWatch())
                if nxt is not None:  # the dispatch ahead ran on these rows: its results first (untimed)
                    done, compacted = retire(nxt, None)
                    nxt, active = None, int((~done).sum())
                    if done.all():
                        harvest(state)
                        break
                    running = np.flatnonzero(~done)
                if on_progress is None:
                    harvest(state)
                size = 1 << int(len(running) - 1).bit_length()
                take = np.concatenate([running, np.full(size - len(running), running[0])])
                pad = np.arange(size) >= len(running)
                state = _on_rows(_compacted(state, jnp.asarray(take), jnp.asarray(pad), page_size is not None), target)
                slot_request = np.where(pad, -1, slot_request[take])
                need["rows"], need["rate"] = np.where(pad, 0, need["rows"][take]), need["rate"][take]
                batch_sizes.append(size)
                if decode.is_auto:  # the compaction is host time, not the next dispatch's (whose time prices a budget)
                    last_rounds = last_rounds[take]
                    jax.block_until_ready(state)
                last_read = None
            if nxt is None:
                state, nxt = launch(state)
                if compacted is not None and nxt is not None:
                    compactions.append(nxt["t"] - compacted)
                    if digest is not None and not compaction_watch.seconds:  # (from batch_sizes[-2] rows)
                        auto_costs.default_table().observe_compaction(cost_key(batch_sizes[-2]), compactions[-1])
                watch = cur.get("watch")
                if watch is not None and not watch.seconds and nxt is not None and nxt["rows"] == cur["rows"] \
                        and observers[cur["rows"]] is not None:
                    # What running alone cost: from the probe's launch to the end of the next launch
                    # (its choice included), less the probe round's table cost; not where a program
                    # was traced or compiled meanwhile.
                    observers[cur["rows"]](nxt["t"] + nxt["launch"] - cur["chosen"] - costs[cur["rows"]][cur["k"]])
            cur = nxt
    finally:
        watches.close()
    seconds = time.perf_counter() - t0

    requests = [
        RequestOutput(
            tokens=host["out"][b, : host["generated"][b]].tolist(),
            finish_reason=FINISH_REASONS[int(host["finish"][b])],
            acceptance_lengths=host["accept_lengths"][b, : host["rounds"][b]].tolist(),
            cached_prompt_tokens=int(cached[b]),
        )
        for b in range(B)
    ]
    return GenerateOutput(
        requests=requests, method=method, budget=checked.budget, rounds=int(host["rounds"].max()), seconds=seconds,
        prefill_seconds=prefill_seconds, time_split=split, batch_sizes=batch_sizes,
        auto=AutoReport.of(chooser, costs, restarts) if decode.is_auto else None, round_seconds=in_rounds,
        dispatches=tuple(timeline), compaction_seconds=tuple(compactions),
    )


RATE_PRIOR = 4.0
"""``_row_rates``: the rounds of the batch's rate each row's own rate starts from."""


def _row_rates(generated: np.ndarray, rounds: np.ndarray, used: np.ndarray) -> np.ndarray:
    """f64 ``[B]``: each slot's tokens committed per round, its own count (past the prefill's
    first token) with ``RATE_PRIOR`` rounds of the used slots' together, at least 1 (every round
    commits a token)."""
    made, ran = np.maximum(generated - 1, 0).astype(np.float64), rounds.astype(np.float64)
    batch = max(1.0, made[used].sum() / max(1.0, ran[used].sum()))
    return np.maximum(1.0, (made + RATE_PRIOR * batch) / (ran + RATE_PRIOR))


@functools.partial(jax.jit, static_argnames=("paged",))
def _compacted(state: DecodeState, take: jax.Array, pad: jax.Array, paged: bool) -> DecodeState:
    """A compaction in one compiled call: ``state``'s rows ``take [B']``, where the padding rows
    ``pad [B']`` (bool: they repeat a running request's rows) are free, so they commit nothing,
    and, ``paged``, hold no pages (they would write the pages of the row they repeat)."""
    state = state.take_rows(take)
    state = dataclasses.replace(state, finish=jnp.where(pad, FREE, state.finish))
    return without_pages(state, pad) if paged else state


@jax.jit
def _harvested(state: DecodeState) -> jax.Array:
    """i32 ``[B, 2C + 3]``: the rows' outputs, acceptance lengths, tokens generated, finish codes
    and rounds run side by side, read back in one transfer (``_host_fields`` splits them)."""
    return jnp.concatenate([state.out, state.accept_lengths,
                            jnp.stack([state.generated, state.finish, state.rounds], axis=1)], axis=1)


def _host_fields(packed: np.ndarray, capacity: int) -> dict[str, np.ndarray]:
    """``_harvested``'s columns by field (views of ``packed``)."""
    C = capacity
    return dict(out=packed[:, :C], accept_lengths=packed[:, C : 2 * C], generated=packed[:, 2 * C],
                finish=packed[:, 2 * C + 1], rounds=packed[:, 2 * C + 2])


@jax.jit
def _progress(state: DecodeState, tally: jax.Array | None = None) -> jax.Array:
    """i32 ``[3 + W, B]``: the rows' done flags, tokens generated and rounds run, then the bits of
    a dispatch's ``tally`` (f32 ``[B, W]``, ``auto_round``) if given: one read-back for both
    (``_read_progress`` splits them)."""
    parts = [state.done.astype(jnp.int32)[None], state.generated[None], state.rounds[None]]
    if tally is not None:
        parts.append(jax.lax.bitcast_convert_type(tally.astype(jnp.float32), jnp.int32).T)
    return jnp.concatenate(parts, axis=0)


def _read_progress(got) -> tuple[np.ndarray | None, np.ndarray]:
    """``(tally f32 [B, W] or None, [done, generated, rounds] i32 [3, B])`` of a read-back of
    ``_progress``."""
    got = np.asarray(got)
    return (got[3:].T.view(np.float32) if got.shape[0] > 3 else None), got[:3]


def _round_costs(decode: DecodeConfig, digest: str | None, models, tparams, dparams, plans, state: DecodeState,
                 base_key, max_len: int, scratch: int, sync_every: int, fixed: bool):
    """``(state, costs, restart, observe)``: seconds per round at each budget at ``state``'s batch
    size, a pipeline restart's price (``auto_budget.restart_price``) and where to store a restart
    the run observes (``CostTable.observe_restart`` for the key; ``None``: nowhere), from
    ``decode.auto_costs`` and ``decode.auto_restart`` (a measured restart) if given, else from
    the cost table (``auto_costs.default_table``;
    ``digest``: the models' ``auto_costs.models_digest``), timed there if it has none: the
    compiled rounds of each of ``plans`` (``sync_every`` per call, in a loop of known trip count
    with ``fixed``: the calls ``generate`` runs, budget 0's without a tally) on ``state``'s own rows,
    running, their stop ids cleared and their limits raised to what their output buffer and cache
    hold (``scratch``: the positions a round needs past a row's tokens), put back before every
    call and after (a round writes the caches only past each row's length, so restoring the rows'
    small fields and cache lengths restores the state)."""
    if decode.auto_costs is not None:
        return state, decode.auto_costs, restart_price(decode.auto_restart, None), None
    key = _cost_key(digest, plans, state.batch_size, max_len, sync_every)
    table = auto_costs.default_table()
    known, restart = table.get(key), table.restart(key)
    observe = functools.partial(table.observe_restart, key)
    if known is not None and restart is not None:  # (no copies of the rows' fields: a lookup costs nothing)
        return state, known, restart_price(restart, table.observed_restart(key)), observe
    if state.deferred is not None:  # the timed rounds reuse the held-back buffer: empty it first
        state = run_flush(models, tparams, dparams, state)
    saved = _row_fields(state)
    room = state.generated + max_len - scratch - 1 - state.target_cache.lengths
    timing = dict(saved, stop_ids=jnp.full_like(state.stop_ids, NO_STOP),
                  max_new_tokens=jnp.clip(room, 1, state.capacity).astype(jnp.int32))
    work = [state]

    def run(k):  # (the programs generate runs: budget 0 plain rounds, holding their context back)
        if k == 0:
            work[0] = run_rounds(models, tparams, dparams, plans[0], work[0], base_key, sync_every, fixed)
            return work[0].rounds
        rounds = run_fixed_tallied_rounds if fixed else run_tallied_rounds
        work[0], tally = rounds(models, tparams, dparams, plans[k], work[0], base_key, sync_every)
        return tally

    def before():
        work[0] = _put_row_fields(work[0], timing)
        return work[0]

    costs = table.get_or_measure(key, run, per_call=sync_every, before=before, restart=True)
    price = restart_price(table.restart(key), table.observed_restart(key))
    return _put_row_fields(work[0], saved), costs, price, observe


def _cost_key(digest: str, plans, rows: int, max_len: int, sync_every: int) -> dict:
    """The cost table's key (``auto_costs.cost_key``) of ``generate``'s rounds at ``rows`` rows."""
    return auto_costs.cost_key(digest, backend=plans[-1].backend, rows=rows, cache_len=max_len,
                               per_call=sync_every, budgets=plans[-1].expected_budgets)


def _compaction_pays(table: auto_costs.CostTable, key: dict, smaller: dict, k: int, rounds_left: float) -> bool:
    """Whether compacting a batch of ``key``'s rows to ``smaller``'s pays by what ``table`` knows:
    the rounds left (of the slowest running row, ``rounds_left``) times what a round at budget
    index ``k`` saves at the smaller batch (the two batches' table costs) against what compacting
    from ``key``'s rows cost the host when a run last did it (``observed_compaction``: the
    harvest and the gather, to the next launch) plus the smaller batch's pipeline restart (the
    next launch is not hidden; ``measure_restart``'s, 0 where unknown). True where the table
    does not know the compaction's cost or the smaller batch's costs: the compaction then runs,
    and measures them."""
    price, now, then = table.observed_compaction(key), table.get(key), table.get(smaller)
    if price is None or now is None or then is None:
        return True
    return rounds_left * (now[k] - then[k]) > price + (table.restart(smaller) or 0.0)


_ROW_FIELDS = ("root", "out", "generated", "finish", "accept_lengths", "rounds", "max_new_tokens", "stop_ids")


@jax.jit
def _row_fields(state: DecodeState) -> dict:
    """Copies of what a round changes besides the caches' contents: the rows' fields, the
    caches' lengths and the held-back context's counts."""
    fields = {f: jnp.copy(getattr(state, f)) for f in _ROW_FIELDS}
    fields["target_lengths"] = jnp.copy(state.target_cache.lengths)
    if state.draft_cache is not None:
        fields["draft_lengths"] = jnp.copy(state.draft_cache.lengths)
    if state.deferred is not None:
        fields["deferred_count"] = jnp.copy(state.deferred.count)
    return fields


@functools.partial(jax.jit, donate_argnames=("state",))
def _put_row_fields(state: DecodeState, fields: dict) -> DecodeState:
    """``state`` with copies of ``_row_fields``' fields put back (copies: ``state`` is donated
    later, ``fields`` is used again)."""
    fields = {f: jnp.copy(x) for f, x in fields.items()}
    new = dataclasses.replace(state, **{f: fields[f] for f in _ROW_FIELDS},
                              target_cache=dataclasses.replace(state.target_cache, lengths=fields["target_lengths"]))
    if state.draft_cache is not None:
        new = dataclasses.replace(new, draft_cache=dataclasses.replace(state.draft_cache,
                                                                       lengths=fields["draft_lengths"]))
    if state.deferred is not None:
        new = dataclasses.replace(new, deferred=dataclasses.replace(state.deferred, count=fields["deferred_count"]))
    return new


def _profiled_round(models, tparams, dparams, plan, state, base_key, split):
    """One round, stage by stage (``run_stage``), each timed to completion (for the time split only)."""
    work = {}
    for name, _ in STAGES:
        t = time.perf_counter()
        work = jax.block_until_ready(run_stage(name, models, tparams, dparams, plan, state, base_key, work))
        split[name] += time.perf_counter() - t
    return work["state"]
