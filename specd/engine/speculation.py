"""Speculative decoding inside the engine: propose draft tokens, verify them in the same forward pass
as everything else, keep the longest accepted prefix.

Lossless by construction: the target distribution at every verified position goes through exactly
the transform a plain step samples from (``sampler.sampling_probs``: temperature, top-k, top-p, fp32),
the draft distribution is exactly what the drafter sampled from (one-hot for deterministic proposals
and greedy drafts), and ``kernels.rejection_sample`` accepts with min(1, p_t/p_d), resamples a
rejection from norm(max(p_t - p_d, 0)) and adds a bonus token when every draft passes. Greedy requests
(temperature 0) get one-hot target rows, so they emit exactly the target's argmax chain.

KV rollback needs no copy: the pool slots of rejected drafts lie beyond the sequence's computed length
and are overwritten by the next step; blocks are published only up to the computed length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import torch

import kvspec_kernels as kernels
from specd.engine.greedy_verify import GreedyVerify
from specd.engine.sampler import RowSettings, draw_uniforms, rows_probs
from specd.sampling_params import SamplingParams

METHODS = ("none", "ngram", "dspark", "dflash", "eagle3")


@dataclass
class Draft:
    """One sequence's proposal for this step.

    Its distribution is ``probs`` when given, else row ``origin[1]`` of the proposal's batched
    ``origin[0]`` (the first k slots), else one-hot at the tokens (deterministic proposals). A drafter
    hands over the batched form, so ``verify`` stacks every draft of one proposal with one gather (or
    none) instead of one copy per sequence. ``origin[0]`` may be a CUDA graph's output buffer: valid
    until the proposer's next proposal, i.e. for this step."""

    tokens: list[int]                   # k draft tokens, k may be 0
    probs: torch.Tensor | None = None   # [k, V] fp32 the tokens were sampled from
    confidence: list[float] | None = None   # [k] raw conditional survival c_j (DSpark's head); None = no head
    origin: tuple[torch.Tensor, int] | None = None   # ([B, γ, V] fp32 probs of the whole proposal, this row)

    def truncated(self, k: int) -> "Draft":
        """The first k drafts: still lossless, a prefix of the block is verified exactly like the block."""
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k],
                     None if self.confidence is None else self.confidence[:k], self.origin)


class Proposer(Protocol):
    method: str
    capture_layers: tuple[int, ...]     # target layers whose outputs the proposer reads (empty: none)

    def propose(self, seqs: Seq, limits: Seq[int]) -> list[Draft]:
        """One batched proposal for all sequences (``specd.engine.sequence.Sequence``: tokens,
        sampling params, generator, draft features); sequence i gets at most ``limits[i]`` tokens."""

    def fuse(self, captured: Seq[torch.Tensor]) -> torch.Tensor:
        """Captured target layer outputs ([n, d] each) -> the features the proposer keeps per token."""


def target_probs(logits: torch.Tensor, params: SamplingParams | Seq[SamplingParams]) -> torch.Tensor:
    """logits: [n, V]; params: one request's settings, or one per row -> the distribution a plain step
    would sample from at each row, fp32 [n, V] (greedy rows: one-hot at the argmax). ``verify`` computes
    the same through ``rows_probs`` with settings uploaded before the forward (``VerifyInputs``)."""
    rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else params
    return rows_probs(logits, RowSettings.of(rows, logits.shape[1], logits.device))


def verify(logits: torch.Tensor, starts: Seq[int], drafts: Seq[Draft], params: Seq[SamplingParams],
           generators: Seq[torch.Generator | None]) -> list[list[int]]:
    """logits: [R, V] target logits; sequence i's rows are ``starts[i] .. starts[i] + k_i``: its last
    known token, then each draft position. Returns, per sequence, the accepted drafts followed by one
    target-sampled token (``verify_prepared`` with inputs prepared now).

    No per-sequence device work: one target transform (``rows_probs``) over every verified row, the draft rows stacked
    per proposal, token ids and indices in one upload, one rejection-sampling launch, one download."""
    return verify_prepared(logits, prepare_verify(starts, drafts, params, generators, logits.shape[1],
                                                  logits.device))


