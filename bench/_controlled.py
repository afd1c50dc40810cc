"""A target and drafter whose acceptance is set by hand, for benchmarks of the decoding loop on
random models (a random drafter's drafts are almost never accepted by a random target).

Both models run their real passes, so a round costs what the real models' round costs; only the
logits they return change, to ``1e-3 * logits`` (the pass stays live, its spread no longer
matters) plus fixed biases on a few tokens:

* **target**: after token ``x`` it prefers ``successor(x)``, with probability ``target_p`` at
  temperature 1 (the rest spread over the vocabulary), so its greedy chain is the successor chain;
* **drafter**: from the root ``r`` it drafts the chain ``c_0 = r``, ``c_i = guess(c_{i-1})``
  with probability ``draft_p`` at each depth, where ``guess(x) = successor(x)`` for a share
  ``hit_rate`` of the tokens (a fixed hash of ``x`` decides which) and a wrong token otherwise; a
  second choice gets ``(1 - draft_p) / 2``: ``successor(x)`` after a miss for a share
  ``hit_rate`` of the tokens (a second hash), so a tree with siblings recovers some misses.

A greedy chain round therefore accepts depth ``i`` iff the chain's first ``i`` tokens are all
hits (``E[accepted] = sum_i hit_rate^i`` up to the block's depth); a tree adds the recovered
misses' one token, and sampled rounds lose more with the target's spread. ``LEVELS`` gives three
settings.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ddtree_jax.models import DFlashDrafter, KimiForCausalLM

_NOISE = 1e-3
_MULTIPLIER = 7919  # odd and prime to 5: x -> 7919 x + 1 permutes any vocabulary of 2^a 5^b ids
_HASH = 2654435761  # Knuth's multiplicative hash (mod 2^32)


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """``hit_rate``: share of tokens whose drafted successor is the target's; ``target_p``: the
    target's probability of the successor at temperature 1; ``draft_p``: the drafter's
    probability of its chain token."""

    hit_rate: float
    target_p: float
    draft_p: float

    def __post_init__(self):
        if not 0.0 <= self.hit_rate < 1.0:
            raise ValueError(f"Acceptance.hit_rate: must be in [0, 1), got {self.hit_rate}")
        for name in ("target_p", "draft_p"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"Acceptance.{name}: must be in (0, 1), got {getattr(self, name)}")


LEVELS = {
    "high": Acceptance(hit_rate=0.95, target_p=0.95, draft_p=0.8),
    "medium": Acceptance(hit_rate=0.7, target_p=0.8, draft_p=0.6),
    "low": Acceptance(hit_rate=0.2, target_p=0.4, draft_p=0.3),
}


def successor(x: jax.Array, vocab: int) -> jax.Array:
    """The target's preferred next token after ``x``."""
    return (x.astype(jnp.int32) * _MULTIPLIER + 1) % vocab


def is_hit(x: jax.Array, hit_rate: float) -> jax.Array:
    """Whether the drafter guesses ``successor(x)`` after ``x`` (a fixed hash of ``x``)."""
    h = x.astype(jnp.uint32) * jnp.uint32(_HASH)
    return h < jnp.uint32(min(int(hit_rate * 2.0**32), 2**32 - 1))


def guess(x: jax.Array, vocab: int, hit_rate: float) -> tuple[jax.Array, jax.Array]:
    """``(drafted, other)``: the drafter's token after ``x`` (``successor(x)`` on a hit, a wrong
    token on a miss) and its second choice (on a hit a wrong token; on a miss ``successor(x)``
    for a share ``hit_rate`` of the tokens, by a second hash, else another wrong one)."""
    right = successor(x, vocab)
    wrong = (right + 1) % vocab
    hit = is_hit(x, hit_rate)
    second_hit = is_hit(x + 0x5BD1, hit_rate)
    return jnp.where(hit, right, wrong), jnp.where(hit | ~second_hit, (right + 2) % vocab, right)


def _logit(p: float, share_of_rest: float, vocab: int, others: int) -> float:
    """The bias giving a token probability ``p`` over ``vocab - others`` tokens of logit 0 that
    share ``share_of_rest`` of the remaining ``1 - p``."""
    rest_each = (1.0 - p) * share_of_rest / (vocab - others)
    return math.log(p / rest_each)


def _steer(logits: jax.Array, tokens: list[jax.Array], biases: list[float]) -> jax.Array:
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    out = logits * _NOISE
    for tok, bias in zip(tokens, biases, strict=True):
        out = out + jnp.where(ids == tok[..., None], jnp.float32(bias), jnp.float32(0.0))
    return out


class ControlledTarget(KimiForCausalLM):
    """``KimiForCausalLM`` whose next-token logits prefer ``successor`` (module docstring)."""

    def __init__(self, cfg, *, acceptance: Acceptance, **kwargs):
        super().__init__(cfg, **kwargs)
        self.acceptance = acceptance

    def _run(self, tokens, *args, logits_at=None, **kwargs):
        logits, hidden, rows = super()._run(tokens, *args, logits_at=logits_at, **kwargs)
        vocab = self.config.vocab_size
        bias = _logit(self.acceptance.target_p, 1.0, vocab, 1)
        if logits_at is not None:  # (the logits of those positions only)
            tokens = jnp.take_along_axis(tokens, logits_at[:, None], axis=1)
        return _steer(logits, [successor(tokens, vocab)], [bias]), hidden, rows


class ControlledDrafter(DFlashDrafter):
    """``DFlashDrafter`` whose drafts follow ``guess``'s chain from the root (module docstring)."""

    def __init__(self, cfg, *, acceptance: Acceptance, **kwargs):
        super().__init__(cfg, **kwargs)
        self.acceptance = acceptance

    def propose(self, target, cache, last_token: jax.Array, *, depths: int | None = None) -> jax.Array:
        logits = super().propose(target, cache, last_token, depths=depths)
        vocab, a = logits.shape[-1], self.acceptance

        def step(x, _):
            drafted, other = guess(x, vocab, a.hit_rate)
            return drafted, (drafted, other)

        _, (chain, others) = jax.lax.scan(step, last_token.astype(jnp.int32), None, length=logits.shape[1])
        chain, others = chain.T, others.T  # [B, L]
        top = _logit(a.draft_p, 0.5, vocab, 2)
        second = top + math.log(0.5 * (1.0 - a.draft_p) / a.draft_p)
        return _steer(logits, [chain, others], [top, second])
