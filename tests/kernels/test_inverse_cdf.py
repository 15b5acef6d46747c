"""Inverse-CDF draws: the kernel (interpreted) picks the reference's token on rows spanning several
chunks, never a zero-probability token, and its draws follow the row's distribution (chi-square)."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.inverse_cdf import CHUNK, draw_ref, draw_triton
from kernel_checks import assert_draws_follow

ALPHA = 1e-3


def test_kernel_picks_the_reference_token():
    g = torch.Generator().manual_seed(0)
    vocab = 2 * CHUNK + 333
    probs = torch.rand(6, vocab, generator=g) ** 4
    probs[:, ::3] = 0.0
    probs[1, : CHUNK + 50] = 0.0                     # the mass starts in the second chunk
    probs[2, CHUNK:] = 0.0                           # and ends in the first
    u = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.999, 0.123])
    got, want = draw_triton(probs, u), draw_ref(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_a_uniform_at_the_top_draws_the_last_token_with_mass():
    probs = torch.zeros(2, CHUNK + 10)
    probs[:, 5] = 0.5
    probs[:, CHUNK + 3] = 0.5
    u = torch.tensor([0.99999994, 0.0])
    for fn in (draw_ref, draw_triton):
        assert fn(probs, u).tolist() == [CHUNK + 3, 5], fn.__name__


def test_a_row_without_mass_draws_the_last_token_and_reads_nothing_outside_it():
    probs = torch.zeros(2, CHUNK + 7)
    probs[1, 3] = 1.0
    u = torch.tensor([0.5, 0.5])
    for fn in (draw_ref, draw_triton):
        assert fn(probs, u).tolist() == [CHUNK + 6, 3], fn.__name__


def test_kernel_draws_follow_the_distribution():
    """4,000 rows of the same distribution with independent uniforms, one launch."""
    draws = 4000
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.25])
    g = torch.Generator().manual_seed(3)
    tokens = draw_triton(p.expand(draws, -1).contiguous(), torch.rand(draws, generator=g))
    assert_draws_follow(tokens, p, torch.tensor([0.10, 0.0, 0.25, 0.15, 0.0, 0.25, 0.25]), ALPHA)


def test_bad_arguments_are_typed_errors():
    with pytest.raises(KernelArgumentError, match="fp32"):
        draw_triton(torch.ones(2, 5, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(KernelArgumentError, match="uniforms"):
        draw_triton(torch.ones(2, 5), torch.zeros(3))
