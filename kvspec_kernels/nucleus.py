"""Top-p (nucleus) probabilities without sorting the vocabulary: exact for the target, rounded to a
bucket for drafts.

Why: four of the five bench workloads sample with top-p and no top-k, and the torch path sorted all
151,936 logits of every row it transformed. On the H200 (session 10, run AD, per-step phases) that made
a plain step 0.6-1.7 ms slower on those workloads than on the greedy one, a DSpark draft round 1.5-7 ms
slower (seven sequential positions, one sort each) and a verify 1-4 ms slower (γ + 1 rows per request).
Measured with `python -m bench.sampling_cost` (docs/design/kernels.md, "Top-p without a sort").

**Exact** (``nucleus_probs``; the target's distribution, plain steps and verification): with
``w = exp(l - max l)`` and ``s = Σ w``, token x is kept iff the mass of the tokens with a strictly larger
logit is below ``p · s``; kept tokens get ``w / Σ kept w``, the others exactly 0. That is "the smallest
prefix of the sorted vocabulary whose mass reaches p" (the token that crosses p stays) whenever the
boundary logit is not tied; a tie keeps the whole tie group, so the result never depends on the order a
sort puts equal values in. ``p >= 1`` keeps every token.

**Rounded** (``bucket_nucleus_probs``; drafts): the nucleus widened to whole buckets of STEP nats on a
fixed grid (``floor(-l / STEP)``): every token in a bucket above or at the one where the mass first
reaches ``p · s``. Verification is exact for any draft distribution as long as it uses the one the
draft was drawn from, which it does (the proposal's rows); the rounded nucleus only adds tokens within
e^STEP of the boundary weight, which the target then rejects. It needs no ranking inside a bucket, so it
is three fully parallel launches.

The fine grid (NB buckets of STEP nats below the row's max, the last for everything further down) is
reached in two levels (session 31): coarse buckets of FINE fine ones first, then the fine buckets of the
one coarse bucket where the mass reaches ``p · s``. Why: the one-level ladder compared every token with
all 64 fine buckets and counted them too (128 compare-and-adds a token); on the H200 that was most of the
exact nucleus's ~3 ms at 256 rows (verify at c = 32) and 0.36 ms of the rounded one at 32 rows (each of a
draft round's seven positions; docs/design/kernels.md). Two levels take 16 + 8 (+ 8 counts): ~4x fewer.
The result is the one-level grid's by construction (the same buckets, the same bracket, sums in another
fixed order). H200, session 32 (``bash bench/gpu/session.sh nucleus``: ``python -m bench.sampling_cost
--against`` the old file, both in one run): 0.36x / 0.25x the one-level exact / rounded transforms at 256
rows, the same kept sets (docs/design/kernels.md).

The kernels (grid ``(rows, chunks of CHUNK tokens)`` except ``_search``):
1. ``_coarse_ladder``: each chunk's largest logit and the mass of its tokens per coarse bucket, counted
   from the coarse bucket of the chunk's own max (NC buckets, the last for everything further down). The
   grid is the same for every chunk, so the row's buckets are the chunks' shifted by whole buckets
   (``_row_coarse``, masses rescaled to the row's max) and no chunk needs the row's max first.
2. ``_fine_ladder``: each chunk's mass (and count) per fine bucket of the row's coarse bracket, and of
   the last fine bucket, from the row's max (every program reads the coarse ladder's rows, as
   ``_row_coarse``); ``_row_buckets`` then finds the fine bucket j where the mass first reaches ``p · s``.
3. Rounded: ``_rounded_write`` writes every token at or above bucket j.
   Exact: tokens above bucket j are kept and those below dropped whatever their rank, so only bucket j's
   tokens (the bracket) need ranking. ``_compact`` copies them to a list at the front of the output row
   (each chunk at the offset its predecessors' counts give), ``_search`` (one program per row) bisects
   the list's keys (the logits' bits, ordered as the values) for the boundary, in registers when the
   bracket has at most SEARCH_BLOCK tokens, else in passes over the list, and ``_write`` writes the row.
Every sum runs in a fixed order, so a row's result is deterministic and never depends on other rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.alignment import aligned
from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError

CHUNK = 4096           # tokens per program of the chunked kernels (38 chunks at V = 151,936)
SUB = 512              # tokens per bucketing step inside a chunk ([SUB, NC] and [SUB, FINE] one-hot tiles)
NB = 64                # fine buckets below a max, the last for everything further down (e^-31.5)
STEP = 0.5             # nats per fine bucket (a power of two: the grid arithmetic is exact)
FINE = 8               # fine buckets per coarse bucket (4 nats)
NC = 16                # coarse buckets below a chunk's max, the last for everything further down: the fine
                       # buckets 0..63 below a max lie in its first 9 coarse ones, whatever its offset
SEARCH_BLOCK = 4096    # a bracket up to this size is searched in registers


def nucleus_probs(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] fp32 (temperature already applied); top_p: [R] fp32 in (0, 1].
    Returns [R, V] fp32 probabilities, filtered tokens at exactly 0. Triton on CUDA, else the reference."""
    fn = nucleus_probs_triton if use_triton(logits.device) else nucleus_probs_ref
    return fn(logits, top_p)


