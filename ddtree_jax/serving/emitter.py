"""``Emitter``: turns the token ids an engine step committed into what clients see.

The engine thread only moves token ids: after each batch of rounds it hands the emitter one list of
``Emit`` items (a request, its new tokens and acceptance lengths, their log-probabilities if the
request asked, and the finish reason when the request ends). The emitter detokenises (a request
without stop strings only records its chunks' tokens: their text is decoded by whoever reads it,
``TextStream.defer``), applies stop strings (cutting the log-probabilities to the tokens kept),
keeps the per-request metrics (first token, inter-token latency, tokens/s), builds the
``RequestResult`` and pushes the chunks to the request handles, on the engine thread (a thread
of its own measured slower: it contends with the engine thread for the interpreter lock;
docs/serving.md).

A request whose text completes a stop string ends here, not on the device: the emitter finishes it
and reports it through ``take_stopped`` so that the engine frees its slot at its next step. Items
for a request that has already ended are dropped (the engine may have committed a few more tokens
for it before it learned of the stop).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ddtree_jax.serving.engine import _Request
    from ddtree_jax.serving.metrics import EngineMetrics

__all__ = ["Emit", "Emitter", "RequestResult", "StepLatency", "StreamChunk", "TokenLogprobs", "deliver",
           "request_result", "stream_news"]


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of consecutive generated tokens, for a request that asked for them
    (``Engine.submit(logprobs=k)``; the law they follow: docs/serving.md, "Log-probabilities").

    Attributes:
      logprob: f32 ``[n]`` each token's log-probability.
      top_ids: i32 ``[n, k]`` the ``k`` most probable tokens of the row each token was drawn from,
        most probable first.
      top_logprobs: f32 ``[n, k]`` their log-probabilities (``-inf``: removed by the request's
        top-k / top-p / min-p).
    """

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __len__(self) -> int:
        return len(self.logprob)

    def head(self, n: int) -> TokenLogprobs:
        """The first ``n`` tokens' entries."""
        return TokenLogprobs(self.logprob[:n], self.top_ids[:n], self.top_logprobs[:n])

    @classmethod
    def concat(cls, parts: list[TokenLogprobs], k: int) -> TokenLogprobs:
        """``parts`` one after the other (``k`` alternatives each; no parts: zero tokens)."""
        if not parts:
            return cls(np.zeros((0,), np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))


def deliver(deliveries: list) -> None:
    """Hand ``(loop, queue, chunk)`` triples to their asyncio queues with ONE thread-safe wake-up
    per event loop (a wake-up is a write to the loop's self-pipe: one per chunk made the event loop
    and the engine thread trade the interpreter lock per token). Order is kept per queue."""
    by_loop: dict = {}
    for loop, queue, chunk in deliveries:
        by_loop.setdefault(loop, []).append((queue, chunk))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the listener's loop has closed
            pass


def _put_all(batch: list) -> None:
    for queue, chunk in batch:
        queue.put_nowait(chunk)


