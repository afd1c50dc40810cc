"""Capacity planning: the bytes each device holds to serve a target (+ DFlash drafter) on a mesh,
by kind, and the most slots that fit (``python -m ddtree_jax plan``; design note and worked
examples: docs/capacity.md).

Nothing is allocated. Weights and the per-slot arrays are exact: the models are built abstractly
(``flax.nnx.eval_shape`` of their constructors) and each weight is split as loading places it
(``ddtree_jax.checkpoints.partition_spec``); the caches and the decoding state are the serving
engine's own (``serving._device.empty_state`` under ``jax.eval_shape``, ``EngineConfig.cache_len``
positions per slot). Activations and the compile workspace are estimates by the rules of
``ActivationRule``: the largest live set of the engine's compiled programs, and the buffers XLA's
GEMM autotuner allocates while it compiles them (derivations: docs/capacity.md).

Rows layout: the slots are split over the "row devices" (the ``data`` axis, and with
data-parallel attention also ``expert``); every per-slot array (both caches, the decoding state)
is split over them and replicated over the other axes; weights are replicated over ``data``.

    plan = plan_capacity(KimiConfig.kimi_k2(), drafter_config_for(KimiConfig.kimi_k2()),
                         {"expert": 8}, slots=64, max_model_len=32768, int4=K2_INT4)
    plan.bytes, plan.total, plan.fits(usable_memory("h200")), plan.max_slots(usable_memory("h200"))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax.checkpoints import DEFAULT_MESH_AXES, CheckpointError, partition_spec
from ddtree_jax.config import ConfigError, DecodeConfig, EngineConfig
from ddtree_jax.models import DFlashConfig, DFlashDrafter, Int4Format, KimiConfig, KimiForCausalLM
from ddtree_jax.models.dflash_config import default_target_layer_ids

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "DEVICE_MEMORY",
    "K2_INT4",
    "KINDS",
    "ActivationRule",
    "CapacityPlan",
    "abstract_drafter",
    "abstract_target",
    "device_memory",
    "drafter_config_for",
    "plan_capacity",
    "shard_bytes",
    "target_from_hf",
    "usable_memory",
]

KINDS = {
    "routed_experts": "routed expert weights",
    "dense_weights": "other (dense) weights",
    "embeddings": "embeddings + LM head",
    "drafter_weights": "drafter weights",
    "target_cache": "target cache (MLA latents)",
    "drafter_cache": "drafter cache",
    "decode_state": "rest of the decoding state",
    "activations": "activations (estimate)",
    "compile_workspace": "compile workspace (estimate)",
}
"""Every kind of per-device bytes a plan counts, in order, with its label."""

WEIGHT_KINDS = ("routed_experts", "dense_weights", "embeddings", "drafter_weights")
SLOT_KINDS = ("target_cache", "drafter_cache", "decode_state")

DEVICE_MEMORY = {"h200": 141 * 10**9}
"""Named devices' memory in bytes: an H200 has 141 GB (10^9 bytes) of HBM3e."""

DEFAULT_MEMORY_FRACTION = 0.9
"""The share of a device's memory a plan may fill; the rest is left to the runtime (CUDA context,
XLA's own buffers, fragmentation)."""

SAMPLER_CHUNK, SAMPLER_CANDIDATES, SAMPLER_TILE, SAMPLER_SEGMENT = 64, 128, 4096, 4
"""The fused sampler's geometry (``pallas_kernels/triton/fused_sample.py``: ``CHUNK``,
``CAND_CHUNKS``, ``MAX_TILE``, ``CHECK_SEG``), which sizes its per-row scratch."""

HOPPER_BLOCK = 512
"""The longest block whose attention runs the sm_90 kernel plus a float32 block part that holds
the block's scores (``latent_attention.HOPPER_MAX_BLOCK``); longer blocks take the Triton kernel,
which keeps them in registers."""

K2_INT4 = Int4Format(group_size=32, symmetric=True)
"""Kimi K2 Thinking's routed experts: symmetric INT4 in groups of 32 inputs."""

_DATA, _EXPERT, _TENSOR = "data", "expert", "tensor"
_MESH_AXES = (_DATA, _EXPERT, _TENSOR)


def _error(field: str, message: str) -> ConfigError:
    return ConfigError("plan_capacity", field, message)


