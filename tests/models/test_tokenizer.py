"""Tokenizers built from GGUF metadata: SentencePiece equivalence, round trips, streaming, chat templates."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from specd.chat_template import FALLBACK_TEMPLATE, ChatTemplateError, render_chat_template
from specd.loader.gguf import gguf_tokenizer
from specd.loader.gguf_file import GGUFFile

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
QWEN_GGUF = os.environ.get("SPECD_QWEN_GGUF", "")
needs_qwen = pytest.mark.skipif(not Path(QWEN_GGUF).is_file(), reason="set SPECD_QWEN_GGUF to the Qwen2.5-Coder-0.5B GGUF")
SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "corpora" / "creative" / "tinyshakespeare.txt"
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces, double  spaces and trailing ",
    "Tabs\tand\nnewlines\n\nand unicode: café, naïve, 日本語, emoji 🙂!",
    "He said: \"Let's go!\" -- 42 apples & 7 pears (100%).",
]


def spm_reference(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """SentencePiece BPE, written directly: merge the adjacent pair forming the best-scoring piece
    (leftmost on ties) until none is in the vocabulary; unknown characters fall back to bytes."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            merged = symbols[i] + symbols[i + 1]
            if merged in vocab and (best is None or scores[vocab[merged]] > best[0]):
                best = (scores[vocab[merged]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids += [vocab[s]] if s in vocab else [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return ids


@pytest.fixture(scope="module")
def stories_vocab():
    r = GGUFFile(STORIES)
    return [r.get(f"tokenizer.ggml.{k}") for k in ("tokens", "scores", "token_type")]


def _sample_texts() -> list[str]:
    lines = SHAKESPEARE.read_text().splitlines()[:400] if SHAKESPEARE.exists() else []
    return TEXTS + [line for line in lines if line.strip()]


def test_stories_encoding_equals_sentencepiece_algorithm(stories, stories_vocab):
    tok = stories[1]
    texts = _sample_texts()
    mismatches = [t for t in texts if tok.encode(t, add_bos=False) != spm_reference(t, *stories_vocab)]
    assert not mismatches, mismatches[:3]


@pytest.mark.parametrize("text", TEXTS)
def test_stories_round_trip(stories, text):
    tok = stories[1]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1 and tok.eos_id == 2
    assert tok.decode(ids) == text


def test_stories_known_tokens(stories):
    tok = stories[1]
    ids = tok.encode("Once upon a time", add_bos=False)
    assert [tok.token_text(i) for i in ids] == ["\u2581Once", "\u2581upon", "\u2581a", "\u2581time"]
    assert [tok.token_text(i) for i in tok.encode("ü", add_bos=False)] == ["\u2581", "<0xC3>", "<0xBC>"]


def test_streaming_deltas_concatenate_to_decode_and_never_split_characters(stories):
    tok = stories[1]
    prompt = tok.encode("Say:")
    out = tok.encode("naïve 日本 ok", add_bos=False)  # SentencePiece adds the space
    stream = tok.stream(prompt)
    deltas = [stream.push(i) for i in out] + [stream.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " naïve 日本 ok"


def test_fallback_chat_template(stories):
    tok = stories[1]
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "Story?"}]}]
    assert tok.apply_chat_template(msgs) == "Be kind.\n\nUser: Hi\nAssistant: Hello.\nUser: Story?\nAssistant:"
    assert tok.apply_chat_template(msgs[:2], add_generation_prompt=False) == "Be kind.\n\nUser: Hi\n"
    ids = tok.encode_chat(msgs[1:2])
    assert ids[0] == tok.bos_id and tok.decode(ids) == "User: Hi\nAssistant:"


def test_chat_template_errors_are_typed():
    with pytest.raises(ChatTemplateError):
        render_chat_template(FALLBACK_TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template(FALLBACK_TEMPLATE, [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def qwen_tok():
    return gguf_tokenizer(GGUFFile(QWEN_GGUF))


@needs_qwen
def test_qwen_tokenizer(qwen_tok):
    tok = qwen_tok
    assert tok.vocab_size == 151936 and not tok.add_bos
    assert tok.eos_id == tok.inner.token_to_id("<|im_end|>") and tok.inner.token_to_id("<|endoftext|>") in tok.stop_ids
    for text in TEXTS + ["def add(a, b):\n    return a + b\n", "  x\r\n\ty"]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("12345")) == 5                      # qwen2 pre-tokenizer: one digit per token
    assert [tok.token_text(i) for i in tok.encode("Hello world")] == ["Hello", "\u0120world"]


@needs_qwen
def test_qwen_chat_template(qwen_tok):
    tok = qwen_tok
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                      "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.inner.token_to_id("<|im_start|>") and tok.token_text(ids[1]) == "system"
    assert tok.decode(ids) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")
