"""Incremental detokenization with stop strings.

Why hold text back: a stop string must never reach the client, not even its first half, so the
emitted text lags by up to ``len(longest stop) - 1`` characters until it is clear no stop begins
there. Text ending in U+FFFD is an incomplete UTF-8 sequence (byte-fallback tokens) and waits too.
"""
from __future__ import annotations

from typing import Callable, Sequence


class Detokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._text = ""          # decoded text of all output ids
        self._emitted = 0        # characters of _text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly safe text. Sets ``stopped`` when a stop string appears."""
        self._ids.append(token_id)
        self._text = self._decode(self._ids)
        for stop in self._stops:
            at = self._text.find(stop, max(0, self._emitted - len(stop)))
            if at >= 0:
                self.stopped = True
                self._text = self._text[:at]
                return self._flush(len(self._text))
        safe = len(self._text) - self._holdback
        if self._text.endswith("\ufffd"):
            safe = min(safe, len(self._text) - 1)
        return self._flush(safe)

    def finish(self) -> str:
        """The text still held back, once the request ends for another reason than a stop string."""
        text = self._text[:-1] if self._text.endswith("\ufffd") else self._text
        return self._flush(len(text))

    def _flush(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out

    @property
    def text(self) -> str:
        return self._text[: self._emitted]
