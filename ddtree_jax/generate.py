"""End-to-end speculative decoding: autoregressive, linear DFlash and DDTree, exact and batched.

One round, for every request of the batch at once (fixed shapes):

    draft the block (DFlash drafter, one pass)       -> draft logits [B, L, V]
    build the tree (DDTree) or the chain (DFlash)    -> DraftTree with M = budget + 1 slots
    verify the tree with the target (one pass)       -> target logits at every node [B, M, V]
    sample every node with the request's own rule    -> [B, M] tokens
    walk the tree, commit both caches                -> 1 .. L + 1 new tokens per request

Cache convention: after a round each request has committed ``n`` tokens; the target cache
holds the first ``n - 1`` of them and the last one (the "root") opens the next block, at
position ``n - 1``. The drafter's context holds the target's hidden states of the same
``n - 1`` tokens. Autoregressive decoding is the same round with a root-only tree.

Host round-trips: rounds run inside one ``lax.while_loop`` on the device, ``sync_every`` at a
time; the host reads back only the ``done`` flags (one ``[B]`` bool transfer) after each
batch of rounds, to stop when every request has finished and to report progress. With
``profile=True`` each stage is a separate compiled call timed on the host (slower; it exists
to measure the time split).

Finished requests stop costing work where the shapes allow: inside a batch of rounds they ride
along (fixed shapes), but at a host sync where at most half the rows are still running, the
running ones are gathered into the next smaller power-of-two batch (caches included) and the
rounds continue on that; each batch size compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.sampling import INVALID_TOKEN, SamplingBatch, SamplingParams, batch_sampling, per_row_keys, sample_tree_nodes
from ddtree_jax.tree import DraftTree, build_draft_tree, chain_draft_tree
from ddtree_jax.verify import accept_path
from pallas_kernels._dispatch import resolve_impl

__all__ = ["GenerateOutput", "RequestOutput", "generate"]

METHODS = ("ddtree", "dflash", "ar")
_RUNNING, _STOP, _LENGTH, _ERROR = 0, 1, 2, 3
_FINISH_REASONS = {_STOP: "stop", _LENGTH: "length", _ERROR: "error: the target produced non-finite logits"}
STAGES = ("draft", "tree", "verify", "sample", "commit")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One request's result.

    Attributes:
      tokens: generated token ids (prompt excluded), at most ``max_new_tokens``; ends with the
        stop token when ``finish_reason == "stop"``.
      finish_reason: ``"stop"``, ``"length"`` or ``"error: ..."``.
      acceptance_lengths: tokens the target accepted per round, bonus included (1 .. L + 1),
        before truncation at a stop token or the length limit.
    """

    tokens: list[int]
    finish_reason: str
    acceptance_lengths: list[int]

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length per round, bonus token included."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Result of ``generate``.

    Attributes:
      requests: one ``RequestOutput`` per prompt, in order.
      method, budget: what ran (budget: non-root tree nodes; L for dflash, 0 for ar).
      rounds: rounds the batch ran (the longest request's count).
      seconds: wall time of the decoding rounds (prefill excluded; compilation excluded after
        the first call with the same shapes).
      prefill_seconds: wall time of the prompt prefill.
      time_split: seconds per stage (draft, tree, verify, sample, commit) with ``profile=True``,
        else ``None``.
      batch_sizes: the batch sizes the rounds ran at, in order (compaction shrinks it).
    """

    requests: list[RequestOutput]
    method: str
    budget: int
    rounds: int
    seconds: float
    prefill_seconds: float
    time_split: dict[str, float] | None
    batch_sizes: list[int]

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.requests]

    @property
    def mean_tau(self) -> float:
        """Mean acceptance length over all rounds of all requests."""
        lengths = [a for r in self.requests for a in r.acceptance_lengths]
        return float(np.mean(lengths)) if lengths else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def root_only_tree(batch: int) -> DraftTree:
    """The tree of autoregressive decoding: just the root (one verify token per request)."""
    neg1 = jnp.full((batch, 1), -1, jnp.int32)
    return DraftTree(
        tokens=neg1, parents=neg1, depth=jnp.zeros((batch, 1), jnp.int32), score=jnp.zeros((batch, 1), jnp.float32),
        first_child=neg1, next_sibling=neg1, valid=jnp.ones((batch, 1), bool),
        ancestor_mask=jnp.ones((batch, 1, 1), bool), draft_len=0,
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static settings of one generate call (hashable: part of the compiled functions' keys)."""

    method: str
    budget: int  # non-root nodes per tree
    max_new_tokens: int
    hidden_layer_ids: tuple[int, ...]
    impl: str  # kernels or references for tree, sampling and walk ("auto" | "pallas" | "reference")


def _validate(target, drafter, prompts, method, budget, sampling, max_new_tokens, stop_tokens, max_len):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = target.config
    V = cfg.vocab_size
    if isinstance(prompts, np.ndarray) or not isinstance(prompts, Sequence) or not prompts:
        if not (isinstance(prompts, np.ndarray) and prompts.ndim == 2 and prompts.shape[0] > 0):
            raise ValueError("prompts must be a non-empty list of token-id lists (or a 2-D integer array)")
    rows = []
    for i, p in enumerate(prompts):
        p = np.asarray(p)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {p.shape}")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got {p.dtype}")
        bad = p[(p < 0) | (p >= V)]
        if bad.size:
            raise ValueError(f"prompts[{i}] has token id {int(bad[0])} outside the vocabulary [0, {V})")
        rows.append(p.astype(np.int32))
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stop = tuple(int(s) for s in stop_tokens)
    for s in stop:
        if not 0 <= s < V:
            raise ValueError(f"stop_tokens: {s} is outside the vocabulary [0, {V})")
    if method != "ar":
        if drafter is None:
            raise ValueError(f"method={method!r} needs a drafter")
        L = drafter.config.block_size - 1
    else:
        L = 0
    if method == "ddtree":
        if not _is_int(budget) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    else:
        budget = L
    longest = max(len(p) for p in rows)
    context = cfg.max_position_embeddings
    if longest + max_new_tokens > context:
        i = int(np.argmax([len(p) for p in rows]))
        raise ValueError(
            f"prompts[{i}] ({len(rows[i])} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context "
            f"of {context} positions (max_position_embeddings)"
        )
    # The cache must hold the longest prompt, the new tokens, and one verify block of scratch.
    needed = longest + max_new_tokens + budget + 1
    if max_len is not None and needed > max_len:
        raise ValueError(
            f"budget={budget}: the verify block ({budget + 1} tokens) does not fit the cache: the longest prompt "
            f"({longest}) + max_new_tokens ({max_new_tokens}) + {budget + 1} = {needed} > max_len={max_len}"
        )
    sb = batch_sampling(sampling, len(rows))
    return rows, sb, stop, L, budget, max_len or needed


def generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    method: str = "ddtree",
    budget: int = 64,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(temperature=0.0),
    max_new_tokens: int = 64,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    max_len: int | None = None,
    sync_every: int = 8,
    profile: bool = False,
    compact: bool = True,
    impl: str = "auto",
    on_progress: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> GenerateOutput:
    """Generates continuations of ``prompts`` with the target's exact sampling law.

    Args:
      target: a ``KimiForCausalLM`` (anything with its ``prefill/verify/commit`` interface).
      drafter: a ``DFlashDrafter`` sharing the target's embedding and LM head; ``None`` for
        ``method="ar"``.
      prompts: one list of token ids per request (different lengths are fine).
      method: ``"ddtree"`` (tree of ``budget`` nodes), ``"dflash"`` (the argmax chain of the
        drafter's block) or ``"ar"`` (autoregressive, one token per target pass).
      budget: DDTree node budget (non-root nodes per tree).
      sampling: one ``SamplingParams`` for all, or one per request (greedy and sampled mixed).
      max_new_tokens: per request.
      stop_tokens: ids that end a request (the stop token is returned as its last token).
      seed: the base key. A request's random stream is ``(seed, request seed or row, round)``,
        so a seeded request's output does not depend on what else is in the batch.
      max_len: cache size per request; default: just what this call needs.
      sync_every: rounds run on the device between host checks for completion.
      profile: time each stage separately (see ``GenerateOutput.time_split``).
      compact: re-pack the running requests into a smaller batch once at most half are running.
      impl: tree builder, sampler and walk: ``"auto"`` (Pallas kernels on GPU, plain-JAX
        references elsewhere), ``"pallas"`` or ``"reference"``.
      on_progress: called after each host sync with ``(tokens [B, max_new], generated [B])``.

    Returns:
      ``GenerateOutput``.
    """
    rows, sb, stop, L, budget, max_len = _validate(target, drafter, prompts, method, budget, sampling, max_new_tokens, stop_tokens, max_len)
    resolve_impl(impl)  # validates `impl` before anything compiles
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if not _is_int(sync_every) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    plan = _Plan(
        method=method, budget=budget, max_new_tokens=int(max_new_tokens), impl=impl,
        hidden_layer_ids=tuple(drafter.config.target_layer_ids) if drafter is not None and method != "ar" else (),
    )
    B = len(rows)
    tgraph, tparams = nnx.split(target)
    dgraph, dparams = nnx.split(drafter) if plan.hidden_layer_ids else (None, None)

    t0 = time.perf_counter()
    lengths = np.array([len(p) for p in rows], np.int32)
    padded = np.zeros((B, max(1, int(lengths.max()) - 1)), np.int32)
    for i, p in enumerate(rows):
        padded[i, : len(p) - 1] = p[:-1]
    roots = np.array([p[-1] for p in rows], np.int32)
    state = _prefill(tgraph, tparams, dgraph, dparams, plan.hidden_layer_ids, plan.max_new_tokens, jnp.asarray(padded), jnp.asarray(lengths - 1), jnp.asarray(roots), max_len)
    # Stop ids as data (padded with -2, which matches nothing), so new stop sets do not recompile.
    stop_ids = jnp.asarray(np.array(stop or (-2,), np.int32))
    jax.block_until_ready(state)
    prefill_seconds = time.perf_counter() - t0

    base_key = jax.random.key(seed)
    split = dict.fromkeys(STAGES, 0.0) if profile else None
    # Host copies of each request's results, by original request index; `rows` maps batch rows
    # to requests (-1: a padding row, kept finished).
    host = {k: np.zeros((B, plan.max_new_tokens), np.int32) for k in ("out", "accept_hist")}
    host.update({k: np.zeros((B,), np.int32) for k in ("gen", "finish", "nrounds")})
    rows = np.arange(B)
    request_ids = jnp.arange(B, dtype=jnp.uint32)
    batch_sizes = [B]

    def harvest(state):
        got = jax.device_get({k: state[k] for k in host})
        live = rows >= 0
        for k, v in got.items():
            host[k][rows[live]] = v[live]

    t0 = time.perf_counter()
    while True:
        if profile:
            state = _profiled_round(tgraph, tparams, dgraph, dparams, plan, state, sb, base_key, request_ids, stop_ids, split)
        else:
            state = _run_rounds(tgraph, tparams, dgraph, dparams, plan, state, sb, base_key, request_ids, stop_ids, sync_every)
        done = np.asarray(state["done"])  # the one host round-trip per `sync_every` rounds
        if on_progress is not None or done.all():
            harvest(state)
            if on_progress is not None:
                on_progress(host["out"].copy(), host["gen"].copy())
        if done.all():
            break
        running = np.flatnonzero(~done)
        if compact and len(running) <= len(rows) // 2:
            if on_progress is None:
                harvest(state)
            size = 1 << int(len(running) - 1).bit_length()
            take = np.concatenate([running, np.full(size - len(running), running[0])])
            pad = np.arange(size) >= len(running)
            state, sb, request_ids = _take_rows(state, sb, request_ids, jnp.asarray(take))
            # Padding rows repeat a running request but are finished: they emit nothing.
            state["finish"] = jnp.where(jnp.asarray(pad), _STOP, state["finish"])
            state["done"] = state["finish"] != _RUNNING
            rows = np.where(pad, -1, rows[take])
            batch_sizes.append(size)
    seconds = time.perf_counter() - t0

    requests = [
        RequestOutput(
            tokens=host["out"][b, : host["gen"][b]].tolist(),
            finish_reason=_FINISH_REASONS[int(host["finish"][b])],
            acceptance_lengths=host["accept_hist"][b, : host["nrounds"][b]].tolist(),
        )
        for b in range(B)
    ]
    return GenerateOutput(
        requests=requests, method=method, budget=budget, rounds=int(host["nrounds"].max()), seconds=seconds,
        prefill_seconds=prefill_seconds, time_split=split, batch_sizes=batch_sizes,
    )


