"""Kimi K2 / DeepSeek-V3 target model (HF ``DeepseekV3ForCausalLM``) in Flax NNX.

MLA attention over a latent KV cache, sigmoid-routed MoE with grouped matmuls
(``ddtree_jax.models.moe``: a Pallas kernel or ``jax.lax.ragged_dot``), and three cached forward
modes used by tree speculative decoding:

* ``prefill``: append a causal chunk (a prompt, or one decoded token) after each row's prefix;
* ``verify``: run a draft tree block whose nodes attend to the prefix and to their ancestors;
  the block's latents are written after the prefix but the lengths do not move;
* ``commit``: move the accepted nodes' latents into place and advance the lengths.

Each takes the contiguous ``KVCache`` or the paged ``paged_cache.PagedKVCache``: the forward pass
reads and writes a cache only through its ``layout`` (``ddtree_jax.models.interface.CacheLayout``)
and attends through ``paged_attention.layout_latent_attention``.

Numerics follow transformers' ``modeling_deepseek_v3.py`` (checked by tests/test_kimi.py).
Differences between transformers and DeepSeek's own inference code, where we follow transformers:
the ``q_a_layernorm``/``kv_a_layernorm`` use eps 1e-6 regardless of ``rms_norm_eps``; the yarn
softmax correction is applied whenever factor > 1 (DeepSeek only when the run's max length exceeds
the original one); top-k weights are normalised only if ``norm_topk_prob`` (DeepSeek always
normalises sigmoid scores) with a 1e-20 epsilon.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.backend import Backend
from ddtree_jax.config import ConfigError, ExecutionConfig, execution_of
from ddtree_jax.models._layers import (
    Embed,
    GatedMLP,
    Linear,
    RMSNorm,
    dense_product,
    execution_backend,
    normal_init,
)
from ddtree_jax.models.int4 import Int4Format, PackedWeight, random_packed_weight
from ddtree_jax.models.kimi_config import KimiConfig
from ddtree_jax.models.latent_attention import (
    AttentionMesh,
    cache_slots,
    per_head_causal_attention,
)
from ddtree_jax.models.moe import ExpertMesh, experts_reference, routed_experts
from ddtree_jax.models.paged_attention import layout_latent_attention
from ddtree_jax.models.paged_cache import PagedKVCache
from ddtree_jax.models.rope import apply_rope, rope_cos_sin
from ddtree_jax.models.tree_cache import ROWS, BlockMask, RowLayout, tree_block_mask
from ddtree_jax.rows import RowMesh, per_rows

__all__ = ["KVCache", "KimiForCausalLM"]

# transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """MLA latent cache, one slot per batch row.

    ``latent``: per layer, ``[B, max_len, kv_lora_rank]``, the normalised compressed KV;
    ``k_rope``: per layer, ``[B, max_len, qk_rope_head_dim]``, the shared RoPE key (rotated);
    ``lengths [B] int32``: committed tokens per row. Entries at and past ``lengths`` are scratch.
    """

    latent: tuple[jax.Array, ...]
    k_rope: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.latent[0].shape[1]

    @property
    def layout(self) -> RowLayout:
        """Contiguous: position p of row b at ``[b, p]``."""
        return ROWS

    def take_rows(self, rows: jax.Array) -> KVCache:
        """The cache of batch rows ``rows [R]`` (a gather; rows may repeat)."""
        return KVCache(
            tuple(jnp.take(a, rows, axis=0) for a in self.latent),
            tuple(jnp.take(a, rows, axis=0) for a in self.k_rope),
            jnp.take(self.lengths, rows, axis=0),
        )

    def put_rows(self, rows: jax.Array, src: KVCache) -> KVCache:
        """This cache with batch rows ``rows [R]`` replaced by ``src``'s R rows."""
        return KVCache(
            tuple(a.at[rows].set(s.astype(a.dtype)) for a, s in zip(self.latent, src.latent, strict=True)),
            tuple(a.at[rows].set(s.astype(a.dtype)) for a, s in zip(self.k_rope, src.k_rope, strict=True)),
            self.lengths.at[rows].set(src.lengths),
        )


