"""Triton kernels of the serving path, each with a plain-torch reference beside it.

The public functions dispatch with ``use_triton(device)``: Triton for CUDA tensors, the torch
reference on CPU (unless ``KVSPEC_TRITON_INTERPRET=1``). The ``*_triton`` and ``*_ref`` variants
are importable from each module for tests and benchmarks.
"""
from kvspec_kernels.block_copy import gather_blocks, gather_blocks_ref, scatter_blocks, scatter_blocks_ref
from kvspec_kernels.dispatch import fused_elementwise, use_triton
from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.inverse_cdf import draw, draw_ref
from kvspec_kernels.kv_append import append_kv, append_kv_ref
from kvspec_kernels.nucleus import bucket_nucleus_probs, bucket_nucleus_probs_ref, nucleus_probs, nucleus_probs_ref
from kvspec_kernels.paged_attention import paged_attention, paged_attention_ref
from kvspec_kernels.rejection_sample import rejection_sample, rejection_sample_ref
from kvspec_kernels.rms_norm import rms_norm, rms_norm_ref
from kvspec_kernels.rotary import rotary, rotary_ref

__all__ = [
    "KernelArgumentError",
    "append_kv",
    "append_kv_ref",
    "bucket_nucleus_probs",
    "bucket_nucleus_probs_ref",
    "draw",
    "draw_ref",
    "fused_elementwise",
    "gather_blocks",
    "gather_blocks_ref",
    "nucleus_probs",
    "nucleus_probs_ref",
    "paged_attention",
    "paged_attention_ref",
    "rejection_sample",
    "rejection_sample_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary",
    "rotary_ref",
    "scatter_blocks",
    "scatter_blocks_ref",
    "use_triton",
]
