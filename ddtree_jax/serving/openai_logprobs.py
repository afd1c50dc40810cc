"""The OpenAI ``logprobs`` objects of a response or stream chunk, from ``TokenLogprobs``.

* ``/v1/completions`` (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``: the token strings, their log-probabilities, one ``{token string: logprob}``
  dict per token (its top alternatives; alternatives whose strings coincide share one key), and
  each token's character offset in the completion text (from 0, continued across a stream's
  chunks by ``CompletionOffsets``).
* ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": None}``.

A token's string is the tokenizer's decoding of that token alone (special tokens included), its
``bytes`` that string's UTF-8 encoding. Alternatives the request's sampling removed (``-inf``) are
left out, so a token may list fewer alternatives than asked for; a token's own value is finite
(it was drawn from that law), and any non-finite value that reaches JSON is written as
``NEG_INF_LOGPROB``, as vLLM does. The law and the limits: docs/serving.md, "Log-probabilities".
"""

from __future__ import annotations

import math

from ddtree_jax.serving.emitter import TokenLogprobs

__all__ = ["NEG_INF_LOGPROB", "CompletionOffsets", "TokenTexts", "chat_logprobs", "completion_logprobs"]

NEG_INF_LOGPROB = -9999.0


def _value(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else NEG_INF_LOGPROB


class TokenTexts:
    """Token id -> its string, decoded once per id (thread-safe enough: a race decodes twice)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        token = int(token)
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return text


def _alternatives(lp: TokenLogprobs, i: int):
    return [(int(t), float(v)) for t, v in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True) if v > -math.inf]


class CompletionOffsets:
    """A completion choice's running character offset (``text_offset`` across stream chunks)."""

    def __init__(self):
        self.offset = 0


def completion_logprobs(token_ids: list[int], lp: TokenLogprobs, texts: TokenTexts,
                        offsets: CompletionOffsets) -> dict:
    """The legacy completions ``logprobs`` object of ``token_ids`` (advances ``offsets``)."""
    tokens = [texts(t) for t in token_ids]
    text_offset = []
    for s in tokens:
        text_offset.append(offsets.offset)
        offsets.offset += len(s)
    return {"tokens": tokens, "token_logprobs": [_value(v) for v in lp.logprob],
            "top_logprobs": [{texts(t): _value(v) for t, v in _alternatives(lp, i)} for i in range(len(lp))],
            "text_offset": text_offset}


def chat_logprobs(token_ids: list[int], lp: TokenLogprobs, texts: TokenTexts) -> dict:
    """The chat ``logprobs`` object of ``token_ids``."""

    def entry(token: int, value) -> dict:
        s = texts(token)
        return {"token": s, "logprob": _value(value), "bytes": list(s.encode("utf-8"))}

    content = [{**entry(t, lp.logprob[i]), "top_logprobs": [entry(a, v) for a, v in _alternatives(lp, i)]}
               for i, t in enumerate(token_ids)]
    return {"content": content, "refusal": None}
