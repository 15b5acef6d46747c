"""Encode a rendered chat by its segments between added tokens, each segment's ids cached.

Why: an agent's turn re-sends its whole history, and the server encodes the rendered chat on the thread
that also steps the engine (specd/server.py). Qwen2.5's tokenizer took 24 ms for a 22k-token turn on the
CPU machine, every turn, while every other session's decode waited. The history's segments are the same
text every turn, so their ids come from the cache and only the new turn's text is encoded.

Why it is exact: `tokenizers` itself splits the text at added tokens (leftmost-longest) before it
normalizes and pre-tokenizes, and runs both on each segment alone, so encoding segment by segment
gives the same ids, provided no added token strips the whitespace beside it (lstrip/rstrip) and the
normalizer and pre-tokenizer have no rule that looks across segments (SentencePiece's Metaspace with
``prepend_scheme="first"`` does). ``SegmentCache.for_tokenizer`` returns None unless the tokenizer is
of the known-safe kinds: no normalizer or a Unicode normal form, and a pre-tokenizer built only of
``Split``, ``ByteLevel`` and ``Digits`` (GPT-2-style byte-level BPE: Qwen, Llama 3). The plain
``inner.encode`` stays the reference; tests/models/test_segment_cache.py checks the two agree.
"""
from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict

import tokenizers

SAFE_NORMALIZERS = {None, "NFC", "NFKC", "NFD", "NFKD"}
SAFE_PRE_TOKENIZERS = {"Sequence", "Split", "ByteLevel", "Digits"}
MAX_CACHED_CHARS = 32 << 20      # the cache's text: 32 MiB of segments, ~8M ids kept as int32 (~32 MiB more)
MIN_CACHED_CHARS = 256           # shorter segments are encoded each time (a role line, a newline)


def _types(node) -> set:
    if not isinstance(node, dict):
        return set()
    out = {node.get("type")}
    for key in ("pretokenizers", "normalizers"):
        for child in node.get(key) or ():
            out |= _types(child)
    return out


class SegmentCache:
    def __init__(self, inner: tokenizers.Tokenizer, added: dict[str, int], max_chars: int = MAX_CACHED_CHARS):
        self.inner = inner
        self.added = added
        ordered = sorted(added, key=len, reverse=True)          # leftmost-longest, as tokenizers matches
        self.pattern = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self.max_chars = max_chars
        self._cache: OrderedDict[str, array] = OrderedDict()     # ids as int32: a list of ints costs 36 B each
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, inner: tokenizers.Tokenizer) -> "SegmentCache | None":
        """A cache when segment-by-segment encoding is exact for ``inner`` (see the module docstring)."""
        # each component's own JSON: the whole tokenizer's (its vocabulary) takes ~0.25 s to write for Qwen
        normalizer = json.loads(inner.normalizer.__getstate__()) if inner.normalizer is not None else None
        pre = json.loads(inner.pre_tokenizer.__getstate__()) if inner.pre_tokenizer is not None else None
        if (normalizer or {}).get("type") not in SAFE_NORMALIZERS or not pre or not _types(pre) <= SAFE_PRE_TOKENIZERS:
            return None
        added = inner.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word or (t.normalized and not t.special) for t in added.values()):
            return None
        return cls(inner, {t.content: i for i, t in added.items()})

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (added tokens parsed, no post-processor), from cached segments."""
        if self.pattern is None:
            return self._segment(text)
        ids: list[int] = []
        for k, part in enumerate(self.pattern.split(text)):
            if k % 2:
                ids.append(self.added[part])
            elif part:
                ids.extend(self._segment(part))
        return ids

    def _segment(self, text: str) -> list[int]:
        if len(text) < MIN_CACHED_CHARS:
            return self.inner.encode(text, add_special_tokens=False).ids
        with self._lock:
            got = self._cache.get(text)
            if got is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return got.tolist()
        ids = self.inner.encode(text, add_special_tokens=False).ids
        with self._lock:
            self.misses += 1
            if text not in self._cache and len(text) <= self.max_chars:
                self._cache[text] = array("i", ids)
                self._chars += len(text)
                while self._chars > self.max_chars:
                    old, _ = self._cache.popitem(last=False)
                    self._chars -= len(old)
        return ids
