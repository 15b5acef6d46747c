"""Checks shared by the kernel tests: a chi-square test of drawn tokens with its power check, and the
ahead-of-time CUDA compile of a kernel module (no GPU)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0).item()


def assert_draws_follow(tokens: torch.Tensor, p: torch.Tensor, shifted: torch.Tensor, alpha: float) -> None:
    """The tokens never take a zero-probability entry of ``p`` and pass a chi-square test against it at
    ``alpha``; the same counts fail it against ``shifted`` (the test has power)."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    keep = p > 0
    draws = tokens.numel()
    p_value = _p_value(counts[keep], p[keep].double() * draws)
    assert p_value > alpha, f"chi-square p={p_value:.2e}"
    assert _p_value(counts[keep], shifted[keep].double() * draws) < alpha


def compiled_kernels(script: str) -> list[str]:
    """Run tests/kernels/<script> (it compiles a module's kernels for sm_90 and prints their names) in a
    process without TRITON_INTERPRET, and return the names; skips where Triton has no CUDA backend."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = Path(__file__).with_name(script)
    done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()
