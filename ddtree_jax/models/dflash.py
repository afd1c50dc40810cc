"""DFlash block-diffusion drafter (z-lab/dflash ``DFlashDraftModel``) in Flax NNX.

A few Qwen3-style layers predict a whole block of future tokens in one pass. Input block:
``[last committed token, MASK x (block_size-1)]`` at positions ``len .. len+block_size-1``,
embedded with the TARGET's embedding; output: logits at depths ``1 .. block_size-1`` through the
target's LM head (after the drafter's own final norm). Conditioning: the target's hidden states
after ``target_layer_ids`` (concatenated on features) go through ``fc`` + ``hidden_norm``; in every
layer the keys/values are ``[proj(context) ; proj(block)]`` and the queries come from the block
only; attention is non-causal, as in the reference. A ``sliding_attention`` layer with a window
``w`` sees the symmetric band ``|query position - key position| < w`` of ``[context ; block]``
(the reference's flash-attention behaviour); ``is_causal=True`` in the config also hides later
positions (see ``DFlashConfig``). RoPE is Qwen3's: default, linear or yarn (yarn's attention
factor multiplies cos and sin, so scores scale by its square), the same tables for the context
keys and the block queries/keys. The projected context K/V are cached per layer
(``DraftCache``, or paged: ``paged_cache.PagedDraftCache``, read and written only through the
cache's ``layout``) and grow only by accepted tokens.

The target is passed to the calls that need it: any object with ``embed(tokens) -> [..., H]``
and ``lm_logits(hidden) -> [..., V]`` (``KimiForCausalLM`` has both).

How the drafter computes is an ``ExecutionConfig`` (``ddtree_jax.config``), as for the target: with
``batch_invariant`` every product (the projections, the MLPs, ``fc``) runs through the fixed-order
Pallas product (``pallas_kernels/triton/dense_matmul.py``) and the attention through its Triton
kernel (``models.block_attention``, one program per row and key-value head), so a row's bits do
not depend on the other rows or on their number; the LM head is the target's (batch-invariant
when the target is). Wherever the Triton kernels run, the drafting pass (``propose``) attends
through that kernel, which reads each row's context only up to its length. The other fields
concern the target only. Design note: docs/serving.md, "Deterministic mode".
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.backend import REFERENCE
from ddtree_jax.config import ConfigError, ExecutionConfig, execution_of
from ddtree_jax.models._layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    execution_backend,
)
from ddtree_jax.models.block_attention import block_attention
from ddtree_jax.models.dflash_config import DFlashConfig
from ddtree_jax.models.paged_cache import PagedDraftCache
from ddtree_jax.models.rope import apply_rope, rope_cos_sin
from ddtree_jax.models.tree_cache import ROWS, RowLayout

__all__ = ["DFlashDrafter", "DraftCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """Projected context keys/values of the committed tokens, per draft layer and batch slot.

    ``k, v``: per draft layer, ``[B, max_len, kv_heads, head_dim]`` (keys after k_norm and RoPE at
    their absolute positions ``0 .. lengths-1``), each layer its own buffer (updated in place, never
    stacked); ``lengths [B] int32``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def layout(self) -> RowLayout:
        """Contiguous: position p of row b at ``[b, p]``."""
        return ROWS

    def take_rows(self, rows: jax.Array) -> DraftCache:
        """The cache of batch rows ``rows [R]`` (a gather; rows may repeat)."""
        return DraftCache(
            tuple(jnp.take(a, rows, axis=0) for a in self.k),
            tuple(jnp.take(a, rows, axis=0) for a in self.v),
            jnp.take(self.lengths, rows, axis=0),
        )

    def put_rows(self, rows: jax.Array, src: DraftCache) -> DraftCache:
        """This cache with batch rows ``rows [R]`` replaced by ``src``'s R rows."""
        return DraftCache(
            tuple(a.at[rows].set(s.astype(a.dtype)) for a, s in zip(self.k, src.k, strict=True)),
            tuple(a.at[rows].set(s.astype(a.dtype)) for a, s in zip(self.v, src.v, strict=True)),
            self.lengths.at[rows].set(src.lengths),
        )