# ---------------------------------------------------------------------------------------------
# Compiled pieces. Models travel as (graphdef, params) so the functions are pure.


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "hidden_layer_ids", "max_new_tokens", "max_len"))
def _prefill(tgraph, tparams, dgraph, dparams, hidden_layer_ids, max_new_tokens: int, padded, lengths, roots, max_len: int):
    target = nnx.merge(tgraph, tparams)
    B = padded.shape[0]
    tcache = target.init_cache(B, max_len)
    _, hidden, tcache = target.prefill(padded, lengths, tcache, hidden_layer_ids=hidden_layer_ids)
    state = dict(
        tcache=tcache,
        root=roots,
        out=jnp.zeros((B, max_new_tokens), jnp.int32),
        gen=jnp.zeros((B,), jnp.int32),
        done=jnp.zeros((B,), bool),
        finish=jnp.zeros((B,), jnp.int32),
        accept_hist=jnp.zeros((B, max_new_tokens), jnp.int32),
        nrounds=jnp.zeros((B,), jnp.int32),
    )
    if hidden_layer_ids:
        drafter = nnx.merge(dgraph, dparams)
        dcache = drafter.init_cache(B, max_len)
        state["dcache"] = drafter.append_context(dcache, jnp.concatenate(hidden, axis=-1), lengths)
    return state


