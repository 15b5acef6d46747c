"""The engine's measured prefill cost, for kvd's prefetch budget (docs/design/kvd.md, "Prefetch budget").

kvd promotes a DRAM/NVMe hit only when that is predicted faster than recomputing it; the recompute side
is this estimate. Why only steps with at least MIN_TOKENS new tokens: a decode step's time is launch-bound
(~20 ms of host time on the GPU whatever the token count), so folding it in would make prefill look
far slower than it is and promote everything. Until a prefill step has been measured there is no
estimate (None): kvd then promotes every hit, as it did before the budget existed.

Why the marginal cost (session 8), not tokens / seconds: recomputing a hit's blocks adds their tokens to
a forward that runs anyway, so what it costs is the step time per *extra* token, the slope of step time
against new tokens. A step's time is a fixed part (launches, the decode rows beside the chunk) plus a
per-token part. The ratio charged the fixed part to every token: a 72-token step of 15 ms read as
4.8k tokens/s where the slope on the H200 is nearer 100k. So kvd kept promoting NVMe blocks at 0.8 GB/s
(run O: 88,278 promotions, one recompute decision, 113 ms parked on turn 7 against a 63 ms prefill). The
slope is a decayed least-squares fit over prefill steps; the average per-token cost bounds it from above
(the fixed part is never negative) and a tenth of it from below (noise must not make recompute free).
Until the steps' token counts spread enough to fit a slope, the estimate is the average, as before.
The model is linear: a block deep in a long context costs more attention than one near its start.
"""
from __future__ import annotations

PREFILL_EWMA = 0.2       # weight of a new step in the average cost
FIT_DECAY = 0.95         # per step, the slope fit's memory (~20 prefill steps)
MIN_TOKENS = 64
MIN_SPREAD = 0.25        # the fit needs the token counts' std at least this fraction of their mean
MIN_SLOPE_FRACTION = 0.1  # the marginal cost is at least this fraction of the average cost


class PrefillRate:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.average_s: float | None = None      # EWMA of seconds / token over prefill steps
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One forward step that computed ``tokens`` new tokens in ``seconds``."""
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        per_token = seconds / tokens
        old = self.average_s
        self.average_s = per_token if old is None else (1 - PREFILL_EWMA) * old + PREFILL_EWMA * per_token
        d = FIT_DECAY
        self._w, self._n, self._t = d * self._w + 1, d * self._n + tokens, d * self._t + seconds
        self._nn, self._nt = d * self._nn + tokens * tokens, d * self._nt + tokens * seconds

    def token_seconds(self) -> float | None:
        """Predicted seconds one more token adds to a prefill step, or None before any measurement."""
        if self.average_s is None:
            return None
        mean_n = self._n / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < (MIN_SPREAD * mean_n) ** 2:
            return self.average_s
        slope = (self._nt / self._w - mean_n * self._t / self._w) / var_n
        return min(self.average_s, max(slope, MIN_SLOPE_FRACTION * self.average_s))

    @property
    def tokens_per_s(self) -> float | None:
        s = self.token_seconds()
        return None if s is None else 1.0 / s

    def block_seconds(self) -> float | None:
        """Predicted seconds to recompute one block, or None before any measurement."""
        s = self.token_seconds()
        return None if s is None else self.block_size * s
