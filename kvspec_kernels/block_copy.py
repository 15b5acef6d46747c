"""Gather and scatter whole pool blocks, for tier moves (GPU pool <-> DRAM/NVMe staging buffers).

A pool is ``[N, row]`` with contiguous rows (kvd's byte pools are ``[N, block_bytes]`` uint8).
Rows are reinterpreted as the widest integer word that divides them (8-byte words for any real
block size), so each program moves 8-byte words instead of single bytes. Grid
``(n, cdiv(words, BLOCK_WORDS))``: many programs per block, since a block is 0.5 to 4 MB. On CPU
the torch references (index_select / index_copy_) are what kvd uses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError

# 1024 words of 8 bytes = 8 KB per program: enough bytes in flight per program to approach copy
# bandwidth, small enough that a 0.5 MB block still spreads over 64 programs.
BLOCK_WORDS = 1024
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def gather_blocks(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """pool: [N, row]; ids: [n] int64 -> [n, row] copy of those rows; Triton on CUDA."""
    if use_triton(pool.device):
        return gather_blocks_triton(pool, ids)
    return gather_blocks_ref(pool, ids)


def scatter_blocks(pool: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """pool: [N, row]; ids: [n] int64; src: [n, row] -> pool[ids] = src in place; Triton on CUDA."""
    if use_triton(pool.device):
        scatter_blocks_triton(pool, ids, src)
    else:
        scatter_blocks_ref(pool, ids, src)


def gather_blocks_ref(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    _check_args(pool, ids)
    return pool.index_select(0, ids)


def scatter_blocks_ref(pool: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    _check_args(pool, ids, src)
    pool.index_copy_(0, ids, src)


def gather_blocks_triton(pool: torch.Tensor, ids: torch.Tensor, block_words: int = BLOCK_WORDS) -> torch.Tensor:
    """``block_words`` (words per program) is exposed for bench/kernels_gpu.py's sweep."""
    _check_args(pool, ids)
    out = torch.empty((ids.shape[0], pool.shape[1]), device=pool.device, dtype=pool.dtype)
    _launch(pool, ids, out, gather=True, block_words=block_words)
    return out


def scatter_blocks_triton(pool: torch.Tensor, ids: torch.Tensor, src: torch.Tensor,
                          block_words: int = BLOCK_WORDS) -> None:
    _check_args(pool, ids, src)
    _launch(pool, ids, src, gather=False, block_words=block_words)


def _launch(pool: torch.Tensor, ids: torch.Tensor, dense: torch.Tensor, gather: bool, block_words: int) -> None:
    """``dense`` is the [n, row] side of the copy: the output of a gather, the source of a scatter."""
    if ids.shape[0] == 0 or pool.shape[1] == 0:
        return
    word = _widest_word(pool, dense)
    pool_w, dense_w = pool.view(word), dense.view(word)
    words = pool_w.shape[1]
    grid = (ids.shape[0], triton.cdiv(words, block_words))
    _copy_rows_kernel[grid](pool_w, ids, dense_w, words, pool_w.stride(0), dense_w.stride(0),
                            GATHER=gather, BLOCK=block_words)


def _widest_word(pool: torch.Tensor, dense: torch.Tensor) -> torch.dtype:
    """The widest integer dtype that tiles a row exactly and is aligned in both tensors."""
    row_bytes = pool.shape[1] * pool.element_size()
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        aligned = all((t.data_ptr() % size == 0) and (t.stride(0) * t.element_size()) % size == 0
                      for t in (pool, dense))
        if row_bytes % size == 0 and aligned:
            return word
    return torch.uint8


def _check_args(pool: torch.Tensor, ids: torch.Tensor, src: torch.Tensor | None = None) -> None:
    if pool.dim() != 2 or pool.stride(1) != 1:
        raise KernelArgumentError(f"pool must be [N, row] with contiguous rows, got {tuple(pool.shape)}")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise KernelArgumentError(f"ids must be [n] int64, got {tuple(ids.shape)} {ids.dtype}")
    if src is not None and (src.shape != (ids.shape[0], pool.shape[1]) or src.dtype != pool.dtype
                            or src.stride(1) != 1):
        raise KernelArgumentError(f"src must be [{ids.shape[0]}, {pool.shape[1]}] {pool.dtype} with contiguous "
                                  f"rows, got {tuple(src.shape)} {src.dtype}")


@triton.jit
def _copy_rows_kernel(pool_ptr, ids_ptr, dense_ptr, words, stride_pool, stride_dense,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < words
    block = tl.load(ids_ptr + row)
    pool_offs = block * stride_pool + cols
    dense_offs = row.to(tl.int64) * stride_dense + cols
    if GATHER:
        tl.store(dense_ptr + dense_offs, tl.load(pool_ptr + pool_offs, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr + pool_offs, tl.load(dense_ptr + dense_offs, mask=mask), mask=mask)
