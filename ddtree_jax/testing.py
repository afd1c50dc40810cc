"""Hand-built models for tests and benchmarks.

``make_bigram(target)`` zeroes a target's attention and MLP outputs, so its next token depends
only on the current one (the layers still run: compute cost is unchanged), and
``BigramOracleDrafter`` proposes exactly that model's greedy continuation. Together they give a
drafter that always agrees with the target: acceptance length = block size under greedy decoding,
the upper bound for measuring verification cost.

``ContinuationOracleDrafter(table)`` proposes a known continuation of each row (e.g. the target's
own greedy autoregressive output) for any target: the tree's best path is that continuation, as a
chain of consecutive node slots, and greedy DDTree accepts all of it exactly when the target's
verify agrees with its decode steps (the batch-invariance measurement: bench/bench_batch_invariance.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["BigramOracleDrafter", "ContinuationOracleDrafter", "make_bigram"]


def make_bigram(target):
    """Zeroes ``o_proj`` and every ``down_proj`` in place: logits = head(norm(embed(token)))."""
    for path, var in nnx.iter_graph(target):
        if isinstance(var, nnx.Param) and ("o_proj" in path or "down_proj" in path):
            var[...] = jnp.zeros_like(var[...])
    return target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CountCache:
    """The oracle's whole context: how many tokens each row has committed."""

    lengths: jax.Array  # i32 [B]

    def take_rows(self, rows: jax.Array) -> CountCache:
        return CountCache(jnp.take(self.lengths, rows, axis=0))

    def put_rows(self, rows: jax.Array, src: CountCache) -> CountCache:
        return CountCache(self.lengths.at[rows].set(src.lengths))


@dataclasses.dataclass(frozen=True)
class OracleConfig:
    block_size: int
    target_layer_ids: tuple[int, ...] = (0,)


class BigramOracleDrafter(nnx.Module):
    """Proposes a bigram target's greedy continuation: depth k gets the k-th successor, as a
    near-one-hot distribution. Implements the drafter interface ``generate`` uses."""

    def __init__(self, block_size: int):
        self.config = OracleConfig(block_size)

    def init_cache(self, batch: int, max_len: int) -> CountCache:
        return CountCache(jnp.zeros((batch,), jnp.int32))

    def append_context(self, cache: CountCache, target_hidden, counts) -> CountCache:
        return CountCache(cache.lengths + counts)

    def propose(self, target, cache, last_token, *, depths=None):
        logits, tok = [], last_token
        for _ in range(depths or self.config.block_size - 1):
            tok = jnp.argmax(target.lm_logits(target.model.norm(target.embed(tok))), axis=-1)
            logits.append(jax.nn.one_hot(tok, target.config.vocab_size) * 30.0)
        return jnp.stack(logits, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableCache:
    """Committed tokens per row and the row's known sequence (prompt then continuation)."""

    lengths: jax.Array  # i32 [B]
    table: jax.Array  # i32 [B, N]

    def take_rows(self, rows: jax.Array) -> TableCache:
        return TableCache(jnp.take(self.lengths, rows, axis=0), jnp.take(self.table, rows, axis=0))

    def put_rows(self, rows: jax.Array, src: TableCache) -> TableCache:
        return TableCache(self.lengths.at[rows].set(src.lengths), self.table.at[rows].set(src.table))


class ContinuationOracleDrafter(nnx.Module):
    """Proposes each row's next tokens from ``table [B, N]`` (row b: its prompt, then the
    continuation to propose), as near-one-hot distributions: depth k gets the token k places after
    the round's root. Rows ride in the drafter cache (batch compaction keeps them aligned)."""

    def __init__(self, table, block_size: int, vocab_size: int):
        self.config = OracleConfig(block_size)
        self.table = nnx.Variable(jnp.asarray(table, jnp.int32))
        self.vocab_size = vocab_size

    def init_cache(self, batch: int, max_len: int) -> TableCache:
        table = self.table[...][:batch]
        return TableCache(jnp.zeros((batch,), jnp.int32), table)

    def append_context(self, cache: TableCache, target_hidden, counts) -> TableCache:
        return TableCache(cache.lengths + counts, cache.table)

    def propose(self, target, cache: TableCache, last_token, *, depths=None):
        # the root sits at position ``lengths`` (the committed prefix excludes it)
        n = cache.table.shape[1]
        pos = cache.lengths[:, None] + jnp.arange(1, 1 + (depths or self.config.block_size - 1))[None]
        tok = jnp.take_along_axis(cache.table, jnp.minimum(pos, n - 1), axis=1)
        return jax.nn.one_hot(tok, self.vocab_size) * 30.0
