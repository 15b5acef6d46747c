"""Shared fixtures: the bundled stories260K target, one real token sequence and its fused features."""
from pathlib import Path

import pytest
import torch

from specd.drafter import DrafterConfig, build_drafter, target_features
from specd.loader import load_model

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
TEXT = "Once upon a time there was a little girl named Lily. She loved to play with her ball in the park."


@pytest.fixture(scope="session")
def target():
    model, tokenizer = load_model(STORIES, dtype="float32", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def tokens(target) -> torch.Tensor:
    _, tokenizer = target
    return torch.tensor(tokenizer.encode(TEXT, add_bos=True), dtype=torch.int64)


def _make_drafter(model, method: str, **overrides):
    """A randomly initialised drafter; seeded so every test sees the same weights."""
    torch.manual_seed(0)
    overrides.setdefault("num_layers", 2 if method in ("dspark", "dflash") else 1)
    if method == "dspark":
        overrides.setdefault("markov_rank", 16)
    drafter = build_drafter(DrafterConfig.for_target(model.config, method, **overrides), model)
    if method == "dspark":
        # a freshly initialised W2 is small; make the Markov bias matter so tests can see it
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=1.0)
    return drafter.eval()


def _fused(drafter, model, tokens) -> torch.Tensor:
    """[T, d] fused features of `tokens` for `drafter`."""
    out = target_features(model, tokens, drafter.config.target_layers)
    with torch.no_grad():
        return drafter.fuse(out.captured)


@pytest.fixture(scope="session")
def make_drafter():
    """The factory `make_drafter(model, method, **overrides)` (a fixture, so tests never import conftest)."""
    return _make_drafter


@pytest.fixture(scope="session")
def fused():
    """The helper `fused(drafter, model, tokens) -> [T, d]`."""
    return _fused


@pytest.fixture(scope="module")
def one_thread():
    """These models are tiny: extra threads only spin against each other on a shared 2-core machine
    (measured: the lossless test takes 2.6 s with 1 thread, minutes with 2 under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
