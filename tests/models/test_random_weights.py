"""The random-weights model directory (specd/loader/random_weights.py): a real tokenizer carried exactly, weights
drawn reproducibly at load, and served by the engine like any other model."""
from __future__ import annotations

import json

import pytest
import torch

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.loader import CheckpointError, load_model
from specd.loader.random_weights import MARKER, SHAPES, main, write_random_dir
from specd.sampling_params import SamplingParams

from tests.models.conftest import STORIES

TEXT = "Once upon a time, there was a little girl named Lily.\nShe said: \"hi!\""


@pytest.fixture
def random_dir(tmp_path, stories):
    return write_random_dir("tiny-qwen3", stories[1], tmp_path / "rand", seed=3)


def test_the_tokenizer_files_rebuild_the_gguf_tokenizer_exactly(random_dir, stories):
    _, want = stories
    _, got = load_model(random_dir, dtype="float32", device="cpu")
    assert (got.bos_id, got.eos_id, got.stop_ids, got.add_bos) == (want.bos_id, want.eos_id, want.stop_ids,
                                                                    want.add_bos)
    assert got.chat_template == want.chat_template
    assert got.encode(TEXT) == want.encode(TEXT) and got.decode(want.encode(TEXT)) == want.decode(want.encode(TEXT))
    assert got.fingerprint == want.fingerprint          # same vocabulary and rules: the same KV namespace part


def test_weights_are_drawn_reproducibly_with_unit_norms_and_a_seeded_fingerprint(tmp_path, random_dir, stories):
    a, _ = load_model(random_dir, dtype="float32", device="cpu")
    b, _ = load_model(random_dir, dtype="float32", device="cpu")
    other, _ = load_model(write_random_dir("tiny-qwen3", stories[1], tmp_path / "seed4", seed=4),
                          dtype="float32", device="cpu")
    cfg = a.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.qk_norm) == ("qwen3", 2, 64, True)
    for (name, pa), (_, pb), (_, po) in zip(a.named_parameters(), b.named_parameters(), other.named_parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1.0), name
        else:
            assert not torch.equal(pa, po), name
            assert 0.01 < pa.float().std().item() < 0.03, name
    assert a.config.fingerprint == b.config.fingerprint != other.config.fingerprint


def test_a_directory_without_marker_or_weights_is_an_error_not_a_random_model(random_dir):
    (random_dir / MARKER).rename(random_dir / "moved.json")
    with pytest.raises(CheckpointError, match="neither"):
        load_model(random_dir, device="cpu")
    (random_dir / MARKER).write_text(json.dumps({"shape": "tiny-qwen3", "seed": 0}))   # no config, no std
    with pytest.raises(CheckpointError, match="not a valid random-weights marker"):
        load_model(random_dir, device="cpu")


def test_a_tokenizer_larger_than_the_shapes_embedding_is_refused(tmp_path, stories, monkeypatch):
    monkeypatch.setitem(SHAPES, "too-small", dict(SHAPES["tiny-qwen3"], vocab_size=100))
    with pytest.raises(ValueError, match="embeds 100"):
        write_random_dir("too-small", stories[1], tmp_path / "x")
    with pytest.raises(ValueError, match="unknown shape"):
        write_random_dir("no-such-shape", stories[1], tmp_path / "y")


def test_the_engine_serves_it_with_fixed_length_answers(random_dir):
    engine = SpecEngine.from_config(EngineConfig(model=random_dir, device="cpu", dtype="float32"))
    prompt = engine.tokenizer.encode(TEXT)
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    ids, finished = [], False
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            ids += out.token_ids
            finished |= out.finished
    assert finished and len(ids) == 12
    assert all(0 <= t < engine.model.config.vocab_size for t in ids)


def test_the_command_line_writes_a_loadable_directory(tmp_path, capsys):
    assert main(["--shape", "tiny-qwen3", "--tokenizer-from", str(STORIES), "--out", str(tmp_path / "cli")]) == 0
    assert "random weights" in capsys.readouterr().out
    model, tok = load_model(tmp_path / "cli", device="cpu")
    assert model.config.vocab_size == SHAPES["tiny-qwen3"]["vocab_size"] and tok.vocab_size == 512


def test_reports_name_it_random_and_traces_use_its_tokenizers_vocabulary(random_dir):
    from bench.trace_replay import model_vocab_size
    from specd.loader.random_weights import model_label

    assert model_label(random_dir) == "rand (tiny-qwen3 shape, RANDOM WEIGHTS: timing only)"
    assert model_label(STORIES) == "stories260K.gguf"
    assert model_vocab_size(random_dir) == model_vocab_size(STORIES) == 512
