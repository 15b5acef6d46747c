"""The causal confidence scheduler (DESIGN.md §5): how many drafted tokens each request verifies this step.

Every decoding request r brings γ drafts with calibrated conditional confidences c_{r,j} (the probability
that draft j survives given that j−1 did). Its survival to position j is a_{r,j} = Π_{i≤j} c_{r,i}. A
verify step over B batch tokens runs at SPS(B) steps per second and emits, in expectation,
τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}) tokens, so the engine's token rate is Θ = τ·SPS(B). The scheduler picks
the lengths ℓ_r greedily: admit (r, j) pairs in decreasing a while Θ rises, and stop at the first that
does not raise it. Under load SPS(B) falls with every added token, so the budget per request shrinks
smoothly; when nothing raises Θ, every ℓ_r is 0 and the step is a plain decode step.

``SpsProfile`` is the SPS(B) table, measured once at engine start-up by timing the model on dummy
verify batches of B tokens and interpolated in between.
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


class SchedulerError(ValueError):
    """A profile or a confidence row that the scheduler cannot use."""


@dataclass(frozen=True)
class SpsProfile:
    """Verify steps per second against the number of batch tokens B, measured at a few points.

    ``forward_sps(B)`` is the target forward alone: linear between points, the first value below them,
    ∝ 1/B past the largest (the compute-bound limit, so a large batch never looks free). ``sps(B)`` is
    the whole step: it adds ``overhead_s``, the time a step spends outside the target forward (drafting,
    which happens before the scheduler decides, verification, host work). Without it a small target looks
    far more expensive per verified token than it is, and the scheduler under-speculates."""

    points: tuple[int, ...]        # batch tokens, strictly increasing, ≥ 1
    steps_per_s: tuple[float, ...]  # measured forward steps/s at each point, > 0
    overhead_s: float = 0.0         # seconds per step outside the target forward, ≥ 0

    def __post_init__(self) -> None:
        if not self.points or len(self.points) != len(self.steps_per_s):
            raise SchedulerError("an SPS profile needs one rate per point, and at least one point")
        if any(b < 1 for b in self.points) or any(x >= y for x, y in zip(self.points, self.points[1:])):
            raise SchedulerError(f"SPS points must be increasing and ≥ 1, got {self.points}")
        if any(not s > 0 for s in self.steps_per_s):
            raise SchedulerError(f"steps/s must be positive, got {self.steps_per_s}")
        if not self.overhead_s >= 0:
            raise SchedulerError(f"step overhead must be ≥ 0 s, got {self.overhead_s}")

    @classmethod
    def from_table(cls, table: dict[int, float]) -> "SpsProfile":
        """{B: steps/s} -> profile (tests, or a profile saved by ``to_table``)."""
        items = sorted((int(b), float(s)) for b, s in table.items())
        return cls(tuple(b for b, _ in items), tuple(s for _, s in items))

    def to_table(self) -> dict[int, float]:
        return dict(zip(self.points, self.steps_per_s))

    @classmethod
    def measure(cls, forward: Callable[[int], object], points: Sequence[int], repeats: int = 3,
                sync: Callable[[], object] = lambda: None) -> "SpsProfile":
        """Time ``forward(B)`` (one verify-shaped model pass over B tokens) at each point.

        One untimed warm-up per point (allocator, kernel autotuning), then the median of ``repeats``
        timed runs: the median ignores a run disturbed by another process on a shared machine.
        ``sync`` waits for the device (``torch.cuda.synchronize``) so a timed run includes its kernels."""
        rates = []
        for b in points:
            forward(b)
            sync()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(b)
                sync()
                times.append(time.perf_counter() - t0)
            rates.append(1.0 / max(statistics.median(times), 1e-9))
        return cls(tuple(points), tuple(rates))

    def with_overhead(self, seconds: float) -> "SpsProfile":
        return SpsProfile(self.points, self.steps_per_s, max(0.0, seconds))

    def sps(self, b: int) -> float:
        return 1.0 / (1.0 / self.forward_sps(b) + self.overhead_s)

    def forward_sps(self, b: int) -> float:
        pts, rates = self.points, self.steps_per_s
        if b <= pts[0]:
            return rates[0]
        if b >= pts[-1]:
            return rates[-1] * pts[-1] / b
        i = bisect.bisect_right(pts, b)
        b0, b1 = pts[i - 1], pts[i]
        return rates[i - 1] + (rates[i] - rates[i - 1]) * (b - b0) / (b1 - b0)


def profile_points(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_tokens``: enough to see a knee, few enough to time fast."""
    pts = [1 << k for k in range(max(1, max_tokens).bit_length()) if 1 << k < max_tokens]
    return pts + [max(1, max_tokens)]


