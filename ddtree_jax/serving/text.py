"""Host-side text of a streamed request: incremental detokenisation and stop strings.

Detokenisation is incremental (the cost per step does not grow with the output): the text of new
tokens is the decoding of a short window of recent tokens minus the decoding of the window's
already-read part, so the tokenizer sees the context it needs (leading spaces, merged bytes)
without re-decoding the whole output. Tokens whose text ends in an incomplete UTF-8 sequence
(U+FFFD) stay pending until the next tokens complete it.

What is streamed is a prefix of the text that can no longer change: a tail that could be the
start of a stop string is held back until the next tokens decide it. When a stop string appears,
the text ends just before it (the stop string is not returned, as in the OpenAI API) and the
tokens end with the one that completed it.

A stream without stop strings can defer its detokenisation (``deferred``): the engine thread
only records each chunk's tokens (``defer``), and whoever reads a chunk's text decodes it
(``piece``; chunks in order, each exactly as the eager path would have), so that text nobody
reads is never decoded and the reading runs on the reader's thread.
"""

from __future__ import annotations

import threading

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"


class TextStream:
    """Detokenises one request's tokens as they arrive and applies its stop strings."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, deferred: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        # deferred: chunks recorded by ``defer``, decoded by ``piece`` / ``tail`` (no stop strings)
        self.deferred = deferred and not self.stop and tokenizer is not None
        self._lock = threading.Lock()
        self._marks: list[int] = []  # token counts at the ends of the chunks recorded, in order
        self._pieces: list[str] = []  # the text of the first len(_pieces) of them
        self._tail: str | None = None  # the text the finish flushed (deferred mode)
        self._window = max((len(s) for s in self.stop), default=0)  # the longest stop string
        self.tokens: list[int] = []
        self.text = ""  # the text of tokens[:read] (truncated at a stop string once one is found)
        self.sent = 0  # characters of self.text streamed so far
        self.stopped = False
        self._prefix = 0  # the decoding window starts here ...
        self._read = 0  # ... and its text up to here is already in self.text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def _piece(self, extra: list[int]) -> str:
        """The text that the tokens past ``self.text`` (pending ones) plus ``extra`` add to it."""
        window = self.tokens[self._prefix :]
        full = self._decode(window + list(extra))
        return full[len(self._decode(window[: self._read - self._prefix])) :]

    def _candidate(self, extra: list[int]) -> str:
        """The text of all tokens so far plus ``extra`` (pending ones included)."""
        return self.text + self._piece(extra)

    def _find_stop(self, text: str, start: int) -> int:
        """The first index >= ``start`` where a stop string begins in ``text``, or -1."""
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def add(self, new_tokens: list[int]) -> tuple[list[int], str]:
        """Take newly committed tokens; returns ``(tokens kept, text that can be streamed now)``.
        After a stop string, ``stopped`` is set and later calls keep nothing."""
        if self.stopped or not new_tokens:
            return [], ""
        if type(new_tokens) is not list:
            new_tokens = list(new_tokens)
        if not self.stop and self.tokenizer is not None:
            self.tokens += new_tokens
            return new_tokens, self._advance(len(self.tokens))
        text = self._candidate(new_tokens) if self.tokenizer is not None else ""
        start = max(0, len(self.text) - self._window + 1)
        if self.stop and self._find_stop(text, start) >= 0:
            # The smallest number of new tokens whose text contains a stop string.
            for k in range(1, len(new_tokens) + 1):
                text = self._candidate(new_tokens[:k])
                at = self._find_stop(text, start)
                if at >= 0:
                    self.tokens += new_tokens[:k]
                    self.text = text[:at]
                    self.stopped = True
                    return new_tokens[:k], self._emit(len(self.text))
        self.tokens += new_tokens
        if not text.endswith(_INCOMPLETE) and len(text) > len(self.text):
            self.text = text
            self._prefix, self._read = self._read, len(self.tokens)
        return new_tokens, self._ready()

    def _advance(self, end: int) -> str:
        """Without stop strings: ``tokens[:end]`` (already in ``tokens``) are in; returns the text
        they add, all of it streamed at once (the same window as ``_piece``)."""
        window = self.tokens[self._prefix : end]
        piece = self._decode(window)[len(self._decode(window[: self._read - self._prefix])) :]
        if not piece or piece[-1] == _INCOMPLETE:
            return ""
        self.text += piece
        self.sent = len(self.text)
        self._prefix, self._read = self._read, end
        return piece

    def defer(self, new_tokens: list[int]) -> int:
        """Deferred mode's ``add``: record a chunk of tokens (all kept); returns its index for
        ``piece``. Thread-safe against readers."""
        with self._lock:
            self.tokens += new_tokens
            self._marks.append(len(self.tokens))
            return len(self._marks) - 1

    def piece(self, index: int) -> str:
        """Deferred mode: the text chunk ``index`` streams (decoding the chunks before it first)."""
        with self._lock:
            for end in self._marks[len(self._pieces) : index + 1]:
                self._pieces.append(self._advance(end))
            return self._pieces[index]

    def tail(self) -> str:
        """Deferred mode, once the request has finished: what the finish flushes (decoding every
        chunk first); ``text`` is then complete. The same string at every call."""
        if self._marks:
            self.piece(len(self._marks) - 1)
        with self._lock:
            if self._tail is None:
                self._tail = self.flush()
            return self._tail

    def _ready(self) -> str:
        """Stream what is settled: hold back a tail that could start a stop string."""
        end = len(self.text)
        if not self.stop:
            return self._emit(end)
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, end - self.sent), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._emit(end - hold)

    def flush(self) -> str:
        """The request has finished: everything not yet streamed (pending tokens included)."""
        if not self.stopped:
            self.text = self._candidate([])
            self._prefix = self._read = len(self.tokens)
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
