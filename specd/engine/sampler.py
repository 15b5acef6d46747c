"""Batched sampling with per-request temperature, top-k, top-p and RNG.

``sampling_probs`` is the single definition of "the distribution a request samples from": the
speculative verifier must compare draft and target under exactly this transform, so nothing else
re-implements it. Work is in fp32 whatever the model dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvspec_kernels.inverse_cdf import draw
from kvspec_kernels.nucleus import bucket_nucleus_probs, nucleus_probs
from specd.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowKinds:
    """Which transform each row of a batch needs, decided on the host from the requests' settings, so
    choosing a path costs no device sync. Each row's path depends on its own settings only: a row's
    probabilities never depend on which other requests share its batch."""

    plain: tuple[int, ...]     # no top-k, top-p ≥ 1: one softmax, no sort
    top_k: tuple[int, ...]     # top-k (top-p applied inside the k): torch.topk, no full sort
    top_p: tuple[int, ...]     # top-p without top-k: kernels.nucleus (a full sort on the CPU)
    max_k: int = 0             # the largest k of the top_k rows

    @classmethod
    def of(cls, top_k: Sequence[int], top_p: Sequence[float], vocab: int) -> "RowKinds":
        limited = [0 < k < vocab for k in top_k]
        return cls(tuple(i for i, (lim, p) in enumerate(zip(limited, top_p)) if not lim and p >= 1.0),
                   tuple(i for i, lim in enumerate(limited) if lim),
                   tuple(i for i, (lim, p) in enumerate(zip(limited, top_p)) if not lim and p < 1.0),
                   max((k for k, lim in zip(top_k, limited) if lim), default=0))


@dataclass(frozen=True)
class SamplingPath:
    """Which transforms a batch's rows need, decided on the host; the half of a draft graph's key that
    says what the captured sampler computes (specd/engine/draft_graphs.py)."""

    greedy: bool = False       # some rows are greedy (argmax, one-hot)
    plain: bool = False        # some sampled rows take the plain softmax
    max_k: int = 0             # > 0: some rows take top-k; the largest k among them
    top_p: bool = False        # some rows take top-p without top-k (kernels.nucleus)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> "SamplingPath":
        sampled = [p for p in params if not p.greedy]
        kinds = RowKinds.of([p.top_k for p in sampled], [p.top_p for p in sampled], vocab)
        return cls(len(sampled) < len(params), bool(kinds.plain), kinds.max_k, bool(kinds.top_p))


# row kinds of ``static_probs``'s ``kind`` tensor
GREEDY_ROW, PLAIN_ROW, TOP_K_ROW, TOP_P_ROW = 0, 1, 2, 3


def row_kind_codes(params: Sequence[SamplingParams], vocab: int) -> list[int]:
    """Each row's kind code, as ``RowKinds`` / ``SlotSampler`` decide it."""
    return [GREEDY_ROW if p.greedy else TOP_K_ROW if 0 < p.top_k < vocab else TOP_P_ROW if p.top_p < 1.0
            else PLAIN_ROW for p in params]


def static_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, kind: torch.Tensor,
                 path: SamplingPath, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-row transform of ``sampling_probs(..., draft=True)`` (sampled rows; drafts only: the draft
    rounds of specd/engine/draft_graphs.py) and ``one_hot_argmax`` (greedy rows) with fixed shapes: every
    transform ``path`` names runs on every row and each row keeps its own by ``torch.where``, so no row
    list is needed and the call can be captured in a CUDA graph. ``path`` has sampled rows (a greedy-only
    slot is an argmax and a one-hot: kvspec_kernels/markov_slot.plain_slot); the draft rounds send paths of
    greedy and unfiltered rows only to plain_slot too, so here they come with top-k or top-p rows.

    logits: [B, V] fp32, scaled by each row's temperature already (kvspec_kernels/markov_slot.slot_logits;
    greedy rows: 1); top_p: [B] fp32; top_k: [B] int64; kind: [B] int64 row kind codes. Returns (probs
    [B, V] fp32, written into ``out`` when given, and argmax [B] int64, or None where no row is greedy: the
    Markov loop's sampled slots then skip a pass over [B, V])."""
    if not (path.plain or path.max_k or path.top_p):
        raise ValueError(f"static_probs needs a path with sampled rows, got {path}")
    argmax = logits.argmax(dim=1) if path.greedy else None
    probs = None
    for on, code, fn in ((path.plain, PLAIN_ROW, None), (path.max_k, TOP_K_ROW, _top_k_probs),
                         (path.top_p, TOP_P_ROW, _draft_top_p_probs)):
        if not on:
            continue
        these = torch.softmax(logits, dim=1) if fn is None else fn(logits, top_k, top_p, path.max_k)
        probs = these if probs is None else torch.where((kind == code)[:, None], these, probs)
    if path.greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
        return torch.where((kind == GREEDY_ROW)[:, None], one_hot, probs, out=out), argmax
    return (probs if out is None else out.copy_(probs)), argmax


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   kinds: RowKinds | None = None, draft: bool = False) -> torch.Tensor:
    """logits: [B, V]; temperature/top_p: [B] fp32 (temperature > 0); top_k: [B] int64 (0 = off).
    Returns probs [B, V] fp32 with the filtered tokens at exactly 0.

    ``kinds``: the rows' paths when the caller knows the settings on the host (else read from the
    tensors: one sync). Rows with top-p and no top-k go through ``kernels.nucleus`` (a full sort only in
    its CPU reference); a top-k row sorts its k candidates (``torch.topk``), an unfiltered row is one
    softmax. ``draft``: the distribution a drafter samples from, whose top-p rows take the rounded
    nucleus (``_draft_top_p_probs``); the target's is the exact one."""
    logits = logits.float() / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    if kinds is None:
        kinds = RowKinds.of(top_k.tolist(), top_p.tolist(), vocab)
    nucleus = _draft_top_p_probs if draft else _top_p_probs
    parts = [(rows, fn) for rows, fn in ((kinds.plain, None), (kinds.top_k, _top_k_probs), (kinds.top_p, nucleus))
             if rows]
    if len(parts) == 1:                                   # one kind: no gather or scatter of rows
        fn = parts[0][1]
        return torch.softmax(logits, dim=1) if fn is None else fn(logits, top_k, top_p, kinds.max_k)
    out = torch.empty_like(logits)
    for rows, fn in parts:
        idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        out[idx] = (torch.softmax(logits[idx], dim=1) if fn is None
                    else fn(logits[idx], top_k[idx], top_p[idx], kinds.max_k))
    return out


