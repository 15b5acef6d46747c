"""NgramIndex: prompt lookup kept up to date token by token, for the serving path.

``NgramDrafter.propose`` (specd/drafter/ngram.py) is the reference: it rebuilds a tensor of the whole
history and scans it for every n, every step. On the H200 (run K, session 6) that scan cost ~0.15 ms per
request per step with 2-5k-token histories: at 32 requests a resting ngram step took 11 ms against a
plain step's 6 ms, and the gate, which compares drafting with resting *after* the proposal, kept
drafting at 0.53-0.61× plain decoding. The index registers each new token's n-grams once (``n_max``
dict writes) and answers a step with ``n_max`` dict reads, whatever the history's length.

Same answer as the reference, by construction: after ``sync`` to a history of length L, ``last[n]`` maps
every n-gram whose window ends at position e ≤ L − 1 (exclusive end; the suffix itself ends at L and is
not registered yet) to the largest such e, so the proposal ``tokens[e:e + γ]`` continues the most recent
earlier occurrence of the longest matching suffix. tests/drafter/test_ngram_index.py checks it against
the reference on random histories, grown step by step.
"""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    def __init__(self, ngram_max: int, gamma: int):
        if ngram_max < 1 or gamma < 1:
            raise ValueError(f"ngram_max and gamma must be ≥ 1, got {ngram_max}, {gamma}")
        self.n_max, self.gamma = ngram_max, gamma
        self.tokens: list[int] = []
        self.last: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_max + 1)]
        self.registered = 0          # windows with exclusive end e ≤ registered are in ``last``

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with the history ``prompt + output`` (it only grows; a shorter one starts over)."""
        have, total = len(self.tokens), len(prompt) + len(output)
        if total < have:
            self.__init__(self.n_max, self.gamma)
            have = 0
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            self.tokens.extend(output)
        else:
            self.tokens.extend(output[have - len(prompt):])
        self._register(len(self.tokens) - 1)

    def _register(self, upto: int) -> None:
        tokens, last = self.tokens, self.last
        for e in range(self.registered + 1, upto + 1):
            for n in range(1, min(self.n_max, e) + 1):
                last[n][tuple(tokens[e - n:e])] = e
        self.registered = max(self.registered, upto)

    def propose(self) -> list[int]:
        """Up to γ tokens continuing the most recent earlier occurrence of the longest matching suffix."""
        tokens, size = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, size - 1), 0, -1):
            e = self.last[n].get(tuple(tokens[size - n:]))
            if e is not None:
                return tokens[e:e + self.gamma]
        return []
