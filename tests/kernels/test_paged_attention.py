"""The Triton paged-attention kernel (interpreted) against the torch reference on odd shapes."""
from __future__ import annotations

import pytest
import torch
from kv_pools import cu_lens, make_pool, random_block_tables

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.paged_attention import paged_attention, paged_attention_ref, paged_attention_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NUM_LAYERS, LAYER = 3, 1


def _case(q_lens, seq_lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype):
    """Queries, strided per-layer pool views and metadata for one ragged batch."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    pool = make_pool(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_dim, dtype)
    k_pool, v_pool = pool[:, LAYER, 0], pool[:, LAYER, 1]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim).to(dtype)
    meta = (random_block_tables(seq_lens, block_size, num_blocks), cu_lens(q_lens),
            torch.tensor(seq_lens, dtype=torch.int32))
    return q, k_pool, v_pool, meta


def _compare(q_lens, seq_lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype, window=None, **kw):
    q, k_pool, v_pool, (tables, cu, lens) = _case(q_lens, seq_lens, block_size, num_q_heads, num_kv_heads,
                                                   head_dim, dtype)
    assert not k_pool.is_contiguous()
    scale = head_dim ** -0.5
    got = paged_attention_triton(q, k_pool, v_pool, tables, cu, lens, scale, window, **kw)
    want = paged_attention_ref(q, k_pool, v_pool, tables, cu, lens, scale, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# prefill over a cached prefix (5 of 40), a fresh prefill (17 of 23) and a decode (1 of 1)
RAGGED = dict(q_lens=[1, 5, 17], seq_lens=[1, 40, 23])


@pytest.mark.parametrize("block_size,head_dim,window", [(16, 8, None), (4, 24, 7), (16, 64, None), (4, 64, 16)])
def test_ragged_fp32(block_size, head_dim, window):
    _compare(**RAGGED, block_size=block_size, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
             dtype=torch.float32, window=window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_half(dtype):
    _compare(**RAGGED, block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=24, dtype=dtype, window=9)


def test_decode_qwen_group_of_seven():
    """Decode at Qwen-0.5B's GQA ratio (14 q heads on 2 KV heads): 7 heads share one tile."""
    _compare(q_lens=[1, 1, 1, 1], seq_lens=[37, 1, 16, 70], block_size=16, num_q_heads=14, num_kv_heads=2,
             head_dim=64, dtype=torch.float32)


def test_stories_shape_no_gqa():
    """stories260K: head_dim 8, as many KV heads as query heads."""
    _compare(q_lens=[3, 1], seq_lens=[9, 30], block_size=16, num_q_heads=8, num_kv_heads=8, head_dim=8,
             dtype=torch.float32)


@pytest.mark.parametrize("window", [None, 11])
def test_split_kv_matches(window):
    """The flash-decoding path (KV range split over programs, merged by log-sum-exp)."""
    _compare(q_lens=[1, 4, 2], seq_lens=[150, 61, 3], block_size=4, num_q_heads=4, num_kv_heads=2,
             head_dim=16, dtype=torch.float32, window=window, num_splits=3)


def test_max_q_len_hint_matches():
    _compare(**RAGGED, block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.float32,
             max_q_len=17)


def test_verify_step_windowed_bf16():
    """A verify step: a few query tokens per sequence at the end of a long cached context."""
    _compare(q_lens=[4, 8, 2], seq_lens=[100, 51, 9], block_size=16, num_q_heads=8, num_kv_heads=2,
             head_dim=64, dtype=torch.bfloat16, window=32)


def test_reference_matches_dense_causal_attention():
    """The reference itself, on one sequence with no prefix, equals torch's causal SDPA."""
    q, k_pool, v_pool, (tables, cu, lens) = _case([13], [13], 4, 4, 4, 16, torch.float32)
    out = paged_attention_ref(q, k_pool, v_pool, tables, cu, lens, 0.25)
    ids = tables[0, :4].long()
    k = k_pool[ids].flatten(0, 1)[:13].transpose(0, 1)
    v = v_pool[ids].flatten(0, 1)[:13].transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_dispatch_uses_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KVSPEC_TRITON_INTERPRET", raising=False)
    q, k_pool, v_pool, (tables, cu, lens) = _case([2], [5], 4, 2, 1, 8, torch.float32)
    got = paged_attention(q, k_pool, v_pool, tables, cu, lens, 0.3)
    torch.testing.assert_close(got, paged_attention_ref(q, k_pool, v_pool, tables, cu, lens, 0.3), atol=0, rtol=0)


def test_rejects_int64_metadata():
    q, k_pool, v_pool, (tables, cu, lens) = _case([2], [5], 4, 2, 1, 8, torch.float32)
    with pytest.raises(KernelArgumentError):
        paged_attention_triton(q, k_pool, v_pool, tables.long(), cu, lens, 0.3)


@pytest.mark.parametrize("max_block_m", [16, 128])
def test_prefill_tile_size_hook_matches(max_block_m):
    """The sweep's tile sizes compute the same attention (GQA 7: 16 rows hold 2 query tokens, 128 hold 18)."""
    _compare(q_lens=[40, 1], seq_lens=[70, 9], block_size=16, num_q_heads=14, num_kv_heads=2, head_dim=16,
             dtype=torch.float32, max_block_m=max_block_m)
    with pytest.raises(KernelArgumentError):
        _compare(**RAGGED, block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 max_block_m=48)


def test_prefill_tile_is_smaller_in_fp32():
    """fp32's IEEE dots spill a 128-row tile's registers (3.3x slower data stage on the H200, session 8):
    fp32 keeps 64 rows, 16-bit types the sweep's 128, and both are valid tiles."""
    from kvspec_kernels.paged_attention import MIN_BLOCK_M, prefill_tile_rows

    assert prefill_tile_rows(torch.float32) == 64
    assert prefill_tile_rows(torch.bfloat16) == prefill_tile_rows(torch.float16) == 128
    for rows in (prefill_tile_rows(torch.float32), prefill_tile_rows(torch.bfloat16)):
        assert rows >= MIN_BLOCK_M and rows & (rows - 1) == 0


def test_split_counts_are_few_powers_of_two():
    """NUM_SPLITS is a compile-time constant: each distinct value is another kernel compile. Over every
    decode batch up to 256 sequences and every block-table width up to 32k tokens, the H200's 132 SMs
    (Qwen-0.5B: 2 KV heads) give six counts; unrounded, the heuristic took all 32 values in 1..32."""
    from kvspec_kernels.paged_attention import MAX_SPLITS, PROGRAMS_PER_SM, split_count

    counts = {split_count(132, 2 * b, t) for b in range(1, 257) for t in range(1, 2049)}
    assert counts == {1, 2, 4, 8, 16, 32}
    raw = {max(1, min(MAX_SPLITS, (PROGRAMS_PER_SM * 132) // (2 * b), t)) for b in range(1, 257) for t in range(1, 2049)}
    assert len(raw) > 25
    # never more splits than KV tiles or than the SM budget asks for, and at least half of what it asks
    for b, t in ((1, 3), (1, 2000), (33, 2000), (128, 2000), (200, 5)):
        want = max(1, min(MAX_SPLITS, (PROGRAMS_PER_SM * 132) // (2 * b), t))
        assert want / 2 < split_count(132, 2 * b, t) <= want
