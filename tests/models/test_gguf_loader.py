"""GGUF loader: the Q/K un-permutation, config from metadata, fingerprints, and the Qwen smoke test."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import gguf
import pytest
import torch

from bench.hf_reference import to_transformers
from specd.loader import load_model
from specd.loader.gguf import dequantize, gguf_config, gguf_fingerprint, unpermute_qk
from specd.loader.gguf_file import GGUFFile, GGUFFormatError
from specd.models import ContiguousKV

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
QWEN_GGUF = os.environ.get("SPECD_QWEN_GGUF", "")
needs_qwen = pytest.mark.skipif(not Path(QWEN_GGUF).is_file(), reason="set SPECD_QWEN_GGUF to the Qwen2.5-Coder-0.5B GGUF")


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (written out from its definition)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fingerprint(path: Path) -> str:
    reader = GGUFFile(path)
    return gguf_fingerprint(path, reader, gguf_config(reader))


@pytest.mark.parametrize("shape,heads", [((4 * 8, 5), 4), ((2 * 6, 3), 2), ((3 * 4,), 3)])
def test_unpermute_inverts_llama_cpp_permute(shape, heads):
    w = torch.randn(shape)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    assert not torch.equal(llama_cpp_permute(w, heads), w)


def test_header_parser_agrees_with_gguf_reader():
    ours, theirs = GGUFFile(STORIES), gguf.GGUFReader(STORIES)
    assert ours.data_offset == theirs.data_offset
    assert ours.metadata.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            got = ours.get(key)
            assert got == want or (isinstance(want, list) and torch.allclose(torch.tensor(got), torch.tensor(want))), key
    for t_ours, t_theirs in zip(ours.tensors, theirs.tensors):
        assert t_ours.name == t_theirs.name and t_ours.qtype == t_theirs.tensor_type
        assert torch.equal(torch.from_numpy(dequantize(ours, t_ours)), torch.from_numpy(t_theirs.data.copy()))


def test_not_a_gguf_file_is_a_typed_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError):
        GGUFFile(tmp_path / "x.gguf")


def test_stories_config_from_metadata():
    c = gguf_config(GGUFFile(STORIES))
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        ("llama", 5, 64, 8, 4, 8, 512)
    assert not c.tie_word_embeddings and not c.qkv_bias and c.rope_theta == 10000.0


def test_fingerprint_is_stable_across_copies_and_sees_data(tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(STORIES, copy)
    os.utime(copy, (0, 0))  # mtime and path must not matter
    fp = [_fingerprint(p) for p in (STORIES, copy)]
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF                                    # flip one weight byte near the end
    copy.write_bytes(bytes(data))
    changed = _fingerprint(copy)
    assert fp[0] == fp[1] and changed != fp[0]


def test_loaded_model_exposes_fingerprint(stories):
    model, _ = stories
    assert model.config.fingerprint == _fingerprint(STORIES)


def test_bf16_dtype_keeps_fp32_logits():
    model, tok = load_model(STORIES, dtype="bfloat16", device="cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    kv = ContiguousKV(model.config.num_layers)
    ids = torch.tensor(tok.encode("Once upon a time"))
    with torch.no_grad():
        assert model.logits(model(ids, kv.begin([("s", len(ids))]), kv).hidden).dtype == torch.float32


@needs_qwen
def test_qwen_gguf_chat_smoke(greedy):
    """Loads the real 0.5B Q4_K_M file in fp32 and answers a coding request with code."""
    t0 = time.perf_counter()
    model, tok = load_model(QWEN_GGUF, dtype="float32", device="cpu")
    load_s = time.perf_counter() - t0
    c = model.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size, c.qkv_bias) == \
        ("qwen2", 24, 896, 14, 2, 151936, True)
    prompt = tok.encode_chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    t0 = time.perf_counter()
    out = greedy(model, prompt, 24, tok.stop_ids)
    text = tok.decode(out)
    print(f"\nqwen load {load_s:.1f}s, {len(out)} tokens in {time.perf_counter() - t0:.1f}s: {text!r}")
    assert "def " in text


@needs_qwen
@torch.no_grad()
def test_qwen_gguf_logits_match_transformers_on_same_weights():
    """Our Qwen2 code vs transformers' Qwen2ForCausalLM holding the same dequantized weights (fp32)."""
    model, tok = load_model(QWEN_GGUF, dtype="float32", device="cpu")
    c = model.config
    ref = to_transformers(model)
    ids = torch.tensor(tok.encode_chat([{"role": "user", "content": "Sort a list in Python."}]))
    kv = ContiguousKV(c.num_layers)
    ours = model.logits(model(ids, kv.begin([("s", len(ids))]), kv).hidden)
    theirs = ref(ids[None]).logits[0]
    print(f"\nqwen fp32 max |logit diff| {(ours - theirs).abs().max().item():.2e} over {len(ids)} tokens")
    assert (ours - theirs).abs().max().item() < 5e-4  # measured 4.1e-5; 24 layers, |logits| ~ 30: fp32 summation order only
