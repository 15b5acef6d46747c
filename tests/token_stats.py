"""The two-sample test the losslessness checks share: do two lists of sampled token ids come from one
distribution?"""
from __future__ import annotations

import collections

from scipy.stats import chi2_contingency


def token_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square on token counts; rare tokens pooled so every cell expects >= 5."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    keep = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 20]
    rows = [[ca[t] for t in keep] + [sum(v for t, v in ca.items() if t not in keep)],
            [cb[t] for t in keep] + [sum(v for t, v in cb.items() if t not in keep)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return chi2_contingency(rows)[1]