def bucket_nucleus_probs(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rounded nucleus (drafts); arguments and result as ``nucleus_probs``."""
    fn = bucket_nucleus_probs_triton if use_triton(logits.device) else bucket_nucleus_probs_ref
    return fn(logits, top_p)


def nucleus_probs_ref(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition through a full sort: the exclusive running mass of the sorted weights is the
    mass strictly above a tie group's first member, so the smallest kept logit is that of the last
    sorted position whose running mass is below p · s, and every logit >= it is kept."""
    _check_args(logits, top_p)
    top = logits.max(dim=1, keepdim=True).values
    w = torch.exp(logits - top)
    total = w.sum(dim=1, keepdim=True)
    sorted_l, _ = torch.sort(logits, dim=1, descending=True)
    sorted_w = torch.exp(sorted_l - top)
    before = torch.cumsum(sorted_w, dim=1) - sorted_w
    target = torch.where(top_p >= 1.0, float("inf"), top_p).unsqueeze(1) * total   # p = 1 keeps every token
    kept_count = (before < target).sum(dim=1, keepdim=True).clamp(min=1)
    smallest = sorted_l.gather(1, kept_count - 1)
    kept = torch.where(logits >= smallest, w, torch.zeros_like(w))
    return kept / kept.sum(dim=1, keepdim=True)


def bucket_nucleus_probs_ref(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The rounded nucleus from its definition: bucket masses summed from the top."""
    _check_args(logits, top_p)
    top = logits.max(dim=1, keepdim=True).values
    w = torch.exp(logits - top)
    bucket = torch.clamp(torch.floor(logits * (-1.0 / STEP)) - torch.floor(top * (-1.0 / STEP)), max=NB - 1).long()
    live = logits > float("-inf")
    per_bucket = torch.zeros(logits.shape[0], NB, dtype=torch.float32, device=logits.device)
    per_bucket.scatter_add_(1, torch.where(live, bucket, 0), torch.where(live, w, 0.0))
    target = torch.where(top_p >= 1.0, float("inf"), top_p).unsqueeze(1) * per_bucket.sum(dim=1, keepdim=True)
    j = (torch.cumsum(per_bucket, dim=1) < target).sum(dim=1, keepdim=True).clamp(max=NB - 1)
    kept = torch.where((bucket <= j) & live, w, torch.zeros_like(w))
    return kept / kept.sum(dim=1, keepdim=True)


def _ladders(logits: torch.Tensor, top_p: torch.Tensor, counts: bool
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, int]:
    """Check the arguments, allocate the output and run the two ladders (``_coarse_ladder``, then
    ``_fine_ladder`` inside the row's coarse bracket): (out, (coarse, fine) scratch, chunks); scratch is
    None for an empty input (nothing to launch). The callers pass aligned inputs (a plain step's top-p
    values are a view 4·s bytes into its upload; kvspec_kernels/alignment.py)."""
    _check_args(logits, top_p)
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0 or vocab == 0:
        return out, None, 0
    chunks = triton.cdiv(vocab, CHUNK)
    block_s = triton.next_power_of_2(chunks)
    coarse = torch.empty((rows, chunks, NC + 1), dtype=torch.float32, device=logits.device)
    fine = torch.empty((rows, chunks, 2 * FINE + 2), dtype=torch.float32, device=logits.device)
    _coarse_ladder[(rows, chunks)](logits, coarse, vocab, logits.stride(0), CHUNK=CHUNK, SUB=SUB, NC=NC, STEP=STEP,
                                   FINE=FINE, num_warps=8)
    _fine_ladder[(rows, chunks)](logits, top_p, coarse, fine, vocab, logits.stride(0), chunks, CHUNK=CHUNK, SUB=SUB,
                                 NC=NC, STEP=STEP, FINE=FINE, NB=NB, BLOCK_S=block_s, COUNTS=counts, num_warps=8)
    return out, (coarse, fine), chunks


def nucleus_probs_triton(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Five launches, no host synchronisation (capturable in a CUDA graph)."""
    logits, top_p = aligned(logits), aligned(top_p)      # kvspec_kernels/alignment.py: one build per kernel
    out, scratch, chunks = _ladders(logits, top_p, counts=True)
    if scratch is None:
        return out
    coarse, fine = scratch
    rows, vocab = logits.shape
    cut = torch.empty((rows, 2), dtype=torch.float32, device=logits.device)    # boundary key (bits), kept mass
    meta = dict(NC=NC, STEP=STEP, FINE=FINE, NB=NB, BLOCK_S=triton.next_power_of_2(chunks))
    _compact[(rows, chunks)](logits, top_p, coarse, fine, out, vocab, logits.stride(0), out.stride(0), chunks,
                             CHUNK=CHUNK, SUB=SUB, **meta)
    _search[(rows,)](top_p, coarse, fine, out, cut, out.stride(0), chunks, SEARCH_BLOCK=SEARCH_BLOCK, num_warps=8,
                     **meta)
    _write[(rows, chunks)](logits, coarse, cut, out, vocab, logits.stride(0), out.stride(0), chunks,
                           CHUNK=CHUNK, NC=NC, BLOCK_S=meta["BLOCK_S"])
    return out


def bucket_nucleus_probs_triton(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Three launches, no host synchronisation."""
    logits, top_p = aligned(logits), aligned(top_p)      # kvspec_kernels/alignment.py: one build per kernel
    out, scratch, chunks = _ladders(logits, top_p, counts=False)
    if scratch is None:
        return out
    coarse, fine = scratch
    rows, vocab = logits.shape
    _rounded_write[(rows, chunks)](logits, top_p, coarse, fine, out, vocab, logits.stride(0), out.stride(0), chunks,
                                   CHUNK=CHUNK, NC=NC, STEP=STEP, FINE=FINE, NB=NB,
                                   BLOCK_S=triton.next_power_of_2(chunks))
    return out


def _check_args(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise KernelArgumentError(f"logits must be [R, V] fp32, got {tuple(logits.shape)} {logits.dtype}")
    if tuple(top_p.shape) != (logits.shape[0],) or top_p.dtype != torch.float32:
        raise KernelArgumentError(f"top_p must be [{logits.shape[0]}] fp32, got {tuple(top_p.shape)} {top_p.dtype}")
    if logits.shape[1] and logits.stride(1) != 1:
        raise KernelArgumentError("the vocabulary dimension of the logits must be contiguous")
    if logits.device != top_p.device:
        raise KernelArgumentError(f"logits on {logits.device}, top_p on {top_p.device}")


@triton.jit
def _key(x):
    """fp32 -> int32 ordered as the values (-0.0 as +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _grid(x, STEP: tl.constexpr):
    """A logit's fine bucket on the fixed grid, as a float (-inf lands at +inf)."""
    return tl.floor(x * (-1.0 / STEP))


@triton.jit
def _coarse(x, STEP: tl.constexpr, FINE: tl.constexpr):
    """A logit's coarse bucket on the fixed grid: FINE fine buckets each, as a float (-inf at +inf)."""
    return tl.floor(_grid(x, STEP) * (1.0 / FINE))


@triton.jit
def _coarse_ladder(logits_ptr, coarse_ptr, vocab, stride_l, CHUNK: tl.constexpr, SUB: tl.constexpr,
                   NC: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr):
    """coarse[row, chunk] = [mass per coarse bucket (NC, counted from the bucket of the chunk's own max,
    relative to that max), the chunk's max]; -inf tokens count nowhere. The grid is the same for every
    chunk, so the row's buckets are the chunks' shifted by whole buckets (``_row_coarse``) and no chunk
    needs the row's max first."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    l_row = logits_ptr + row * stride_l
    whole = c * CHUNK + tl.arange(0, CHUNK)
    top = tl.max(tl.load(l_row + whole, mask=whole < vocab, other=float("-inf")), 0)
    home = _coarse(top, STEP, FINE)
    buckets = tl.arange(0, NC)
    m_acc = tl.zeros([SUB, NC], tl.float32)         # reduced once at the end
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        x = tl.load(l_row + idx, mask=idx < vocab, other=float("-inf"))
        b = tl.minimum(_coarse(x, STEP, FINE) - home, NC - 1)
        hit = (b[:, None] == buckets[None, :].to(tl.float32)) & (x > float("-inf"))[:, None]
        m_acc += tl.where(hit, tl.exp(x - top)[:, None], 0.0)
    base = coarse_ptr + (row * chunks + c) * (NC + 1)
    tl.store(base + buckets, tl.sum(m_acc, 0))
    tl.store(base + NC, top)


@triton.jit
def _row_coarse(top_p_ptr, coarse_ptr, row, chunks, NC: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """The row's coarse buckets from its chunks', the same arithmetic in every program that asks. Returns
    (row max, the coarse bucket C where the mass first reaches the target, as an absolute grid index, the
    mass of the coarse buckets above C, the target p · s, the row's mass s)."""
    s = tl.arange(0, BLOCK_S)
    g = tl.arange(0, NC)
    real = s < chunks
    chunk_rows = coarse_ptr + (row * chunks + s) * (NC + 1)
    chunk_top = tl.load(chunk_rows + NC, mask=real, other=float("-inf"))
    top = tl.max(chunk_top, 0)
    home = _coarse(top, STEP, FINE)
    shift = tl.minimum(_coarse(chunk_top, STEP, FINE) - home, NC).to(tl.int32)     # an all -inf chunk: NC (none)
    scale = tl.exp(chunk_top - top)
    src = g[None, :] - shift[:, None]                 # the chunk bucket feeding row bucket g (g < NC - 1)
    fed = (src >= 0) & (src < NC - 1) & (g[None, :] < NC - 1) & real[:, None]     # (a NaN max: no shift to trust)
    per_bucket = tl.sum(tl.load(chunk_rows[:, None] + src, mask=fed, other=0.0) * scale[:, None], 0)
    chunk_mass = tl.sum(tl.load(chunk_rows[:, None] + g[None, :], mask=real[:, None], other=0.0), 1)
    total = tl.sum(chunk_mass * scale, 0)
    per_bucket = tl.where(g == NC - 1, tl.maximum(total - tl.sum(per_bucket, 0), 0.0), per_bucket)
    p = tl.load(top_p_ptr + row)
    target = tl.where(p >= 1.0, float("inf"), p * total)      # p = 1 keeps every token, whatever the rounding
    through = tl.cumsum(per_bucket, 0)
    j = tl.minimum(tl.sum((through < target).to(tl.int32), 0), NC - 1)
    above = tl.sum(tl.where(g < j, per_bucket, 0.0), 0)
    return top, home + j.to(tl.float32), above, target, total


@triton.jit
def _fine_ladder(logits_ptr, top_p_ptr, coarse_ptr, fine_ptr, vocab, stride_l, chunks, CHUNK: tl.constexpr,
                 SUB: tl.constexpr, NC: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr, NB: tl.constexpr,
                 BLOCK_S: tl.constexpr, COUNTS: tl.constexpr):
    """fine[row, chunk] = [mass per fine bucket of the row's coarse bracket (FINE, relative to the row's
    max), token count per such bucket (FINE, as floats; COUNTS only), then the count (COUNTS only) and the
    mass of the tokens NB - 1 or more fine buckets below the row's max (the last fine bucket, everything
    further down)]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    top, bracket, above, target, total = _row_coarse(top_p_ptr, coarse_ptr, row, chunks, NC, STEP, FINE, BLOCK_S)
    home = _grid(top, STEP)
    first = bracket * FINE                            # the bracket's first fine bucket, on the grid
    ks = tl.arange(0, FINE)
    m_acc = tl.zeros([SUB, FINE], tl.float32)
    n_acc = tl.zeros([SUB, FINE], tl.float32)
    t_mass = tl.zeros([SUB], tl.float32)
    t_count = tl.zeros([SUB], tl.float32)
    l_row = logits_ptr + row * stride_l
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        x = tl.load(l_row + idx, mask=idx < vocab, other=float("-inf"))
        live = x > float("-inf")
        f = _grid(x, STEP)
        w = tl.exp(x - top)
        hit = ((f - first)[:, None] == ks[None, :].to(tl.float32)) & live[:, None]
        m_acc += tl.where(hit, w[:, None], 0.0)
        tail = live & (f - home >= NB - 1)
        t_mass += tl.where(tail, w, 0.0)
        if COUNTS:
            n_acc += hit.to(tl.float32)
            t_count += tail.to(tl.float32)
    base = fine_ptr + (row * chunks + c) * (2 * FINE + 2)
    tl.store(base + ks, tl.sum(m_acc, 0))
    tl.store(base + 2 * FINE + 1, tl.sum(t_mass, 0))
    if COUNTS:           # the counts, the last bucket's after them: ``_bracket_counts`` reads FINE + k, k ≤ FINE
        tl.store(base + FINE + ks, tl.sum(n_acc, 0))
        tl.store(base + 2 * FINE, tl.sum(t_count, 0))


@triton.jit
def _row_buckets(top_p_ptr, coarse_ptr, fine_ptr, row, chunks, NC: tl.constexpr, STEP: tl.constexpr,
                 FINE: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr):
    """The row's bracket from both ladders. Returns (row max, its fine grid bucket, the bracket j as a fine
    bucket below the max (NB - 1: the last, everything further down), the bracket's position inside the
    coarse one (FINE: the last fine bucket), the mass of the fine buckets above j, the target p · s, the
    mass of buckets 0..j). The fine buckets of the coarse bracket that lie NB - 1 or more below the max
    merge into the last one, as the one-level grid of 64 buckets had them."""
    top, bracket, above_c, target, total = _row_coarse(top_p_ptr, coarse_ptr, row, chunks, NC, STEP, FINE, BLOCK_S)
    home = _grid(top, STEP)
    s = tl.arange(0, BLOCK_S)
    ks = tl.arange(0, FINE)
    real = s < chunks
    base = fine_ptr + (row * chunks + s) * (2 * FINE + 2)
    fine = tl.sum(tl.load(base[:, None] + ks[None, :], mask=real[:, None], other=0.0), 0)
    tail_mass = tl.sum(tl.load(base + 2 * FINE + 1, mask=real, other=0.0), 0)
    through = above_c + tl.cumsum(fine, 0)
    k = tl.minimum(tl.sum((through < target).to(tl.int32), 0), FINE - 1)
    rel = bracket * FINE + k.to(tl.float32) - home    # the bracket's fine bucket below the max
    last = rel >= NB - 1
    j = tl.where(last, NB - 1, rel)
    above = tl.where(last, total - tail_mass, above_c + tl.sum(tl.where(ks < k, fine, 0.0), 0))
    through_j = tl.where(last, total, above_c + tl.sum(tl.where(ks <= k, fine, 0.0), 0))
    return top, home, j, tl.where(last, FINE, k), above, target, through_j


@triton.jit
def _bracket_counts(fine_ptr, row, chunks, k, FINE: tl.constexpr, BLOCK_S: tl.constexpr):
    """[BLOCK_S]: each chunk's token count in the bracket (fine bucket k of the coarse one; FINE: the last
    fine bucket, counted apart by ``_fine_ladder``)."""
    s = tl.arange(0, BLOCK_S)
    base = fine_ptr + (row * chunks + s) * (2 * FINE + 2)
    return tl.load(base + FINE + k, mask=s < chunks, other=0.0).to(tl.int32)


@triton.jit
def _rounded_write(logits_ptr, top_p_ptr, coarse_ptr, fine_ptr, out_ptr, vocab, stride_l, stride_o, chunks,
                   CHUNK: tl.constexpr, NC: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr, NB: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    top, home, j, k, above, target, through_j = _row_buckets(top_p_ptr, coarse_ptr, fine_ptr, row, chunks, NC, STEP,
                                                             FINE, NB, BLOCK_S)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = tl.load(logits_ptr + row * stride_l + idx, mask=inside, other=float("-inf"))
    keep = (tl.minimum(_grid(x, STEP) - home, NB - 1) <= j) & (x > float("-inf"))
    tl.store(out_ptr + row * stride_o + idx, tl.where(keep, tl.exp(x - top) / through_j, 0.0), mask=inside)


@triton.jit
def _compact(logits_ptr, top_p_ptr, coarse_ptr, fine_ptr, out_ptr, vocab, stride_l, stride_o, chunks,
             CHUNK: tl.constexpr, SUB: tl.constexpr, NC: tl.constexpr, STEP: tl.constexpr, FINE: tl.constexpr,
             NB: tl.constexpr, BLOCK_S: tl.constexpr):
    """Bracket j's logits to the front of the output row (scratch until ``_write``), chunk by chunk."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    top, home, j, k, above, target, through_j = _row_buckets(top_p_ptr, coarse_ptr, fine_ptr, row, chunks, NC, STEP,
                                                             FINE, NB, BLOCK_S)
    counts = _bracket_counts(fine_ptr, row, chunks, k, FINE, BLOCK_S)
    offset = tl.sum(tl.where(tl.arange(0, BLOCK_S) < c, counts, 0), 0)
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < vocab, other=float("-inf"))
        member = (tl.minimum(_grid(x, STEP) - home, NB - 1) == j) & (x > float("-inf"))
        at = offset + tl.cumsum(member.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * stride_o + at, x, mask=member)
        offset += tl.sum(member.to(tl.int32), 0)


@triton.jit
def _search(top_p_ptr, coarse_ptr, fine_ptr, out_ptr, cut_ptr, stride_o, chunks, NC: tl.constexpr,
            STEP: tl.constexpr, FINE: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr,
            SEARCH_BLOCK: tl.constexpr):
    """cut[row] = (the smallest kept key, as fp32 bits; the kept mass): the smallest key k of the bracket
    list whose strictly-larger mass G(k) = above + Σ_{list key > k} w is below the target."""
    row = tl.program_id(0).to(tl.int64)
    top, home, j, k_in, above, target, through_j = _row_buckets(top_p_ptr, coarse_ptr, fine_ptr, row, chunks, NC,
                                                                STEP, FINE, NB, BLOCK_S)
    n = tl.sum(_bracket_counts(fine_ptr, row, chunks, k_in, FINE, BLOCK_S), 0)
    list_ptr = out_ptr + row * stride_o
    offs = tl.arange(0, SEARCH_BLOCK)
    # invariants: G(lo) >= target > G(hi); every list key is in (lo, hi]
    lo = tl.full([], 2147483647, tl.int64)
    hi = tl.full([], -2147483648, tl.int64)
    g_lo = above
    for start in range(0, n, SEARCH_BLOCK):
        inside = start + offs < n
        x = tl.load(list_ptr + start + offs, mask=inside, other=float("-inf"))
        k = _key(x).to(tl.int64)
        lo = tl.minimum(lo, tl.min(tl.where(inside, k, 2147483647), 0))
        hi = tl.maximum(hi, tl.max(tl.where(inside, k, -2147483648), 0))
        g_lo += tl.sum(tl.exp(x - top), 0)
    lo = lo - 1
    between = (hi - lo > 1).to(tl.int32)
    if n <= SEARCH_BLOCK:
        inside = offs < n
        x = tl.load(list_ptr + offs, mask=inside, other=float("-inf"))
        k = _key(x).to(tl.int64)
        w = tl.exp(x - top)
        while between > 0:
            mid = lo + (hi - lo) // 2
            g_mid = above + tl.sum(tl.where(k > mid, w, 0.0), 0)
            valid = g_mid < target
            n_below = tl.sum(((k > lo) & (k < mid) & inside).to(tl.int32), 0)
            n_above = tl.sum(((k > mid) & (k < hi) & inside).to(tl.int32), 0)
            between = tl.where(valid, n_below, n_above)
            g_lo = tl.where(valid, g_lo, g_mid)
            hi = tl.where(valid, mid, hi)
            lo = tl.where(valid, lo, mid)
    else:
        while between > 0:
            mid = lo + (hi - lo) // 2
            g_acc = tl.zeros([SEARCH_BLOCK], tl.float32)
            below_acc = tl.zeros([SEARCH_BLOCK], tl.int32)
            above_acc = tl.zeros([SEARCH_BLOCK], tl.int32)
            for start in range(0, n, SEARCH_BLOCK):
                inside = start + offs < n
                x = tl.load(list_ptr + start + offs, mask=inside, other=float("-inf"))
                k = _key(x).to(tl.int64)
                g_acc += tl.where(k > mid, tl.exp(x - top), 0.0)
                below_acc += ((k > lo) & (k < mid) & inside).to(tl.int32)
                above_acc += ((k > mid) & (k < hi) & inside).to(tl.int32)
            g_mid = above + tl.sum(g_acc, 0)
            valid = g_mid < target
            between = tl.where(valid, tl.sum(below_acc, 0), tl.sum(above_acc, 0))
            g_lo = tl.where(valid, g_lo, g_mid)
            hi = tl.where(valid, mid, hi)
            lo = tl.where(valid, lo, mid)
    # no list key strictly between lo and hi: the kept tokens are those with key > lo, of mass G(lo).
    # An empty list (the last bucket, forced when the whole mass stays below the target): keep all.
    cut = tl.where(n > 0, lo + 1, -2147483648).to(tl.int32)
    tl.store(cut_ptr + row * 2, cut.to(tl.float32, bitcast=True))
    tl.store(cut_ptr + row * 2 + 1, g_lo)


@triton.jit
def _write(logits_ptr, coarse_ptr, cut_ptr, out_ptr, vocab, stride_l, stride_o, chunks,
           CHUNK: tl.constexpr, NC: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    top = tl.max(tl.load(coarse_ptr + (row * chunks + s) * (NC + 1) + NC, mask=s < chunks,
                         other=float("-inf")), 0)
    cut = tl.load(cut_ptr + row * 2).to(tl.int32, bitcast=True)
    kept = tl.load(cut_ptr + row * 2 + 1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = tl.load(logits_ptr + row * stride_l + idx, mask=inside, other=float("-inf"))
    tl.store(out_ptr + row * stride_o + idx, tl.where(_key(x) >= cut, tl.exp(x - top) / kept, 0.0), mask=inside)
