"""Which proposer serves a speculation method. Built lazily, once per engine and method."""
from __future__ import annotations

from specd.engine.errors import EngineError
from specd.engine.speculation import Draft, Proposer


class NgramProposer:
    """Prompt lookup (specd.drafter.ngram). Its proposals are deterministic, so they travel without
    probabilities (one-hot), which keeps a [k, vocab] tensor per sequence off the hot path."""

    method = "ngram"

    def __init__(self, drafter):
        self.drafter = drafter

    def propose(self, histories, limits, params, generators) -> list[Draft]:
        return [Draft(self.drafter.propose(h)[:k]) for h, k in zip(histories, limits)]


def load_proposer(method: str, config, model) -> Proposer:
    if method == "ngram":
        from specd.drafter.config import DrafterConfig
        from specd.drafter.ngram import NgramDrafter

        dc = DrafterConfig.for_target(model.config, "ngram", gamma=config.num_speculative_tokens)
        return NgramProposer(NgramDrafter(dc))
    # dspark, dflash and eagle3 read the target's hidden states, which the engine does not capture yet
    raise EngineError("bad_request", f"speculation method {method!r} is not served yet; use ngram or none")