class MLAttention(nnx.Module):
    """Multi-head latent attention, computed in the "absorbed" form straight from the latent."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype):
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, axes=(None, None), rngs=rngs, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=_LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(
            h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, axes=(None, None), rngs=rngs, dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=_LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank,
            nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            axes=(None, "tensor"),
            rngs=rngs,
            dtype=dtype,
        )
        self.o_proj = Linear(nh * cfg.v_head_dim, h, axes=("tensor", None), rngs=rngs, dtype=dtype)
        # static, set by ``KimiForCausalLM`` from its ``ExecutionConfig`` and placement: the
        # attention settings, and the ``AttentionMesh`` the kernel runs per shard of (None: one device)
        self.execution = ExecutionConfig()
        self.attention_mesh = None

    def latents(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [B,T,H]`` -> ``(latent [B,T,kv_lora_rank], k_rope [B,T,qk_rope_head_dim])``."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        k_rope = apply_rope(kv[..., cfg.kv_lora_rank :], cos, sin, interleaved=cfg.rope_interleave)
        return latent, k_rope

    def __call__(self, x, cos, sin, latent, k_rope, mask: BlockMask, *, backend: Backend, layout=ROWS) -> jax.Array:
        """Attend from ``x [B,T,H]`` to keys ``latent``/``k_rope`` (the block's own latents at
        ``[mask.start, mask.start + T)``) where ``mask`` allows (``BlockMask``): one layer's cache
        buffers laid out as ``layout`` (a ``CacheLayout``) says, contiguous ``[B,S,r]``/``[B,S,dr]``
        by default."""
        cfg = self.cfg
        b, t, _ = x.shape
        nh, dn = cfg.num_attention_heads, cfg.qk_nope_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, nh, cfg.qk_head_dim)
        q_nope = q[..., :dn]
        q_rope = apply_rope(q[..., dn:], cos[:, :, None], sin[:, :, None], interleaved=cfg.rope_interleave)
        w_kv = self.kv_b_proj.kernel[...].reshape(cfg.kv_lora_rank, nh, dn + cfg.v_head_dim)
        w_k, w_v = w_kv[..., :dn], w_kv[..., dn:]
        # The absorbed per-head products: XLA's einsum, or in the batch-invariant mode (the
        # projections' ``fixed_order``) the fixed-order product with the heads as groups.
        fixed = self.kv_b_proj.fixed_order
        if fixed is None:
            q_latent = jnp.einsum("btnd,rnd->btnr", q_nope, w_k)
        else:
            q_latent = dense_product(q_nope, w_k.transpose(1, 2, 0), fixed)
        ex = self.execution

        def absorbed():
            out_latent = layout_latent_attention(layout, q_latent, q_rope, latent, k_rope, mask,
                                                 scale=cfg.softmax_scale(), backend=backend,
                                                 mesh=self.attention_mesh, segment_keys=ex.attention_segment_keys,
                                                 segment_group=ex.attention_segment_group,
                                                 hopper=ex.hopper_attention and fixed is None).astype(x.dtype)
            if fixed is None:
                return jnp.einsum("btnr,rnd->btnd", out_latent, w_v)
            return dense_product(out_latent, w_v.transpose(1, 0, 2), fixed)

        min_tokens = ex.per_head_prefill_min_tokens
        long_prefill = mask.causal and min_tokens and t >= min_tokens and fixed is None
        impl = long_prefill and (ex.per_head_prefill_impl
                                 or _per_head_default(q_nope.dtype, dn + cfg.qk_rope_head_dim))
        if impl:
            def per_head():
                # the block's own slots: a block starting at slot 0 sees nothing else
                return per_head_causal_attention(q_nope, q_rope, layout.view(latent, t), layout.view(k_rope, t),
                                                 w_k, w_v, scale=cfg.softmax_scale(), implementation=impl,
                                                 mesh=self.attention_mesh).astype(x.dtype)

            out = jax.lax.cond(jnp.all(mask.start == 0), per_head, absorbed)
        else:
            out = absorbed()
        return self.o_proj(out.reshape(b, t, nh * cfg.v_head_dim))


def _per_head_default(dtype, head_dim: int) -> str | None:
    """The per-head prefill's attention by default: XLA off the GPU; on a GPU cuDNN's flash
    attention where it takes the shapes (bf16/fp16, a head dim that is a multiple of 8, up to 256
    from Hopper on, else 128), and else ``None``, the absorbed form (XLA's attention would build
    the ``[B,H,T,T]`` scores)."""
    if jax.default_backend() != "gpu":
        return "xla"
    hopper = float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0
    fits = dtype in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= (256 if hopper else 128)
    return "cudnn" if fits else None


class Router(nnx.Module):
    """Sigmoid top-k router with group-limited choice (HF ``DeepseekV3TopkRouter``); float32 weights."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nnx.Param(normal_init(rngs, (e, h), h, jnp.float32), axes=(None, None))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32), axes=(None,))
        self.fixed_order = None  # static, as ``Linear.fixed_order``

    def __call__(self, x: jax.Array, *, rows: RowMesh | None = None,
                 batch: int | None = None) -> tuple[jax.Array, jax.Array]:
        """``x [N,H]`` -> ``(weights [N,k] float32, expert ids [N,k] int32)``. ``rows``: the tokens
        are the row-major flattening of ``batch`` rows placed as ``rows`` says; each device routes
        its own (``ddtree_jax.rows.per_rows``)."""
        return per_rows(self._route, rows, x.shape[0] if batch is None else batch, x,
                        shared=(self.weight[...], self.e_score_correction_bias[...]))

    def _route(self, x: jax.Array, weight: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        scores = jax.nn.sigmoid(dense_product(x.astype(jnp.float32), weight.T, self.fixed_order))
        choice = scores + bias
        n = x.shape[0]
        grouped = choice.reshape(n, cfg.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        group_ok = jnp.any(top_groups[:, :, None] == jnp.arange(cfg.n_group)[None, None], axis=1)  # [n, groups]
        choice = jnp.where(group_ok[:, :, None], grouped, -jnp.inf).reshape(n, -1)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class Experts(nnx.Module):
    """Routed experts, stacked: ``gate_up_proj [E, H, 2I]`` (gate then up), ``down_proj [E, I, H]``.

    With ``int4`` (an ``Int4Format``) they are stored packed instead (``ddtree_jax.models.int4``):
    ``<name>_packed`` int32 ``[E, K/8, N]``, ``<name>_scale`` ``[E, K/G, N]`` in ``dtype`` and, for
    an asymmetric format, ``<name>_zero_point`` int8 ``[E, K/G, N]``, for ``<name>`` in
    ``gate_up_proj`` / ``down_proj``; each with the logical axes of the dense weight it stands for
    (so they shard alike). No dense copy is kept: the kernel path dequantises in registers, the
    plain-JAX paths per call."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype, int4: Int4Format | None = None):
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.int4 = int4
        shapes = {"gate_up_proj": ((e, h, 2 * i), ("expert", None, "tensor")),
                  "down_proj": ((e, i, h), ("expert", "tensor", None))}
        for name, (shape, axes) in shapes.items():
            if int4 is None:
                setattr(self, name, nnx.Param(normal_init(rngs, shape, shape[1], dtype), axes=axes))
                continue
            w = random_packed_weight(rngs, shape, int4, dtype)
            setattr(self, f"{name}_packed", nnx.Param(w.packed, axes=axes))
            setattr(self, f"{name}_scale", nnx.Param(w.scale, axes=axes))
            if w.zero is not None:
                setattr(self, f"{name}_zero_point", nnx.Param(w.zero, axes=axes))
        # static, set by ``KimiForCausalLM``: the ``ExpertMesh`` when the weights' expert dim is
        # split over a mesh axis, and the kernel's pinned ``MoEBlocks`` (None: by the token count)
        self.expert_mesh = None
        self.blocks = None

    def weights(self) -> tuple[jax.Array | PackedWeight, jax.Array | PackedWeight]:
        """``(gate_up, down)``: dense arrays, or ``PackedWeight`` for INT4 experts."""
        if self.int4 is None:
            return self.gate_up_proj[...], self.down_proj[...]

        def packed(name):
            zero = getattr(self, f"{name}_zero_point", None)
            return PackedWeight(getattr(self, f"{name}_packed")[...], getattr(self, f"{name}_scale")[...],
                                None if zero is None else zero[...])

        return packed("gate_up_proj"), packed("down_proj")

    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array, *, backend: Backend,
                 valid: jax.Array | None = None, batch: int | None = None) -> jax.Array:
        """Grouped matmuls over token copies sorted by expert: the Pallas kernel where
        ``backend.kernels``, else ``jax.lax.ragged_dot``. ``x [N,H]``, ``weights/ids [N,k]``,
        ``valid [N]`` bool (None: all): invalid tokens route to no expert (zero output); ``batch``:
        the rows the tokens flatten (``routed_experts``)."""
        gate_up, down = self.weights()
        return routed_experts(x, gate_up, down, weights, ids, backend=backend, valid=valid,
                              expert_mesh=self.expert_mesh, blocks=self.blocks, batch=batch)

    def reference(self, x: jax.Array, weights: jax.Array, ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """Same result with every expert run densely on every token (the slow, obvious version)."""
        return experts_reference(x, *self.weights(), weights, ids, valid)


class MoE(nnx.Module):
    """Routed experts plus always-on shared experts (HF ``DeepseekV3MoE``)."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype, int4: Int4Format | None = None):
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, int4=int4)
        self.shared_experts = GatedMLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, rngs=rngs, dtype=dtype
        )
        self.row_mesh = None  # static, set by ``KimiForCausalLM``: where the batch rows live

    def __call__(self, x: jax.Array, *, backend: Backend, dense_experts: bool = False,
                 valid: jax.Array | None = None) -> jax.Array:
        """``[B,T,H] -> [B,T,H]``; ``dense_experts`` runs ``Experts.reference`` (tests, benchmark);
        ``valid [B,T]`` bool (None: all): invalid tokens get only the shared experts' output."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat, rows=self.row_mesh, batch=x.shape[0])
        flat_valid = None if valid is None else valid.reshape(-1)
        if dense_experts:
            routed = self.experts.reference(flat, weights, ids, flat_valid)
        else:
            routed = self.experts(flat, weights, ids, backend=backend, valid=flat_valid, batch=x.shape[0])
        return routed.reshape(x.shape) + self.shared_experts(x)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: KimiConfig, layer: int, *, rngs: nnx.Rngs, dtype, int4: Int4Format | None = None):
        self.self_attn = MLAttention(cfg, rngs=rngs, dtype=dtype)
        self.mlp = (
            MoE(cfg, rngs=rngs, dtype=dtype, int4=int4)
            if cfg.is_moe_layer(layer)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, cos, sin, mask, cache_rows, start, *, backend: Backend, dense_experts=False, valid=None,
                 layout=ROWS):
        """One block. ``cache_rows``: ``None`` (attend within ``x``) or this layer's
        ``(latent, k_rope)`` cache buffers, laid out as ``layout`` (a ``CacheLayout``) says; the
        new latents are written at ``start [B]`` and ``mask`` (``BlockMask``) says what the block
        sees; ``valid [B,T]`` (or None) is for the MoE. Returns ``(x, cache_rows)``."""
        h = self.input_layernorm(x)
        latent, k_rope = self.self_attn.latents(h, cos, sin)
        if cache_rows is not None:
            latent = layout.write(cache_rows[0], start, latent)
            k_rope = layout.write(cache_rows[1], start, k_rope)
            cache_rows = (latent, k_rope)
        x = x + self.self_attn(h, cos, sin, latent, k_rope, mask, backend=backend, layout=layout)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            x = x + self.mlp(h, backend=backend, dense_experts=dense_experts, valid=valid)
        else:
            x = x + self.mlp(h)
        return x, cache_rows


class DeepseekV3Model(nnx.Module):
    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype, int4: Int4Format | None = None):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, int4=int4)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)


class KimiForCausalLM(nnx.Module):
    """The target model; parameter paths mirror HF names (``model.layers.3.self_attn.kv_b_proj``).

    ``dtype`` is the weights' and activations' dtype; norms, softmax and the router run in float32.
    ``execution`` (an ``ExecutionConfig``, default ``ExecutionConfig()``) says how it computes:
    the attention and expert implementations (``impl``: ``"auto"`` runs the Pallas kernels on a
    GPU, the plain-JAX references elsewhere), batch invariance, kernel blocks and segments, the
    attention forms; ``impl=`` alone is shorthand for ``execution=ExecutionConfig(impl=impl)``. It
    is read as ``model.execution`` and changed with ``with_execution`` (a new model object on the
    same weights). ``experts_int4`` (an ``Int4Format``): every MoE layer's routed experts are
    stored as packed INT4 with group scales (``Experts``; random values here, a checkpoint's
    through ``load_target``), everything else stays in ``dtype``.

    Placement: ``load_target(mesh=...)`` and ``init_on_mesh`` place the weights and tell the model
    its mesh, so that the kernels run sharded: with the expert dim split over a mesh axis, the MoE
    kernel path runs expert-parallel (``ddtree_jax.models.moe.experts_expert_parallel``); the
    batch rows split over the mesh's row axes (``row_mesh``, a ``ddtree_jax.rows.RowMesh``: by
    default ``data`` and ``expert``, data-parallel attention; the serving state's caches follow,
    ``ddtree_jax.serving.sharding.state_sharding``), the attention running in a ``shard_map`` on
    each device's rows with heads over the ``tensor`` axis (``latent_attention``).
    """

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, execution: ExecutionConfig | None = None,
                 impl: str | Backend | None = None, experts_int4: Int4Format | None = None):
        if experts_int4 is not None:
            experts_int4.check(cfg.hidden_size, cfg.moe_intermediate_size)
        self.config = cfg
        self.experts_int4 = experts_int4
        self.model = DeepseekV3Model(cfg, rngs=rngs, dtype=dtype, int4=experts_int4)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self._configure(execution_of(execution, impl), None, ())

    @property
    def execution(self) -> ExecutionConfig:
        """How the model computes (``ExecutionConfig``); ``with_execution`` changes it."""
        return self._execution

    def with_execution(self, execution: ExecutionConfig) -> KimiForCausalLM:
        """A new model object on the same weight arrays (``nnx.split``/``nnx.merge``; its own
        variables, so writing into one model's weights leaves the other's as they are), placed as
        this one and computing as ``execution`` says. This model is left as it is. Raises
        ``ConfigError`` where ``execution`` does not fit the backend or the placement (batch
        invariance needs the Triton kernels on one device)."""
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state, copy=True)
        model._configure(execution, self._mesh, self._mesh_axes)
        return model

    def _learn_placement(self, mesh, mesh_axes: dict[str, str]) -> None:
        """Learn the mesh the weights were just placed on (``load_target``, ``init_on_mesh``: on a
        model they built) under the logical -> mesh axis map ``mesh_axes``."""
        self._configure(self._execution, mesh, tuple(sorted(mesh_axes.items())))

    def _configure(self, execution: ExecutionConfig, mesh, mesh_axes: tuple[tuple[str, str], ...]) -> None:
        """Check ``execution`` against its backend and the placement, then set every submodule's
        static settings from them (the one place that does)."""
        backend = execution_backend(execution, "model")
        axes = dict(mesh_axes)
        attention = AttentionMesh.of(mesh, axes)
        rows = RowMesh.of(mesh, axes)
        if execution.batch_invariant and attention is not None:
            raise ConfigError("ExecutionConfig", "batch_invariant",
                              "the fixed-order product runs on one device; this model is placed on a mesh")
        expert_axis = axes.get("expert")
        fixed = backend if execution.batch_invariant else None
        blocks = execution.moe_blocks
        if blocks is None and execution.batch_invariant:
            blocks = self._decode_moe_blocks()
        for _, module in nnx.iter_graph(self):
            if isinstance(module, (Linear, Router)):
                module.fixed_order = fixed
            elif isinstance(module, MLAttention):
                module.execution, module.attention_mesh = execution, attention
            elif isinstance(module, MoE):
                module.row_mesh = rows
            elif isinstance(module, Experts):
                split = (mesh is not None and expert_axis in mesh.axis_names
                         and module.num_experts % mesh.shape[expert_axis] == 0)
                module.expert_mesh = ExpertMesh(mesh, expert_axis, rows) if split else None
                module.blocks = blocks
        self._execution, self.backend, self.row_mesh = execution, backend, rows
        self._mesh, self._mesh_axes = mesh, mesh_axes

    def _decode_moe_blocks(self):
        """The MoE kernel's blocks for the fewest token copies (a decode step's, as ``choose_blocks``
        gives them): what the batch-invariant mode pins when ``moe_blocks`` is ``None``."""
        from pallas_kernels.triton.moe_grouped_matmul import choose_blocks

        cfg = self.config
        act_bytes = jnp.dtype(self.model.embed_tokens.weight.dtype).itemsize
        return choose_blocks(1, cfg.n_routed_experts, int4=self.experts_int4 is not None, act_bytes=act_bytes)

    # ---- pieces the drafter shares ----

    def embed(self, tokens: jax.Array) -> jax.Array:
        """``int [...] -> [..., H]``: the token embedding."""
        return self.model.embed_tokens(tokens)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """``[..., H] -> float32 [..., V]``: the LM head alone (no final norm), its float32
        accumulation returned as it is (a bf16 result converted afterwards would round every logit
        to bf16 and cost a pass over the ``[tokens, V]`` logits; docs/performance.md, "The Kimi
        K2-shaped target")."""
        return self.lm_head(hidden, out_dtype=jnp.float32)

    # ---- forward passes ----

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Cache-free causal forward: ``int [B,T]`` -> logits ``float32 [B,T,V]``."""
        return self.forward_uncached(input_ids)[0]

    def forward_uncached(self, input_ids, *, hidden_layer_ids: tuple[int, ...] = (), dense_experts=False):
        """Causal forward without a cache: ``(logits [B,T,V], hidden tuple of [B,T,H])``.

        ``hidden`` holds, for each id in ``hidden_layer_ids``, transformers'
        ``hidden_states[id + 1]``: the output of layer ``id``, except that the LAST layer's entry is
        after the final norm (transformers returns the normed final state as its last entry).
        The same holds for ``prefill`` and ``verify``."""
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = BlockMask(jnp.zeros((b,), jnp.int32))
        logits, hidden, _ = self._run(input_ids, positions, mask, None, None, hidden_layer_ids, dense_experts)
        return logits, hidden

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache of ``batch`` slots of at least ``max_len`` tokens (``dtype`` defaults to the
        weights'): the length is rounded up to a multiple of ``CACHE_SLOT_MULTIPLE`` (8), which
        the Hopper attention kernel needs (``cache_slots``; the extra slots are scratch)."""
        cfg = self.config
        max_len = cache_slots(max_len)
        dtype = dtype or self.model.embed_tokens.weight.dtype
        layers = range(cfg.num_hidden_layers)
        return KVCache(
            tuple(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype) for _ in layers),
            tuple(jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype) for _ in layers),
            jnp.zeros((batch,), jnp.int32),
        )

    def init_paged_cache(self, num_pages: int, page_size: int, pages_per_slot: int, batch: int,
                         dtype=None) -> PagedKVCache:
        """An empty paged cache (``PagedKVCache.init``: zero pools of ``num_pages`` pages of
        ``page_size`` positions, ``batch`` rows of ``pages_per_slot`` null table entries); ``dtype``
        defaults to the weights'. Every forward pass takes it where it takes a ``KVCache``."""
        cfg = self.config
        return PagedKVCache.init(num_pages, page_size, pages_per_slot, batch, num_layers=cfg.num_hidden_layers,
                                 kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                                 dtype=dtype or self.model.embed_tokens.weight.dtype)

    def prefill(
        self,
        input_ids: jax.Array,
        lengths: jax.Array,
        cache: KVCache,
        *,
        hidden_layer_ids: tuple[int, ...] = (),
        dense_experts: bool = False,
        valid: jax.Array | None = None,
        logits_at: jax.Array | None = None,
    ):
        """Append a causal chunk after each row's prefix (a prompt into an empty slot, or a decode step).

        ``input_ids [B,T]`` right-padded, ``lengths [B]`` valid tokens per row (0 leaves a row
        untouched). Needs ``cache.lengths + T <= max_len``. Returns ``(logits [B,T,V] float32,
        hidden tuple of [B,T,H] after each requested layer (see ``forward_uncached``), cache)``;
        the lengths advance by ``lengths``. Outputs at padded positions are meaningless; with
        ``valid [B,T]`` (the tokens before each row's length) they also route to no expert (the
        valid tokens' outputs are unchanged). ``cache``:
        a ``KVCache`` or a ``PagedKVCache`` whose tables cover ``[0, cache.lengths + lengths)``
        (``verify``'s and ``commit``'s the same, over their blocks).
        ``dense_experts`` runs the dense reference MoE (benchmarks). ``logits_at [B]`` (positions in
        the chunk): the logits there only, ``[B, 1, V]`` (the LM head runs on those rows alone).
        """
        b, t = input_ids.shape
        chex.assert_shape(lengths, (b,))
        start = cache.lengths
        positions = start[:, None] + jnp.arange(t)[None]
        logits, hidden, cache = self._run_cached(
            input_ids, positions, None, cache, hidden_layer_ids, dense_experts, valid, logits_at=logits_at
        )
        return logits, hidden, dataclasses.replace(cache, lengths=start + lengths.astype(jnp.int32))

    def verify(
        self,
        tokens: jax.Array,
        depths: jax.Array,
        ancestor_mask: jax.Array,
        cache: KVCache,
        *,
        hidden_layer_ids: tuple[int, ...] = (),
        dense_experts: bool = False,
        valid: jax.Array | None = None,
    ):
        """Score a tree block of ``T`` nodes per row (node 0 is the root: the last committed token).

        ``tokens [B,T]``, ``depths [B,T]`` (root 0; position = ``lengths + depth``),
        ``ancestor_mask [B,T,T]`` bool, ``[b,i,j]`` true iff node j is an ancestor of node i (the
        diagonal is added). Each node attends to the row's cached prefix and its ancestors. The
        block's latents are written at ``[lengths, lengths+T)``; lengths do not move (``commit``
        keeps the accepted ones). ``valid [B,T]`` bool (None: all nodes): unused node slots route
        to no expert (their outputs are meaningless; the valid nodes' are unchanged).
        Returns ``(logits [B,T,V], hidden tuple [B,T,H], cache)``.
        """
        b, t = tokens.shape
        chex.assert_shape([depths, ancestor_mask], [(b, t), (b, t, t)])
        if valid is not None:
            chex.assert_shape(valid, (b, t))
        positions = cache.lengths[:, None] + depths
        return self._run_cached(
            tokens, positions, tree_block_mask(ancestor_mask), cache, hidden_layer_ids, dense_experts, valid
        )

    @staticmethod
    def commit(cache: KVCache | PagedKVCache, accepted: jax.Array, counts: jax.Array) -> KVCache | PagedKVCache:
        """Keep the accepted nodes of the last ``verify`` block and drop the rest.

        ``accepted [B,A]`` node indices in path order (root first), ``-1`` padded; ``counts [B]``
        how many are valid. Node ``accepted[b,i]``'s latents move to ``lengths[b] + i``; lengths
        advance by ``counts``.
        """
        start, layout = cache.lengths, cache.layout
        return dataclasses.replace(cache, latent=tuple(layout.commit(a, start, accepted) for a in cache.latent),
                                   k_rope=tuple(layout.commit(a, start, accepted) for a in cache.k_rope),
                                   lengths=start + counts.astype(jnp.int32))

    # ---- shared trunk ----

    def _run_cached(self, tokens, positions, block_mask, cache, hidden_layer_ids, dense_experts, valid=None,
                    logits_at=None):
        """Run a block written at ``cache.lengths`` (a ``KVCache`` or ``PagedKVCache``);
        ``block_mask [B,T,T]`` says which block tokens see which, ``None`` a causal block (the
        whole prefix is always visible)."""
        start = cache.lengths
        mask = BlockMask(start, block_mask)
        logits, hidden, rows = self._run(tokens, positions, mask, cache, start, hidden_layer_ids, dense_experts,
                                         valid, logits_at=logits_at)
        # Each layer's buffer was updated where the block landed; nothing is stacked or copied.
        return logits, hidden, dataclasses.replace(cache, latent=tuple(r[0] for r in rows),
                                                   k_rope=tuple(r[1] for r in rows))

    def _run(self, tokens, positions, mask, cache, start, hidden_layer_ids, dense_experts, valid=None,
             logits_at=None):
        """The trunk; ``cache`` is ``None`` (cache-free) or a cache whose ``layout`` says where its
        buffers hold the positions; ``valid [B,T]`` (or None) reaches only the MoE layers (invalid
        tokens route to no expert); ``logits_at [B]``: the logits at those positions only."""
        cfg = self.config
        for i in hidden_layer_ids:
            if not 0 <= i < cfg.num_hidden_layers:
                raise ValueError(f"hidden_layer_ids: layer {i} not in [0, {cfg.num_hidden_layers})")
        inv_freq, rope_scale = cfg.rope_tables()
        cos, sin = rope_cos_sin(positions, inv_freq, rope_scale)
        x = self.embed(tokens)
        hidden, rows = {}, []
        layout = ROWS if cache is None else cache.layout
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else (cache.latent[i], cache.k_rope[i])
            x, layer_cache = layer(x, cos, sin, mask, layer_cache, start, backend=self.backend,
                                   dense_experts=dense_experts, valid=valid, layout=layout)
            rows.append(layer_cache)
            hidden[i] = x
        # transformers' ``hidden_states[i + 1]`` convention: the last entry is the NORMED output
        # (DFlash's ``extract_context_feature`` reads it that way for a last-layer target id).
        hidden[cfg.num_hidden_layers - 1] = normed = self.model.norm(x)
        if logits_at is not None:
            normed = jnp.take_along_axis(normed, logits_at[:, None, None], axis=1)
        logits = self.lm_logits(normed)
        return logits, tuple(hidden[i] for i in hidden_layer_ids), rows