def _draft(tgraph, tparams, dgraph, dparams, plan, state):
    target, drafter = nnx.merge(tgraph, tparams), nnx.merge(dgraph, dparams)
    return drafter.propose(target, state["dcache"], state["root"])


def _tree(plan: _Plan, draft_logits, root):
    B = root.shape[0]
    if plan.method == "ar":
        tree = root_only_tree(B)
    elif plan.method == "dflash":
        tree = chain_draft_tree(draft_logits)
    else:
        tree = build_draft_tree(draft_logits, plan.budget, impl=plan.impl)
    return tree.with_root_tokens(root)


def _verify(tgraph, tparams, plan: _Plan, state, tree: DraftTree):
    target = nnx.merge(tgraph, tparams)
    tokens = jnp.where(tree.valid, tree.tokens, 0)  # unused slots: any in-vocabulary id, never accepted
    logits, hidden, tcache = target.verify(tokens, tree.depth, tree.ancestor_mask, state["tcache"], hidden_layer_ids=plan.hidden_layer_ids)
    feats = jnp.concatenate(hidden, axis=-1) if hidden else None
    return logits, feats, tcache


def _round_keys(base_key, sb: SamplingBatch, request_ids, nrounds):
    """Per-request keys of this round: (seed, request seed or request index, the request's own round)."""
    return jax.vmap(jax.random.fold_in)(per_row_keys(base_key, sb, request_ids), nrounds)


@jax.jit
def _take_rows(state, sb: SamplingBatch, request_ids, rows):
    """Gathers batch rows of the decoding state. Caches (``tcache``, ``dcache``) are layer-major:
    their arrays of rank >= 2 carry the batch on axis 1 (``[layers, B, ...]``), their ``[B]``
    vectors on axis 0; every other field has the batch on axis 0."""
    def cache_rows(a):
        return jnp.take(a, rows, axis=1 if a.ndim >= 2 else 0)

    state = {k: jax.tree.map(cache_rows if k in ("tcache", "dcache") else (lambda a: jnp.take(a, rows, axis=0)), v)
             for k, v in state.items()}
    return state, jax.tree.map(lambda a: jnp.take(a, rows, axis=0), sb), jnp.take(request_ids, rows, axis=0)


def _sample(plan: _Plan, logits, sb: SamplingBatch, keys):
    return sample_tree_nodes(logits, sb, keys, impl=plan.impl)


