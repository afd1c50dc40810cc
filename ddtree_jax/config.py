"""The runtime settings, one frozen dataclass per concern, each value checked once when it is built.

* ``DecodeConfig``: how requests decode (method, tree budget or ``"auto"``, host sync cadence,
  seed, stop ids, the decode loop's kernels); ``generate`` and ``serving.Engine`` run it.
* ``EngineConfig``: the serving engine's slots, lengths, queue and prefill chunking, around a
  ``DecodeConfig``.
* ``ExecutionConfig``: how the target model and the drafter compute (kernels, batch invariance,
  kernel blocks and segments, attention forms); given to ``KimiForCausalLM`` / ``DFlashDrafter``
  or ``load_target`` / ``load_drafter``, changed with their ``with_execution``. Placement on a
  mesh is an argument of ``load_target`` / ``init_on_mesh``, not a setting.

A bad value raises ``ConfigError`` (a ``ValueError``) whose ``field`` names it. The checks that
need the models run where the models are: ``DecodeConfig.check_for`` / ``EngineConfig.check_for``
(stop ids inside the vocabulary, a drafter for the drafting methods, the context length; called by
``generate``, the ``Engine`` and the command line) and ``KimiForCausalLM`` / ``DFlashDrafter``
(batch invariance needs the Triton kernels on one device).

This module imports no JAX: the command line validates its options through it before anything
heavy loads (``ddtree_jax/_preflight.py``).
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Iterable
from typing import Any

from ddtree_jax.backend import IMPLS, Backend

__all__ = [
    "AUTO",
    "METHODS",
    "PER_HEAD_PREFILL",
    "PER_HEAD_PREFILL_IMPLS",
    "SEGMENT_GROUP",
    "SEGMENT_KEYS",
    "ConfigError",
    "DecodeConfig",
    "EngineConfig",
    "ExecutionConfig",
    "auto_budget_set",
    "execution_of",
    "is_int",
    "token_id_problem",
]

METHODS = ("ddtree", "dflash", "ar")
AUTO = "auto"  # DecodeConfig.budget: a budget chosen per round (ddtree_jax/auto_budget.py)

# The defaults of ``ExecutionConfig``'s attention settings (design notes: docs/kernels.md, "MLA
# attention" and "Prefill: the absorbed form costs 3.4x the flops"): keys per segment of the
# attention kernel's fixed reduction, segments per group, and the prefill length from which the
# per-head form runs.
SEGMENT_KEYS = 512
SEGMENT_GROUP = 4
PER_HEAD_PREFILL = 512
PER_HEAD_PREFILL_IMPLS = ("cudnn", "xla")


def is_int(x: Any) -> bool:
    """Whether ``x`` is an integer (Python or NumPy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def token_id_problem(value: Any, vocab_size: int | None) -> str | None:
    """What is wrong with ``value`` as a token id of a ``vocab_size`` vocabulary (``None``: of
    unknown size, any id >= 0), or ``None`` when it is one."""
    if not is_int(value):
        return f"{value!r} is not an integer token id"
    if vocab_size is None and value < 0:
        return f"{value} is not a token id (negative)"
    if vocab_size is not None and not 0 <= value < vocab_size:
        return f"{value} is outside the vocabulary [0, {vocab_size})"
    return None


class ConfigError(ValueError):
    """A setting out of range: ``field`` names it, ``message`` says why; ``str()`` reads
    ``"<Config>.<field>: <message>"``."""

    def __init__(self, owner: str, field: str, message: str):
        super().__init__(f"{owner}.{field}: {message}")
        self.owner, self.field, self.message = owner, field, message


def _require(ok: bool, owner: str, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(owner, field, message)


def _check_count(owner: str, field: str, value: Any, lo: int = 1, optional: bool = False) -> None:
    """``value`` is an integer >= ``lo`` (or ``None`` where ``optional``)."""
    if optional and value is None:
        return
    _require(is_int(value) and value >= lo, owner, field,
             f"must be {'None or ' if optional else ''}an integer >= {lo}, got {value!r}")


def _check_impl(owner: str, impl: Any) -> None:
    _require(isinstance(impl, Backend) or (isinstance(impl, str) and impl in IMPLS), owner, "impl",
             f"must be one of {IMPLS} or a Backend, got {impl!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How requests decode: the settings ``generate`` and ``serving.Engine`` share."""

    method: str = "ddtree"
    """``"ddtree"`` (the best tree of ``budget`` drafted nodes), ``"dflash"`` (the argmax chain of
    the drafter's block) or ``"ar"`` (autoregressive, one token per target pass, no drafter)."""

    budget: int | str = 64
    """DDTree's node budget: non-root nodes per tree, >= 1. Used by ``"ddtree"`` only (dflash
    verifies the drafter's block, ar one token). ``"auto"`` (``"ddtree"`` only): each round
    verifies the tree of the budget, out of ``auto_budget.budget_set(auto_max_budget)`` (0: an
    autoregressive step without the drafter), that maximizes the expected committed tokens per
    second (``ddtree_jax.auto_budget``; design note: docs/auto-budget.md)."""

    auto_max_budget: int = 32
    """With ``budget="auto"``: the largest budget of the set, >= 1."""

    auto_costs: tuple[float, ...] | None = None
    """With ``budget="auto"``: the cost of a round at each budget of the set (any unit, > 0),
    instead of timing the compiled rounds; stored as a tuple of floats. ``None``: measured
    (``ddtree_jax.auto_costs``)."""

    auto_restart: float | None = None
    """With ``budget="auto"`` and ``auto_costs``: what a call of rounds costs launched and waited
    for alone beyond its rounds (a pipeline restart, in ``auto_costs``' unit), >= 0; ``generate``
    runs its first probe alone, read back before the next choice, where its price
    (``auto_budget.restart_price``: ``MEASURED_RESTART`` times this) is at most
    ``auto_budget.RESTART_SHARE`` of a call's plain rounds. ``None``: measured with the cost
    table, or with ``auto_costs`` unknown (the first probe runs inside a full call)."""

    auto_probe_every: int = 8
    """With ``budget="auto"``: after this many rounds in a row without the drafter, one round
    drafts again to re-measure the acceptance, >= 1."""

    sync_every: int | str | None = None
    """Compiled rounds between host checks, >= 1, or ``"auto"``. ``None``: the runner's default
    (``generate``: 8, fewer host round trips; ``Engine``: ``"auto"`` on GPUs with a fixed budget,
    else 1). ``"auto"``: the ``Engine`` chooses each dispatch's rounds from 1, 2 and 4 by their
    measured cost (``ddtree_jax.serving.dispatch``; not with ``budget="auto"``); ``generate``
    takes its default."""

    seed: int = 0
    """The base key of every random stream, in ``[0, 2**32)`` (``ddtree_jax.rng``): a seeded
    request's output depends on it and the request's own seed only."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a request (returned as its last token); any integer sequence, stored as a
    tuple. Their range is checked against the target's vocabulary by ``check_for``."""

    impl: str | Backend = "auto"
    """The decode loop's tree builder, sampler and accept walk (``ddtree_jax.backend``): one of
    ``IMPLS`` (``"auto"``: the Pallas kernels on a GPU or TPU, the references elsewhere) or a
    resolved ``Backend``."""

    def __post_init__(self):
        owner = "DecodeConfig"
        _require(self.method in METHODS, owner, "method", f"must be one of {METHODS}, got {self.method!r}")
        if self.budget == AUTO:
            _require(self.method == "ddtree", owner, "budget",
                     f"'auto' chooses DDTree's budget per round: it needs method 'ddtree', got {self.method!r}")
        else:
            _require(is_int(self.budget) and self.budget >= 1, owner, "budget",
                     f"must be an integer >= 1, got {self.budget!r} (or 'auto')")
        _check_count(owner, "auto_max_budget", self.auto_max_budget)
        _check_count(owner, "auto_probe_every", self.auto_probe_every)
        if self.auto_costs is not None:
            costs = self.auto_costs
            ok = isinstance(costs, Iterable) and not isinstance(costs, str | bytes)
            costs = tuple(costs) if ok else ()
            n = len(auto_budget_set(self.auto_max_budget))
            ok = ok and len(costs) == n and all(
                isinstance(c, numbers.Real) and not isinstance(c, bool) and 0 < c < float("inf") for c in costs)
            _require(ok, owner, "auto_costs",
                     f"must be None or {n} positive finite numbers (one per budget of "
                     f"{auto_budget_set(self.auto_max_budget)}), got {self.auto_costs!r}")
            object.__setattr__(self, "auto_costs", tuple(float(c) for c in costs))
        if self.auto_restart is not None:
            r = self.auto_restart
            _require(self.auto_costs is not None and isinstance(r, numbers.Real) and not isinstance(r, bool)
                     and 0 <= r < float("inf"), owner, "auto_restart",
                     f"must be None or a finite number >= 0 beside auto_costs (the cost table's own is measured), "
                     f"got {r!r}" + ("" if self.auto_costs is not None else " without auto_costs"))
            object.__setattr__(self, "auto_restart", float(r))
        if not (isinstance(self.sync_every, str) and self.sync_every == AUTO):
            _require(self.sync_every is None or (is_int(self.sync_every) and self.sync_every >= 1), owner,
                     "sync_every", f"must be None, 'auto' or an integer >= 1, got {self.sync_every!r}")
        elif self.is_auto:
            raise ConfigError(owner, "sync_every", "'auto' (rounds per dispatch chosen by cost) does not combine "
                              "with budget='auto' yet; give an integer or None")
        _require(is_int(self.seed) and 0 <= self.seed < 2**32, owner, "seed",
                 f"must be an integer in [0, 2**32), got {self.seed!r}")
        ids = self.stop_token_ids
        _require(isinstance(ids, Iterable) and not isinstance(ids, str | bytes), owner, "stop_token_ids",
                 f"must be a sequence of token ids, got {ids!r}")
        ids = tuple(ids)
        for s in ids:
            problem = token_id_problem(s, None)
            _require(problem is None, owner, "stop_token_ids", str(problem))
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in ids))
        _check_impl(owner, self.impl)

    @property
    def is_auto(self) -> bool:
        """Whether the budget is chosen per round (``budget="auto"``)."""
        return self.budget == AUTO

    @property
    def max_budget(self) -> int:
        """The largest tree the rounds build: ``budget``, or ``auto_max_budget`` with ``"auto"``."""
        return self.auto_max_budget if self.is_auto else self.budget

    @property
    def uses_drafter(self) -> bool:
        """Whether the method drafts (``"ddtree"``, ``"dflash"``)."""
        return self.method != "ar"

    def check_for(self, vocab_size: int | None, has_drafter: bool) -> None:
        """The checks that need the models: every stop id inside the target's vocabulary
        (``None``: size unknown yet, not checked) and a drafter for the drafting methods."""
        for s in self.stop_token_ids:
            problem = token_id_problem(s, vocab_size)
            _require(problem is None, "DecodeConfig", "stop_token_ids", str(problem))
        _require(has_drafter or not self.uses_drafter, "DecodeConfig", "method",
                 f"{self.method!r} needs a drafter; only 'ar' runs without one")


MIN_PAGE_SIZE = 16
"""The smallest page of a paged cache: the paged attention kernel's smallest key tile (each tile
lies in one page), so that a page size valid on the CPU is valid on every backend."""


def is_page_size(x: Any) -> bool:
    """Whether ``x`` is a valid page size: an integer power of two >= ``MIN_PAGE_SIZE``."""
    return is_int(x) and x >= MIN_PAGE_SIZE and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The serving engine's settings (``ddtree_jax.serving.Engine``)."""

    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
    """How requests decode; ``stop_token_ids`` there are the stop tokens every request gets
    (e.g. EOS) unless it sets ``ignore_eos``."""

    slots: int = 8
    """Requests decoded at once (the compiled rounds' batch), >= 1."""

    max_model_len: int | None = None
    """Prompt + ``max_tokens`` limit per request, >= 2 and at most the target's context; sets the
    cache size: every slot holds that many positions (plus one verify block). ``None``: the
    target's ``max_position_embeddings``, at most 8192."""

    max_output_tokens: int | None = None
    """The largest ``max_tokens`` a request may ask for, >= 1; sets the output buffer. ``None``:
    ``max_model_len - 1``."""

    max_queue: int = 256
    """Requests waiting for a slot before ``submit`` raises ``EngineOverloaded``, >= 1."""

    prefill_chunk: int = 512
    """Most prompt tokens a slot prefills per engine step, >= 1."""

    prefill_batch: int | None = None
    """Most slots prefilled per engine step, >= 1. ``None``: all free slots."""

    admit_group: int | None = None
    """Admission in groups: while requests queue and slots run, the engine admits queued requests
    once ``min(admit_group, queued requests)`` slots are free (or after ``admit_wait`` steps), so
    that one prefill serves several newcomers; >= 1, at most ``prefill_batch`` in effect. ``None``:
    ``slots // 8`` (at least 1; 1 admits at once). Every prefill launch is a pass of both models
    over their weights: docs/serving.md, "Admission in groups"."""

    admit_wait: int = 8
    """Most engine steps a free slot is held for ``admit_group`` while requests queue, >= 0."""

    deterministic: bool = False
    """The deterministic mode: the engine runs the target and the drafter with
    ``ExecutionConfig.batch_invariant`` (``with_execution``; a model already in the mode is used
    as it is), so that a request's tokens depend only on the engine's settings, the models, its
    own prompt, sampling parameters and seed (or, unseeded, its request id), never on the other
    requests, its slot, or how prompts were grouped and chunked for prefill. Needs the Triton
    kernels on one device (``ConfigError`` naming ``ExecutionConfig.batch_invariant`` otherwise).
    The guarantee and its cost: docs/serving.md, "Deterministic mode"."""

    freeze_gc: bool = True
    """When the background thread starts (``Engine.start``), take the objects alive then (the
    models, compiled programs, everything loaded) out of the cyclic garbage collector's scans
    (``gc.freeze``; process-wide). The collections the engine's per-step objects trigger then
    scan only what was made since, instead of the whole heap a loaded model leaves (docs/serving.md,
    "The engine")."""

    max_stop_ids: int = 8
    """Stop-token slots per request (the decoding state's stop-id width), >= 1; raised to the
    number of ``decode.stop_token_ids`` if that is larger."""

    max_logprobs: int = 0
    """Most top alternatives a request may ask for beside its tokens' log-probabilities, in
    ``[0, vocab size]``; 0: the engine computes no log-probabilities and refuses requests for
    them. Compile-time: with it the rounds also compute and return, for every committed token,
    its log-probability and this many alternatives (docs/serving.md, "Log-probabilities")."""

    page_size: int | None = None
    """Paged caches: positions per page, a power of two >= ``MIN_PAGE_SIZE``; ``None``: every slot owns
    ``cache_len`` contiguous positions. Paged, the target's and the drafter's caches live in one
    pool of ``kv_pages`` pages shared by all slots, requests are admitted (and, when the pool runs
    short, preempted and later resumed) by pages, and full pages of common prefixes are shared
    (docs/paged-caches.md, "The engine")."""

    kv_pages: int | None = None
    """Pages in the pool (``page_size`` set), not counting the null page; it must hold one
    request of ``max_model_len`` positions with its scratch. ``None``: ``slots`` full-length
    slots' worth, the memory of the contiguous caches."""

    read_lag: int | None = None
    """Engine steps between a dispatch's launch and its read-back, 1 or 2: with 2 the device has
    the next dispatch queued behind the one it runs while the host reads back, streams and
    launches, so that the step's host work and its launch need not fit together in one
    dispatch's device time (each within it is enough); tokens reach their streams one step later.
    ``None``: where the engine chooses the rounds per dispatch (``decode.sync_every="auto"``, the
    default on a GPU with one process), 2 after a dispatch of several rounds (the sizer's choice
    where a small model's rounds are shorter than the host's work around them) and 1 after a
    dispatch of one (a large model's: its device time hides the host's work, and a newcomer's
    prefill then waits behind one dispatch fewer); else 1 (docs/serving.md, "Read back two steps
    late")."""

    def __post_init__(self):
        owner = "EngineConfig"
        _require(isinstance(self.decode, DecodeConfig), owner, "decode",
                 f"must be a DecodeConfig, got {type(self.decode).__name__}")
        for name in ("slots", "max_queue", "prefill_chunk", "max_stop_ids"):
            _check_count(owner, name, getattr(self, name))
        for name in ("deterministic", "freeze_gc"):
            _require(isinstance(getattr(self, name), bool), owner, name,
                     f"must be True or False, got {getattr(self, name)!r}")
        _check_count(owner, "max_model_len", self.max_model_len, lo=2, optional=True)
        _check_count(owner, "max_output_tokens", self.max_output_tokens, optional=True)
        _check_count(owner, "prefill_batch", self.prefill_batch, optional=True)
        _check_count(owner, "admit_group", self.admit_group, optional=True)
        _check_count(owner, "admit_wait", self.admit_wait, lo=0)
        _check_count(owner, "max_logprobs", self.max_logprobs, lo=0)
        _check_count(owner, "kv_pages", self.kv_pages, optional=True)
        _require(self.read_lag is None or (is_int(self.read_lag) and self.read_lag in (1, 2)), owner, "read_lag",
                 f"must be None, 1 or 2, got {self.read_lag!r}")
        _require(self.page_size is None or is_page_size(self.page_size), owner, "page_size",
                 f"must be None or a power of two >= {MIN_PAGE_SIZE}, got {self.page_size!r}")
        _require(self.kv_pages is None or self.page_size is not None, owner, "kv_pages",
                 "needs page_size (the pool's pages are page_size positions)")

    def check_for(self, vocab_size: int, has_drafter: bool, context: int) -> None:
        """``decode.check_for``, ``max_model_len`` within the target's ``context`` positions and
        ``max_logprobs`` within its vocabulary."""
        self.decode.check_for(vocab_size, has_drafter)
        _require(self.max_model_len is None or self.max_model_len <= context, "EngineConfig", "max_model_len",
                 f"must be in [2, {context}] (the target's context), got {self.max_model_len}")
        _require(self.max_logprobs <= vocab_size, "EngineConfig", "max_logprobs",
                 f"must be in [0, {vocab_size}] (the target's vocabulary), got {self.max_logprobs}")

    def cache_len(self, max_model_len: int, depth: int) -> int:
        """Cache positions per slot: ``max_model_len`` (the resolved context) plus one block of
        scratch, the largest of a verify (``budget + 1`` nodes; ``budget`` the largest tree,
        ``decode.max_budget``, for ddtree, else ``depth``), a commit (``depth + 1`` positions;
        ``depth``: tokens the drafter drafts per round, its block size - 1, 0 without one) and a
        prompt chunk (``prefill_chunk``). The serving engine allocates this many (``Engine.cache_len``)."""
        budget = self.decode.max_budget if self.decode.method == "ddtree" else depth
        return max_model_len + max(budget + 1, depth + 1, self.prefill_chunk)


def auto_budget_set(max_budget: int) -> tuple[int, ...]:
    """The budgets ``budget="auto"`` chooses from: 0 (an autoregressive step), the powers of two
    from 4 below ``max_budget``, and ``max_budget``; e.g. 32 -> ``(0, 4, 8, 16, 32)``."""
    steps, b = [], 4
    while b < max_budget:
        steps.append(b)
        b *= 2
    return (0, *steps, max_budget)


def _is_moe_blocks(value: Any) -> bool:
    """Whether ``value`` is a ``pallas_kernels.triton.moe_grouped_matmul.MoEBlocks`` (without
    importing that module: an instance exists only once it is imported)."""
    module = sys.modules.get("pallas_kernels.triton.moe_grouped_matmul")
    return module is not None and isinstance(value, module.MoEBlocks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """How the target model (``KimiForCausalLM``) and the drafter (``DFlashDrafter``) compute;
    none of it changes the weights. The drafter reads ``impl`` and ``batch_invariant`` only."""

    impl: str | Backend = "auto"
    """The attention and expert implementations (``ddtree_jax.backend``): one of ``IMPLS``
    (``"auto"``: the Pallas kernels on a GPU, the plain-JAX references elsewhere) or a resolved
    ``Backend``."""

    batch_invariant: bool = False
    """Every dense product of the target (attention projections, dense MLPs, shared experts,
    routers, the LM head, the absorbed attention's per-head products) and of the drafter (its
    projections, MLPs, ``fc`` and attention products) through the fixed-order Pallas product
    (``pallas_kernels/triton/dense_matmul.py``) instead of XLA's dot, whose algorithm depends on
    the number of rows; with the attention kernel's fixed segments (the Hopper kernel is then not
    used) and pinned MoE blocks (``moe_blocks``, by default the decode step's), a row's arithmetic
    does not depend on the other rows or their number: the same in a decode step and in a tree
    verify, so greedy DDTree commits greedy autoregressive decoding's tokens in bf16 too
    (``bench/bench_batch_invariance.py`` measures it), and the same alone and in any batch
    (``EngineConfig.deterministic``). Needs the Triton kernels (``impl`` ``"pallas"``, or
    ``"auto"`` on an NVIDIA GPU) on one device (no mesh)."""

    moe_blocks: Any = None
    """The MoE kernel's ``pallas_kernels.triton.moe_grouped_matmul.MoEBlocks``, pinned for every
    call whatever the number of tokens (a row's routed-expert arithmetic then does not depend on
    the batch or the block length). ``None``: ``choose_blocks`` by the token count, or with
    ``batch_invariant`` the blocks of the fewest tokens (a decode step's), pinned."""

    attention_segment_keys: int = SEGMENT_KEYS
    """Keys per segment of the attention kernel's fixed reduction (``latent_attention``), >= 0;
    fixed segments make a row's attention bits independent of the batch and the block length.
    0: splits chosen by the shapes (not batch-invariant)."""

    attention_segment_group: int = SEGMENT_GROUP
    """Segments folded per group of the attention kernel's reduction, >= 1."""

    hopper_attention: bool = True
    """Whether the absorbed attention runs the Hopper kernel where it can (``latent_attention``:
    compiled on an sm_90 GPU, bf16 caches, supported shapes) or always the Triton kernel. The
    batch-invariant mode runs the Triton kernel's fixed segments either way."""

    per_head_prefill_min_tokens: int = PER_HEAD_PREFILL
    """Causal blocks of at least this many tokens that start at slot 0 (a prompt's prefill) attend
    in the per-head form (``latent_attention.per_head_causal_attention``: a third of the absorbed
    form's flops at K2 shapes), >= 0; 0: always the absorbed form. The batch-invariant mode runs
    the absorbed form whatever this says (the fixed-order products cover only that form)."""

    per_head_prefill_impl: str | None = None
    """The per-head form's ``jax.nn.dot_product_attention`` implementation: ``"cudnn"`` (GPU),
    ``"xla"``, or ``None``: by the backend the model is traced for (XLA off the GPU; on a GPU
    cuDNN where it takes the dtype and head dim, else the absorbed form)."""

    def __post_init__(self):
        owner = "ExecutionConfig"
        _check_impl(owner, self.impl)
        for name in ("batch_invariant", "hopper_attention"):
            value = getattr(self, name)
            _require(isinstance(value, bool), owner, name, f"must be True or False, got {value!r}")
        _require(self.moe_blocks is None or _is_moe_blocks(self.moe_blocks), owner, "moe_blocks",
                 f"must be None or a pallas_kernels.triton.moe_grouped_matmul.MoEBlocks, got {self.moe_blocks!r}")
        _check_count(owner, "attention_segment_keys", self.attention_segment_keys, lo=0)
        _check_count(owner, "attention_segment_group", self.attention_segment_group)
        _check_count(owner, "per_head_prefill_min_tokens", self.per_head_prefill_min_tokens, lo=0)
        _require(self.per_head_prefill_impl is None or self.per_head_prefill_impl in PER_HEAD_PREFILL_IMPLS, owner,
                 "per_head_prefill_impl",
                 f"must be one of {PER_HEAD_PREFILL_IMPLS} or None, got {self.per_head_prefill_impl!r}")


def execution_of(execution: ExecutionConfig | None, impl: str | Backend | None) -> ExecutionConfig:
    """The ``ExecutionConfig`` a model constructor or loader was given: ``execution``, or the
    shorthand ``impl=`` (``ExecutionConfig(impl=impl)``), or the default; both is an error."""
    if execution is not None and impl is not None:
        raise ValueError("pass execution=ExecutionConfig(impl=...) or impl=, not both")
    return execution if execution is not None else ExecutionConfig() if impl is None else ExecutionConfig(impl=impl)
