"""Paged attention over ragged query blocks: one kernel for prefill over a cached prefix, verify
(a few query tokens) and decode (one query token).

Layout. All sequences' query tokens are concatenated (``cu_q_lens`` delimits them). Query token i
of sequence b sits at absolute position ``seq_lens[b] - q_len_b + i``: its own K/V were appended
to the pool before the call, so it attends causally to positions ``<= p`` (and ``> p - W`` with a
sliding window W). K/V live in per-layer pool views ``[N, bs, Hkv, D]`` whose block stride spans
all layers, so every address goes through the tensors' strides and nothing is copied.

Grid ``(query tiles, B * Hkv, splits)``. A program owns one KV head of one sequence and a tile of
``BLOCK_Q`` query tokens; its ``BLOCK_M`` rows are (token, query head of the KV head's group)
pairs, so the query heads sharing a KV head read each KV tile once. It walks the sequence's KV
range ``BLOCK_N`` tokens at a time, looking each token's block up in the block table (a tile may
span several small blocks), with an fp32 online softmax. When few programs would run (decode at
small batch), the KV range is split across ``splits`` programs (flash-decoding) and a second
kernel merges their partial results by log-sum-exp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError

LOG2E = 1.4426950408889634
# KV tokens per inner iteration; 32 for wide heads keeps the [BLOCK_M, D] fp32 accumulator and
# the K/V tiles within registers and shared memory.
BLOCK_N_NARROW = 64
BLOCK_N_WIDE = 32
# Query rows per program: at least 16 (tl.dot's minimum), at most 128 rows of (token, head). On the H200
# (session 5, run F), 128 rows × 4 warps beat 64 × 4 on every prefill shape swept: 4-12% on Qwen-0.5B and
# Qwen3-8B, 2k new tokens on 4k and 8k on 16k (docs/design/kernels.md). Decode and verify tiles (≤ 64 rows)
# are unchanged.
# That sweep ran bf16. In fp32 (the drafter pipeline's target dtype, IEEE dots without tensor cores) the
# 128-row tile's fp32 operands and accumulators overflow the registers: session 8 timed the pipeline's
# data stage (bench/gpu/answers_probe.py, 160 real prompts, random Qwen-0.5B weights) at 127 ms a step
# with 128 rows against 38 ms with 64, and paged attention was 85% of the fp32 step's GPU time. So fp32
# keeps session 3's 64 rows.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 128
MAX_BLOCK_M_FP32 = 64
# KV splits (flash-decoding). On the H200 (132 SMs), decode with B*Hkv programs was fastest near
# 8 programs per SM: Qwen3-8B B=32 ctx 4096 took 139 us with 4 splits against 174 us unsplit,
# Qwen-0.5B B=32 ctx 4096 29 us with 16 against 96 us (bench/kernels_gpu.py; docs/design/kernels.md).
# A split covers at least one BLOCK_N tile of the longest possible context.
PROGRAMS_PER_SM = 8
MAX_SPLITS = 32


def paged_attention(
    q: torch.Tensor,             # [T, Hq, D]
    k_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    v_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_q_lens: torch.Tensor,     # [B+1] int32
    seq_lens: torch.Tensor,      # [B] int32, KV length including the new query tokens
    scale: float,
    sliding_window: int | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:               # [T, Hq, D], dtype of q
    """Attention of each query token over its sequence's paged KV; Triton or the torch reference
    depending on ``use_triton(q.device)``. ``max_q_len`` is an optional host-side bound on the
    longest query block (it only sizes the grid; see ``paged_attention_triton``)."""
    if use_triton(q.device):
        return paged_attention_triton(
            q, k_pool, v_pool, block_tables, cu_q_lens, seq_lens, scale, sliding_window, max_q_len
        )
    return paged_attention_ref(q, k_pool, v_pool, block_tables, cu_q_lens, seq_lens, scale, sliding_window)


def paged_attention_ref(
    q: torch.Tensor,             # [T, Hq, D]
    k_pool: torch.Tensor,        # [N, bs, Hkv, D]
    v_pool: torch.Tensor,        # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_q_lens: torch.Tensor,     # [B+1] int32
    seq_lens: torch.Tensor,      # [B] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:               # [T, Hq, D]
    """Readable reference: gather each sequence's KV, mask, softmax in fp32."""
    _check_args(q, k_pool, v_pool, block_tables, cu_q_lens, seq_lens)
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q_b = q[cu[b]:cu[b + 1]].float()                                    # [q_len, Hq, D]
        q_len = q_b.shape[0]
        ids = block_tables[b, :triton.cdiv(kv_len, block_size)].long().to(k_pool.device)
        k = k_pool[ids].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)  # [kv, Hq, D]
        v = v_pool[ids].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale                # [Hq, q_len, kv]
        pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        key = torch.arange(kv_len, device=q.device)[None, :]
        allowed = key <= pos
        if sliding_window is not None:
            allowed &= key > pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def paged_attention_triton(
    q: torch.Tensor,             # [T, Hq, D]
    k_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    v_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_q_lens: torch.Tensor,     # [B+1] int32
    seq_lens: torch.Tensor,      # [B] int32
    scale: float,
    sliding_window: int | None = None,
    max_q_len: int | None = None,
    num_splits: int | None = None,
    max_block_m: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:               # [T, Hq, D]
    """Launch the Triton kernel; no host synchronisation, so it can be captured in a CUDA graph.

    Without ``max_q_len`` the grid assumes every sequence has at least one query token, so no
    query block is longer than ``T - B + 1``. ``num_splits`` overrides the KV-split heuristic.
    ``max_block_m`` (a power of two) and ``num_warps`` are tuning hooks for the prefill sweep of
    bench/kernels_gpu.py: with GQA 7 (Qwen-0.5B) 64 rows held only 9 query tokens, so a long prefill
    re-read each K/V tile once per 9 tokens; the default (``prefill_tile_rows``: 128 rows in 16-bit
    types, 64 in fp32; Triton's 4 warps) is the sweep's.
    """
    _check_args(q, k_pool, v_pool, block_tables, cu_q_lens, seq_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_q_heads // num_kv_heads
    q_bound = max_q_len if max_q_len is not None else num_tokens - batch + 1
    if max_block_m is None:
        max_block_m = prefill_tile_rows(q.dtype)
    if max_block_m < MIN_BLOCK_M or max_block_m & (max_block_m - 1):
        raise KernelArgumentError(f"max_block_m must be a power of two >= {MIN_BLOCK_M}, got {max_block_m}")
    block_m = min(max(triton.next_power_of_2(q_bound * group), MIN_BLOCK_M), max_block_m)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    q_tiles = max(triton.cdiv(q_bound, block_q), 1)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_n = BLOCK_N_NARROW if block_d <= 128 else BLOCK_N_WIDE
    if num_splits is None:
        kv_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)
        num_splits = _auto_splits(q.device, q_tiles, batch * num_kv_heads, kv_tiles)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if num_splits > 1:
        part_out = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((num_splits, num_tokens, num_q_heads), device=q.device, dtype=torch.float32)
    else:
        part_out, part_lse = out, out  # unused by the kernel when NUM_SPLITS == 1
    grid = (q_tiles, batch * num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, out, part_out, part_lse,
        block_tables, cu_q_lens, seq_lens,
        scale * LOG2E, sliding_window or 0, num_tokens,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=_interpreter_lacks_bf16_dot(q),
        **({"num_warps": num_warps} if num_warps is not None else {}),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, out, num_tokens,
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


def prefill_tile_rows(dtype: torch.dtype) -> int:
    """The largest query tile (rows of (token, head)) for this dtype: see MAX_BLOCK_M_FP32."""
    return MAX_BLOCK_M_FP32 if dtype == torch.float32 else MAX_BLOCK_M


def _auto_splits(device: torch.device, q_tiles: int, heads: int, kv_tiles: int) -> int:
    """Split the KV range of decode and verify steps (one query tile per sequence) when the grid
    has too few programs to keep the memory system busy; prefill has parallelism in its queries.
    ``kv_tiles`` bounds the context from the block table's width (known without a sync)."""
    if device.type != "cuda" or q_tiles > 1:
        return 1
    return split_count(torch.cuda.get_device_properties(device).multi_processor_count, heads, kv_tiles)


def split_count(sms: int, heads: int, kv_tiles: int) -> int:
    """The KV splits of a decode grid of ``heads`` (sequence, KV head) programs: enough for
    ``PROGRAMS_PER_SM`` programs per SM, at most ``MAX_SPLITS`` and one per KV tile, rounded down to
    a power of two. Why the rounding: ``NUM_SPLITS`` is a compile-time constant, so every distinct
    value compiles the kernel again (seconds each). Unrounded, the count takes every value in 1..32 as
    batch sizes and block-table widths vary (on the H200 with 2 KV heads; even the graph buckets alone
    give 4, 5, 8, 11, 16, 22 and 32); rounded, it takes six. Suspected, not confirmed, as the cause of
    the drafter pipeline's data stage compiling for 540 s on the H200 in session 7. Any count is
    correct: the split only changes which program reduces which KV range."""
    want = max(1, min(MAX_SPLITS, (PROGRAMS_PER_SM * sms) // max(heads, 1), kv_tiles))
    return 1 << (want.bit_length() - 1)


def _interpreter_lacks_bf16_dot(q: torch.Tensor) -> bool:
    """Triton's interpreter (3.9) multiplies bf16 operands of tl.dot as raw integers; CPU tensors
    only ever run there, so upcast them (after the same bf16 rounding the GPU path does)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _check_args(q, k_pool, v_pool, block_tables, cu_q_lens, seq_lens) -> None:
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise KernelArgumentError(f"q must be [T,Hq,D] and pools [N,bs,Hkv,D]; got {tuple(q.shape)}, "
                                  f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if q.shape[2] != k_pool.shape[3] or q.shape[1] % k_pool.shape[2] != 0:
        raise KernelArgumentError(f"head_dim or GQA mismatch: q {tuple(q.shape)}, pool {tuple(k_pool.shape)}")
    if q.stride(2) != 1 or k_pool.stride(3) != 1 or v_pool.stride(3) != 1:
        raise KernelArgumentError("the head dimension of q and of the pools must be contiguous")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise KernelArgumentError(f"dtype mismatch: q {q.dtype}, pools {k_pool.dtype}/{v_pool.dtype}")
    for name, t in (("block_tables", block_tables), ("cu_q_lens", cu_q_lens), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise KernelArgumentError(f"{name} must be int32, got {t.dtype}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise KernelArgumentError("block_tables must be [B, max_blocks] with contiguous rows")
    if cu_q_lens.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise KernelArgumentError("cu_q_lens must be [B+1] and block_tables [B, max_blocks] for seq_lens [B]")


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, cu_q_lens_ptr, seq_lens_ptr,
    scale_log2, window, num_tokens,
    stride_qt, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1) // NUM_KV_HEADS
    kv_head = tl.program_id(1) % NUM_KV_HEADS
    split = tl.program_id(2)
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)

    # Rows are (query token, query head of this KV head's group) pairs.
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    pos = kv_len - q_len + q_idx
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # KV range of the whole tile, then this split's share of it.
    hi = kv_len - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(kv_len - q_len + tile * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0)
        block = block.to(tl.int64)
        k_offs = block * stride_kn + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        v_offs = block * stride_vn + (keys % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        k = tl.load(k_ptr + k_offs[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        scores = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale_log2              # [BLOCK_M, BLOCK_N]
        allowed = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_offs[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    tok = (q_start + q_idx).to(tl.int64)
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out_offs = tok[:, None] * (NUM_KV_HEADS * GROUP * HEAD_DIM) + head[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (split * num_tokens + tok) * (NUM_KV_HEADS * GROUP) + head
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], o, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_tokens,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Combine the splits' normalised partial outputs, weighted by their (log2) softmax mass."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    row = (splits * num_tokens + tok) * NUM_Q_HEADS + head                     # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=splits < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = weight / tl.sum(weight, 0)
    mask = (splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    o = tl.sum(parts * weight[:, None], 0)
    out_offs = (tok * NUM_Q_HEADS + head) * HEAD_DIM + dims
    tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
