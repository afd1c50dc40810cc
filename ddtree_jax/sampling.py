"""Per-request sampling parameters, the canonical filter pipeline and the reference sampler.

The target's decoding rule is ONE pipeline, used everywhere (plain sampling, the speculative
walk, the kernels):

    logits -> / temperature -> keep top-k -> keep top-p -> keep min-p -> renormalise

with ``temperature < GREEDY_BELOW`` (1e-5; 0 included) meaning greedy (argmax, lowest index on
ties). Greedy is not a second code path: its law is the point mass on the argmax, and the same
sampler draws from it. The threshold is applied in one function, ``canonical_temperature``, by
every consumer of a ``SamplingBatch`` (``target_logprobs``, the fused kernel's wrapper), so the
references and the kernel agree on which rows are greedy.

Cut rules (each is a threshold on one row, so a sort-free kernel can compute the same set):

* top-k (``k > 0``): keep ``v`` iff ``z_v >= z_(k)``, the k-th largest scaled logit. Ties with
  the k-th value are all kept (the rule HF transformers' ``TopKLogitsWarper`` uses).
* top-p (``p < 1``): with ``q`` the top-k-renormalised distribution, keep ``v`` iff the mass of
  tokens strictly more probable than ``v`` is ``< p``. Without ties this is "the smallest set of
  most probable tokens whose mass reaches p"; tokens tied at the boundary are all kept.
* min-p (``m > 0``): keep ``v`` iff ``q_v >= m * max(q)`` (computed after top-p; the ratio does
  not depend on renormalisation).

Non-finite logits policy: ``-inf`` is a legal logit and means "probability zero" (vocabulary
masks). A row that contains ``NaN`` or ``+inf``, or whose entries are all ``-inf``, has no
well-defined law: its log-probabilities are all ``NaN`` and its sampled token is ``-1``
(``INVALID_TOKEN``). Nothing is clamped silently; callers (the generate loop) turn a ``-1``
into an error for that request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.backend import Backend, kernel_module, resolve_backend
from ddtree_jax.config import is_int
from ddtree_jax.rng import node_seed_words, request_keys

INVALID_TOKEN = -1

# Temperatures below this are greedy (compared in float32). See SamplingParams.
GREEDY_BELOW = 1e-5

__all__ = [
    "GREEDY_BELOW",
    "INVALID_TOKEN",
    "SamplingBatch",
    "SamplingParams",
    "batch_sampling",
    "canonical_temperature",
    "reference_sample",
    "sample_tree_nodes",
    "target_logprobs",
]


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one request.

    Attributes:
      temperature: >= 0. Below ``GREEDY_BELOW`` (1e-5, compared in float32; 0 included) means
        greedy: the argmax, lowest index on ties. Why a threshold and not only 0: the DFlash
        reference (``temperature < 1e-5``) and vLLM (``_SAMPLING_EPS = 1e-5``) use this rule, and
        at such temperatures the law is the argmax anyway unless logits tie within ~1e-5, where
        float32 logits carry no reliable information. So ``temperature=1e-6`` gives exactly the
        ``temperature=0`` output on every path (references, kernels, ``generate``), never a
        NaN or an overflow.
      top_k: >= 0; 0 means off.
      top_p: in (0, 1]; 1.0 means off.
      min_p: in [0, 1]; 0 means off.
      seed: ``None`` or an integer in [0, 2**32). With a seed, the request's random stream
        depends only on the seed and the caller's key (per round), so the same seed gives the
        same output whatever else shares the batch. Without one, it depends on the request's
        row in the batch (still independent of the other rows' contents).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 (< {GREEDY_BELOW} = greedy), got {t!r}"
            )
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1.0 = off), got {p!r}")
        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 = off), got {m!r}")
        if self.seed is not None and (not is_int(self.seed) or not (0 <= self.seed < 2**32)):
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**32), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """``temperature < GREEDY_BELOW`` in float32: exactly the rows ``canonical_temperature`` zeroes."""
        return bool(np.float32(self.temperature) < np.float32(GREEDY_BELOW))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "seed", "has_seed"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as arrays (a pytree), one entry per request: each field ``[B]``."""

    temperature: jax.Array  # f32 [B]
    top_k: jax.Array  # i32 [B]
    top_p: jax.Array  # f32 [B]
    min_p: jax.Array  # f32 [B]
    seed: jax.Array  # u32 [B]
    has_seed: jax.Array  # bool [B]

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


