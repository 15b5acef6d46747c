"""Top-p (nucleus) probabilities without sorting the vocabulary.

Why: four of the five bench workloads sample with top-p and no top-k, and the torch path sorted all
151,936 logits of every row it transformed. On the H200 (session 10, run AD, per-step phases) that made
a plain step 0.6-1.7 ms slower on those workloads than on the greedy one, a DSpark draft round 1.5-7 ms
slower (seven sequential positions, one sort each) and a verify 1-4 ms slower (γ + 1 rows per request).
`python -m bench.sampling_cost` (session 11): the sorted transform costs 0.57 ms eager at 1 row (mostly
host launches), 1.36 ms at 64 rows and 4.35 ms at 256 (GPU-bound); a first kernel that bisected each row
in one program took ~0.45 ms whatever the rows (30 passes over 608 KB from one SM).

The definition (the reference and the kernel share it; the draft and the target both use it, so
verification stays exact): with ``w = exp(l - max l)`` and ``s = Σ w``, token x is kept iff the mass of
the tokens with a strictly larger logit is below ``p · s``; kept tokens get ``w / Σ kept w``, the others
exactly 0. That is "the smallest prefix of the sorted vocabulary whose mass reaches p" (the token that
crosses p stays) whenever the boundary logit is not tied; a tie keeps the whole tie group, so the result
never depends on the order a sort puts equal values in. ``p >= 1`` keeps every token.

The kernels (grid ``(rows, chunks of CHUNK tokens)`` except the search):
1. ``_chunk_max``: each chunk's largest logit.
2. ``_ladder``: with the row's max m, the mass and count of each chunk's tokens per *bucket* of
   ``floor((m - l) / STEP)`` (NB buckets of STEP nats; the last takes everything further down).
3. ``_compact``: every program sums the row's bucket masses from the top (the same order everywhere,
   so all agree) and finds the bucket j where the mass first reaches ``p · s``. Tokens in buckets above j
   are kept and those below dropped, whatever their exact rank; only bucket j's tokens (the bracket)
   need ranking. Each chunk writes its bracket logits to a compact list in the output row (scratch until
   step 5), at offsets from the counts of the chunks before it.
4. ``_search``: one program per row bisects the bracket's keys (the logits' bits, ordered as the values)
   for the smallest key whose strictly-larger mass stays below ``p · s``, in registers when the bracket
   has at most SEARCH_BLOCK tokens (the usual case: a bucket of e^0.5 around the boundary), else in
   passes over the list.
5. ``_write``: ``w / kept mass`` for keys at or above the boundary, 0 elsewhere.
Every sum runs in a fixed order, so a row's result is deterministic and never depends on other rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton
from kernels.errors import KernelArgumentError

CHUNK = 4096           # tokens per program of the chunked kernels (37 chunks at V = 151,936)
SUB = 128              # tokens per bucketing step inside a chunk ([SUB, NB] one-hot tiles)
NB = 64                # buckets below the row's max
STEP = 0.5             # nats per bucket: 63 buckets cover e^-31.5 of the max, the last takes the rest
SEARCH_BLOCK = 4096    # a bracket up to this size is searched in registers


def nucleus_probs(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] fp32 (temperature already applied); top_p: [R] fp32 in (0, 1].
    Returns [R, V] fp32 probabilities, filtered tokens at exactly 0. Triton on CUDA, else the reference."""
    fn = nucleus_probs_triton if use_triton(logits.device) else nucleus_probs_ref
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


