"""The compiled decoding round: draft, tree, verify, sample, commit — for every slot at once.

    draft   the drafter proposes a block                 -> draft logits [B, L, V] (DDTree: only
            the min(L, budget) depths its tree can reach)
    tree    DDTree's best tree, the DFlash chain, or AR's root-only tree (M = budget + 1 slots)
    verify  the target's forward pass over the tree      -> logits at every node [B, M, V]
    sample  every node draws from its request's own rule -> [B, M] tokens
    commit  the accept walk, then both caches and the outputs advance (1 .. L + 1 tokens)

Cache convention: after a round a request has committed ``n`` tokens; the target cache holds the
first ``n - 1`` of them and the last one (the "root") opens the next block, at position ``n - 1``.
The drafter's context holds the target's hidden states of the same ``n - 1`` tokens, but for
those an autoregressive round holds back in ``DecodeState.deferred`` (``budget="auto"``).
Autoregressive decoding is the same round with a root-only tree.

With ``DecodePlan.logprobs = K > 0`` the commit stage also reports, for every committed token, its
log-probability and the ``K`` most probable tokens of the row it was drawn from
(``token_logprobs``; the law it reports is stated there and in docs/serving.md);
``round_with_logprobs`` returns them beside the next state.

The round is ``STAGES`` applied in order; ``run_rounds`` runs whole rounds inside one
``lax.while_loop``, and ``run_stage`` compiles one stage alone (to time the split). Models travel
as ``(graphdef, params)`` pairs so that the compiled functions are pure.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.accept import _accept_path
from ddtree_jax.auto_budget import expected_tokens
from ddtree_jax.backend import Backend
from ddtree_jax.decode_state import DecodeState
from ddtree_jax.rng import first_token_keys, round_keys
from ddtree_jax.rows import RowMesh, on_own_rows, per_rows
from ddtree_jax.sampling import (
    INVALID_TOKEN,
    SamplingBatch,
    _sample_tree_nodes,
    canonical_temperature,
    target_logprobs,
)
from ddtree_jax.tree import _build_draft_tree, chain_draft_tree, root_only_tree

__all__ = ["STAGES", "DecodePlan", "first_tokens", "prefill", "prefill_rows", "realized_tokens", "round_with_expected",
           "round_with_logprobs", "run_rounds", "run_stage", "token_logprobs"]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static settings of a decoding run (hashable: part of the compiled functions' keys).

    Attributes:
      method: "ddtree", "dflash" or "ar".
      budget: non-root tree nodes (L for dflash, 0 for ar).
      hidden_layer_ids: target layers whose outputs feed the drafter (empty for ar).
      backend: kernels or references for the tree, sampling and walk (resolved once).
      logprobs: top alternatives reported per committed token (``token_logprobs``); 0: no
        log-probabilities are computed at all.
      expected_budgets: ``budget="auto"``'s budget set, or empty. Non-empty, a DDTree round drafts
        the depths its own budget reaches, as a fixed budget's does, builds the tree of the set's
        largest budget on them, verifies that tree's prefix of ``budget + 1`` slots (the tree a
        build of ``budget`` gives on the whole block: ``DraftTree.prefix``) and reports each row's
        expected tokens at every budget of the set (``round_with_expected``): exact up to its own
        budget, past it those of a tree held to its depth (lower bounds); an ar round reports ones.
    """

    method: str
    budget: int
    hidden_layer_ids: tuple[int, ...]
    backend: Backend
    logprobs: int = 0
    expected_budgets: tuple[int, ...] = ()


