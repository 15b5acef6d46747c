"""The causal confidence scheduler replayed on recorded rounds: a PROJECTED speed-up at batch B where each
request verifies the length specd's scheduler gives it (``specd.engine.spec_scheduler.schedule_verify``),
beside the best single k for every request under the same costs.

Why: ``sps_projection.project`` charges one uniform k to every request, a stand-in for the scheduler
that can only bound it from below. Its real input is each round's confidences, which ``bench acceptance
--keep-rounds`` records with the drafts each round had accepted (γ drafted, chain verification).

A replayed step at batch B draws B recorded rounds (seeded, with replacement), calibrates their
confidences with the drafter's STS temperatures, and asks the scheduler for lengths ℓ_r with the SPS
profile of this batch: the verify times t_B(k) at n = B·(k + 1) tokens (linear in steps/s between them, as
the engine's profile is) plus the drafter's cost a step as its overhead. Request r then emits
1 + min(accepted_r, ℓ_r) tokens: chain verification keeps the accepted prefix of what it verifies and adds
one token. The step costs t_B(n) at n = B + Σℓ, plus the draft. The speed-up is emitted tokens per second
over plain decoding's B / t_B(0). A step where every ℓ is 0 still paid for its draft: the gate
(``SpecGate``) decides before drafting whether to draft at all, so the served row is at least plain
decoding, max(1, speed-up), and the table shows both.
"""
from __future__ import annotations

import random
from typing import Sequence

from specd.engine.spec_scheduler import SpsProfile, calibrate, schedule_verify

Round = tuple[list[float], int]          # calibrated conditional confidences c_1..γ, drafts accepted of γ


def recorded_rounds(records: dict) -> list[Round]:
    """``bench acceptance --keep-rounds``' ``round_records`` -> calibrated (confidences, accepted) rounds."""
    temps = records.get("sts_temperatures")
    return [(calibrate(row, temps), int(a)) for row, a in zip(records["confidence"], records["accepted"])]


def batch_profile(times_s: Sequence[float], b: int, draft_s: float) -> SpsProfile:
    """The SPS profile of a step of b requests: t_B(k) at b·(k + 1) tokens, and the draft as overhead."""
    return SpsProfile.from_table({b * (k + 1): 1.0 / t for k, t in enumerate(times_s)}).with_overhead(draft_s)


def replay(rounds: Sequence[Round], times_s: Sequence[float], b: int, draft_s: float, steps: int = 200,
           seed: int = 0, lengths_of=None) -> dict:
    """Replay ``steps`` steps of b requests. ``lengths_of(confidences, profile)`` picks the lengths
    (default: the scheduler); the same draws go to every caller with the same seed."""
    if not rounds:
        raise ValueError("no recorded rounds to replay")
    profile = batch_profile(times_s, b, draft_s)
    pick = lengths_of or schedule_verify
    rng = random.Random(seed)
    emitted = verified = 0
    seconds = 0.0
    for _ in range(steps):
        drawn = [rounds[rng.randrange(len(rounds))] for _ in range(b)]
        lengths = pick([conf for conf, _ in drawn], profile)
        emitted += sum(1 + min(accepted, n) for (_, accepted), n in zip(drawn, lengths))
        verified += sum(lengths)
        seconds += 1.0 / profile.sps(b + sum(lengths))      # the forward at its tokens + the draft (overhead)
    plain = b / times_s[0]
    return {"speedup": emitted / seconds / plain, "mean_length": verified / (steps * b),
            "tokens_per_request_step": emitted / (steps * b)}


def scheduled_against_uniform(rounds: Sequence[Round], times_s: Sequence[float], b: int, draft_s: float,
                              steps: int = 200, seed: int = 0) -> dict:
    """The scheduler's replay, and the best uniform k (1..γ) on the same draws and costs."""
    sched = replay(rounds, times_s, b, draft_s, steps, seed)
    gamma = len(times_s) - 1
    uniform = {k: replay(rounds, times_s, b, draft_s, steps, seed, lambda conf, _p, k=k: [k] * len(conf))
               for k in range(1, gamma + 1)}
    best = max(uniform, key=lambda k: uniform[k]["speedup"])
    return {"scheduled": sched, "best_uniform": {"k": best, **uniform[best]}}