class StepLatency:
    """One step's latency observations, recorded into the metrics under one lock acquisition: the
    tokens, each first token's time to first token and time from its request's admission into a
    slot (the prefill, the first round and its read-back), and per request the inter-token gap with the
    number of tokens it covers (a first chunk of ``n`` tokens adds ``n - 1`` gaps of 0)."""

    __slots__ = ("tokens", "ttft", "prefill", "itl_values", "itl_counts", "deliveries")

    def __init__(self):
        self.deliveries: list = []  # the step's chunks for async listeners (``deliver``)
        self.tokens = 0
        self.ttft: list[float] = []
        self.prefill: list[float] = []
        self.itl_values: list[float] = []
        self.itl_counts: list[int] = []

    def add(self, r: _Request, n: int, now: float) -> None:
        self.tokens += n
        if r.first_token is None:
            r.first_token = now
            self.ttft.append(now - r.submitted)
            if r.admitted is not None:
                self.prefill.append(now - r.admitted)
            if n > 1:
                self.itl_values.append(0.0)
                self.itl_counts.append(n - 1)
        else:
            self.itl_values.append((now - r.last_emit) / n)
            self.itl_counts.append(n)
        r.last_emit = now

    def record(self, metrics: EngineMetrics, seen: float) -> None:
        """Record the step's observations into ``metrics`` (nothing when it streamed no token)."""
        if self.tokens:
            metrics.record_step(self.tokens, seen, self.ttft, self.itl_values, self.itl_counts, self.prefill)


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """A finished request.

    Attributes:
      request_id: the engine's id (also keys an unseeded request's random stream).
      prompt_tokens: number of prompt tokens.
      tokens: generated token ids (ends with the stop token for a stop-token finish; with the token
        that completed the stop string for a stop-string finish).
      text: decoded text (stop string excluded), ``""`` without a tokenizer (the engine may hand
        it over undecoded: it is decoded, on the reader's thread, when first read).
      finish_reason: ``"stop"``, ``"length"``, ``"cancelled"``, ``"abort"`` or ``"error: ..."``.
      acceptance_lengths: tokens accepted per round (bonus included).
      ttft: seconds from submission to the first token (``None`` if there was none).
      seconds: seconds from submission to the end.
      logprobs: the log-probabilities of ``tokens`` when the request asked for them, else ``None``.
    """

    request_id: int
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    acceptance_lengths: list[int]
    ttft: float | None
    seconds: float
    logprobs: TokenLogprobs | None = None

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name == "text" and type(value) is not str:  # deferred: decoded on first read
            value = value()
            object.__setattr__(self, "text", value)
        return value

    def __getstate__(self):
        _ = self.text  # a deferred text is decoded before it is pickled or copied
        return self.__dict__

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length per round (bonus token included)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0


class StreamChunk:
    """What one engine step produced for a request: new tokens and new text (and the tokens'
    log-probabilities when the request asked for them); the last chunk carries ``finish_reason``
    and ``result``. Every reader of the request gets the same object: do not modify it.

    ``text`` may be given as a zero-argument callable (the engine's deferred detokenisation,
    ``TextStream.defer``): it is called, on the reader's thread, when ``text`` is first read."""

    __slots__ = ("token_ids", "_text", "finish_reason", "result", "logprobs")

    def __init__(self, token_ids: list[int], text="", finish_reason: str | None = None,
                 result: RequestResult | None = None, logprobs: TokenLogprobs | None = None):
        self.token_ids = token_ids
        self._text = text
        self.finish_reason = finish_reason
        self.result = result
        self.logprobs = logprobs

    @property
    def text(self) -> str:
        text = self._text
        if type(text) is not str:
            text = self._text = text()
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self):  # (pickled or copied with its text decoded)
        return StreamChunk, (self.token_ids, self.text, self.finish_reason, self.result, self.logprobs)

    def __repr__(self) -> str:
        return (f"StreamChunk(token_ids={self.token_ids!r}, text={self.text!r}, finish_reason={self.finish_reason!r}, "
                f"logprobs={self.logprobs!r})")



@dataclasses.dataclass(slots=True)
class Emit:
    """One request's news from one engine step. ``finish``: the finish reason when the request
    ends with this item (``"stop"``, ``"length"``, ``"cancelled"``, ``"abort"``, ``"error: ..."``);
    ``logprobs``: the tokens' log-probabilities, for a request that asked for them."""

    request: _Request
    tokens: list[int]
    acceptance: list[int]
    finish: str | None = None
    logprobs: TokenLogprobs | None = None


