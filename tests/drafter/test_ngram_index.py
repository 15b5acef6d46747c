"""The incremental prompt lookup gives the reference's proposal (NgramDrafter.propose) at every step."""
from __future__ import annotations

import random

import pytest

from specd.drafter.config import DrafterConfig
from specd.drafter.ngram import NgramDrafter
from specd.drafter.ngram_index import NgramIndex


def reference(ngram_max: int, gamma: int) -> NgramDrafter:
    return NgramDrafter(DrafterConfig(method="ngram", vocab_size=64, hidden_size=8, intermediate_size=16,
                                      num_heads=1, num_kv_heads=1, head_dim=8, confidence=False, markov_rank=0,
                                      ngram_max=ngram_max, gamma=gamma))


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_reference_as_a_history_grows(seed):
    rng = random.Random(seed)
    ngram_max, gamma, vocab = rng.randint(1, 5), rng.randint(1, 8), rng.choice([2, 3, 5, 12])
    ref, index = reference(ngram_max, gamma), NgramIndex(ngram_max, gamma, vocab)
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    output: list[int] = []
    for _ in range(60):
        index.sync(prompt, output)
        assert index.propose() == ref.propose(prompt + output), (prompt, output)
        output.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))   # accepted drafts: several


def test_known_answers_and_a_shorter_history_starts_over():
    index = NgramIndex(4, 4, vocab_size=10)
    index.sync([7, 8, 9, 1, 2, 3, 9, 5, 6, 7, 8, 9], [])
    assert index.propose() == [1, 2, 3, 9]
    index.sync([4, 1, 2, 4, 3, 3], [4])            # another history, shorter than the indexed one
    assert index.propose() == [3, 3, 4]
    assert NgramIndex(3, 2).propose() == []
    with pytest.raises(ValueError):
        NgramIndex(0, 4)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_prompt_registered_at_once_matches_the_reference(seed):
    """The whole-n registration path (a prompt) and the one-by-one path (decoding) agree."""
    rng = random.Random(100 + seed)
    ref, index = reference(4, 6), NgramIndex(4, 6, vocab_size=7)
    prompt = [rng.randrange(7) for _ in range(rng.randint(50, 300))]
    output: list[int] = []
    for _ in range(30):
        index.sync(prompt, output)
        assert index.propose() == ref.propose(prompt + output)
        output.append(rng.randrange(7))
