"""The engine's measured prefill rate, for kvd's prefetch budget (docs/design/kvd.md, "Prefetch budget").

kvd promotes a DRAM/NVMe hit only when that is predicted faster than recomputing it; the recompute side
is this rate. Why only steps with at least MIN_TOKENS new tokens: a decode step's time is launch-bound
(~20 ms of host time on the GPU whatever the token count), so folding it in would make prefill look
far slower than it is and promote everything. Until a prefill step has been measured there is no
estimate (None): kvd then promotes every hit, as it did before the budget existed.
"""
from __future__ import annotations

PREFILL_EWMA = 0.2
MIN_TOKENS = 64


class PrefillRate:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """One forward step that computed ``tokens`` new tokens in ``seconds``."""
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else (1 - PREFILL_EWMA) * old + PREFILL_EWMA * rate

    def block_seconds(self) -> float | None:
        """Predicted seconds to recompute one block, or None before any measurement."""
        return None if self.tokens_per_s is None else self.block_size / self.tokens_per_s
