"""Host-side text of a streamed request: incremental detokenisation and stop strings.

The text of a request is always the tokenizer's decoding of all its tokens so far. What is streamed
is a prefix of it that can no longer change: trailing replacement characters (an incomplete UTF-8
sequence whose next bytes are still to come) and any tail that could be the start of a stop string
are held back until the next tokens decide them. When a stop string appears, the text ends just
before it (the stop string is not returned, as in the OpenAI API) and the tokens end with the one
that completed it.
"""

from __future__ import annotations

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"


class TextStream:
    """Detokenises one request's tokens as they arrive and applies its stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # the decoding of self.tokens (truncated at a stop string once one is found)
        self.sent = 0  # characters of self.text streamed so far
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def _find_stop(self, text: str, start: int) -> int:
        """The first index >= ``start`` where a stop string begins in ``text``, or -1."""
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def add(self, new_tokens: list[int]) -> tuple[list[int], str]:
        """Take newly committed tokens; returns ``(tokens kept, text that can be streamed now)``.
        After a stop string, ``stopped`` is set and later calls keep nothing."""
        if self.stopped or not new_tokens:
            return [], ""
        old_len = len(self.text)
        window = max((len(s) for s in self.stop), default=0)
        text = self._decode(self.tokens + list(new_tokens))
        start = max(0, min(old_len, len(text)) - window + 1)
        if self.stop and self._find_stop(text, start) >= 0:
            # The smallest number of new tokens whose text contains a stop string.
            for k in range(1, len(new_tokens) + 1):
                text = self._decode(self.tokens + list(new_tokens[:k]))
                at = self._find_stop(text, start)
                if at >= 0:
                    kept = list(new_tokens[:k])
                    self.tokens += kept
                    self.text = text[:at]
                    self.stopped = True
                    return kept, self.flush()
        self.tokens += list(new_tokens)
        self.text = text
        return list(new_tokens), self._ready()

    def _ready(self) -> str:
        """Stream what is settled: hold back an incomplete character and a possible stop-string start."""
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == _INCOMPLETE:
            end -= 1
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, end - self.sent), hold, -1):
                if self.text.endswith(s[:n], 0, end):
                    hold = n
                    break
        return self._emit(end - hold)

    def flush(self) -> str:
        """Everything not yet streamed (the request has finished)."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
