"""Where each kernel runs: Triton on CUDA, the torch reference on CPU.

On a CPU the Triton interpreter is orders of magnitude slower than the torch references, so the
engine and kvd use the references there. Setting ``KVSPEC_TRITON_INTERPRET=1`` (together with
Triton's own ``TRITON_INTERPRET=1``, which must be set before triton is imported) routes CPU
tensors through the Triton kernels too, to debug a kernel without a GPU. ``KVSPEC_FUSED=1`` runs the
model's norms and rotary embedding as one-launch Triton kernels (``fused_elementwise``; session 14, tested
in the interpreter only, so off by default until an H200 run has timed and checked them). This is the only
place that reads these variables.
"""
from __future__ import annotations

import os

import torch

INTERPRET_ENV = "KVSPEC_TRITON_INTERPRET"
FUSED_ENV = "KVSPEC_FUSED"


def use_triton(device: torch.device | str) -> bool:
    """True when the kernels for tensors on ``device`` should be the Triton ones."""
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get(INTERPRET_ENV) == "1"


def fused_elementwise(device: torch.device | str) -> bool:
    """True when the model's RMSNorm and rotary embedding should run as one-launch Triton kernels
    (kernels/rms_norm.py, kernels/rotary.py): with ``KVSPEC_FUSED=1``, wherever Triton runs."""
    return os.environ.get(FUSED_ENV) == "1" and use_triton(device)
