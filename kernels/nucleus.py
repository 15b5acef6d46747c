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

Two launches:
1. ``_ladder`` (grid ``(rows, chunks of CHUNK tokens)``): each chunk's largest logit, and the mass and
   count of its tokens per *bucket* of STEP nats on a fixed grid, ``floor(-l / STEP)``, counted from the
   bucket of the chunk's own max (NB buckets, the last for everything further down). The grid is the
   same for every chunk, so the row's buckets are the chunks' shifted by whole buckets, and no chunk
   needs the row's max first.
2. ``_select`` (one program per row): adds the chunks' buckets from the top (masses rescaled to the
   row's max) and finds the bucket j where the mass first reaches ``p · s``. Tokens in buckets above j
   are kept and those below dropped, whatever their exact rank; only bucket j's tokens (the bracket, a
   factor e^STEP of weights around the boundary) need ranking. It copies them to a list in the output
   row, searches the list for the boundary (16 probes per pass over the list, so about 5 passes), and
   writes the probabilities over the list.
Every sum runs in a fixed order, so a row's result is deterministic and never depends on other rows.
Timings: docs/design/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import use_triton
from kernels.errors import KernelArgumentError

CHUNK = 4096           # tokens per program of _ladder (38 chunks at V = 151,936)
SUB = 128              # tokens per bucketing step inside a chunk ([SUB, NB] one-hot tiles)
NB = 64                # buckets below a max
STEP = 0.5             # nats per bucket (a power of two: the grid arithmetic is exact); 63 buckets reach e^-31.5
ROW_BLOCK = 2048       # tokens per step of _select's passes over the row
LIST_BLOCK = 256       # bracket tokens per step of the search ([LIST_BLOCK, PROBES] tiles)
PROBES = 16            # thresholds tried per pass over the bracket


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
    """Two launches, no host synchronisation (capturable in a CUDA graph)."""
    _check_args(logits, top_p)
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0 or vocab == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    scratch = torch.empty((rows, chunks, NB + 1), dtype=torch.float32, device=logits.device)
    _ladder[(rows, chunks)](logits, scratch, vocab, logits.stride(0), CHUNK=CHUNK, SUB=SUB, NB=NB, STEP=STEP)
    _select[(rows,)](logits, top_p, scratch, out, vocab, logits.stride(0), out.stride(0), chunks,
                     NB=NB, STEP=STEP, BLOCK_S=triton.next_power_of_2(chunks), ROW_BLOCK=ROW_BLOCK,
                     LIST_BLOCK=LIST_BLOCK, PROBES=PROBES, num_warps=8)
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
    """A logit's bucket on the fixed grid (as a float: -inf lands at +inf)."""
    return tl.floor(x * (-1.0 / STEP))