def _top_k_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """Rows with 0 < top_k < V: the max_k largest logits, sorted (torch.topk), are all a row can keep."""
    values, order = torch.topk(logits, max_k, dim=1)
    return _filter_sorted(values, order, top_k, top_p, logits.shape[1])


def _top_p_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """Rows with top-p and no top-k: ``kernels.nucleus`` (no sort on CUDA; its sorted reference on the
    CPU). A tie at the nucleus' boundary keeps the whole tie group (see that module)."""
    return nucleus_probs(logits.contiguous(), top_p.float())


def _draft_top_p_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """A draft's top-p rows: the nucleus rounded up to whole buckets (``kernels.nucleus``): two parallel
    launches and no ranking, where the exact nucleus ranks the boundary bucket. Lossless because the
    verifier compares against exactly these rows (the proposal's p_d); it only adds tokens within
    e^0.5 of the boundary weight, which the target then rejects."""
    return bucket_nucleus_probs(logits.contiguous(), top_p.float())


def _filter_sorted(values: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   vocab: int) -> torch.Tensor:
    """values/order: [B, n] logits sorted descending and their token ids (n ≤ vocab) -> probs [B, vocab]."""
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = rank >= k
    sorted_probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays)
    mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)
    probs_sorted = torch.softmax(values.masked_fill(drop, float("-inf")), dim=1)
    return torch.zeros(values.shape[0], vocab, device=values.device).scatter_(1, order, probs_sorted)


@dataclass(frozen=True)
class RowSettings:
    """Per-row sampling settings of a batch, on the device in one upload: the sampled (non-greedy) rows'
    temperature/top-k/top-p and their ``RowKinds``, decided on the host. Why: a per-request
    ``torch.tensor`` costs a host-to-device copy each (~7 us of host time per op on the H200); a verify
    of 32 requests built ~500 of them."""

    sampled: tuple[int, ...]        # rows that sample, on the host; the others are greedy
    index: torch.Tensor             # [S] int64: the sampled rows on the device
    temperature: torch.Tensor       # [S] fp32
    top_k: torch.Tensor             # [S] int64
    top_p: torch.Tensor             # [S] fp32
    kinds: RowKinds                 # over the sampled rows

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> "RowSettings":
        sampled = tuple(i for i, p in enumerate(params) if not p.greedy)
        chosen = [params[i] for i in sampled]
        ints = torch.tensor([list(sampled), [p.top_k for p in chosen]], dtype=torch.int64).to(device)
        floats = torch.tensor([[p.temperature for p in chosen], [p.top_p for p in chosen]],
                              dtype=torch.float32).to(device)
        kinds = RowKinds.of([p.top_k for p in chosen], [p.top_p for p in chosen], vocab)
        return cls(sampled, ints[0], floats[0], ints[1], floats[1], kinds)