def batch_sampling(
    sampling: SamplingParams | Sequence[SamplingParams] | SamplingBatch, batch_size: int
) -> SamplingBatch:
    """Turns one ``SamplingParams`` (shared), a list of them (one per request) or a
    ``SamplingBatch`` into a ``SamplingBatch`` of ``batch_size`` rows."""
    if isinstance(sampling, SamplingBatch):
        for f in dataclasses.fields(SamplingBatch):
            shape = getattr(sampling, f.name).shape
            if shape != (batch_size,):
                raise ValueError(f"sampling.{f.name} must have shape ({batch_size},), got {shape}")
        return sampling
    if isinstance(sampling, SamplingParams):
        rows = [sampling] * batch_size
    elif isinstance(sampling, Sequence) and all(isinstance(s, SamplingParams) for s in sampling):
        rows = list(sampling)
        if len(rows) != batch_size:
            raise ValueError(f"sampling has {len(rows)} SamplingParams for a batch of {batch_size} requests")
    else:
        raise TypeError(
            f"sampling must be SamplingParams, a list of them, or SamplingBatch; got {type(sampling).__name__}"
        )
    return SamplingBatch(
        temperature=jnp.asarray(np.array([s.temperature for s in rows], np.float32)),
        top_k=jnp.asarray(np.array([s.top_k for s in rows], np.int32)),
        top_p=jnp.asarray(np.array([s.top_p for s in rows], np.float32)),
        min_p=jnp.asarray(np.array([s.min_p for s in rows], np.float32)),
        seed=jnp.asarray(np.array([s.seed or 0 for s in rows], np.uint32)),
        has_seed=jnp.asarray(np.array([s.seed is not None for s in rows], bool)),
    )


def canonical_temperature(temperature: jax.Array) -> jax.Array:
    """Per-row temperatures as float32 with every value below ``GREEDY_BELOW`` set to 0 (greedy)."""
    t = jnp.asarray(temperature).astype(jnp.float32)
    return jnp.where(t < jnp.float32(GREEDY_BELOW), jnp.float32(0.0), t)


def _row_is_valid(logits: jax.Array) -> jax.Array:
    """[..., V] -> [...]: no NaN, no +inf, at least one finite entry."""
    return ~jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1) & jnp.any(logits > -jnp.inf, axis=-1)


def _mass_strictly_above(q: jax.Array) -> jax.Array:
    """[..., V] probabilities -> [..., V]: for each v, the total mass of entries with q_u > q_v."""
    desc = -jnp.sort(-q, axis=-1)
    excl_cumsum = jnp.cumsum(desc, axis=-1) - desc
    # Number of entries strictly greater than q_v = position of q_v's first occurrence in `desc`.
    n_greater = jax.vmap(lambda d, x: jnp.searchsorted(-d, -x, side="left"))(
        desc.reshape(-1, desc.shape[-1]), q.reshape(-1, q.shape[-1])
    ).reshape(q.shape)
    return jnp.take_along_axis(excl_cumsum, n_greater, axis=-1)


@jax.jit
def target_logprobs(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """The exact law of the canonical pipeline, as log-probabilities (plain reference).

    Args:
      logits: ``[B, M, V]`` (any float dtype; computed in float32).
      params: ``SamplingBatch`` with ``[B]`` fields (one per request, shared by its M rows).

    Returns:
      ``[B, M, V]`` float32 log-probabilities: ``-inf`` for removed tokens; greedy rows are the
      point mass on the argmax; invalid rows (see module doc) are all ``NaN``.
    """
    x = logits.astype(jnp.float32)
    B, M, V = x.shape
    col = lambda a: a[:, None, None]  # [B] -> [B, 1, 1]
    temperature = col(canonical_temperature(params.temperature))  # greedy iff 0 from here on
    top_k, top_p, min_p = col(params.top_k), col(params.top_p), col(params.min_p)

    valid = _row_is_valid(x)[..., None]
    # Greedy: the point mass on the argmax (lowest index on ties).
    greedy = jnp.where(jnp.arange(V) == jnp.argmax(x, axis=-1)[..., None], 0.0, -jnp.inf)

    # Temperature. Shifting by the row max first keeps tiny temperatures from overflowing.
    z = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(temperature > 0, temperature, 1.0)
    # top-k: keep everything tied with the k-th largest value.
    kth = jnp.take_along_axis(-jnp.sort(-z, axis=-1), jnp.clip(top_k - 1, 0, V - 1), axis=-1)
    keep = (top_k <= 0) | (top_k >= V) | (z >= kth)
    # top-p on the top-k-renormalised distribution.
    q = jax.nn.softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
    keep &= (top_p >= 1.0) | (_mass_strictly_above(q) < top_p)
    # min-p relative to the most probable token (renormalisation does not change the ratio).
    keep &= q >= min_p * jnp.max(q, axis=-1, keepdims=True)
    keep &= z > -jnp.inf
    sampled = jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)

    logp = jnp.where(temperature > 0, sampled, greedy)
    return jnp.where(valid, logp, jnp.nan)