def nucleus_probs_triton(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Five launches, no host synchronisation (capturable in a CUDA graph)."""
    _check_args(logits, top_p)
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0 or vocab == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    chunk_max = torch.empty((rows, chunks), dtype=torch.float32, device=dev)
    mass = torch.empty((rows, chunks, NB), dtype=torch.float32, device=dev)
    count = torch.empty((rows, chunks, NB), dtype=torch.int32, device=dev)
    row_max = torch.empty(rows, dtype=torch.float32, device=dev)
    cut = torch.empty(rows, dtype=torch.int32, device=dev)          # boundary key
    kept = torch.empty(rows, dtype=torch.float32, device=dev)       # kept mass
    block_s = triton.next_power_of_2(chunks)
    grid = (rows, chunks)
    _chunk_max[grid](logits, chunk_max, vocab, logits.stride(0), chunks, CHUNK=CHUNK)
    _ladder[grid](logits, chunk_max, mass, count, row_max, vocab, logits.stride(0), chunks,
                  CHUNK=CHUNK, SUB=SUB, NB=NB, STEP=STEP, BLOCK_S=block_s)
    _compact[grid](logits, top_p, row_max, mass, count, out, vocab, logits.stride(0), out.stride(0), chunks,
                   CHUNK=CHUNK, SUB=SUB, NB=NB, STEP=STEP, BLOCK_S=block_s)
    _search[(rows,)](top_p, row_max, mass, count, out, cut, kept, out.stride(0), chunks,
                     NB=NB, BLOCK_S=block_s, SEARCH_BLOCK=SEARCH_BLOCK, num_warps=8)
    _write[grid](logits, row_max, cut, kept, out, vocab, logits.stride(0), out.stride(0), CHUNK=CHUNK, num_warps=8)
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
def _row_max(chunk_max_ptr, row, chunks, BLOCK_S: tl.constexpr):
    s = tl.arange(0, BLOCK_S)
    return tl.max(tl.load(chunk_max_ptr + row * chunks + s, mask=s < chunks, other=float("-inf")), 0)


@triton.jit
def _chunk_max(logits_ptr, chunk_max_ptr, vocab, stride_l, chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < vocab, other=float("-inf"))
    tl.store(chunk_max_ptr + row * chunks + c, tl.max(x, 0))


@triton.jit
def _bucket(x, row_max, NB: tl.constexpr, STEP: tl.constexpr):
    """The bucket of each logit below the row's max: floor((max - x) / STEP), the last for the rest."""
    d = (row_max - x) / STEP
    return tl.minimum(d, NB - 1).to(tl.int32)


@triton.jit
def _ladder(logits_ptr, chunk_max_ptr, mass_ptr, count_ptr, row_max_ptr, vocab, stride_l, chunks,
            CHUNK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr, STEP: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    top = _row_max(chunk_max_ptr, row, chunks, BLOCK_S)
    if c == 0:
        tl.store(row_max_ptr + row, top)
    buckets = tl.arange(0, NB)
    m_acc = tl.zeros([NB], tl.float32)
    n_acc = tl.zeros([NB], tl.int32)
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        inside = idx < vocab
        x = tl.load(logits_ptr + row * stride_l + idx, mask=inside, other=float("-inf"))
        w = tl.exp(x - top)
        hit = (_bucket(x, top, NB, STEP)[:, None] == buckets[None, :]) & inside[:, None]
        m_acc += tl.sum(tl.where(hit, w[:, None], 0.0), 0)
        n_acc += tl.sum(hit.to(tl.int32), 0)
    base = (row * chunks + c) * NB
    tl.store(mass_ptr + base + buckets, m_acc)
    tl.store(count_ptr + base + buckets, n_acc)


@triton.jit
def _bracket(top_p_ptr, mass_ptr, row, chunks, NB: tl.constexpr, BLOCK_S: tl.constexpr):
    """(bracket bucket j, mass of the buckets above j, target p · s), from the row's bucket masses; the
    same arithmetic in every program that asks."""
    s = tl.arange(0, BLOCK_S)
    buckets = tl.arange(0, NB)
    m = tl.load(mass_ptr + (row * chunks + s[:, None]) * NB + buckets[None, :], mask=(s < chunks)[:, None], other=0.0)
    per_bucket = tl.sum(m, 0)                       # [NB]
    total = tl.sum(per_bucket, 0)
    p = tl.load(top_p_ptr + row)
    target = tl.where(p >= 1.0, float("inf"), p * total)
    through = tl.cumsum(per_bucket, 0)              # mass of buckets 0..b
    j = tl.minimum(tl.sum((through < target).to(tl.int32), 0), NB - 1)
    above = tl.sum(tl.where(buckets < j, per_bucket, 0.0), 0)
    return j, above, target


@triton.jit
def _compact(logits_ptr, top_p_ptr, row_max_ptr, mass_ptr, count_ptr, out_ptr, vocab, stride_l, stride_o, chunks,
             CHUNK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr, STEP: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    j, above, target = _bracket(top_p_ptr, mass_ptr, row, chunks, NB, BLOCK_S)
    s = tl.arange(0, BLOCK_S)
    before = tl.load(count_ptr + (row * chunks + s) * NB + j, mask=s < c, other=0)
    offset = tl.sum(before, 0)
    top = tl.load(row_max_ptr + row)
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        inside = idx < vocab
        x = tl.load(logits_ptr + row * stride_l + idx, mask=inside, other=float("-inf"))
        member = (_bucket(x, top, NB, STEP) == j) & inside
        at = offset + tl.cumsum(member.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * stride_o + at, x, mask=member)
        offset += tl.sum(member.to(tl.int32), 0)


@triton.jit
def _search(top_p_ptr, row_max_ptr, mass_ptr, count_ptr, out_ptr, cut_ptr, kept_ptr, stride_o, chunks,
            NB: tl.constexpr, BLOCK_S: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j, above, target = _bracket(top_p_ptr, mass_ptr, row, chunks, NB, BLOCK_S)
    s = tl.arange(0, BLOCK_S)
    n = tl.sum(tl.load(count_ptr + (row * chunks + s) * NB + j, mask=s < chunks, other=0), 0)
    top = tl.load(row_max_ptr + row)
    list_ptr = out_ptr + row * stride_o
    offs = tl.arange(0, SEARCH_BLOCK)
    # bounds: every bracket key is > lo and <= hi; G(k) = above + Σ_{bracket key > k} w
    lo = tl.full([], 2147483647, tl.int64)
    hi = tl.full([], -2147483648, tl.int64)
    g_lo = above
    for start in range(0, n, SEARCH_BLOCK):
        x = tl.load(list_ptr + start + offs, mask=start + offs < n, other=float("-inf"))
        k = _key(x).to(tl.int64)
        inside = start + offs < n
        lo = tl.minimum(lo, tl.min(tl.where(inside, k, 2147483647), 0))
        hi = tl.maximum(hi, tl.max(tl.where(inside, k, -2147483648), 0))
        g_lo += tl.sum(tl.exp(x - top), 0)
    lo = lo - 1
    between = (hi - lo > 1).to(tl.int32)
    if n <= SEARCH_BLOCK:
        x = tl.load(list_ptr + offs, mask=offs < n, other=float("-inf"))
        k = _key(x).to(tl.int64)
        w = tl.exp(x - top)
        inside = offs < n
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
            g = tl.zeros([SEARCH_BLOCK], tl.float32)
            n_below = tl.zeros([SEARCH_BLOCK], tl.int32)
            n_above = tl.zeros([SEARCH_BLOCK], tl.int32)
            for start in range(0, n, SEARCH_BLOCK):
                inside = start + offs < n
                x = tl.load(list_ptr + start + offs, mask=inside, other=float("-inf"))
                k = _key(x).to(tl.int64)
                g += tl.where(k > mid, tl.exp(x - top), 0.0)
                n_below += ((k > lo) & (k < mid) & inside).to(tl.int32)
                n_above += ((k > mid) & (k < hi) & inside).to(tl.int32)
            g_mid = above + tl.sum(g, 0)
            valid = g_mid < target
            between = tl.where(valid, tl.sum(n_below, 0), tl.sum(n_above, 0))
            g_lo = tl.where(valid, g_lo, g_mid)
            hi = tl.where(valid, mid, hi)
            lo = tl.where(valid, lo, mid)
    # no bracket key strictly between lo and hi: the kept tokens are those with key > lo, of mass G(lo)
    # (an empty bracket: the last bucket, forced when the whole mass stays below the target: keep all)
    tl.store(cut_ptr + row, tl.where(n > 0, lo + 1, -2147483648).to(tl.int32))
    tl.store(kept_ptr + row, g_lo)


@triton.jit
def _write(logits_ptr, row_max_ptr, cut_ptr, kept_ptr, out_ptr, vocab, stride_l, stride_o, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inside = idx < vocab
    x = tl.load(logits_ptr + row * stride_l + idx, mask=inside, other=float("-inf"))
    top = tl.load(row_max_ptr + row)
    keep = _key(x) >= tl.load(cut_ptr + row)
    w = tl.exp(x - top) / tl.load(kept_ptr + row)
    tl.store(out_ptr + row * stride_o + idx, tl.where(keep, w, 0.0), mask=inside)