def prepare_verify(starts: Seq[int], drafts: Seq[Draft], params: Seq[SamplingParams],
                   generators: Seq[torch.Generator | None], vocab: int, device: torch.device,
                   greedy_chain: bool = True) -> "VerifyInputs | GreedyVerify | MixedVerify":
    """``verify``'s inputs, made before the step's forward: the argmax chain's (``GreedyVerify``) for greedy
    requests, the rejection sampler's (``VerifyInputs``, the reference) for sampled ones, both
    (``MixedVerify``) for a step with some of each; the rejection sampler's for all with ``greedy_chain``
    False."""
    greedy = [i for i, p in enumerate(params) if p.greedy] if greedy_chain else []
    if len(greedy) == len(params):
        return GreedyVerify.of(starts, [d.tokens for d in drafts], device)
    if not greedy:
        return VerifyInputs.of(starts, drafts, params, generators, vocab, device)
    chosen = set(greedy)
    sampled = [i for i in range(len(params)) if i not in chosen]
    return MixedVerify(greedy, sampled,
                       GreedyVerify.of([starts[i] for i in greedy], [drafts[i].tokens for i in greedy], device),
                       VerifyInputs.of([starts[i] for i in sampled], [drafts[i] for i in sampled],
                                       [params[i] for i in sampled], [generators[i] for i in sampled], vocab,
                                       device))


@dataclass
class MixedVerify:
    """A step verifying greedy and sampled requests: the chain for the greedy ones, the rejection sampler
    for the others, the chains put back in the requests' order. Why: through the rejection sampler, a
    greedy request costs full-vocabulary one-hot rows like a sampled one (specd/engine/greedy_verify.py);
    served traffic mixes both. Lossless: the greedy requests get the reference's chains, the sampled ones
    what the reference gives them as a batch of their own (tests/engine/test_greedy_verify.py). A sampled
    request's last token reads draw K + 1 of its generator, K the longest draft among the sampled requests
    now rather than among all: another sample from the same distribution. Two downloads instead of one."""

    greedy: list[int]             # positions of the greedy requests among the step's verified ones
    sampled: list[int]
    chain: "GreedyVerify"
    rejection: "VerifyInputs"

    def run(self, logits: torch.Tensor) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(len(self.greedy) + len(self.sampled))]
        for i, chain in zip(self.sampled, verify_prepared(logits, self.rejection)):    # launched first
            out[i] = chain
        for i, chain in zip(self.greedy, self.chain.run(logits)):
            out[i] = chain
        return out


@dataclass
class VerifyInputs:
    """Everything ``verify`` needs besides the logits, uploaded before the step's forward (the engine
    prepares it with the step's ``sampler.SamplePlan``): after the forward only device work is launched,
    queued behind it, and one download waits. Why: made after the forward, the first blocking upload
    waited for it, and the launches after it ran with the GPU idle (see ``sampler.SamplePlan``; not
    measured in isolation). Exact: the same operations on the same values; each request's K + 1 uniforms are
    drawn once a step from its own generator, before the forward instead of after it."""

    drafts: Seq[Draft]
    plan: VerifyPlan
    ints: torch.Tensor            # ``plan.ints`` on the device
    rows: RowSettings             # the target transform of every verified row
    uniforms: torch.Tensor        # [S, K+1] fp32: K accept draws + 1 for the last token

    @classmethod
    def of(cls, starts: Seq[int], drafts: Seq[Draft], params: Seq[SamplingParams],
           generators: Seq[torch.Generator | None], vocab: int, device: torch.device) -> "VerifyInputs":
        plan = VerifyPlan.of(starts, drafts, vocab)
        ints = torch.tensor(plan.ints, dtype=torch.int64).to(device, non_blocking=True)
        row_params = [p for p, d in zip(params, drafts) for _ in range(len(d.tokens) + 1)]
        rows = RowSettings.of(row_params, vocab, device)
        uniforms = draw_uniforms(generators, plan.k_max + 1).to(device)
        return cls(drafts, plan, ints, rows, uniforms)


def verify_prepared(logits: torch.Tensor, inputs: "VerifyInputs | GreedyVerify | MixedVerify") -> list[list[int]]:
    """``verify`` on prepared inputs: device work, then one device-to-host copy (two for a mixed step)."""
    if isinstance(inputs, (GreedyVerify, MixedVerify)):
        return inputs.run(logits)
    plan, drafts, u = inputs.plan, inputs.drafts, inputs.uniforms
    rows, gather, toks, num, one_hot, sources = plan.split(inputs.ints)
    p_t = rows_probs(logits.index_select(0, rows), inputs.rows)
    p_t = p_t.index_select(0, gather).view(len(drafts), plan.k_max + 1, -1)     # [S, K+1, V]
    p_d = draft_rows(drafts, plan, one_hot, sources, p_t)                         # [S, K, V]
    accepted, out = kernels.rejection_sample(p_t, p_d, toks.view(len(drafts), plan.k_max), num.int(),
                                             u[:, :plan.k_max].contiguous(), u[:, plan.k_max].contiguous())
    both = torch.cat([accepted.long()[:, None], out], dim=1).tolist()          # one device-to-host copy
    return [row[1: row[0] + 2] for row in both]