class DFlashAttention(nnx.Module):
    """Qwen3 attention (q/k RMSNorm per head, RoPE, GQA) whose keys also cover the context."""

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype):
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(h, cfg.num_attention_heads * hd, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.k_proj = Linear(h, cfg.num_key_value_heads * hd, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.v_proj = Linear(h, cfg.num_key_value_heads * hd, axes=(None, "tensor"), rngs=rngs, dtype=dtype)
        self.o_proj = Linear(cfg.num_attention_heads * hd, h, axes=("tensor", None), rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.attention_backend = REFERENCE  # static: where ``block_attention`` runs (``DFlashDrafter._configure``)

    def kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [B,S,H]`` -> keys, values ``[B,S,kv_heads,head_dim]`` (keys normed and rotated)."""
        b, s, _ = x.shape
        shape = (b, s, self.cfg.num_key_value_heads, self.cfg.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(shape)), cos[:, :, None], sin[:, :, None], interleaved=False)
        return k, self.v_proj(x).reshape(shape)

    def __call__(self, x, cos, sin, k_ctx, v_ctx, lengths, *, causal: bool, window: int | None,
                 kernel: bool = True, page_table=None) -> jax.Array:
        """Block ``x [B,T,H]`` at positions ``lengths + t`` attends to its context ``k_ctx, v_ctx
        [B,S,kvh,hd]`` (the first ``lengths [B]`` positions; with ``page_table``, page pools) and
        to itself (``models.block_attention``: ``causal`` and ``window`` as there;
        ``kernel=False``: its plain-JAX reference whatever ``attention_backend`` says)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], interleaved=False)
        k_blk, v_blk = self.kv(x, cos, sin)
        out = block_attention(q, k_ctx.astype(x.dtype), v_ctx.astype(x.dtype), k_blk, v_blk, lengths,
                              causal=causal, window=window, scale=cfg.head_dim**-0.5,
                              backend=self.attention_backend if kernel else REFERENCE, page_table=page_table)
        return self.o_proj(out.reshape(b, t, -1))


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype):
        self.self_attn = DFlashAttention(cfg, rngs=rngs, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, cos, sin, k_ctx, v_ctx, lengths, *, causal: bool, window: int | None, kernel: bool,
                 page_table=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, lengths, causal=causal, window=window,
                               kernel=kernel, page_table=page_table)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nnx.Module):
    """The drafter's own weights (parameter paths mirror the checkpoint's tensor names).

    ``execution`` (an ``ExecutionConfig``, default ``ExecutionConfig()``; ``impl=`` alone is
    shorthand for ``ExecutionConfig(impl=impl)``) says how it computes: its ``impl`` and
    ``batch_invariant`` as for the target (the module docstring). Read as ``drafter.execution``,
    changed with ``with_execution``."""

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 execution: ExecutionConfig | None = None, impl=None):
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nnx.List([DFlashLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_hidden_layers)])
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, axes=(None, None), rngs=rngs, dtype=dtype)
        self.hidden_norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self._configure(execution_of(execution, impl))

    @property
    def execution(self) -> ExecutionConfig:
        """How the drafter computes (``ExecutionConfig``); ``with_execution`` changes it."""
        return self._execution

    def with_execution(self, execution: ExecutionConfig) -> DFlashDrafter:
        """A new drafter object on the same weight arrays (as ``KimiForCausalLM.with_execution``),
        computing as ``execution`` says; this one is left as it is. Raises ``ConfigError`` where
        ``batch_invariant`` does not fit (it needs the Triton kernels, on one device)."""
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state, copy=True)
        model._configure(execution)
        return model

    def _configure(self, execution: ExecutionConfig) -> None:
        """Check ``execution`` and set every product's static ``fixed_order`` and the attention's
        backend from it (the one place that does)."""
        backend = execution_backend(execution, "drafter")
        several = _on_several_devices(self)
        if execution.batch_invariant and several:
            raise ConfigError("ExecutionConfig", "batch_invariant",
                              "the fixed-order product runs on one device; this drafter is placed on a mesh")
        fixed = backend if execution.batch_invariant else None
        for _, module in nnx.iter_graph(self):
            if isinstance(module, Linear):
                module.fixed_order = fixed
        # the attention kernel runs on one device (a mesh runs the plain-JAX path, which XLA
        # partitions); its rows are batch-invariant by construction
        self._attend_on(REFERENCE if several else backend)
        self._execution = execution

    def _learn_placement(self, mesh, mesh_axes) -> None:
        """``init_on_mesh``, ``load_drafter``: a drafter placed on a mesh of several devices attends
        through the plain-JAX path."""
        if mesh.size > 1:
            self._attend_on(REFERENCE)

    def _attend_on(self, backend) -> None:
        """Every layer's attention runs on ``backend`` (``DFlashAttention.attention_backend``)."""
        for layer in self.layers:
            layer.self_attn.attention_backend = backend

    # ---- context ----

    def init_cache(self, batch: int, max_len: int, dtype=None) -> DraftCache:
        cfg = self.config
        dtype = dtype or self.fc.kernel.dtype
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        return DraftCache(
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            jnp.zeros((batch,), jnp.int32),
        )

    def init_paged_cache(self, num_pages: int, page_size: int, pages_per_slot: int, batch: int,
                         dtype=None) -> PagedDraftCache:
        """An empty paged context (``PagedDraftCache.init``; ``dtype`` defaults to the weights'):
        ``append_context`` and ``propose`` take it where they take a ``DraftCache``."""
        cfg = self.config
        return PagedDraftCache.init(num_pages, page_size, pages_per_slot, batch, num_layers=cfg.num_hidden_layers,
                                    kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                    dtype=dtype or self.fc.kernel.dtype)

    def _context_kv(self, target_hidden: jax.Array, positions: jax.Array):
        """``[B,A,n*H]`` target features at ``positions [B,A]`` -> per-layer ``(k, v)`` lists."""
        features = self.hidden_norm(self.fc(target_hidden))
        cos, sin = rope_cos_sin(positions, *self.config.rope_tables())
        kvs = [layer.self_attn.kv(features, cos, sin) for layer in self.layers]
        return [k for k, _ in kvs], [v for _, v in kvs]

    def append_context(self, cache, target_hidden: jax.Array, counts: jax.Array):
        """Add accepted tokens to the context (a ``DraftCache`` or a ``PagedDraftCache``).

        ``target_hidden [B,A,n*H]``: the target's hidden states after ``config.target_layer_ids``
        (concatenated on features, in that order) for the next ``A`` committed positions of each
        row; only the first ``counts [B]`` are valid. Needs ``lengths + A <= max_len`` (paged:
        positions past a row's pages are dropped, so its table must cover the valid ones).
        """
        b, a, _ = target_hidden.shape
        chex.assert_shape(counts, (b,))
        start, layout = cache.lengths, cache.layout
        ks, vs = self._context_kv(target_hidden, start[:, None] + jnp.arange(a)[None])
        k = tuple(layout.write(buf, start, new) for buf, new in zip(cache.k, ks, strict=True))
        v = tuple(layout.write(buf, start, new) for buf, new in zip(cache.v, vs, strict=True))
        return dataclasses.replace(cache, k=k, v=v, lengths=start + counts.astype(jnp.int32))

    # ---- block ----

    def _block_logits(self, target, last_token, lengths, k_ctx, v_ctx, *, kernel: bool, page_table=None,
                      depths: int | None = None):
        """Shared block pass. ``k_ctx/v_ctx``: per-layer ``[B,S,kvh,hd]`` at positions ``0 .. S-1``
        (with ``page_table``: page pools), of which the first ``lengths [B]`` are the context; the
        block sits at ``lengths + i``. ``depths``: the logits of the first ``depths`` depths only
        (the block's passes are the same: its attention is over all of it).
        ``kernel``: the attention runs where ``_configure`` said (else its reference: the passes
        that are differentiated, which the kernel is not)."""
        cfg = self.config
        b = last_token.shape[0]
        tokens = jnp.concatenate(
            [last_token[:, None], jnp.full((b, cfg.block_size - 1), cfg.mask_token_id, last_token.dtype)], axis=1
        )
        x = target.embed(tokens).astype(self.fc.kernel.dtype)
        cos, sin = rope_cos_sin(lengths[:, None] + jnp.arange(cfg.block_size)[None], *cfg.rope_tables())
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, k_ctx[i], v_ctx[i], lengths, causal=cfg.layer_is_causal(i),
                      window=cfg.layer_window(i), kernel=kernel, page_table=page_table)
        return target.lm_logits(self.norm(x)[:, 1 : None if depths is None else 1 + depths])

    def propose(self, target, cache, last_token: jax.Array, *, depths: int | None = None) -> jax.Array:
        """Draft one block per row from the cached context (a ``DraftCache`` or a
        ``PagedDraftCache``, whose pages the attention kernel reads in place).

        ``last_token [B]``: each row's last committed token (not yet in the context), placed at
        position ``cache.lengths``. Returns logits ``float32 [B, block_size-1, V]`` for depths
        ``1 .. block_size-1``; with ``depths``, those of depths ``1 .. depths`` only (the same
        values; the LM head then runs on those positions alone).
        """
        return self._block_logits(target, last_token, cache.lengths, cache.k, cache.v, kernel=True,
                                  page_table=cache.layout.page_table, depths=depths)

    def anchored_blocks(self, target, target_hidden: jax.Array, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
        """Many blocks per sequence in one pass (training, the DFlash recipe's random anchors).

        ``target_hidden [B,S,n*H]``: the target's features of the whole sequence ``tokens [B,S]``;
        ``anchors [B,A]`` int, each in ``[1, S)``. Block ``(b, a)`` is ``[tokens[b, a], MASK ...]``
        at positions ``a .. a+block_size-1`` and sees the context strictly before ``a``: the same
        logits as ``__call__(target, target_hidden[b:b+1, :a], tokens[b:b+1, a])``. Returns logits
        ``float32 [B, A, block_size-1, V]``.
        """
        b, s, _ = target_hidden.shape
        a = anchors.shape[1]
        chex.assert_shape([tokens, anchors], [(b, s), (b, a)])
        ctx_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
        k_ctx, v_ctx = self._context_kv(target_hidden, ctx_pos)
        rows = lambda x: jnp.repeat(x, a, axis=0)  # noqa: E731  (one row per block)
        last = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
        logits = self._block_logits(target, last, anchors.reshape(-1), [rows(k) for k in k_ctx],
                                    [rows(v) for v in v_ctx], kernel=False)
        return logits.reshape(b, a, *logits.shape[1:])

    def __call__(self, target, target_hidden: jax.Array, last_token: jax.Array) -> jax.Array:
        """Cache-free draft: context ``target_hidden [B,C,n*H]`` at positions ``0..C-1``, block at
        ``C..C+block_size-1``. Returns logits ``float32 [B, block_size-1, V]``."""
        b, c, _ = target_hidden.shape
        ctx_pos = jnp.broadcast_to(jnp.arange(c)[None], (b, c))
        k_ctx, v_ctx = self._context_kv(target_hidden, ctx_pos)
        return self._block_logits(target, last_token, jnp.full((b,), c, jnp.int32), k_ctx, v_ctx, kernel=False)


def _on_several_devices(module: nnx.Module) -> bool:
    """Whether any parameter of ``module`` is placed over more than one device (traced arrays,
    under ``nnx.eval_shape``, are placed nowhere yet)."""
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param) and not isinstance(value := var[...], jax.core.Tracer):
            sharding = getattr(value, "sharding", None)
            if sharding is not None and len(sharding.device_set) > 1:
                return True
    return False