def _commit(tgraph, tparams, dgraph, dparams, plan: _Plan, state, tree: DraftTree, samples, feats, tcache, stop_ids):
    res = accept_path(tree, samples, impl=plan.impl)
    B, A = res.committed.shape
    idx = jnp.arange(A)[None]
    n = res.num_accepted + 1
    active = ~state["done"]
    invalid = res.bonus == INVALID_TOKEN
    # Truncate at the first stop token (kept) and at max_new_tokens; nothing after a stop.
    is_stop = jnp.isin(res.committed, stop_ids) & (idx < n[:, None])
    stop_at = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, A + 1)
    c = jnp.minimum(jnp.minimum(n, stop_at), plan.max_new_tokens - state["gen"])
    c = jnp.where(active & ~invalid, c, 0).astype(jnp.int32)

    rows = jnp.arange(B)[:, None]
    pos = jnp.where(idx < c[:, None], state["gen"][:, None] + idx, plan.max_new_tokens)
    out = state["out"].at[rows, pos].set(res.committed, mode="drop")
    gen = state["gen"] + c
    last = jnp.take_along_axis(res.committed, jnp.maximum(c - 1, 0)[:, None], axis=1)[:, 0]
    root = jnp.where(c > 0, last, state["root"])

    finish = jnp.where(active & invalid, _ERROR, state["finish"])
    finish = jnp.where(active & ~invalid & (stop_at <= c), _STOP, finish)
    finish = jnp.where(active & (finish == _RUNNING) & (gen >= plan.max_new_tokens), _LENGTH, finish)
    hist = state["accept_hist"].at[jnp.arange(B), jnp.where(active, state["nrounds"], plan.max_new_tokens)].set(n, mode="drop")

    new = dict(
        state,
        tcache=nnx.merge(tgraph, tparams).commit(tcache, res.path, c),
        root=root, out=out, gen=gen, finish=finish, done=finish != _RUNNING,
        accept_hist=hist, nrounds=state["nrounds"] + active,
    )
    if plan.hidden_layer_ids:
        drafter = nnx.merge(dgraph, dparams)
        path_feats = jnp.take_along_axis(feats, jnp.maximum(res.path, 0)[..., None], axis=1)
        new["dcache"] = drafter.append_context(state["dcache"], path_feats, c)
    return new


def _round(tgraph, tparams, dgraph, dparams, plan, state, sb, base_key, request_ids, stop_ids):
    draft_logits = _draft(tgraph, tparams, dgraph, dparams, plan, state) if plan.method != "ar" else None
    tree = _tree(plan, draft_logits, state["root"])
    logits, feats, tcache = _verify(tgraph, tparams, plan, state, tree)
    samples = _sample(plan, logits, sb, _round_keys(base_key, sb, request_ids, state["nrounds"]))
    return _commit(tgraph, tparams, dgraph, dparams, plan, state, tree, samples, feats, tcache, stop_ids)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "plan", "max_rounds"), donate_argnames=("state",))
def _run_rounds(tgraph, tparams, dgraph, dparams, plan, state, sb, base_key, request_ids, stop_ids, max_rounds: int):
    """Up to ``max_rounds`` rounds on the device, stopping early once every request is done."""

    def cond(carry):
        i, st = carry
        return (i < max_rounds) & ~jnp.all(st["done"])

    def body(carry):
        i, st = carry
        return i + 1, _round(tgraph, tparams, dgraph, dparams, plan, st, sb, base_key, request_ids, stop_ids)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


_draft_jit = jax.jit(_draft, static_argnames=("tgraph", "dgraph", "plan"))
_tree_jit = jax.jit(_tree, static_argnames=("plan",))
_verify_jit = jax.jit(_verify, static_argnames=("tgraph", "plan"))
_sample_jit = jax.jit(_sample, static_argnames=("plan",))
_commit_jit = jax.jit(_commit, static_argnames=("tgraph", "dgraph", "plan"))


def _profiled_round(tgraph, tparams, dgraph, dparams, plan, state, sb, base_key, request_ids, stop_ids, split):
    """One round, stage by stage, each timed to completion (for the time split only)."""

    def timed(stage, fn, *args):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        split[stage] += time.perf_counter() - t
        return out

    draft_logits = timed("draft", _draft_jit, tgraph, tparams, dgraph, dparams, plan, state) if plan.method != "ar" else None
    tree = timed("tree", _tree_jit, plan, draft_logits, state["root"])
    logits, feats, tcache = timed("verify", _verify_jit, tgraph, tparams, plan, state, tree)
    samples = timed("sample", _sample_jit, plan, logits, sb, _round_keys(base_key, sb, request_ids, state["nrounds"]))
    return timed("commit", _commit_jit, tgraph, tparams, dgraph, dparams, plan, state, tree, samples, feats, tcache, stop_ids)