def warm(device: torch.device, vocab: int) -> None:
    """Build the sampling kernels (``kernels.nucleus``, both nuclei, and ``kernels.inverse_cdf``) now: on
    the first sampled request a build would run inside a step (~0.1 s a kernel, eight kernels). A no-op
    off CUDA."""
    if device.type == "cuda":
        logits, top_p = torch.zeros(1, vocab, device=device), torch.full((1,), 0.9, device=device)
        draw(nucleus_probs(logits, top_p), torch.zeros(1, device=device))
        bucket_nucleus_probs(logits, top_p)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] -> fp32 [B, V] one-hot at each row's argmax: a greedy row's distribution."""
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(1, logits.argmax(1, keepdim=True), 1.0)


def rows_probs(logits: torch.Tensor, rows: RowSettings) -> torch.Tensor:
    """logits: [B, V] -> [B, V] fp32: each row's own distribution, exactly ``sampling_probs`` for sampled
    rows and ``one_hot_argmax`` for greedy ones, whatever the other rows of the batch are."""
    if not rows.sampled:
        return one_hot_argmax(logits)
    if len(rows.sampled) == logits.shape[0]:
        return sampling_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.kinds)
    out = one_hot_argmax(logits)
    out[rows.index] = sampling_probs(logits[rows.index], rows.temperature, rows.top_k, rows.top_p, rows.kinds)
    return out


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [B, V] (unnormalised is fine); uniforms: [B] in [0, 1). The token whose CDF interval holds
    u; never a zero-prob token. ``kernels.inverse_cdf``: two launches on CUDA, a cumsum on the CPU."""
    return draw(probs.float().contiguous(), uniforms.float())


def draw_uniforms(generators: Sequence[torch.Generator | None], n: int = 1) -> torch.Tensor:
    """[B, n] fp32 uniforms, each row from its request's own CPU generator (unseeded rows use the global RNG)."""
    rows = [torch.rand(n, generator=g) for g in generators]
    return torch.stack(rows) if rows else torch.empty(0, n)


@dataclass(frozen=True)
class SamplePlan:
    """A plain step's sampling, prepared on the host and uploaded before the step's forward: which logits
    rows sample, the sampled rows' settings and their uniforms. ``sample_planned`` then only launches
    device work, with no host synchronisation, so the launches queue behind the forward while it runs.

    Why: built after the forward, the first upload (``torch.tensor(..., device=cuda)``, a synchronous
    copy) waited for the forward to finish, and every launch after it (a temperature divide, the four
    nucleus kernels, the two inverse-CDF kernels, four more uploads) ran with the GPU idle. On the H200
    (session 15, run AU) plain steps of the four sampled workloads took 0.4-1.0 ms longer than greedy
    extraction's at the same load (c = 8: 2.3-2.9 against 1.92 ms). Session 16, run AX (this code,
    another day): greedy extraction's plain steps unchanged (1.91 ms), coding 2.40 → 2.21 and creative
    2.90 → 2.23 ms, knowledge and support unchanged (2.35, 2.32): suggestive, not a same-run A/B. Exact:
    the same operations on the same values; each request's uniforms are drawn once a step from its own
    generator, before the forward instead of after it, where nothing else in the step draws from it (a
    drafting request draws in its proposal, before both, and in ``verify``)."""

    rows: torch.Tensor              # [B] int64: the logits row of each sampling sequence
    settings: RowSettings           # the sampled ones among them (positions, settings, kinds)
    uniforms: torch.Tensor          # [S] fp32

    @property
    def every_row_samples(self) -> bool:
        """No greedy row among them: the sampled rows need no gather, the draws no scatter."""
        return len(self.settings.sampled) == self.rows.shape[0]

    @classmethod
    def of(cls, rows: Sequence[int], params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           vocab: int, device: torch.device) -> "SamplePlan":
        """Two uploads: one int64 tensor (logits rows, sampled positions, top-k), one fp32 tensor
        (temperature, top-p, uniforms)."""
        sampled = tuple(i for i, p in enumerate(params) if not p.greedy)
        chosen = [params[i] for i in sampled]
        n, s = len(rows), len(sampled)
        ints = torch.tensor(list(rows) + list(sampled) + [p.top_k for p in chosen], dtype=torch.int64).to(device)
        if s:
            u = draw_uniforms([generators[i] for i in sampled]).view(-1)
            floats = torch.cat([torch.tensor([p.temperature for p in chosen] + [p.top_p for p in chosen],
                                             dtype=torch.float32), u.float()]).to(device)
        else:                                           # all greedy: nothing to upload
            floats = torch.empty(0, dtype=torch.float32, device=device)
        kinds = RowKinds.of([p.top_k for p in chosen], [p.top_p for p in chosen], vocab)
        settings = RowSettings(sampled, ints[n: n + s], floats[:s], ints[n + s:], floats[s: 2 * s], kinds)
        return cls(ints[:n], settings, floats[2 * s:])


def sample_planned(logits: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
    """logits: [R, V] (the step's rows); returns the token ids [B] int64 on the device of ``plan.rows``'
    sequences, in their order: argmax for greedy rows, the plan's draw from ``sampling_probs`` for the
    others. Device work only (no host synchronisation)."""
    picked = logits.index_select(0, plan.rows)
    out = torch.argmax(picked, dim=1)
    rows = plan.settings
    if not rows.sampled:
        return out
    chosen = picked if plan.every_row_samples else picked.index_select(0, rows.index)
    drawn = inverse_cdf(sampling_probs(chosen, rows.temperature, rows.top_k, rows.top_p, rows.kinds), plan.uniforms)
    return drawn if plan.every_row_samples else out.index_copy(0, rows.index, drawn)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] int64 on logits.device (``sample_planned`` with a plan made now)."""
    plan = SamplePlan.of(range(logits.shape[0]), params, generators, logits.shape[1], logits.device)
    return sample_planned(logits, plan)
