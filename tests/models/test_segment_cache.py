"""Segment-by-segment encoding with a cache (specd/segment_cache.py) gives the plain encode's ids on the
tokenizers it is enabled for, and is refused for the ones where it would not."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from specd.loader.gguf import gguf_tokenizer
from specd.loader.gguf_file import GGUFFile
from specd.segment_cache import MIN_CACHED_CHARS, SegmentCache

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "models" / "stories260K.gguf"
QWEN_GGUF = os.environ.get("SPECD_QWEN_GGUF", "")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"]


def byte_level_bpe() -> tokenizers.Tokenizer:
    """A small GPT-2-style tokenizer (Split + ByteLevel, NFC) trained on this repository's code."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [p.read_text() for p in sorted((ROOT / "specd" / "engine").glob("*.py"))]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def chats(rng: random.Random, count: int) -> list[str]:
    """Rendered-chat-like texts: segments (some long and repeated, so the cache serves them) between
    added tokens, with spaces, newlines and non-ASCII beside the boundaries."""
    pool = [" ".join(rng.choice(["def", "x", "ünï", "日本", "\n", "  ", "return", "(a, b)", "💡"])
                     for _ in range(rng.randint(1, 300))) for _ in range(12)]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 8)):
            parts.append(rng.choice(SPECIALS))
            parts.append(rng.choice(["user\n", "assistant\n", " ", "\n"]) + rng.choice(pool))
        out.append("".join(parts))
    return out


def test_equals_the_plain_encode_on_a_byte_level_tokenizer():
    tok = byte_level_bpe()
    cache = SegmentCache.for_tokenizer(tok)
    assert cache is not None
    rng = random.Random(0)
    for text in chats(rng, 200) * 2:                 # twice: the second pass reads cached segments
        assert cache.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert cache.hits > 0 and max(len(t) for t in cache._cache) >= MIN_CACHED_CHARS


def test_is_refused_where_segments_are_not_independent():
    stories = gguf_tokenizer(GGUFFile(STORIES))
    assert stories.segments is None                    # SentencePiece normalizer (Prepend ▁)
    tok = byte_level_bpe()
    tok.add_special_tokens([tokenizers.AddedToken("<eot>", lstrip=True)])
    assert SegmentCache.for_tokenizer(tok) is None     # an added token that eats the space before it


def test_the_cache_is_bounded():
    tok = byte_level_bpe()
    cache = SegmentCache(tok, {}, max_chars=2000)
    for i in range(20):
        cache.encode(f"segment {i} " + "x y z " * 100)
    assert cache._chars <= 2000 and len(cache._cache) <= 3


@pytest.mark.skipif(not Path(QWEN_GGUF).is_file(), reason="set SPECD_QWEN_GGUF to the Qwen2.5-Coder-0.5B GGUF")
def test_equals_the_plain_encode_on_qwen():
    tok = gguf_tokenizer(GGUFFile(QWEN_GGUF))
    assert tok.segments is not None
    rng = random.Random(1)
    for text in chats(rng, 200) * 2:
        assert tok.encode(text, add_bos=False) == tok.inner.encode(text, add_special_tokens=False).ids
