"""Where each kernel runs: Triton on CUDA, the torch reference on CPU.

On a CPU the Triton interpreter is orders of magnitude slower than the torch references, so the
engine and kvd use the references there. Setting ``KVSPEC_TRITON_INTERPRET=1`` (together with
Triton's own ``TRITON_INTERPRET=1``, which must be set before triton is imported) routes CPU
tensors through the Triton kernels too, to debug a kernel without a GPU. This is the only place
that reads the variable.
"""
from __future__ import annotations

import os

import torch

INTERPRET_ENV = "KVSPEC_TRITON_INTERPRET"


def use_triton(device: torch.device | str) -> bool:
    """True when the kernels for tensors on ``device`` should be the Triton ones."""
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get(INTERPRET_ENV) == "1"