class _Static:
    """A static value whose hash is computed once: a compiled call hashes its static arguments and
    its pytrees' structure on every call, and an nnx graph's hash walks the whole graph."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Static) and self._hash == other._hash and self.value == other.value)


@jax.tree_util.register_pytree_node_class
class Params:
    """A module's parameters as a flat tuple of arrays with their structure (static, hashed once):
    a compiled call flattens it in one step instead of walking an ``nnx.State``."""

    __slots__ = ("leaves", "structure")

    def __init__(self, leaves: tuple, structure: _Static):
        self.leaves, self.structure = leaves, structure

    @classmethod
    def of(cls, state) -> Params:
        leaves, treedef = jax.tree.flatten(state)
        return cls(tuple(leaves), _Static(treedef))

    def tree_flatten(self):
        return self.leaves, self.structure

    @classmethod
    def tree_unflatten(cls, structure, leaves) -> Params:
        return cls(tuple(leaves), structure)

    def state(self):
        return jax.tree.unflatten(self.structure.value, self.leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class Models:
    """Graph definitions (static) of the target and drafter; their parameters travel apart (as
    ``nnx.State`` or, cheaper to pass to a compiled call, ``Params``: ``Models.split``). Equal
    graphs compare equal; the hash is computed once."""

    target: nnx.GraphDef
    drafter: nnx.GraphDef | None

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.target, self.drafter)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Models) and self._hash == other._hash
                                 and (self.target, self.drafter) == (other.target, other.drafter))

    @classmethod
    def split(cls, target, drafter=None) -> tuple[Models, Params, Params | None]:
        """``(models, target params, drafter params)`` of two modules (``drafter`` may be None).
        Equal graphs give the same ``Models`` object (``_interned``): a compiled function's cache
        then finds its static argument by identity, instead of comparing two graphs on every call
        (milliseconds per call for a model of a few hundred nodes)."""
        tgraph, tstate = nnx.split(target)
        dgraph, dstate = nnx.split(drafter) if drafter is not None else (None, None)
        return _interned(cls(tgraph, dgraph)), Params.of(tstate), None if dstate is None else Params.of(dstate)

    def merge(self, tparams, dparams):
        """The modules back from their parameters (``Params`` or ``nnx.State``), inside a trace."""
        state = lambda p: p.state() if isinstance(p, Params) else p
        target = nnx.merge(self.target, state(tparams))
        drafter = nnx.merge(self.drafter, state(dparams)) if self.drafter is not None else None
        return target, drafter


_MODELS: dict[int, list[Models]] = {}
_MODELS_PER_HASH = 8


def _interned(models: Models) -> Models:
    """The first ``Models`` equal to ``models`` that ``split`` returned (the graphs compared once
    per split, not once per compiled call); a few per hash are kept, the oldest dropped first."""
    seen = _MODELS.setdefault(hash(models), [])
    for other in seen:
        if other == models:
            return other
    seen.append(models)
    del seen[:-_MODELS_PER_HASH]
    return models


# ---------------------------------------------------------------------------------------------- prefill


@functools.partial(jax.jit, static_argnames=("models", "plan", "max_len", "capacity"))
def prefill(models: Models, tparams, dparams, plan: DecodePlan, prompts, lengths, roots, *, max_len: int,
            capacity: int, max_new_tokens, stop_ids, sampling: SamplingBatch, request_ids,
            first_key=None) -> DecodeState:
    """A fresh state for ``B`` requests: their prompts but the last token in both caches.

    ``prompts [B, P]`` right-padded (all but each prompt's last token), ``lengths [B]`` their
    lengths, ``roots [B]`` the prompts' last tokens; per-row ``max_new_tokens [B]``,
    ``stop_ids [B, S]``, ``sampling`` and ``request_ids [B]``.

    With ``first_key`` (the rounds' base key) the last tokens are prefilled too, and each
    request's first new token is drawn from the target's logits at its prompt's last position,
    by its own law (``rng.first_token_keys``; the sampler of a round's node): the state starts
    with that token committed (``DecodeState.with_first_tokens``), and the first round drafts
    from it.
    """
    target, drafter = models.merge(tparams, dparams)
    B = prompts.shape[0]
    if first_key is not None:
        prompts = jnp.concatenate([prompts, jnp.zeros((B, 1), prompts.dtype)], axis=1)
        prompts = prompts.at[jnp.arange(B), lengths].set(roots.astype(prompts.dtype))
        lengths = lengths + 1
    dcache = drafter.init_cache(B, max_len) if plan.hidden_layer_ids else None
    tcache, dcache, last = _append_prompts(target, drafter, plan, target.init_cache(B, max_len), dcache, prompts,
                                           lengths, last=first_key is not None)
    state = DecodeState.start(tcache, dcache, roots, capacity=capacity, max_new_tokens=max_new_tokens,
                              stop_ids=stop_ids, sampling=sampling, request_ids=request_ids)
    if first_key is None:
        return state
    return state.with_first_tokens(first_tokens(last, sampling, request_ids, first_key, plan.backend, _rows(target)))


@functools.partial(jax.jit, static_argnames=("models", "plan", "last"), donate_argnames=("tcache", "dcache"))
def prefill_rows(models: Models, tparams, dparams, plan: DecodePlan, tcache, dcache, rows, prompts, starts, lengths,
                 last: bool = False):
    """``(tcache, dcache)`` with ``prompts [R, T]`` (right-padded, ``lengths [R]`` valid) appended
    to rows ``rows [R]`` (distinct) of both caches after their first ``starts [R]`` positions,
    which they hold already (their lengths are set to ``starts`` first); ``dcache`` is ``None``
    without a drafter. Paged caches (the caches donated): the other rows' pages are left as they
    are, since the rows write only their own pages past ``starts``. With ``last``, also the
    target's logits f32 ``[R, V]`` at each row's last appended token (a third output)."""
    target, drafter = models.merge(tparams, dparams)
    return append_to_rows(target, drafter, plan, tcache, dcache, rows, prompts, starts, lengths, last=last)


@functools.partial(jax.jit, static_argnames=("backend", "rows"))
def first_tokens(logits, sampling: SamplingBatch, request_ids, base_key, backend: Backend,
                 rows: RowMesh | None = None) -> jax.Array:
    """Each request's first new token ``[B]``, drawn from the target's logits ``[B, V]`` at its
    prompt's last position by its own law (``rng.first_token_keys``; a round's node sampler), on
    each device's own rows of the row mesh ``rows`` (``per_rows``; None: as the compiler lays them
    out): what ``prefill`` with ``first_key`` draws, and prefills that gather the logits themselves."""
    keys = first_token_keys(base_key, sampling, request_ids)
    return per_rows(functools.partial(_sample_tree_nodes, backend=backend), rows, logits.shape[0],
                    logits[:, None], sampling, keys)[:, 0]


def with_row_lengths(cache, rows, lengths):
    """``cache`` with ``lengths[rows]`` replaced (a row cache's lengths are ``[B]`` by row)."""
    return dataclasses.replace(cache, lengths=cache.lengths.at[rows].set(lengths.astype(cache.lengths.dtype)))


def append_to_rows(target, drafter, plan: DecodePlan, tcache, dcache, rows, prompts, starts, lengths, *,
                   by_device: bool = False, last: bool = False):
    """``prefill_rows`` on merged models, for use inside a compiled function (the serving engine's
    prefill chunk runs it on its state's caches). A start of ``-1`` keeps the row's length (a
    padding row of ``lengths`` 0: what it writes past its length, a round writes over before it
    reads). ``by_device``: ``rows`` are laid out device by device over the target's row mesh
    (``ddtree_jax.rows.on_own_rows``), and each device takes and puts back only its own rows."""
    mesh = _rows(target) if by_device else None

    def take(cache, idx, starts):
        starts = jnp.where(starts < 0, cache.lengths[idx], starts)
        return with_row_lengths(cache, idx, starts).take_rows(idx)

    def rows_of(cache):
        return None if cache is None else on_own_rows(take, mesh, cache, rows, starts)

    def put(cache, new):
        return on_own_rows(lambda c, idx, n: c.put_rows(idx, n), mesh, cache, rows, new)

    new_t, new_d, logits = _append_prompts(target, drafter, plan, rows_of(tcache), rows_of(dcache), prompts, lengths,
                                           last=last)
    out = put(tcache, new_t), None if dcache is None else put(dcache, new_d)
    return (*out, logits) if last else out


def _append_prompts(target, drafter, plan: DecodePlan, tcache, dcache, prompts, lengths, *, last: bool = False):
    """The target's prefill of ``prompts [B, T]`` (``lengths [B]`` valid) and, with a drafter, the
    context it feeds: ``(tcache, dcache, the target's logits [B, V] at each row's last valid token
    with ``last``, else None)``. The padding (a row's tokens past its length, every token of a
    padding row) routes to no expert."""
    valid = jnp.arange(prompts.shape[1])[None, :] < lengths[:, None]
    at = jnp.maximum(lengths - 1, 0) if last else None
    logits, hidden, tcache = target.prefill(prompts, lengths, tcache, hidden_layer_ids=plan.hidden_layer_ids,
                                            valid=valid, logits_at=at)
    if plan.hidden_layer_ids:
        dcache = drafter.append_context(dcache, jnp.concatenate(hidden, axis=-1), lengths)
    return tcache, dcache, logits[:, 0] if last else None


# ---------------------------------------------------------------------------------------------- stages
# Each stage maps (target, drafter, plan, state, base_key, work) -> work: the dict of what the
# stages so far produced. The last one returns {"state": the next DecodeState}.


def _rows(target) -> RowMesh | None:
    """Where the target's batch rows live (``ddtree_jax.rows``): the tree build, the sampler and
    the walk run on each device's own rows."""
    return getattr(target, "row_mesh", None)


def _tree_of(target, draft_logits, budget: int, backend: Backend):
    return per_rows(functools.partial(_build_draft_tree, budget=budget, backend=backend), _rows(target),
                    draft_logits.shape[0], draft_logits)


def _draft(target, drafter, plan: DecodePlan, state: DecodeState, base_key, work):
    if plan.method == "ar":
        return dict(draft_logits=None)
    depths = None
    if plan.method == "ddtree":
        # A best-first tree of b nodes is at most b deep: the depths past it are never verified
        # (with expected_budgets too: the drafter's LM head dominates a round at a large vocabulary).
        depths = plan.budget if plan.budget < drafter.config.block_size - 1 else None
    return dict(draft_logits=drafter.propose(target, state.draft_cache, state.root, depths=depths))


def _tree(target, drafter, plan: DecodePlan, state: DecodeState, base_key, work):
    expected = None
    if plan.method == "ar":
        tree = root_only_tree(state.batch_size)
        if plan.expected_budgets:
            expected = jnp.ones((state.batch_size, len(plan.expected_budgets)), jnp.float32)
    elif plan.method == "dflash":
        tree = chain_draft_tree(work["draft_logits"])
    elif plan.expected_budgets:
        full = _tree_of(target, work["draft_logits"], max(plan.expected_budgets), plan.backend)
        expected = expected_tokens(full, plan.expected_budgets)
        tree = full.prefix(plan.budget + 1)
    else:
        tree = _tree_of(target, work["draft_logits"], plan.budget, plan.backend)
    out = dict(tree=tree.with_root_tokens(state.root))
    if expected is not None:
        out["expected"] = expected
    return out


def _verify(target, drafter, plan: DecodePlan, state: DecodeState, base_key, work):
    tree = work["tree"]
    tokens = jnp.where(tree.valid, tree.tokens, 0)  # unused slots: any in-vocabulary id, never accepted
    # A row that commits nothing (finished, or a free slot) routes no token to an expert: a MoE
    # round then reads only the experts its running rows pick (its outputs are discarded anyway).
    routed = tree.valid & ~state.done[:, None]
    logits, hidden, tcache = target.verify(tokens, tree.depth, tree.ancestor_mask, state.target_cache,
                                           hidden_layer_ids=plan.hidden_layer_ids, valid=routed)
    feats = jnp.concatenate(hidden, axis=-1) if hidden else None
    return dict(tree=tree, logits=logits, feats=feats, target_cache=tcache)


def _sample(target, drafter, plan: DecodePlan, state: DecodeState, base_key, work):
    keys = round_keys(base_key, state.sampling, state.request_ids, state.rounds)
    samples = per_rows(functools.partial(_sample_tree_nodes, backend=plan.backend), _rows(target),
                       state.batch_size, work["logits"], state.sampling, keys)
    out = dict(tree=work["tree"], samples=samples, feats=work["feats"], target_cache=work["target_cache"])
    if plan.logprobs:
        out["logits"] = work["logits"]
    return out


def _commit(target, drafter, plan: DecodePlan, state: DecodeState, base_key, work):
    res = per_rows(functools.partial(_accept_path, backend=plan.backend), _rows(target), state.batch_size,
                   work["tree"], work["samples"])
    n = res.num_accepted + 1
    active = ~state.done
    committed, count = state.with_committed(res.committed, n, active, res.bonus == INVALID_TOKEN)
    set_row = jax.vmap(lambda row, at, values: row.at[at].set(values, mode="drop"))
    hist_pos = jnp.where(active, state.rounds, state.capacity)
    accept_lengths = set_row(state.accept_lengths, hist_pos, n)

    draft_cache, deferred = state.draft_cache, state.deferred
    if plan.hidden_layer_ids:
        path_feats = jnp.take_along_axis(work["feats"], jnp.maximum(res.path, 0)[..., None], axis=1)
        if plan.method == "ar" and deferred is not None:  # held back: this round runs no drafter code
            deferred = deferred.push(path_feats, count)
        else:
            draft_cache = drafter.append_context(draft_cache, path_feats, count)
    new = dict(state=dataclasses.replace(
        committed, target_cache=target.commit(work["target_cache"], res.path, count), draft_cache=draft_cache,
        deferred=deferred, accept_lengths=accept_lengths, rounds=state.rounds + active,
    ))
    if plan.expected_budgets:
        new["realized"] = realized_tokens(res.path, plan.expected_budgets)
    if plan.logprobs:
        rows_logits = jnp.take_along_axis(work["logits"], jnp.maximum(res.path, 0)[..., None], axis=1)
        new["logprobs"] = token_logprobs(rows_logits, res.committed, state.sampling, plan.logprobs)
    return new


def realized_tokens(path: jax.Array, budgets: tuple[int, ...]) -> jax.Array:
    """f32 ``[B, K]``: the tokens each row would have committed (bonus included) had its round
    verified the tree's prefix of ``budgets[k]`` nodes instead, for every budget up to the one it
    verified (at larger budgets: what it committed). ``path``: the accepted path's node indices
    ``[B, L + 1]`` (``AcceptResult.path``) in a best-first tree, whose smaller budgets' trees are
    its prefixes (nodes numbered parents first).

    Exact, not an estimate: every node carries its own draw, which does not depend on the other
    nodes of the tree (docs/exact-sampling.md), so on a prefix of the tree the walk takes the same
    steps until it would step to a node outside the prefix, and there it stops. Its path's nodes
    number upwards from the root, so the prefix of ``b`` nodes keeps the path's nodes numbered at
    most ``b``: the same round on the smaller tree accepts ``#{path nodes in 1..b}`` tokens."""
    nodes = path[:, 1:, None]
    within = (nodes > 0) & (nodes <= jnp.asarray(budgets, jnp.int32)[None, None])
    return 1.0 + jnp.sum(within, axis=1, dtype=jnp.float32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: SamplingBatch, k: int) -> jax.Array:
    """What a client sees as the log-probabilities of committed tokens (docs/serving.md, "Log-probabilities").

    Args:
      logits: ``[B, A, V]`` the target's logits of the rows the tokens were drawn from.
      tokens: i32 ``[B, A]`` the drawn tokens (entries < 0 are padding; their values are unspecified).
      sampling: the requests' ``SamplingBatch`` (``[B]`` fields).
      k: top alternatives per token, >= 1.

    Returns:
      i32 ``[B, A, 1 + 2 k]``: the token's log-probability, the ``k`` most probable token ids
      (descending, ties lowest id first), then their log-probabilities; log-probabilities are
      float32 bit patterns (``jax.lax.bitcast_convert_type`` back). The law is the request's own:
      ``target_logprobs`` (temperature, top-k, top-p, min-p; removed tokens ``-inf``) for sampled
      requests, and for greedy requests (whose law is a point mass) the target's plain
      ``log_softmax`` at temperature 1.
    """
    greedy = canonical_temperature(sampling.temperature) == 0
    reported = dataclasses.replace(
        sampling, temperature=jnp.where(greedy, 1.0, sampling.temperature).astype(jnp.float32),
        top_k=jnp.where(greedy, 0, sampling.top_k), top_p=jnp.where(greedy, 1.0, sampling.top_p),
        min_p=jnp.where(greedy, 0.0, sampling.min_p))
    logp = target_logprobs(logits, reported)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)
    top, ids = jax.lax.top_k(logp, k)
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([bits(chosen), ids.astype(jnp.int32), bits(top)], axis=-1)


STAGES = (("draft", _draft), ("tree", _tree), ("verify", _verify), ("sample", _sample), ("commit", _commit))


def _round_work(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key) -> dict:
    target, drafter = models.merge(tparams, dparams)
    work, expected = {}, None
    for _, stage in STAGES:
        work = stage(target, drafter, plan, state, base_key, work)
        expected = work.get("expected", expected)
    if expected is not None:
        work["expected"] = expected
    return work


def _round(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key) -> DecodeState:
    return _round_work(models, tparams, dparams, plan, state, base_key)["state"]


def round_with_logprobs(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key):
    """One round (for use inside a compiled function) with ``plan.logprobs > 0``: ``(the next
    state, token_logprobs of the round's committed tokens [B, L + 1, 1 + 2 K])``. Row ``b``'s
    first ``next.generated[b] - state.generated[b]`` entries belong to the tokens it committed."""
    if plan.logprobs < 1:
        raise ValueError(f"round_with_logprobs needs plan.logprobs >= 1, got {plan.logprobs}")
    work = _round_work(models, tparams, dparams, plan, state, base_key)
    return work["state"], work["logprobs"]


def round_with_expected(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key):
    """One round (for use inside a compiled function) with ``plan.expected_budgets``: ``(the next
    state, f32 [B, K] each row's expected committed tokens at each budget of the set, f32 [B, K]
    the tokens it would have committed at each budget: realized_tokens)``."""
    if not plan.expected_budgets:
        raise ValueError("round_with_expected needs plan.expected_budgets")
    work = _round_work(models, tparams, dparams, plan, state, base_key)
    return work["state"], work["expected"], work["realized"]


@functools.partial(jax.jit, static_argnames=("models", "plan", "max_rounds", "fixed"), donate_argnames=("state",))
def run_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
               max_rounds: int, fixed: bool = False) -> DecodeState:
    """Up to ``max_rounds`` rounds on the device, stopping early once every row is done; with
    ``fixed``, exactly ``max_rounds`` (rows that are not running commit nothing, so the tokens are
    the same). On a GPU a loop with a data-dependent end makes the host wait for each iteration's
    predicate, so the call returns only once its rounds are done; a loop of known trip count
    returns at once and lets the host prepare the next call while the device runs this one."""
    if fixed:
        return jax.lax.fori_loop(0, max_rounds, lambda i, st: _round(models, tparams, dparams, plan, st, base_key),
                                 state)

    def cond(carry):
        i, st = carry
        return (i < max_rounds) & ~jnp.all(st.done)

    def body(carry):
        i, st = carry
        return i + 1, _round(models, tparams, dparams, plan, st, base_key)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def unrolled_rounds(models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key,
                    rounds: int) -> DecodeState:
    """``rounds`` rounds one after the other, for use inside a compiled function. Unlike
    ``run_rounds`` there is no device-side loop with a data-dependent end (on a GPU such a loop
    makes the host wait for each iteration's predicate, so the call would return only once the
    rounds are done); rows that are not running commit nothing, so no round needs skipping."""
    for _ in range(rounds):
        state = _round(models, tparams, dparams, plan, state, base_key)
    return state


@functools.partial(jax.jit, static_argnames=("name", "models", "plan"))
def run_stage(name: str, models: Models, tparams, dparams, plan: DecodePlan, state: DecodeState, base_key, work):
    """One stage of a round alone (the same code ``run_rounds`` runs), to time the split."""
    target, drafter = models.merge(tparams, dparams)
    return dict(STAGES)[name](target, drafter, plan, state, base_key, work)