class Emitter:
    """Detokenisation, stop strings, results and client chunks for one engine (see the module
    docstring). ``seen`` is the host time the items' tokens reached the host (latency metrics).
    Each ``submit`` hands what the handles' ``_push`` appended for the pass to ``deliver`` (the
    async listeners' event loops) at once."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics
        self._stopped: list[_Request] = []

    def submit(self, items: list[Emit], seen: float) -> None:
        """Process one step's items, in order; the step's latency metrics are recorded at once."""
        step = StepLatency()
        for item in items:
            self._process(item, seen, step)
        deliver(step.deliveries)
        step.record(self.metrics, seen)

    def take_stopped(self) -> list[_Request]:
        """Requests finished by a stop string since the last call (their slots are still taken)."""
        out, self._stopped = self._stopped, []
        return out

    def _process(self, item: Emit, seen: float, step: StepLatency) -> None:
        r = item.request
        if r.ended:
            return
        kept, text, logprobs, reason = stream_news(r, item.tokens, item.acceptance, item.finish, item.logprobs)
        if kept:
            step.add(r, len(kept), seen)
        if reason is not None:
            self._end(r, reason, kept, text, logprobs, step.deliveries)
            if r.text.stopped:
                self._stopped.append(r)
        elif kept or text:
            r.handle._push(StreamChunk(kept, text, logprobs=logprobs), step.deliveries)

    def _end(self, r: _Request, reason: str, tokens: list[int], text: str, logprobs: TokenLogprobs | None,
             deliveries: list) -> None:
        r.ended = True
        result = request_result(r, r.handle.request_id, int(r.prompt.size), reason,
                                ttft=None if r.first_token is None else r.first_token - r.submitted,
                                seconds=time.perf_counter() - r.submitted)
        self.metrics.count("requests", reason.split(":")[0])
        r.handle._push(StreamChunk(list(tokens), text, reason, result, logprobs), deliveries)


def stream_news(s, tokens: list[int], acceptance: list[int], finish: str | None,
                logprobs: TokenLogprobs | None) -> tuple[list[int], str, TokenLogprobs | None, str | None]:
    """Apply one item of a request's news to its stream state ``s`` (the engine's request, or the
    two-process front end's handle: ``text`` its ``TextStream``, ``acceptance`` its acceptance
    lengths, ``logprobs`` the alternatives asked for or ``None``, ``logprob_parts``). Returns
    ``(tokens kept, text to stream, their log-probabilities, the finish reason if the request ends
    with this item)``: ``"stop"`` when its text completed a stop string, else ``finish`` (the text
    then includes what was pending). For a deferred stream (``TextStream.deferred``) the text is a
    zero-argument callable that decodes it (``StreamChunk`` takes either)."""
    if acceptance:
        s.acceptance += acceptance
    stream = s.text
    if stream.deferred:  # no stop strings: every token is kept; the text is decoded when read
        kept, at = tokens, stream.defer(tokens) if tokens else None
        text = functools.partial(stream.piece, at) if tokens else ""
    else:
        kept, text = stream.add(tokens) if tokens else ([], "")
    part = None
    if s.logprobs is not None:  # items without tokens (an end) carry none
        part = TokenLogprobs.concat([], s.logprobs) if logprobs is None else logprobs.head(len(kept))
        s.logprob_parts.append(part)
    if stream.stopped:
        return kept, text, part, "stop"
    if finish is not None:
        text = functools.partial(_final_text, stream, at) if stream.deferred else text + stream.flush()
        return kept, text, part, finish
    return kept, text, part, None


def _final_text(stream, at: int | None) -> str:
    """A deferred stream's last chunk: its tokens' text (``at``: its index, ``None`` without
    tokens) and what the finish flushes."""
    return (stream.piece(at) if at is not None else "") + stream.tail()


def _result_text(stream) -> str:
    stream.tail()
    return stream.text


def request_result(s, request_id: int, prompt_tokens: int, reason: str, *, ttft: float | None,
                   seconds: float) -> RequestResult:
    """The ``RequestResult`` of a request ending with ``reason``, from its stream state ``s``
    (``stream_news``)."""
    return RequestResult(
        request_id=request_id, prompt_tokens=prompt_tokens, tokens=list(s.text.tokens),
        text=functools.partial(_result_text, s.text) if s.text.deferred else s.text.text,
        finish_reason=reason, acceptance_lengths=list(s.acceptance), ttft=ttft, seconds=seconds,
        logprobs=None if s.logprobs is None else TokenLogprobs.concat(s.logprob_parts, s.logprobs))
