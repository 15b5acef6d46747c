"""Tokenizer: one interface over every model's vocabulary (GGUF-embedded or HF tokenizer.json).

It wraps a `tokenizers.Tokenizer` and adds what serving needs: which ids start and stop a sequence,
whether encode prepends BOS, the chat template, and a streaming decoder that turns token-by-token
output into text deltas without breaking multi-byte characters.

BOS is managed here, never by the wrapped tokenizer's post-processor: `encode` always calls the
inner tokenizer with add_special_tokens=False and prepends BOS itself when asked. Text is parsed for
special tokens (so a rendered chat template's "<|im_start|>" becomes one id).
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from specd.chat_template import render_chat_template
from specd.segment_cache import SegmentCache


class Tokenizer:
    """Immutable after construction but for the segment cache (locked); safe to share between threads for
    encode/decode."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
    ):
        self.inner = inner
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = frozenset(i for i in ({eos_id} | set(stop_ids)) if i is not None)
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template
        # segment-by-segment encoding with cached segments, where that is exact (specd/segment_cache.py)
        self.segments = SegmentCache.for_tokenizer(inner)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable id of the vocabulary and its rules, for the KV namespace (DESIGN.md §2)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.inner.to_str().encode())
        h.update(repr((self.bos_id, sorted(self.stop_ids), self.add_bos)).encode())
        return h.hexdigest()

    @property
    def name(self) -> str:
        """The tokenizer's identity in the KV namespace (the engine passes it to namespace_root)."""
        return self.fingerprint

    def token_text(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids; BOS prepended when `add_bos` (default: the model's own convention)."""
        if self.segments is not None:
            ids = self.segments.encode(text)
        else:
            ids = self.inner.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. SentencePiece vocabularies drop the one space that encode's prefix added,
        so decode(encode(t)) == t."""
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render the model's chat template (or the documented fallback) to a prompt string.

        Encode the result with `encode(prompt)`: a template that writes its own BOS token text is
        detected there, so BOS is never doubled.
        """
        bos = self.token_text(self.bos_id) if self.bos_id is not None else ""
        eos = self.token_text(self.eos_id) if self.eos_id is not None else ""
        return render_chat_template(self.chat_template, messages, add_generation_prompt, bos or "", eos or "", **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Render and encode a conversation; BOS is added only if the template did not write it."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_bos=False)
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def stream(self, context_ids: Sequence[int] = ()) -> "IncrementalDecoder":
        return IncrementalDecoder(self, context_ids)


class IncrementalDecoder:
    """Token-by-token text deltas whose concatenation equals decode(context + generated) minus
    decode(context).

    It re-decodes only a short window (the tokens of the previous delta plus the new ones), so the
    per-token cost is constant. A delta is held back while it ends in U+FFFD, i.e. while a multi-byte
    character is still incomplete; `flush` emits whatever is left at the end.
    """

    _CONTEXT = 5  # prompt tokens kept in the first window, so the first delta gets its spacing right

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids = list(context_ids)
        self._prefix = max(0, len(self._ids) - self._CONTEXT)
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the new text it completes ('' if none yet)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
