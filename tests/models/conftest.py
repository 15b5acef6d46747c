"""Shared fixtures: the bundled stories260K model, a transformers reference built from the same
weights, and a greedy-decoding helper over the contiguous backend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.hf_reference import to_transformers
from specd.loader import load_model
from specd.models import ContiguousKV, DecoderModel

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"


@pytest.fixture(scope="session")
def stories():
    model, tok = load_model(STORIES, dtype="float32", device="cpu")
    return model, tok


@pytest.fixture(scope="session")
def stories_ref(stories):
    return to_transformers(stories[0])


@pytest.fixture
def greedy():
    return greedy_decode


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