@dataclass
class VerifyPlan:
    """Everything ``verify`` indexes with, built on the host and uploaded as one int64 tensor.

    Segments of ``ints``: the verified logits rows [n]; for each padded (sequence, position) of
    [S, K+1], its row among those n (positions past a draft repeat a real row: the kernel reads only
    positions <= k_i); the draft tokens [S, K] (0-padded); k_i [S]; the flat indices of one-hot draft
    entries in [S, K, V]; then per batched proposal (``Draft.origin``) its destination and source rows."""

    ints: list[int]
    sizes: list[int]
    k_max: int
    groups: list[tuple[torch.Tensor, bool]]    # per proposal: (its [B, γ, V] probs, rows are 0..B-1 in order)
    explicit: list[int]                        # sequences whose draft carries its own [k, V] probs

    @classmethod
    def of(cls, starts: Seq[int], drafts: Seq[Draft], vocab: int) -> "VerifyPlan":
        ks = [len(d.tokens) for d in drafts]
        k_max = max(ks, default=0)
        rows, gather, toks, one_hot = [], [], [], []
        for i, (start, d, k) in enumerate(zip(starts, drafts, ks)):
            first = len(rows)
            rows += range(start, start + k + 1)
            gather += [first + min(j, k) for j in range(k_max + 1)]
            toks += d.tokens + [0] * (k_max - k)
            if d.probs is None and d.origin is None:
                one_hot += [(i * k_max + j) * vocab + t for j, t in enumerate(d.tokens)]
        by_block: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, d in enumerate(drafts):
            if d.probs is None and d.origin is not None:
                block, dst, src = by_block.setdefault(id(d.origin[0]), (d.origin[0], [], []))
                dst.append(i)
                src.append(d.origin[1])
        ints, sizes = rows + gather + toks + ks + one_hot, [len(rows), len(gather), len(toks), len(ks), len(one_hot)]
        groups = []
        for block, dst, src in by_block.values():
            ints += dst + src
            sizes += [len(dst), len(src)]
            groups.append((block, dst == src == list(range(block.shape[0]))))
        return cls(ints, sizes, k_max, groups, [i for i, d in enumerate(drafts) if d.probs is not None])

    def split(self, ints: torch.Tensor) -> tuple:
        """The uploaded tensor -> (rows, gather, toks, num, one_hot, [(dst, src) per proposal])."""
        parts = list(ints.split(self.sizes))
        pairs = parts[5:]
        return (*parts[:5], [(pairs[2 * g], pairs[2 * g + 1]) for g in range(len(self.groups))])


def draft_rows(drafts: Seq[Draft], plan: VerifyPlan, one_hot: torch.Tensor, sources: list, like: torch.Tensor
               ) -> torch.Tensor:
    """[S, K, V] fp32: each draft's distribution at its k positions (anything the kernel never reads past
    them). One proposal covering every sequence in order is used as it is (a view, no copy)."""
    s, k_max, vocab = len(drafts), plan.k_max, like.shape[2]
    if len(plan.groups) == 1 and plan.groups[0][1] and not plan.explicit and one_hot.numel() == 0 \
            and plan.groups[0][0].shape[1] >= k_max:
        return plan.groups[0][0][:, :k_max]
    p_d = torch.zeros(s, k_max, vocab, device=like.device)
    for (block, _), (dst, src) in zip(plan.groups, sources):
        width = min(k_max, block.shape[1])
        p_d[dst, :width] = block.index_select(0, src)[:, :width].to(p_d.device, torch.float32)
    for i in plan.explicit:
        d = drafts[i]
        p_d[i, : len(d.tokens)] = d.probs.to(device=like.device, dtype=torch.float32)
    if one_hot.numel():
        p_d.view(-1).index_fill_(0, one_hot, 1.0)
    return p_d
