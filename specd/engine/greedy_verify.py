"""Verification when every verified request is greedy: the longest prefix of the draft that matches the
target's argmax chain, then the target's argmax at the first mismatch (or the bonus position).

Why: rejection sampling against one-hot target rows (``speculation.verify_prepared``, the reference)
gives exactly this chain whatever the draft's distribution is. A drafted token is accepted with
probability min(1, p_t(x)/p_d(x)), which is 1 where x is the argmax and 0 elsewhere; a rejection
resamples from norm(max(p_t - p_d, 0)), which is one-hot at the argmax. The general path gets there
through full-vocabulary fp32 rows: a one-hot target row per verified position, a gather to [S, K+1, V],
the rejection kernel over them, three uploads and a uniform draw per request beforehand. Here it is one
upload (the verified rows), an index and an argmax over them, and the download the general path makes
too. On the H200 (session 16, ``bench.gpu_profile --draft-round``, both paths in the same call,
Qwen2.5-0.5B's vocabulary) verifying 1 / 8 / 32 greedy requests took 0.12 / 0.18 / 0.49 ms this way
against 0.74 / 1.04 / 1.51 ms through the rejection sampler; a whole plain decode step at c = 1 is ~1.7 ms.

Exact, not approximate: the argmax is the same op over the same rows as the reference's one-hot rows
(``sampler.one_hot_argmax``), so ties resolve alike; tests/engine/test_greedy_verify.py checks the two
paths token for token. A greedy request draws no uniforms here, where the reference drew (and ignored)
K + 1 of them from its generator: a seeded request's own outputs cannot change, and an unseeded sampled
request later draws different global-RNG values from the same distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch


@dataclass
class GreedyVerify:
    """The host side of a greedy verification, prepared before the step's forward."""

    drafts: list[list[int]]       # each request's draft tokens (k_i of them)
    rows: torch.Tensor            # [Σ (k_i + 1)] int64 on the device: each request's verified logits rows

    @classmethod
    def of(cls, starts: Seq[int], drafts: Seq[list[int]], device: torch.device) -> "GreedyVerify":
        """starts[i]: request i's first verified logits row (its last known token); rows
        starts[i] .. starts[i] + k_i follow it."""
        rows = [r for start, d in zip(starts, drafts) for r in range(start, start + len(d) + 1)]
        return cls([list(d) for d in drafts], torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True))

    def run(self, logits: torch.Tensor) -> list[list[int]]:
        """logits: [R, V] of the step -> per request, its accepted drafts and one target token."""
        targets = logits.index_select(0, self.rows).argmax(dim=1).tolist()     # one device-to-host copy
        return accept_greedy(self.drafts, targets)


def accept_greedy(drafts: Seq[list[int]], targets: Seq[int]) -> list[list[int]]:
    """drafts: per request its k_i tokens; targets: the k_i + 1 argmax tokens of each request's verified
    rows, concatenated in request order -> per request the matching prefix and the target token after it."""
    out, pos = [], 0
    for draft in drafts:
        chain = targets[pos: pos + len(draft) + 1]
        pos += len(draft) + 1
        j = 0
        while j < len(draft) and draft[j] == chain[j]:
            j += 1
        out.append(draft[:j] + [chain[j]])
    return out
