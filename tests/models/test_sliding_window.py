"""Sliding-window attention: small random Qwen2 (windows on the upper layers, via max_window_layers) and
Qwen3 (Gemma-style alternating local/global layers, via layer_types) checkpoints written by transformers
load through our HF loader and reproduce transformers' eager logits, full-sequence and incremental through
ContiguousKV, and transformers' greedy generate through the engine's paged path."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.loader.hf import hf_config, load_hf_model
from specd.models import BackendWindowError, ContiguousKV, DecoderModel, UnsupportedModelError
from specd.models.config import fingerprint_of
from specd.sampling_params import SamplingParams

ATOL = 1e-4   # fp32, random weights: only summation order may differ
WINDOW = 8
SEQ = 40      # five windows long
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, use_sliding_window=True, sliding_window=WINDOW)
CASES = {
    # transformers 4 spelling (no layer_types in config.json): layers >= max_window_layers slide
    "qwen2-max_window_layers": ("qwen2", dict(num_hidden_layers=3, max_window_layers=1), (None, WINDOW, WINDOW)),
    # Gemma-style: every other layer local, written as transformers 5 layer_types
    "qwen3-alternating": ("qwen3", dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
                          (WINDOW, None, WINDOW, None)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # two shared cores: tiny matmuls gain nothing from more threads
    yield
    torch.set_num_threads(threads)


def _reference(arch: str, **overrides):
    """transformers' model with random weights (biases and norms randomised too, so they matter)."""
    import transformers

    cls, cfg_cls = {"qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config)}[arch]
    torch.manual_seed(0)
    ref = cls(cfg_cls(**{**SMALL, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return ref


@pytest.fixture(params=list(CASES), scope="module")
def checkpoint(request, tmp_path_factory, stories):
    """(transformers reference, HF dir, expected layer windows) for each case."""
    arch, overrides, windows = CASES[request.param]
    ref = _reference(arch, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    stories[1].inner.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if "max_window_layers" in overrides:          # drop the layer_types transformers 5 wrote
        cfg = json.loads((path / "config.json").read_text())
        del cfg["layer_types"]
        (path / "config.json").write_text(json.dumps(cfg))
    return ref, path, windows


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_logits_match_transformers_full_and_incremental(checkpoint):
    ref, path, windows = checkpoint
    model = load_hf_model(path)
    assert model.config.layer_windows == windows
    ids = _ids(SEQ)
    theirs = ref(ids[None]).logits[0]                                      # [SEQ, vocab]
    kv = ContiguousKV.for_model(model.config)
    full = model.logits(model(ids, kv.begin([("s", SEQ)]), kv).hidden)
    kv = ContiguousKV.for_model(model.config)
    steps = []
    for lo, hi in [(0, 13), (13, 18)] + [(i, i + 1) for i in range(18, SEQ)]:   # prefill, a chunk, then decode
        steps.append(model.logits(model(ids[lo:hi], kv.begin([("s", hi - lo)]), kv).hidden))
    assert (full - theirs).abs().max().item() < ATOL
    assert (torch.cat(steps) - theirs).abs().max().item() < ATOL
    # not vacuous: the same weights with full attention everywhere differ beyond the first window
    unwindowed = DecoderModel(dataclasses.replace(model.config, layer_windows=())).eval()
    unwindowed.load_state_dict(model.state_dict())
    kv = ContiguousKV(model.config.num_layers)
    other = model.logits(unwindowed(ids, kv.begin([("s", SEQ)]), kv).hidden)
    assert (other[:WINDOW] - theirs[:WINDOW]).abs().max().item() < ATOL
    assert (other[WINDOW:] - theirs[WINDOW:]).abs().max().item() > 100 * ATOL


@torch.no_grad()
def test_engine_greedy_equals_transformers_generate(checkpoint):
    """Paged KV (block 4, so a window spans blocks), chunked prefill (16-token budget, 30-token prompt)
    and two requests batched together: greedy tokens equal transformers' generate."""
    ref, path, _ = checkpoint
    engine = SpecEngine.from_config(EngineConfig(
        model=path, device="cpu", dtype="float32", block_size=4, num_local_blocks=64,
        max_num_batched_tokens=16, cuda_graphs=False))
    assert not engine.source.connected and engine.runner.backend.windows == engine.model.config.layer_windows
    prompts = {"a": _ids(30).tolist(), "b": _ids(45)[33:].tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(Request(rid, prompt, params))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            got[out.id] += out.token_ids
    for rid, prompt in prompts.items():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
        assert len(want) == 20 and len(prompt) + 20 > 3 * WINDOW
        assert got[rid] == want, rid


def test_backend_without_the_windows_is_refused(checkpoint):
    """A full-attention backend on a sliding model would give plausible wrong logits: refuse it."""
    _, path, _ = checkpoint
    model = load_hf_model(path)
    kv = ContiguousKV(model.config.num_layers)
    with pytest.raises(BackendWindowError):
        model(_ids(4), kv.begin([("s", 4)]), kv)


QWEN = dict(architectures=["Qwen2ForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("extra,windows", [
    # the shipped Qwen2.5 configs: a window and max_window_layers, but use_sliding_window false
    (dict(use_sliding_window=False, sliding_window=32768, max_window_layers=2), (None,) * 4),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), (None, None, 16, 16)),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=2,      # layer_types wins, as in transformers 5
          layer_types=["sliding_attention", "full_attention", "attention", "sliding_attention"]), (16, None, None, 16)),
    (dict(use_sliding_window=True, sliding_window=None, max_window_layers=0), (None,) * 4),
])
def test_config_parsing(extra, windows):
    assert hf_config({**QWEN, **extra}, has_lm_head=True).layer_windows == windows


@pytest.mark.parametrize("extra,match", [
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 4), "chunked_attention"),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 3), "3 entries"),
    (dict(use_sliding_window=True, sliding_window=0), "positive"),
    (dict(architectures=["LlamaForCausalLM"], use_sliding_window=True, sliding_window=8), "llama"),
])
def test_unimplemented_window_configs_are_refused(extra, match):
    with pytest.raises(UnsupportedModelError, match=match):
        hf_config({**QWEN, **extra}, has_lm_head=True)


def test_windows_are_part_of_the_fingerprint():
    """Same tensors, different windows: different KV, so the cache namespaces must differ."""
    full = hf_config(QWEN, has_lm_head=True)
    windowed = hf_config({**QWEN, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, True)
    table = [("embed_tokens.weight", (97, 64), "F32")]
    assert fingerprint_of(full, table, b"x") != fingerprint_of(windowed, table, b"x")