def sample_with_noise(logprobs: jax.Array, gumbel: jax.Array) -> jax.Array:
    """Gumbel-max: argmax(logprobs + noise) is an exact draw from ``softmax(logprobs)``.

    Removed tokens are ``-inf`` and cannot win against any finite noise; rows whose
    log-probabilities are NaN (invalid logits) give ``INVALID_TOKEN``.
    """
    tokens = jnp.argmax(logprobs + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.isnan(logprobs[..., 0]), INVALID_TOKEN, tokens)


def reference_sample(logits: jax.Array, params: SamplingBatch, key: jax.Array) -> jax.Array:
    """One draw per row of ``logits [R, V]`` (``params`` fields ``[R]``) by Gumbel-max from
    ``target_logprobs``: the plain reference of the fused kernel (same law, another random stream)."""
    logp = target_logprobs(logits[:, None, :], params)[:, 0]
    return sample_with_noise(logp, jax.random.gumbel(key, logp.shape, jnp.float32))


def sample_tree_nodes(
    node_logits: jax.Array,
    sampling: SamplingParams | Sequence[SamplingParams] | SamplingBatch,
    key: jax.Array,
    *,
    impl: str | Backend = "auto",
) -> jax.Array:
    """Applies the target's decoding rule independently at every tree node.

    Args:
      node_logits: ``[B, M, V]`` target logits at the M nodes of each request's tree.
      sampling: one ``SamplingParams`` for all, one per request, or a ``SamplingBatch``.
        Greedy and sampled requests can share a batch.
      key: one PRNG key (split per request by ``ddtree_jax.rng.request_keys``) or ``[B]`` keys.
      impl: "auto" (the fused Pallas kernel on GPU and TPU, the reference elsewhere), "pallas"
        (the platform's kernel; the Triton one in interpret mode off GPU/TPU), "pallas:triton" /
        "pallas:mosaic_tpu" (that backend's kernel, interpreted off its platform), "reference",
        or a resolved ``Backend`` (``ddtree_jax.backend``). The kernels draw from the same law
        with their own random stream (``ddtree_jax.rng.node_seed_words``; the Triton and TPU
        kernels hash the same seed words the same way); either way a request's draws depend only
        on its own key (seed), never on its batch position or neighbours.

    Returns:
      ``[B, M]`` int32 tokens; ``INVALID_TOKEN`` (-1) for rows with invalid logits.
    """
    backend = resolve_backend(impl)
    node_logits = jnp.asarray(node_logits)
    if node_logits.ndim != 3:
        raise ValueError(f"node_logits must be [B, M, V], got shape {node_logits.shape}")
    if not jnp.issubdtype(node_logits.dtype, jnp.floating):
        raise ValueError(f"node_logits must be floating point, got {node_logits.dtype}")
    params = batch_sampling(sampling, node_logits.shape[0])
    return _sample_tree_nodes(node_logits, params, request_keys(jnp.asarray(key), params), backend)


def _sample_tree_nodes(node_logits: jax.Array, params: SamplingBatch, keys: jax.Array, backend: Backend) -> jax.Array:
    """``sample_tree_nodes`` on validated inputs with per-request keys ``[B]`` (traceable)."""
    if backend.kernels:
        return _sample_with_kernel(node_logits, params, keys, backend)
    return _sample_reference(node_logits, params, keys)


@jax.jit
def _sample_reference(node_logits, params: SamplingBatch, keys):
    logp = target_logprobs(node_logits, params)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, node_logits.shape[1:], jnp.float32))(keys)
    return sample_with_noise(logp, noise)


@functools.partial(jax.jit, static_argnames=("backend",))
def _sample_with_kernel(node_logits, params: SamplingBatch, keys, backend: Backend):
    fused_sample = kernel_module(backend, "fused_sample").fused_sample
    B, M, V = node_logits.shape
    rep = lambda a: jnp.repeat(a, M)  # noqa: E731
    tokens = fused_sample(
        node_logits.reshape(B * M, V),
        rep(canonical_temperature(params.temperature)),
        rep(params.top_k),
        rep(params.top_p),
        rep(params.min_p),
        node_seed_words(keys, M).reshape(B * M, 2),
        interpret=backend.interpret,
    )
    return tokens.reshape(B, M)