def device_memory(name_or_bytes: str | int) -> int:
    """Bytes of one device: a name of ``DEVICE_MEMORY`` (``"h200"``) or a number of bytes (an
    integer, or a string of one such as ``"80e9"``); ``ValueError`` otherwise."""
    if isinstance(name_or_bytes, str) and name_or_bytes.strip().lower() in DEVICE_MEMORY:
        return DEVICE_MEMORY[name_or_bytes.strip().lower()]
    try:
        value = float(name_or_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of bytes or one of {sorted(DEVICE_MEMORY)}, "
                         f"got {name_or_bytes!r}") from None
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise ValueError(f"expected a whole number of bytes >= 1, got {name_or_bytes!r}")
    return int(value)


def usable_memory(name_or_bytes: str | int, fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """The bytes a plan may fill on the device: ``device_memory(name_or_bytes) * fraction``."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    return int(device_memory(name_or_bytes) * fraction)


def drafter_config_for(tcfg: KimiConfig, layers: int = 1, *, block_size: int = 16) -> DFlashConfig:
    """A DFlash drafter of ``layers`` full-attention layers (block ``block_size``) shaped for the
    target ``tcfg``: its hidden size, ``max(4, hidden / 256)`` heads of ``hidden / heads``
    dimensions with a quarter as many KV heads, an MLP twice the hidden size, fed by
    ``default_target_layer_ids`` of the target's layers, masking with the last token id."""
    heads = max(4, tcfg.hidden_size // 256)
    return DFlashConfig(
        hidden_size=tcfg.hidden_size, intermediate_size=2 * tcfg.hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=tcfg.hidden_size // heads,
        num_target_layers=tcfg.num_hidden_layers, block_size=block_size, mask_token_id=tcfg.vocab_size - 1,
        target_layer_ids=default_target_layer_ids(tcfg.num_hidden_layers, layers),
        layer_types=("full_attention",) * layers, vocab_size=tcfg.vocab_size,
    )


class _TracedKeys:
    """Stands for ``nnx.Rngs`` in a constructor run by ``nnx.eval_shape``: every draw is one
    traced key (only shapes come out, and they do not depend on keys), so no key counter is
    updated per parameter (docs/capacity.md, "Exact parts")."""

    def __init__(self):
        self._key = jax.random.key(0)

    def params(self) -> jax.Array:
        return self._key

    __call__ = params


def abstract_target(cfg: KimiConfig, *, dtype=jnp.bfloat16, int4: Int4Format | None = None) -> KimiForCausalLM:
    """``KimiForCausalLM(cfg, dtype=dtype, experts_int4=int4)`` with ``jax.ShapeDtypeStruct``
    parameters (nothing allocated)."""
    return nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=_TracedKeys(), dtype=dtype, experts_int4=int4))


def abstract_drafter(cfg: DFlashConfig, *, dtype=jnp.bfloat16) -> DFlashDrafter:
    """``DFlashDrafter(cfg, dtype=dtype)`` with ``jax.ShapeDtypeStruct`` parameters."""
    return nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=_TracedKeys(), dtype=dtype))


def target_from_hf(raw: dict, path: str, dtype="auto") -> tuple[KimiConfig, Int4Format | None, object]:
    """What ``checkpoints.load_target(path, dtype=dtype)`` builds from the folder's parsed
    ``config.json`` ``raw``, weights aside: ``(config, the routed experts' Int4Format from its
    quantization_config or None, the weight dtype)``. ``dtype="auto"`` resolves as loading does
    (config.json's ``dtype``/``torch_dtype``, else the weights' own; ``ConfigError`` on ``dtype``
    when neither says). ``ValueError`` (``CheckpointError`` included) for a config loading would
    refuse."""
    from ddtree_jax.checkpoints import _int4_format, _resolve_dtype

    cfg = KimiConfig.from_hf_dict(raw)
    try:
        dtype = _resolve_dtype(dtype, raw, path)
    except CheckpointError as e:
        raise _error("dtype", f"{dtype!r}: config.json names no dtype and the weights cannot tell ({e}); name the "
                              "dtype") from None
    return cfg, _int4_format(raw, abstract_target(cfg, dtype=dtype), path), dtype


