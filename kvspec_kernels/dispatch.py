"""Where each kernel runs: Triton on CUDA, the torch reference on CPU.

On a CPU the Triton interpreter is orders of magnitude slower than the torch references, so the
engine and kvd use the references there. Setting ``KVSPEC_TRITON_INTERPRET=1`` (together with
Triton's own ``TRITON_INTERPRET=1``, which must be set before triton is imported) routes CPU
tensors through the Triton kernels too, to debug a kernel without a GPU.

The model's norms and rotary embedding run as one-launch Triton kernels wherever Triton runs
(``fused_elementwise``); ``KVSPEC_FUSED=0`` turns that off, back to the torch formulas. Why on by default
(H200, session 15, docs/results/speedup.md): a Qwen-0.5B decode step of 16 sequences went from ~1,000
kernels and 2.06 ms to 465 kernels and 1.61 ms (bench/step_profile.py, both paths in one call), and
`none` served 1.20-1.61x the tokens per second (geometric mean 1.44) over the five workloads and five
concurrencies (runs AT and AU, the same commit, back to back). The outputs match the references within
the rounding of an fp32 sum order (bench/kernels_gpu.py). ``KVSPEC_REJECTION_SPLITS=1`` runs the rejection
sampler's vocabulary passes in one program a row, its layout until session 46 (default: split into parts,
kvspec_kernels/rejection_sample.py), so a serving run can measure the split against it on the same machine.
``KVSPEC_MARKOV_SLOT=0`` runs the draft rounds' Markov slots through the torch references of
kvspec_kernels/markov_slot.py on CUDA too (the torch passes the fused kernels replaced, session 51), so one
run can time both and a Triton that refuses the kernels has a way back.
This is the only place that reads these variables.
"""
from __future__ import annotations

import os

import torch

INTERPRET_ENV = "KVSPEC_TRITON_INTERPRET"
FUSED_ENV = "KVSPEC_FUSED"
SPLITS_ENV = "KVSPEC_REJECTION_SPLITS"
MARKOV_SLOT_ENV = "KVSPEC_MARKOV_SLOT"


def use_triton(device: torch.device | str) -> bool:
    """True when the kernels for tensors on ``device`` should be the Triton ones."""
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get(INTERPRET_ENV) == "1"


def fused_elementwise(device: torch.device | str) -> bool:
    """True when the model's RMSNorm and rotary embedding should run as one-launch Triton kernels
    (kvspec_kernels/rms_norm.py, kvspec_kernels/rotary.py): wherever Triton runs, unless ``KVSPEC_FUSED=0``."""
    return os.environ.get(FUSED_ENV, "1") != "0" and use_triton(device)


def markov_slot_kernels(device: torch.device | str) -> bool:
    """True when a draft slot's logits, distribution and draw should run as kvspec_kernels/markov_slot.py's
    Triton kernels: wherever Triton runs, unless ``KVSPEC_MARKOV_SLOT=0``."""
    return os.environ.get(MARKOV_SLOT_ENV, "1") != "0" and use_triton(device)


def rejection_splits() -> int | None:
    """Parts of a row's vocabulary the rejection sampler's passes run in: ``KVSPEC_REJECTION_SPLITS`` when set
    (a positive integer), else None (the kernel picks them by the batch)."""
    text = os.environ.get(SPLITS_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{SPLITS_ENV} must be a positive integer, got {text!r}")
    return int(text)
