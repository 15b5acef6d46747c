"""A small Okapi BM25 index: enough retrieval to give knowledge prompts a realistic shape.

Scores `sum over query terms t of idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / avg_len))`, with
the non-negative idf `log(1 + (N - df + 0.5) / (df + 0.5))`. Postings are an inverted index, so a query
touches only the documents that share a term. Ties break on the lower document index, so results are
deterministic.
"""
from __future__ import annotations

import heapq
import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

_TOKEN = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset("a an and are as at be by did do does for from had has have how i in is it its of on or "
                      "the this to was were what when where which who whom why will with".split())


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


class BM25:
    """Immutable once built; `top_k` is a pure function of the query."""

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.lengths: list[int] = []
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # term -> [(doc index, tf)]
        for index, doc in enumerate(documents):
            counts = Counter(tokenize(doc))
            self.lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings[term].append((index, tf))
        self.avg_len = sum(self.lengths) / max(len(self.lengths), 1)

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1.0 + (len(self.lengths) - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for term in sorted(set(tokenize(query))):  # fixed order: float sums must not depend on hash seeds
            idf = self.idf(term)
            for index, tf in self.postings.get(term, ()):
                norm = self.k1 * (1.0 - self.b + self.b * self.lengths[index] / self.avg_len)
                out[index] += idf * tf * (self.k1 + 1.0) / (tf + norm)
        return out

    def top_k(self, query: str, k: int) -> list[int]:
        """Indices of the k best documents, best first; a query with no known term returns []."""
        scored = self.scores(query)
        return [i for _, i in heapq.nsmallest(k, ((-s, i) for i, s in scored.items()))]
