"""Write this step's K/V into their pool slots, in place.

``slot = block_id * bs + offset`` addresses a token inside the per-layer pool views
``[N, bs, Hkv, D]``, which are strided in the block dimension (one block holds every layer), so
the write goes through the views' strides. A negative slot skips its token (padding of a CUDA
graph bucket, or a token whose block is not allocated). Grid ``(T,)``: one program writes one
token's ``[Hkv, D]`` for K and for V; the work is a scatter of a few KB per token, bound by
launch overhead at decode, so fusing it into the QKV projection's epilogue is what would help.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvspec_kernels.dispatch import use_triton
from kvspec_kernels.errors import KernelArgumentError


def append_kv(
    k: torch.Tensor,             # [T, Hkv, D]
    v: torch.Tensor,             # [T, Hkv, D]
    k_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    v_pool: torch.Tensor,        # [N, bs, Hkv, D], block dim strided
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Triton or the torch reference depending on ``use_triton(k.device)``."""
    if use_triton(k.device):
        append_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    else:
        append_kv_ref(k, v, k_pool, v_pool, slot_mapping)


def append_kv_ref(k, v, k_pool, v_pool, slot_mapping) -> None:
    """Reference: advanced-index assignment into the strided views (writes through to the pool)."""
    _check_args(k, v, k_pool, v_pool, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_pool.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_pool[blocks, offsets] = k[keep]
    v_pool[blocks, offsets] = v[keep]


def append_kv_triton(k, v, k_pool, v_pool, slot_mapping) -> None:
    """Launch the Triton kernel; no host synchronisation (slot validity is not checked on device)."""
    _check_args(k, v, k_pool, v_pool, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _append_kv_kernel[(num_tokens,)](
        k, v, k_pool, v_pool, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_pool.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _check_args(k, v, k_pool, v_pool, slot_mapping) -> None:
    if k.dim() != 3 or k.shape != v.shape or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise KernelArgumentError(f"k, v must be [T,Hkv,D] and pools [N,bs,Hkv,D]; got {tuple(k.shape)}, "
                                  f"{tuple(v.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if k.shape[1:] != k_pool.shape[2:]:
        raise KernelArgumentError(f"k {tuple(k.shape)} does not fit pool {tuple(k_pool.shape)}")
    if k.dtype != k_pool.dtype or v.dtype != v_pool.dtype:
        raise KernelArgumentError(f"dtype mismatch: k {k.dtype}, pool {k_pool.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise KernelArgumentError(f"slot_mapping must be [T] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if min(k.stride(2), v.stride(2), k_pool.stride(3), v_pool.stride(3)) != 1:
        raise KernelArgumentError("the head dimension of k, v and the pools must be contiguous")


@triton.jit
def _append_kv_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kpn, stride_kpt, stride_kph,
    stride_vpn, stride_vpt, stride_vph,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_pool_ptr + block * stride_kpn + offset * stride_kpt + heads * stride_kph + dims, k, mask=mask)
    tl.store(v_pool_ptr + block * stride_vpn + offset * stride_vpt + heads * stride_vph + dims, v, mask=mask)
