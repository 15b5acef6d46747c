"""The Triton block gather/scatter kernels (interpreted) against index_select / index_copy_."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.block_copy import (
    gather_blocks,
    gather_blocks_ref,
    gather_blocks_triton,
    scatter_blocks_ref,
    scatter_blocks_triton,
)
from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError

# 3000 bytes: 8-byte words, and rows wider than one program's 1024 words; 1001: single bytes.
SHAPES = [(9, 3000, torch.uint8), (6, 1001, torch.uint8), (5, 2 * 1030, torch.bfloat16), (4, 33, torch.float32)]


def _pool(num_blocks, row, dtype):
    return torch.randint(0, 255, (num_blocks, row), dtype=torch.uint8) if dtype == torch.uint8 \
        else torch.randn(num_blocks, row).to(dtype)


@pytest.mark.parametrize("num_blocks,row,dtype", SHAPES)
def test_gather_matches_reference(num_blocks, row, dtype):
    pool = _pool(num_blocks, row, dtype)
    ids = torch.tensor([num_blocks - 1, 0, 2, 2], dtype=torch.int64)
    got = gather_blocks_triton(pool, ids)
    assert torch.equal(got, gather_blocks_ref(pool, ids))
    assert torch.equal(got[0], pool[num_blocks - 1])


@pytest.mark.parametrize("num_blocks,row,dtype", SHAPES)
def test_scatter_matches_reference(num_blocks, row, dtype):
    pool = _pool(num_blocks, row, dtype)
    ids = torch.tensor([3, 0, num_blocks - 1], dtype=torch.int64)
    src = _pool(3, row, dtype)
    want = pool.clone()
    scatter_blocks_ref(want, ids, src)
    scatter_blocks_triton(pool, ids, src)
    assert torch.equal(pool, want)
    assert torch.equal(pool[0], src[1])


def test_strided_rows_of_a_wider_pool():
    """A pool whose rows are spaced wider than they are long (a column slice of a bigger pool)."""
    base = _pool(6, 64, torch.uint8)
    pool = base[:, 8:48]
    ids = torch.tensor([5, 1], dtype=torch.int64)
    assert torch.equal(gather_blocks_triton(pool, ids), gather_blocks_ref(pool, ids))


def test_rejects_mismatched_src():
    pool = _pool(4, 16, torch.uint8)
    with pytest.raises(KernelArgumentError):
        scatter_blocks_triton(pool, torch.tensor([0, 1]), _pool(3, 16, torch.uint8))


def test_dispatch_uses_references_on_cpu(monkeypatch):
    monkeypatch.delenv("KVSPEC_TRITON_INTERPRET", raising=False)
    assert not use_triton("cpu") and use_triton("cuda")
    pool = _pool(3, 24, torch.uint8)
    ids = torch.tensor([2, 0], dtype=torch.int64)
    assert torch.equal(gather_blocks(pool, ids), pool[[2, 0]])
    monkeypatch.setenv("KVSPEC_TRITON_INTERPRET", "1")
    assert use_triton("cpu")
