"""Build a `tokenizers.Tokenizer` from the vocabulary embedded in GGUF metadata.

Two kinds exist in the files we serve:
- "llama": a SentencePiece BPE vocabulary (pieces + scores + types, byte fallback). SentencePiece
  BPE encodes by repeatedly merging the adjacent pair whose concatenation is the highest-scoring
  piece in the vocabulary. That is exactly HF BPE with one merge rule per way of splitting each
  piece in two, ranked by the merged piece's score (tests/models/test_tokenizer.py checks it against
  a direct implementation of the SentencePiece algorithm).
- "gpt2": byte-level BPE with explicit merges and a pre-tokenizer regex chosen by `tokenizer.ggml.pre`.
"""
from __future__ import annotations

from typing import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specd.models.config import UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (the same regexes the upstream tokenizer.json files use).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_PATTERNS = {"qwen2": _QWEN2_PATTERN, "llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN}
_NFC_PRE = {"qwen2"}

SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Merge rules equivalent to SentencePiece BPE: every split (left, right) of a NORMAL piece into two
    vocabulary pieces, ordered by the merged piece's score (highest first), then by piece id."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, pid in vocab.items():
        if types[pid] != NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], (left, right)))
    ranked.sort()
    return [m for *_, m in ranked]


def spm_tokenizer(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], add_space_prefix: bool) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True))
    norms = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", SPACE)])
    decs = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decs)
    _add_special(tok, tokens, types)
    return tok


def gpt2_tokenizer(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str) -> HFTokenizer:
    if pre not in _PRE_PATTERNS:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} not supported (have {sorted(_PRE_PATTERNS)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, byte_fallback=False, ignore_merges=False))
    if pre in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRE_PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, types)
    return tok


def _add_special(tok: HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """CONTROL and UNKNOWN tokens are special (skipped by decode); USER_DEFINED ones are matched whole but kept."""
    added = [
        AddedToken(t, special=ty in (CONTROL, UNKNOWN), normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