def shard_bytes(var: nnx.Variable, mesh_sizes: Mapping[str, int], mesh_axes: dict[str, str] = DEFAULT_MESH_AXES) -> int:
    """Bytes of ``var``'s shard on each device when placed on a mesh of ``mesh_sizes`` as loading
    places it (``checkpoints.partition_spec`` of its logical ``axes``)."""
    shape = tuple(var.shape)
    spec = partition_spec(shape, var.get_metadata().get("axes", (None,) * len(shape)), mesh_sizes, mesh_axes)
    local = [d // mesh_sizes[a] if a else d for d, a in zip(shape, spec + (None,) * len(shape), strict=False)]
    return math.prod(local) * np.dtype(var.dtype).itemsize


def _target_kind(path: tuple) -> str:
    if "experts" in path[:-1]:
        return "routed_experts"
    if path[0] == "lm_head" or path[:2] == ("model", "embed_tokens"):
        return "embeddings"
    return "dense_weights"


def _variables(model: nnx.Module):
    return [(path, var) for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Variable)]


def _weight_bytes(target: nnx.Module, drafter: nnx.Module | None, mesh_sizes, mesh_axes) -> tuple[dict, int]:
    """Per-device bytes of the four weight kinds, and the bytes one MoE layer's routed experts
    gain on each device when gathered over the tensor axis (the expert-parallel kernel's input)."""
    out = dict.fromkeys(WEIGHT_KINDS, 0)
    untensored = {a: s for a, s in mesh_sizes.items() if a != _TENSOR}
    gathered, moe_layers = 0, set()
    for path, var in _variables(target):
        kind = _target_kind(path)
        out[kind] += shard_bytes(var, mesh_sizes, mesh_axes)
        if kind == "routed_experts":
            gathered += shard_bytes(var, untensored, mesh_axes) - shard_bytes(var, mesh_sizes, mesh_axes)
            moe_layers.add(path[: path.index("experts")])
    if drafter is not None:
        out["drafter_weights"] = sum(shard_bytes(var, mesh_sizes, mesh_axes) for _, var in _variables(drafter))
    return out, gathered // max(1, len(moe_layers))


