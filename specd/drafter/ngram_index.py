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

from array import array
from typing import Sequence

SCAN_TOKENS = 4096   # up to this history length ``propose`` scans the history's bytes; past it, the index


class NgramIndex:
    """Keys are exact integers, not tuples: an n-gram's tokens packed ``bits`` apart (token ids are
    below the vocabulary size), so the dicts hold no container the garbage collector must track, and
    a prompt is registered a whole n at a time (one list and one C-level ``dict.update`` per n: 32
    prompts of 700 tokens in ~7 ms instead of ~14 ms with a tuple per n-gram, on the CPU machine).

    Short histories are not indexed at all (session 7): up to ``SCAN_TOKENS`` tokens the history is
    also kept as int32 bytes and ``propose`` searches them (``bytearray.rfind``, in C). A request whose
    cell rests still proposes every step (the gate decides after the lookup), so the index's build was
    paid by every request. For 32 prompts of 700 tokens, building the index took 10.2 ms and each step
    0.16 ms; scanning took 0.6 ms up front and 0.09 ms a step (``python -m tests.engine.ngram_scan_probe``,
    CPU machine, medians). On the H200 (run N) a gated ngram row at c = 32 that never drafted still ran
    15-20% slower than ``none``; this is one part of that, how much is not measured.
    Past ``SCAN_TOKENS`` a miss scans too much (~100 µs at 22k tokens), so the history is registered
    once and the index answers from then on."""

    def __init__(self, ngram_max: int, gamma: int, vocab_size: int = 1 << 18):
        if ngram_max < 1 or gamma < 1 or vocab_size < 1:
            raise ValueError(f"ngram_max, gamma and vocab_size must be ≥ 1, got {ngram_max}, {gamma}, {vocab_size}")
        self.n_max, self.gamma, self.vocab_size = ngram_max, gamma, vocab_size
        self.bits = max(1, (vocab_size - 1).bit_length())
        self.tokens: list[int] = []
        self.last: list[dict[int, int]] = [{} for _ in range(ngram_max + 1)]
        self.registered = 0          # windows with exclusive end e ≤ registered are in ``last``
        self.data: bytearray | None = bytearray()   # the history as int32 while it is short; None: indexed

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with the history ``prompt + output`` (it only grows; a shorter one starts over)."""
        have, total = len(self.tokens), len(prompt) + len(output)
        if total < have:
            self.__init__(self.n_max, self.gamma, self.vocab_size)
            have = 0
        if have < len(prompt):
            self.tokens.extend(prompt[have:])
            self.tokens.extend(output)
        else:
            self.tokens.extend(output[have - len(prompt):])
        if self.data is not None:
            if len(self.tokens) <= SCAN_TOKENS:
                self.data += array("i", self.tokens[have:]).tobytes()
                return
            self.data = None         # long now: register the whole history once, then answer from the index
        self._register(len(self.tokens) - 1)

    def _register(self, upto: int) -> None:
        """Register the windows ending at e = registered + 1 .. ``upto``: the first n_max − 1 ends one
        by one (not every n fits before them), the rest a whole n at a time, where the key of the
        n-gram ending at e is the (n − 1)-gram's with tokens[e − n] packed above it."""
        start = self.registered + 1
        tokens, last, bits = self.tokens, self.last, self.bits
        for e in range(start, min(upto, self.n_max - 1) + 1):
            for n, key in enumerate(self._keys(e, e), 1):
                last[n][key] = e
        lo = max(start, self.n_max)
        if lo <= upto:
            ends = range(lo, upto + 1)
            keys = tokens[lo - 1:upto]
            last[1].update(zip(keys, ends))
            for n in range(2, self.n_max + 1):
                shift = bits * (n - 1)
                keys = [k | (t << shift) for k, t in zip(keys, tokens[lo - n:upto - n + 1])]
                last[n].update(zip(keys, ends))
        self.registered = max(self.registered, upto)

    def propose(self) -> list[int]:
        """Up to γ tokens continuing the most recent earlier occurrence of the longest matching suffix."""
        if self.data is not None:
            return self._scan()
        size = len(self.tokens)
        keys = self._keys(size, min(self.n_max, size - 1))     # the suffix's, shortest first
        for n in range(len(keys), 0, -1):
            e = self.last[n].get(keys[n - 1])
            if e is not None:
                return self.tokens[e:e + self.gamma]
        return []

    def _scan(self) -> list[int]:
        """``propose`` by searching the history's bytes, suffix lengths n = 1, 2, ...: an occurrence of
        the (n + 1)-token suffix contains one of the n-token suffix, so the first n that misses ends the
        search, and the longest match's most recent occurrence is the last one found."""
        size, data, found = len(self.tokens), self.data, None
        for n in range(1, min(self.n_max, size - 1) + 1):
            pattern = data[4 * (size - n):]              # a copy: ``rfind`` searches ``data``
            end = 4 * (size - 1)                      # occurrences ending before the suffix's end
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0 or at % 4 == 0:
                    break
                end = at + len(pattern) - 1           # straddles tokens: look further back
            if at < 0:
                break
            found = at // 4 + n
        return [] if found is None else self.tokens[found:found + self.gamma]

    def _keys(self, end: int, most: int) -> list[int]:
        """The keys of the n-grams ending at ``end`` (exclusive), n = 1 .. ``most``: the (n − 1)-gram's
        key with tokens[end − n] packed above it."""
        keys, key = [], 0
        for n in range(1, most + 1):
            key |= self.tokens[end - n] << (self.bits * (n - 1))
            keys.append(key)
        return keys
