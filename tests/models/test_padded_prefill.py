"""PaddedPrefill (one attention call per layer over a right-padded batch) computes what ContiguousKV (one
call per sequence and layer, the reference) does: hidden states and captured layers, with GQA, with
sliding-window layers, and when the batch is split into several groups."""
from __future__ import annotations

import pytest
import torch

import specd.models.padded_prefill as pp
from specd.models import ContiguousKV, DecoderModel
from specd.models.config import ModelConfig
from specd.models.padded_prefill import PaddedPrefill

ATOL = 2e-5   # fp32, random weights: padding changes only the summation order of the attention


def _model(windows=()) -> DecoderModel:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=4,
                      num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      qkv_bias=True, layer_windows=windows)
    model = DecoderModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def _forward(model, kv, seqs, **begin):
    positions = kv.begin([(i, len(s)) for i, s in enumerate(seqs)], **begin)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.no_grad():
        out = model(ids, positions, kv, capture_layers=[0, 2])
    return out.hidden, out.captured


@pytest.mark.parametrize("windows", [(), (5, None, 5, None)], ids=["full", "sliding"])
def test_padded_batch_matches_per_sequence_attention(windows):
    model = _model(windows)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (23, 1, 40, 7)]
    want_h, want_c = _forward(model, ContiguousKV.for_model(model.config), seqs)
    got_h, got_c = _forward(model, PaddedPrefill.for_model(model.config), seqs)
    assert got_h.shape == want_h.shape
    torch.testing.assert_close(got_h, want_h, atol=ATOL, rtol=0)
    for g, w in zip(got_c, want_c):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_groups_split_a_batch_whose_scores_would_not_fit(monkeypatch):
    """A tiny score budget puts every sequence in its own group: same result, several calls."""
    monkeypatch.setattr(pp, "SCORE_BYTES", 6 * 40 * 40 * 4)
    model = _model()
    seqs = [[1, 2, 3] * 10, [4] * 40, [5, 6]]
    kv = PaddedPrefill.for_model(model.config)
    got, _ = _forward(model, kv, seqs, num_heads=6)
    assert len(kv._groups) == 3
    want, _ = _forward(model, ContiguousKV.for_model(model.config), seqs)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_bad_batches_are_refused():
    kv = PaddedPrefill(2)
    with pytest.raises(ValueError, match="once"):
        kv.begin([(0, 3), (0, 2)])
    with pytest.raises(ValueError, match="at least one token"):
        kv.begin([(0, 3), (1, 0)])
    kv.begin([(0, 3)])
    with pytest.raises(ValueError, match="declared 3 tokens"):
        kv(0, torch.zeros(4, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8))
