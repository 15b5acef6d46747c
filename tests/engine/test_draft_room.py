"""A sequence with no room to draft (its next token is its last under max_tokens) runs no draft round:
the proposer leaves it out of the batched round (specd/engine/proposers.py, ``FeatureProposer.propose``),
and the outputs stay those of plain decoding. Stories260K with its committed DSpark drafter, fixed γ."""
from __future__ import annotations

from pathlib import Path

import pytest

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

DRAFTER = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
           "The sun was hot. Ben"]
MAX_TOKENS = (5, 9, 12, 17)


def decode(method: str) -> tuple[dict[str, list[int]], list[tuple[list[int], int]]]:
    """Greedy answers by request, and for every draft round the limits of the sequences it was asked
    about and how many rows the drafter ran."""
    engine = SpecEngine.from_config(EngineConfig(drafters=f"dspark={DRAFTER}", speculation=method,
                                                 spec_schedule="fixed", num_speculative_tokens=7))
    rounds: list[tuple[list[int], int]] = []
    if method != "none":
        proposer = engine._proposer(method)
        draft_contexts = proposer.drafter.draft_contexts
        asked: list[int] = []
        propose = proposer.propose

        def recording_propose(seqs, limits):
            asked[:] = list(limits)
            return propose(seqs, limits)

        def recording_round(ctxs, *args, **kwargs):
            rounds.append((list(asked), len(ctxs)))
            return draft_contexts(ctxs, *args, **kwargs)

        proposer.propose = recording_propose
        proposer.drafter.draft_contexts = recording_round
    tok = engine.tokenizer
    for i, (text, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(Request(f"r{i}", tok.encode(text),
                                   SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    answers: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for out in engine.step():
            answers[out.id] += out.token_ids
    return answers, rounds


def test_a_sequence_at_its_last_token_runs_no_draft_round():
    plain, _ = decode("none")
    spec, rounds = decode("dspark")
    assert spec == plain                                        # greedy: the same answers
    assert all(len(plain[f"r{i}"]) == n for i, n in enumerate(MAX_TOKENS))
    # the case arose: some round was asked about a sequence with no room left
    assert any(0 in limits for limits, _ in rounds)
    # and the drafter ran only the rows with room: none for a round whose sequences all had none
    for limits, rows in rounds:
        assert rows == sum(1 for k in limits if k > 0)