def _slot_bytes(target, drafter, config: EngineConfig, rows: int, cache_len: int) -> dict[str, int]:
    """Bytes of the three per-slot kinds of an engine state of ``rows`` slots (its caches of
    ``cache_len`` positions, the output buffer, stop ids of ``config``, with ``budget="auto"`` the
    held-back drafter context), from the engine's own constructor, not allocated."""
    from ddtree_jax.auto_round import engine_deferred
    from ddtree_jax.backend import REFERENCE
    from ddtree_jax.decode_round import DecodePlan
    from ddtree_jax.serving._device import empty_state

    decode = config.decode
    plan = DecodePlan(method=decode.method, budget=decode.max_budget if drafter is not None else 0,
                      hidden_layer_ids=tuple(drafter.config.target_layer_ids) if drafter is not None else (),
                      backend=REFERENCE)
    capacity = config.max_output_tokens or config.max_model_len - 1
    stop_width = max(config.max_stop_ids, len(decode.stop_token_ids))
    depth = drafter.config.block_size - 1 if drafter is not None else 0
    deferred = engine_deferred(config, depth) if drafter is not None else 0
    state = jax.eval_shape(lambda: empty_state(target, drafter, plan, rows, cache_len, capacity, stop_width,
                                               deferred=deferred))

    def nbytes(tree):
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    caches = {"target_cache": nbytes(state.target_cache), "drafter_cache": nbytes(state.draft_cache)}
    return {**caches, "decode_state": nbytes(state) - sum(caches.values())}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def sampler_scratch(vocab: int) -> int:
    """Bytes of the fused sampler's scratch per sampled row of ``vocab`` logits: per 64-column
    chunk (a power of two of them) the candidate slots and the chunk maxima, 128 more candidate
    slots, and a few float32 words per 4096-column tile and per segment of 4 tiles."""
    tile = max(SAMPLER_CHUNK, min(SAMPLER_TILE, _pow2(vocab)))
    tiles = -(-vocab // tile)
    chunks = _pow2(tiles * (tile // SAMPLER_CHUNK))
    return 4 * (SAMPLER_CANDIDATES + 2 * chunks + 4 * _pow2(tiles) + 3 * _pow2(-(-tiles // SAMPLER_SEGMENT)))


def autotune_bytes(m: int, k: int, n: int, in_bytes: int, out_bytes: int) -> int:
    """Device bytes XLA's GEMM autotuner allocates to time an ``[m, k] @ [k, n]`` product: a copy
    of each operand (``in_bytes`` per element), the result (``out_bytes``) and a reference copy of
    the result that every candidate is checked against."""
    return (m * k + k * n) * in_bytes + 2 * m * n * out_bytes


@dataclasses.dataclass(frozen=True)
class ActivationRule:
    """The transient bytes per device (docs/capacity.md, "Activations" and "Compile workspace").

    **Activations**: the largest live set of the engine's two big compiled programs, each the
    largest of its phases (XLA reuses one phase's buffers in the next):

    * the round's ``verify``: the larger of the logits phase (the float32 logits of every tree
      node, ``n * vocab * 4``, the fused sampler's scratch ``n * sampler_scratch(vocab)`` and the
      ``captured`` target layers' outputs the drafter reads, ``captured * n * hidden * b``) and
      one target layer (``layer``) at ``n`` = slots per row device times ``verify_tokens``;
    * the round's ``draft``: one drafter layer's attention over the whole context of ``keys =
      cache_len + block`` positions, which it copies with the block appended (keys or values,
      ``rows * keys * kv_heads * head_dim * b``) beside its scores and probabilities (``2 * rows
      * heads * block * keys * b``), the block's hidden states and queries and the boolean mask
      (``rows * block * ((heads * head_dim + hidden) * b + keys)``);
    * the ``prefill`` of the largest chunk: the engine lays its rows out device by device, ``r =
      pow2(ceil(min(prefill_batch or slots, slots) / row devices))`` per device (its admission
      spreads newcomers over the devices), each device prefilling its own slots of ``prefill_chunk``
      tokens: the ``r`` slots' caches it takes out of the state and puts back (``r *
      row_cache_bytes``: every layer of both caches; on a row mesh one slot's more, the copy XLA
      makes where the take's ``shard_map`` ends) and one target layer at ``r`` rows.

    One target ``layer`` of ``n`` tokens (``rows * t``): the residual stream, the normed input and
    the captured outputs, ``(2 + captured) * n * hidden * b``, plus the larger of the attention,
    per token and local head the query in latent form ``(kv_lora + qk_rope) * b``, the float32
    partial output ``4 * kv_lora`` and, for blocks of at most ``HOPPER_BLOCK`` tokens, the float32
    scores and probabilities of the block's own keys ``8 * t``; and the routed experts:
    ``moe_rows * t * k`` token copies (``moe_rows``: the rows of the data shard, all of which each
    expert-axis device runs) of ``moe_intermediate * b + hidden * 4`` (the activated gate times up,
    the float32 expert output), with expert parallelism the float32 sum of those tokens' outputs
    ``moe_rows * t * hidden * 4``, and ``expert_gather`` (one layer's local experts gathered over
    ``tensor``).

    **Compile workspace**: while XLA compiles a program it times the candidates of its largest
    matrix product on the device (``autotune_bytes``): the verify's LM head (``n_v`` rows of
    ``hidden`` into ``lm_head_cols`` float32 logits) or the widest other projection
    (``widest_dense`` columns in the weights' dtype) at the larger of the verify's and the
    prefill's tokens."""

    vocab: int
    hidden: int
    heads: int  # local: over the tensor axis where it divides them
    kv_lora: int
    qk_rope: int
    experts_per_token: int  # 0: no MoE layer
    moe_intermediate: int
    captured: int
    dtype_bytes: int
    verify_tokens: int
    prefill_chunk: int
    prefill_batch: int | None
    row_devices: int
    data: int
    expert_parallel: bool
    expert_gather: int
    cache_len: int
    row_cache_bytes: int  # one slot's target and drafter caches
    draft_block: int  # 0: no drafter
    draft_heads: int  # local
    draft_kv_heads: int  # local
    draft_head_dim: int
    lm_head_cols: int  # per device
    widest_dense: int  # per device

    def layer_bytes(self, rows: int, moe_rows: int, t: int) -> int:
        """Live bytes per device of one target layer over ``rows`` rows of ``t`` tokens."""
        b, n = self.dtype_bytes, rows * t
        scores = 8 * t if t <= HOPPER_BLOCK else 0
        attention = n * self.heads * ((self.kv_lora + self.qk_rope) * b + 4 * self.kv_lora + scores)
        moe = 0
        if self.experts_per_token:
            tokens = moe_rows * t
            moe = (tokens * self.experts_per_token * (self.moe_intermediate * b + 4 * self.hidden)
                   + (4 * tokens * self.hidden if self.expert_parallel else 0) + self.expert_gather)
        return (2 + self.captured) * n * self.hidden * b + max(attention, moe)

    def logits_bytes(self, rows: int, t: int) -> int:
        """Live bytes per device of the verify's logits phase over ``rows`` rows of ``t`` nodes."""
        n = rows * t
        return n * (4 * self.vocab + sampler_scratch(self.vocab)) + self.captured * n * self.hidden * self.dtype_bytes

    def draft_bytes(self, rows: int) -> int:
        """Live bytes per device of one drafter layer's attention over ``rows`` rows' contexts."""
        if not self.draft_block:
            return 0
        b, block, keys = self.dtype_bytes, self.draft_block, self.cache_len + self.draft_block
        copy = keys * self.draft_kv_heads * self.draft_head_dim * b
        scores = 2 * self.draft_heads * block * keys * b
        own = block * ((self.draft_heads * self.draft_head_dim + self.hidden) * b + keys)
        return rows * (copy + scores + own)

    def prefill_rows(self, slots: int) -> int:
        """Rows of the engine's largest prefill chunk: a power of two per row device."""
        return self.row_devices * _pow2(-(-min(self.prefill_batch or slots, slots) // self.row_devices))

    def passes(self, slots: int) -> dict[str, int]:
        """``{"verify": bytes, "draft": bytes, "prefill": bytes}`` per device at ``slots`` slots."""
        rows = slots // self.row_devices
        prefill = self.prefill_rows(slots)
        return {
            "verify": max(self.logits_bytes(rows, self.verify_tokens),
                          self.layer_bytes(rows, slots // self.data, self.verify_tokens)),
            "draft": self.draft_bytes(rows),
            "prefill": (prefill // self.row_devices + (1 if self.row_devices > 1 else 0)) * self.row_cache_bytes
                       + self.layer_bytes(prefill // self.row_devices, prefill // self.data, self.prefill_chunk),
        }

    def compile_workspace(self, slots: int) -> int:
        """The compile workspace per device at ``slots`` slots (the class docstring)."""
        b, rows = self.dtype_bytes, slots // self.row_devices
        verify = rows * self.verify_tokens
        prefill = self.prefill_rows(slots) // self.row_devices * self.prefill_chunk
        return max(autotune_bytes(verify, self.hidden, self.lm_head_cols, b, 4),
                   autotune_bytes(max(verify, prefill), self.hidden, self.widest_dense, b, b))


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """Per-device bytes of a serving setup (``plan_capacity``), by kind (``KINDS``).

    ``weights``: the four weight kinds (fixed). ``slot_fixed`` + ``slot_per_row`` * rows per
    device: the three per-slot kinds (exact: every shape is affine in the rows). ``activation``:
    the activation rule. ``cache_len``: positions per slot (``max_model_len`` plus scratch).
    ``budget``: the largest tree a round verifies (0 without a drafter)."""

    mesh: dict[str, int]
    dp_attention: bool
    row_devices: int
    slots: int
    max_model_len: int
    cache_len: int
    budget: int
    weights: dict[str, int]
    slot_fixed: dict[str, int]
    slot_per_row: dict[str, int]
    activation: ActivationRule

    def bytes_at(self, slots: int) -> dict[str, int]:
        """Per-device bytes by kind (``KINDS``' order) with ``slots`` slots (a multiple of
        ``row_devices``)."""
        if slots % self.row_devices:
            raise ValueError(f"slots={slots} is not a multiple of the {self.row_devices} row devices")
        rows = slots // self.row_devices
        return {**self.weights, **{k: self.slot_fixed[k] + rows * self.slot_per_row[k] for k in SLOT_KINDS},
                "activations": max(self.activation.passes(slots).values()),
                "compile_workspace": self.activation.compile_workspace(slots)}

    @property
    def bytes(self) -> dict[str, int]:
        """Per-device bytes by kind at ``slots``."""
        return self.bytes_at(self.slots)

    @property
    def total(self) -> int:
        """Per-device bytes of every kind together at ``slots``."""
        return sum(self.bytes.values())

    @property
    def activation_pass(self) -> str:
        """``"verify"``, ``"draft"`` or ``"prefill"``: the pass whose activations are counted at
        ``slots``."""
        passes = self.activation.passes(self.slots)
        return max(passes, key=passes.get)

    def fits(self, memory: int) -> bool:
        """Whether ``total`` is at most ``memory`` bytes per device (``usable_memory``)."""
        return self.total <= memory

    def max_slots(self, memory: int) -> int:
        """The most slots (a multiple of ``row_devices``; 0: not even the weights and one slot per
        row device fit) whose per-device bytes are at most ``memory``, at ``max_model_len``."""
        step = self.row_devices

        def fit(n):
            return sum(self.bytes_at(n * step).values()) <= memory

        if not fit(1):
            return 0
        hi = 2
        while fit(hi):
            hi *= 2
        lo = hi // 2  # fit(lo), not fit(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fit(mid) else (lo, mid)
        return lo * step


def _resolve_mesh(mesh_sizes: Mapping[str, int], experts: int) -> dict[str, int]:
    mesh = dict(mesh_sizes)
    for axis, size in mesh.items():
        if axis not in _MESH_AXES:
            raise _error("mesh", f"axis {axis!r} is not one of {_MESH_AXES}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise _error("mesh", f"the size of {axis!r} must be an integer >= 1 (the planner has no devices to "
                                 f"fill with -1), got {size!r}")
    ep = mesh.get(_EXPERT, 1)
    if experts and experts % ep:
        raise _error("mesh", f"{experts} routed experts do not split over expert={ep} devices")
    return {a: mesh[a] for a in _MESH_AXES if a in mesh}


def _dp_attention(mode: bool | str, mesh: dict[str, int]) -> bool:
    if isinstance(mode, bool):
        return mode
    if mode not in ("auto", "on", "off"):
        raise _error("dp_attention", f"must be 'auto', 'on', 'off' or a bool, got {mode!r}")
    return mesh.get(_EXPERT, 1) > 1 if mode == "auto" else mode == "on"


def plan_capacity(target_cfg: KimiConfig, drafter_cfg: DFlashConfig | None, mesh_sizes: Mapping[str, int], *,
                  slots: int, max_model_len: int, budget: int | str = 64, int4: Int4Format | None = None,
                  dtype=jnp.bfloat16, dp_attention: bool | str = "auto", prefill_chunk: int = 512,
                  prefill_batch: int | None = None, mesh_axes: dict[str, str] = DEFAULT_MESH_AXES) -> CapacityPlan:
    """Per-device bytes of serving ``target_cfg`` (routed experts packed as ``int4``, weights in
    ``dtype``; router weights stay float32) with a drafter of ``drafter_cfg`` (``None``:
    autoregressive decoding, no drafter) on a mesh of ``mesh_sizes`` (axes among ``data``,
    ``expert``, ``tensor``; ``{}``: one device), the serving engine holding ``slots`` slots of
    ``max_model_len`` positions for ddtree rounds of ``budget`` (or ``"auto"``) with prompt
    chunks of ``prefill_chunk`` tokens over ``prefill_batch`` slots (``None``: all).

    ``dp_attention``: split the slots over the ``expert`` axis too (``"auto"``: when the mesh has
    one of size > 1). ``ConfigError`` naming the field (``mesh``, ``slots``, ``budget``,
    ``max_model_len``, ``prefill_chunk``, ``prefill_batch``, ``dp_attention``, ``int4``,
    ``drafter``) for a setup the engine would refuse."""
    mesh = _resolve_mesh(mesh_sizes, target_cfg.n_routed_experts)
    dp = _dp_attention(dp_attention, mesh)
    row_devices = mesh.get(_DATA, 1) * (mesh.get(_EXPERT, 1) if dp else 1)
    method = "ddtree" if drafter_cfg is not None else "ar"
    config = EngineConfig(decode=DecodeConfig(method=method, budget=budget), slots=slots, max_model_len=max_model_len,
                          prefill_chunk=prefill_chunk, prefill_batch=prefill_batch)
    config.check_for(target_cfg.vocab_size, drafter_cfg is not None, target_cfg.max_position_embeddings)
    if slots % row_devices:
        spec = ",".join(f"{a}={s}" for a, s in mesh.items())
        where = "data x expert: data-parallel attention" if dp else "data"
        raise _error("slots", f"{slots} slots do not split over the {row_devices} row devices of mesh {spec} "
                              f"({where}); use a multiple of {row_devices}")
    if int4 is not None:
        try:
            int4.check(target_cfg.hidden_size, target_cfg.moe_intermediate_size)
        except ValueError as e:
            raise _error("int4", str(e)) from None
    if drafter_cfg is not None and (drafter_cfg.num_target_layers != target_cfg.num_hidden_layers
                                    or drafter_cfg.hidden_size != target_cfg.hidden_size):
        raise _error("drafter", f"made for a target of {drafter_cfg.num_target_layers} layers and hidden size "
                                f"{drafter_cfg.hidden_size}; the target has {target_cfg.num_hidden_layers} and "
                                f"{target_cfg.hidden_size}")

    target = abstract_target(target_cfg, dtype=dtype, int4=int4)
    drafter = abstract_drafter(drafter_cfg, dtype=dtype) if drafter_cfg is not None else None
    weights, expert_gather = _weight_bytes(target, drafter, mesh, mesh_axes)
    depth = drafter_cfg.block_size - 1 if drafter_cfg is not None else 0
    cache_len = config.cache_len(max_model_len, depth)
    one, two = (_slot_bytes(target, drafter, config, rows, cache_len) for rows in (1, 2))
    tensor = mesh.get(_TENSOR, 1)
    local = lambda n: n // tensor if n % tensor == 0 else n  # noqa: E731 - dims split over tensor where it divides
    moe = target_cfg.n_routed_experts and target_cfg.first_k_dense_replace < target_cfg.num_hidden_layers
    max_budget = config.decode.max_budget if drafter_cfg is not None else 0
    dense = [target_cfg.num_attention_heads * target_cfg.qk_head_dim,
             target_cfg.num_attention_heads * (target_cfg.qk_nope_head_dim + target_cfg.v_head_dim)]
    if target_cfg.first_k_dense_replace:
        dense.append(target_cfg.intermediate_size)
    if moe:
        dense.append(target_cfg.moe_intermediate_size * target_cfg.n_shared_experts)
    if drafter_cfg is not None:
        dense.append(drafter_cfg.intermediate_size)
    rule = ActivationRule(
        vocab=target_cfg.vocab_size, hidden=target_cfg.hidden_size, heads=local(target_cfg.num_attention_heads),
        kv_lora=target_cfg.kv_lora_rank, qk_rope=target_cfg.qk_rope_head_dim,
        experts_per_token=target_cfg.num_experts_per_tok if moe else 0,
        moe_intermediate=target_cfg.moe_intermediate_size,
        captured=len(drafter_cfg.target_layer_ids) if drafter_cfg is not None else 0,
        dtype_bytes=np.dtype(dtype).itemsize,
        verify_tokens=max(max_budget + 1, drafter_cfg.block_size if drafter_cfg is not None else 1),
        prefill_chunk=prefill_chunk, prefill_batch=prefill_batch, row_devices=row_devices,
        data=mesh.get(_DATA, 1), expert_parallel=mesh.get(_EXPERT, 1) > 1, expert_gather=expert_gather,
        cache_len=cache_len,
        row_cache_bytes=sum(two[k] - one[k] for k in ("target_cache", "drafter_cache")),
        draft_block=drafter_cfg.block_size if drafter_cfg is not None else 0,
        draft_heads=local(drafter_cfg.num_attention_heads) if drafter_cfg is not None else 0,
        draft_kv_heads=local(drafter_cfg.num_key_value_heads) if drafter_cfg is not None else 0,
        draft_head_dim=drafter_cfg.head_dim if drafter_cfg is not None else 0,
        lm_head_cols=local(target_cfg.vocab_size), widest_dense=max(local(d) for d in dense),
    )
    return CapacityPlan(
        mesh=mesh, dp_attention=dp, row_devices=row_devices, slots=slots, max_model_len=max_model_len,
        cache_len=cache_len, budget=max_budget, weights=weights,
        slot_fixed={k: 2 * one[k] - two[k] for k in SLOT_KINDS}, slot_per_row={k: two[k] - one[k] for k in SLOT_KINDS},
        activation=rule,
    )
