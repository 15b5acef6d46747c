"""The Triton KV-append kernel (interpreted) against the torch reference, on strided pool views."""
from __future__ import annotations

import pytest
import torch
from kv_pools import make_pool

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.kv_append import append_kv_ref, append_kv_triton


def _inputs(num_tokens, block_size, num_kv_heads, head_dim, dtype, num_blocks=7):
    pool = make_pool(num_blocks, 3, block_size, num_kv_heads, head_dim, dtype)
    # k and v as the model makes them: column slices of one fused projection (strided tokens).
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 5).to(dtype)
    k = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1  # skipped tokens
    return pool, k, v, slots


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,dtype", [
    (16, 2, 24, torch.float32), (4, 3, 8, torch.bfloat16), (16, 2, 64, torch.float16)])
def test_append_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    pool, k, v, slots = _inputs(11, block_size, num_kv_heads, head_dim, dtype)
    want = pool.clone()
    append_kv_ref(k, v, want[:, 1, 0], want[:, 1, 1], slots)
    append_kv_triton(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    assert torch.equal(pool, want)  # bit-exact, and no other layer or slot touched


def test_reference_writes_expected_slots():
    pool, k, v, slots = _inputs(5, 4, 2, 8, torch.float32)
    before = pool.clone()
    append_kv_ref(k, v, pool[:, 2, 0], pool[:, 2, 1], slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(pool[slot // 4, 2, 0, slot % 4], k[t])
            assert torch.equal(pool[slot // 4, 2, 1, slot % 4], v[t])
    written = torch.zeros_like(pool, dtype=torch.bool)
    for slot in slots[slots >= 0].tolist():
        written[slot // 4, 2, :, slot % 4] = True
    assert torch.equal(pool[~written], before[~written])


def test_rejects_int32_slots():
    pool, k, v, slots = _inputs(4, 4, 2, 8, torch.float32)
    with pytest.raises(KernelArgumentError):
        append_kv_triton(k, v, pool[:, 0, 0], pool[:, 0, 1], slots.int())
