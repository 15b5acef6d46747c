"""Shared fixtures: the bundled stories260K model, a transformers reference built from the same
weights, and a greedy-decoding helper over the contiguous backend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specd.loader import load_model
from specd.models import ContiguousKV, DecoderModel

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"


@pytest.fixture(scope="session")
def stories():
    model, tok = load_model(STORIES, dtype="float32", device="cpu")
    return model, tok


@pytest.fixture(scope="session")
def stories_ref(stories):
    return hf_reference(stories[0])


@pytest.fixture
def greedy():
    return greedy_decode


def hf_reference(model: DecoderModel):
    """transformers' LlamaForCausalLM with our (already un-permuted) stories weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    ref = LlamaForCausalLM(cfg).eval()
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return ref


@torch.no_grad()
def greedy_decode(model: DecoderModel, prompt: list[int], n: int, stop_ids=frozenset()) -> list[int]:
    """Greedy decode n tokens: one prefill, then one token per step, through ContiguousKV."""
    kv = ContiguousKV(model.config.num_layers)
    out: list[int] = []
    cur = torch.tensor(prompt)
    for _ in range(n):
        positions = kv.begin([("s", len(cur))])
        nxt = int(model.logits(model(cur, positions, kv).hidden[-1:]).argmax(-1))
        if nxt in stop_ids:
            break
        out.append(nxt)
        cur = torch.tensor([nxt])
    return out