@triton.jit
def _ladder(logits_ptr, scratch_ptr, vocab, stride_l,
            CHUNK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr, STEP: tl.constexpr):
    """scratch[row, chunk] = [mass per bucket (NB, relative to the chunk's max), the chunk's max]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    l_row = logits_ptr + row * stride_l
    whole = c * CHUNK + tl.arange(0, CHUNK)
    top = tl.max(tl.load(l_row + whole, mask=whole < vocab, other=float("-inf")), 0)
    home = _grid(top, STEP)
    buckets = tl.arange(0, NB)
    m_acc = tl.zeros([NB], tl.float32)
    for sub in range(0, CHUNK, SUB):
        idx = c * CHUNK + sub + tl.arange(0, SUB)
        inside = idx < vocab
        x = tl.load(l_row + idx, mask=inside, other=float("-inf"))
        b = tl.minimum(_grid(x, STEP) - home, NB - 1)
        hit = (b[:, None] == buckets[None, :].to(tl.float32)) & (x > float("-inf"))[:, None]   # -inf: no mass
        m_acc += tl.sum(tl.where(hit, tl.exp(x - top)[:, None], 0.0), 0)
    base = scratch_ptr + (row * chunks + c) * (NB + 1)
    tl.store(base + buckets, m_acc)
    tl.store(base + NB, top)


@triton.jit
def _select(logits_ptr, top_p_ptr, scratch_ptr, out_ptr, vocab, stride_l, stride_o, chunks,
            NB: tl.constexpr, STEP: tl.constexpr, BLOCK_S: tl.constexpr, ROW_BLOCK: tl.constexpr,
            LIST_BLOCK: tl.constexpr, PROBES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    l_row = logits_ptr + row * stride_l
    o_row = out_ptr + row * stride_o
    width = NB + 1
    s = tl.arange(0, BLOCK_S)
    g = tl.arange(0, NB)
    chunk_rows = scratch_ptr + (row * chunks + s) * width
    real = s < chunks
    chunk_top = tl.load(chunk_rows + NB, mask=real, other=float("-inf"))
    top = tl.max(chunk_top, 0)
    home = _grid(top, STEP)
    # the row's buckets: chunk bucket b is row bucket b + shift; masses rescaled from the chunk's max
    shift = tl.minimum(_grid(chunk_top, STEP) - home, NB).to(tl.int32)     # an all -inf chunk: NB (none)
    scale = tl.exp(chunk_top - top)
    src = g[None, :] - shift[:, None]
    fed = (src >= 0) & (g[None, :] < NB - 1) & (src < NB - 1) & real[:, None]
    per_bucket = tl.sum(tl.load(chunk_rows[:, None] + src, mask=fed, other=0.0) * scale[:, None], 0)
    chunk_mass = tl.sum(tl.load(chunk_rows[:, None] + g[None, :], mask=real[:, None], other=0.0), 1)
    total = tl.sum(chunk_mass * scale, 0)
    per_bucket = tl.where(g == NB - 1, tl.maximum(total - tl.sum(per_bucket, 0), 0.0), per_bucket)
    p = tl.load(top_p_ptr + row)
    target = tl.where(p >= 1.0, float("inf"), p * total)      # p = 1 keeps every token, whatever the rounding
    through = tl.cumsum(per_bucket, 0)
    j = tl.minimum(tl.sum((through < target).to(tl.int32), 0), NB - 1)
    above = tl.sum(tl.where(g < j, per_bucket, 0.0), 0)

    # the bracket's logits to the front of the output row (scratch until the last pass)
    offs = tl.arange(0, ROW_BLOCK)
    n = tl.zeros([], tl.int32)
    for start in range(0, vocab, ROW_BLOCK):
        inside_c = start + offs < vocab
        x_c = tl.load(l_row + start + offs, mask=inside_c, other=float("-inf"))
        member_c = (tl.minimum(_grid(x_c, STEP) - home, NB - 1) == j.to(tl.float32)) & inside_c
        at_c = n + tl.cumsum(member_c.to(tl.int32), 0) - 1
        tl.store(o_row + at_c, x_c, mask=member_c)
        n += tl.sum(member_c.to(tl.int32), 0)
    tl.debug_barrier()

    # the smallest key whose strictly-larger mass, G(k) = above + Σ_{bracket key > k} w, is below target;
    # invariants: G(lo) >= target > G(hi), every bracket key in (lo, hi]; c_lo = #(key > lo), e_hi = #(key >= hi)
    lo = tl.full([], 2147483647, tl.int64)
    hi = tl.full([], -2147483648, tl.int64)
    g_lo = above
    e_hi = tl.zeros([], tl.int32)
    loffs = tl.arange(0, LIST_BLOCK)
    for start in range(0, n, LIST_BLOCK):
        inside_m = start + loffs < n
        x_m = tl.load(o_row + start + loffs, mask=inside_m, other=float("-inf"))
        k_m = _key(x_m).to(tl.int64)
        lo = tl.minimum(lo, tl.min(tl.where(inside_m, k_m, 2147483647), 0))
        hi = tl.maximum(hi, tl.max(tl.where(inside_m, k_m, -2147483648), 0))
        g_lo += tl.sum(tl.exp(x_m - top), 0)
    for start in range(0, n, LIST_BLOCK):
        inside_e = start + loffs < n
        k_e = _key(tl.load(o_row + start + loffs, mask=inside_e, other=float("-inf"))).to(tl.int64)
        e_hi += tl.sum(((k_e == hi) & inside_e).to(tl.int32), 0)
    lo = lo - 1
    c_lo = n
    between = c_lo - e_hi
    probe = tl.arange(0, PROBES)
    while between > 0:
        th = lo + (hi - lo) * (probe + 1).to(tl.int64) // (PROBES + 1)        # [PROBES], increasing
        above_th = tl.zeros([PROBES], tl.float32)
        over = tl.zeros([PROBES], tl.int32)
        at_th = tl.zeros([PROBES], tl.int32)
        for start in range(0, n, LIST_BLOCK):
            inside_p = start + loffs < n
            x_p = tl.load(o_row + start + loffs, mask=inside_p, other=float("-inf"))
            k_p = _key(x_p).to(tl.int64)
            gt_p = (k_p[:, None] > th[None, :]) & inside_p[:, None]
            above_th += tl.sum(tl.where(gt_p, tl.exp(x_p - top)[:, None], 0.0), 0)
            over += tl.sum(gt_p.to(tl.int32), 0)
            at_th += tl.sum(((k_p[:, None] == th[None, :]) & inside_p[:, None]).to(tl.int32), 0)
        valid = above + above_th < target                                    # false ... false, true ... true
        any_invalid = tl.sum((~valid).to(tl.int32), 0) > 0
        any_valid = tl.sum(valid.to(tl.int32), 0) > 0
        g_lo = tl.where(any_invalid, tl.min(tl.where(valid, float("inf"), above + above_th), 0), g_lo)
        c_lo = tl.where(any_invalid, tl.min(tl.where(valid, 2147483647, over), 0), c_lo)
        e_hi = tl.where(any_valid, tl.max(tl.where(valid, over + at_th, -1), 0), e_hi)
        lo = tl.where(any_invalid, tl.max(tl.where(valid, lo, th), 0), lo)
        hi = tl.where(any_valid, tl.min(tl.where(valid, th, hi), 0), hi)
        between = c_lo - e_hi
    # no bracket key strictly between lo and hi: the kept tokens are those with key > lo, of mass G(lo)
    # (an empty bracket: the last bucket, forced when the whole mass stays below the target: keep all)
    cut = tl.where(n > 0, lo + 1, -2147483648).to(tl.int32)
    tl.debug_barrier()
    for start in range(0, vocab, ROW_BLOCK):
        inside_w = start + offs < vocab
        x_w = tl.load(l_row + start + offs, mask=inside_w, other=float("-inf"))
        w_w = tl.exp(x_w - top) / g_lo
        tl.store(o_row + start + offs, tl.where(_key(x_w) >= cut, w_w, 0.0), mask=inside_w)
