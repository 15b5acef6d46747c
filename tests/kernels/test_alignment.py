"""kvspec_kernels/alignment.py: misaligned views reach the Triton kernels as aligned copies (one kernel build,
not one per alignment), and the launchers give the same results on them as on aligned inputs."""
from __future__ import annotations

import importlib

import pytest
import torch

from kvspec_kernels.alignment import ALIGN, aligned

# the modules, not the functions ``kernels`` re-exports under the same names
inverse_cdf = importlib.import_module("kvspec_kernels.inverse_cdf")
nucleus = importlib.import_module("kvspec_kernels.nucleus")
rejection_sample = importlib.import_module("kvspec_kernels.rejection_sample")


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` at an address that is not a multiple of ``ALIGN`` (a view one element into a
    larger tensor, as the packed uploads hand them over)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % ALIGN
    return view


def test_aligned_keeps_an_aligned_tensor_and_copies_a_misaligned_one():
    t = torch.arange(12, dtype=torch.float32)
    assert aligned(t) is t
    m = misaligned(t)
    a = aligned(m)
    assert a is not m and a.data_ptr() % ALIGN == 0 and torch.equal(a, t)
    empty = torch.empty(0)
    assert aligned(empty) is empty


class Spy:
    """Stands in for a ``@triton.jit`` kernel: records the tensor arguments of each launch."""

    def __init__(self, seen: list):
        self.seen = seen

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.extend(a for a in args if isinstance(a, torch.Tensor))


def _inputs(batch=3, k=4, vocab=40):
    g = torch.Generator().manual_seed(0)
    tp = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g), -1)
    dp = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    toks = torch.randint(0, vocab, (batch, k), generator=g)
    num = torch.full((batch,), k, dtype=torch.int32)
    u = torch.rand(batch, k, generator=g)
    bonus = torch.rand(batch, generator=g)
    return tp, dp, toks, num, u, bonus


@pytest.mark.parametrize("launch, names", [
    ("rejection", ["_chain_and_mass_kernel", "_cdf_count_kernel", "_last_token_kernel"]),
    ("draw", ["_chunk_sums", "_pick"]),
    ("nucleus", ["_coarse_ladder", "_fine_ladder", "_compact", "_search", "_write"]),
    ("bucket", ["_coarse_ladder", "_fine_ladder", "_rounded_write"]),
])
def test_every_tensor_a_kernel_receives_is_aligned(launch, names, monkeypatch):
    seen: list = []
    module = {"rejection": rejection_sample, "draw": inverse_cdf, "nucleus": nucleus, "bucket": nucleus}[launch]
    for name in names:
        monkeypatch.setattr(module, name, Spy(seen))
    if launch == "rejection":
        rejection_sample.rejection_sample_triton(*(misaligned(t) for t in _inputs()))
    elif launch == "draw":
        probs = torch.softmax(torch.randn(3, 40), -1)
        inverse_cdf.draw_triton(misaligned(probs), misaligned(torch.rand(3)))
    else:
        fn = nucleus.nucleus_probs_triton if launch == "nucleus" else nucleus.bucket_nucleus_probs_triton
        fn(misaligned(torch.randn(3, 40)), misaligned(torch.full((3,), 0.9)))
    assert seen and all(t.data_ptr() % ALIGN == 0 for t in seen)


def test_the_kernels_give_the_same_results_on_misaligned_views():
    """Through the interpreter (tests/kernels/conftest.py): the copies carry the same values."""
    inputs = _inputs()
    want = rejection_sample.rejection_sample_triton(*inputs)
    got = rejection_sample.rejection_sample_triton(*(misaligned(t) for t in inputs))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    probs, u = torch.softmax(torch.randn(3, 40), -1), torch.rand(3)
    assert torch.equal(inverse_cdf.draw_triton(probs, u), inverse_cdf.draw_triton(misaligned(probs), misaligned(u)))
    logits, top_p = torch.randn(3, 40), torch.tensor([0.5, 0.9, 1.0])
    assert torch.equal(nucleus.nucleus_probs_triton(logits, top_p),
                       nucleus.nucleus_probs_triton(misaligned(logits), misaligned(top_p)))