def calibrate(confidence: Sequence[float], temperatures: Sequence[float] | None) -> list[float]:
    """Raw conditional confidences -> STS-calibrated ones, σ(logit(c_j) / t_j) (specd/drafter/calibration.py).

    The scheduler multiplies them into survivals, and STS fitted t_j so that those products are
    calibrated; positions past the fitted temperatures keep t = 1."""
    if temperatures is None:
        return [float(c) for c in confidence]
    out = []
    for j, c in enumerate(confidence):
        c = min(max(float(c), 1e-7), 1 - 1e-7)
        t = temperatures[j] if j < len(temperatures) else 1.0
        out.append(1.0 / (1.0 + math.exp(-math.log(c / (1 - c)) / t)))
    return out


def survivals(confidence: Sequence[float]) -> list[float]:
    """c_{r,1..k} -> a_{r,1..k} = running products (non-increasing, since each c ≤ 1)."""
    out, a = [], 1.0
    for c in confidence:
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out


def schedule_verify(confidences: Sequence[Sequence[float]], sps: SpsProfile, other_tokens: int = 0,
                    other_emitted: float = 0.0) -> list[int]:
    """confidences[r]: request r's calibrated c_{r,1..k_r} -> ℓ_r, the drafts r verifies (a prefix).

    ``other_tokens`` / ``other_emitted``: what the rest of the step's forward adds to B and to τ
    (prompt chunks, decoders that do not draft); they make each draft's marginal cost the real one.

    Greedy over (r, j) in decreasing a_{r,j}; ties go to the smaller j, then the smaller r, so a
    request's positions are always visited in order and the result is deterministic.

    The early stop is what keeps speculation lossless, not an optimisation. Whether (r, j) is verified
    must not depend on the confidences of later positions c_{r,>j}: those are computed from the drafted
    token x_{r,j} itself, so a rule that reads them (a global search for the best Θ, which may skip a
    non-improving pair to reach a better one behind it) makes "x_{r,j} is verified" depend on which
    token x_{r,j} is, and verification then accepts a biased sample. The DSpark paper's Appendix A
    gives a two-token counterexample (SPS 1/0.5/0.45, p_t = (.7, .3), p_d = (.5, .5): the output
    becomes (.85, .15)). Stopping at the first pair that does not raise Θ decides (r, j) from pairs
    ranked above it only, i.e. from other requests and from c_{r,≤j}.

    Never slower than no speculation: a pair is admitted only when Θ strictly rises, so the chosen Θ
    is above Θ(ℓ = 0) or every ℓ_r is 0.
    """
    lengths = [0] * len(confidences)
    if not confidences:
        return lengths
    tau = len(confidences) + other_emitted
    batch = len(confidences) + other_tokens
    best = tau * sps.sps(batch)
    for a, j, r in sorted((-a, j, r) for r, row in enumerate(confidences) for j, a in enumerate(survivals(row))):
        theta = (tau - a) * sps.sps(batch + 1)          # a is negated in the sort key
        if not theta > best:
            break                                        # the early stop: never look past this pair
        tau, batch, best = tau - a, batch + 1, theta
        lengths[r] = j + 1
    return lengths
