"""The incremental prompt lookup gives the reference's proposal (NgramDrafter.propose) at every step."""
from __future__ import annotations

import random
from array import array

import pytest

from specd.drafter.config import DrafterConfig
from specd.drafter.ngram import NgramDrafter
from specd.drafter.ngram_index import NgramIndex


def reference(ngram_max: int, gamma: int) -> NgramDrafter:
    return NgramDrafter(DrafterConfig(method="ngram", vocab_size=64, hidden_size=8, intermediate_size=16,
                                      num_heads=1, num_kv_heads=1, head_dim=8, confidence=False, markov_rank=0,
                                      ngram_max=ngram_max, gamma=gamma))


@pytest.fixture(params=["scan", "index", "switch"])
def mode(request, monkeypatch):
    """Both ways to answer, and the switch between them: short histories are scanned (the default
    below SCAN_TOKENS), long ones indexed (SCAN_TOKENS 0), or indexed once they pass 20 tokens."""
    import specd.drafter.ngram_index as ni

    monkeypatch.setattr(ni, "SCAN_TOKENS", {"scan": 1 << 30, "index": 0, "switch": 20}[request.param])
    return request.param


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_reference_as_a_history_grows(seed, mode):
    rng = random.Random(seed)
    ngram_max, gamma, vocab = rng.randint(1, 5), rng.randint(1, 8), rng.choice([2, 3, 5, 12])
    ref, index = reference(ngram_max, gamma), NgramIndex(ngram_max, gamma, vocab)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    output: list[int] = []
    for _ in range(60):
        index.sync(prompt, output)
        assert index.propose() == ref.propose(prompt + output), (prompt, output)
        output.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))   # accepted drafts: several


def test_known_answers_and_a_shorter_history_starts_over(mode):
    index = NgramIndex(4, 4, vocab_size=10)
    index.sync([7, 8, 9, 1, 2, 3, 9, 5, 6, 7, 8, 9], [])
    assert index.propose() == [1, 2, 3, 9]
    index.sync([4, 1, 2, 4, 3, 3], [4])            # another history, shorter than the indexed one
    assert index.propose() == [3, 3, 4]
    assert NgramIndex(3, 2).propose() == []
    with pytest.raises(ValueError):
        NgramIndex(0, 4)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_prompt_registered_at_once_matches_the_reference(seed, mode):
    """The whole-n registration path (a prompt) and the one-by-one path (decoding) agree."""
    rng = random.Random(100 + seed)
    ref, index = reference(4, 6), NgramIndex(4, 6, vocab_size=7)
    prompt = [rng.randrange(7) for _ in range(rng.randint(50, 300))]
    output: list[int] = []
    for _ in range(30):
        index.sync(prompt, output)
        assert index.propose() == ref.propose(prompt + output)
        output.append(rng.randrange(7))


def test_a_byte_match_across_two_tokens_is_not_an_occurrence():
    """The scan searches int32 bytes: 65541 followed by 0 holds the bytes of 256 one byte off. Only
    matches on token boundaries count, so the proposal continues the real 256 at position 0."""
    import specd.drafter.ngram_index as ni

    history = [256, 11, 65541, 0, 12, 256]
    index = NgramIndex(1, 4, vocab_size=70_000)
    index.sync(history, [])
    assert index.data is not None and bytes(array("i", [256]))[0:4] in bytes(index.data)[5:16]
    assert index.propose() == [11, 65541, 0, 12] == reference(1, 4).propose(history)
    assert ni.SCAN_TOKENS >= 4096
