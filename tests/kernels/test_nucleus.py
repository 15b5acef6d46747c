"""Top-p without a sort: the kernel (interpreted) keeps the reference's nucleus on every row shape that
takes a different path through it, the reference is the smallest-prefix definition, and a row's result
never depends on its batch."""
from __future__ import annotations

import pytest
import torch

from bench.sampling_cost import zipf_logits
from kernel_checks import compiled_kernels
from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.nucleus import (CHUNK, FINE, NB, SEARCH_BLOCK, STEP, bucket_nucleus_probs_ref,
                                    bucket_nucleus_probs_triton, nucleus_probs_ref, nucleus_probs_triton)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got > 0, want > 0), ((got > 0).sum(1).tolist(), (want > 0).sum(1).tolist())
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    assert torch.allclose(got.sum(1), torch.ones(got.shape[0]), atol=1e-5)


@pytest.mark.parametrize("vocab", [37, CHUNK + 905])
def test_kernel_keeps_the_reference_nucleus(vocab):
    """One chunk and two (the second partial); the nuclei run from 1 token to all of them."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.cat([torch.randn(5, vocab, generator=g) * 3, zipf_logits(4, vocab, "cpu", vocab)])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.1, 0.9, 0.95, 0.6, 0.999])
    _assert_same(nucleus_probs_triton(logits, top_p), nucleus_probs_ref(logits, top_p))


def _offset_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows spanning ~45 nats (past the last fine bucket, NB - 1 = 63 half-nats below the max), with the
    max at every quarter-nat offset of the coarse grid (FINE fine buckets, 4 nats), so the bracket falls at
    each position inside a coarse bucket and the last fine bucket starts in either of the two coarse
    buckets it can; top-p from a handful of tokens to every one. Not p near 1: over a long flat tail the
    boundary is decided by fp32 rounding in the one-level kernel as in this one (p = 0.9999 at V = 5,001:
    1,087 tokens kept against the reference's 1,088, either kernel)."""
    g = torch.Generator().manual_seed(vocab + 7)
    base = -torch.rand(vocab, generator=g) * 45.0
    base[:8] = torch.tensor([0.0, -0.3, -1.1, -2.0, -3.9, -4.2, -6.0, -8.5])
    offsets = torch.arange(0, STEP * FINE, 0.25)
    logits = torch.stack([base + o for o in offsets])
    top_p = torch.tensor([0.3, 0.9, 0.99, 0.98, 1.0, 0.5, 0.95, 0.8, 0.6, 0.7, 0.85, 0.97, 0.2, 0.4, 0.93, 1.0])
    return logits, top_p[: len(offsets)]


@pytest.mark.parametrize("vocab", [300, CHUNK + 905])
def test_both_ladders_keep_the_references_nucleus_at_every_offset_of_the_coarse_grid(vocab):
    """The two-level bracket (a coarse bucket of FINE fine ones, then the fine bucket inside it) must
    give the one-level grid's answer wherever the max sits on the coarse grid, the last fine bucket
    (everything NB - 1 or more below the max) included."""
    assert NB - 1 < 9 * FINE                       # the fine buckets below a max lie in 9 coarse buckets
    logits, top_p = _offset_rows(vocab)
    _assert_same(nucleus_probs_triton(logits, top_p), nucleus_probs_ref(logits, top_p))
    _assert_same(bucket_nucleus_probs_triton(logits, top_p), bucket_nucleus_probs_ref(logits, top_p))


def test_the_last_fine_bucket_is_a_bracket_of_its_own_when_the_nucleus_reaches_it():
    """p = 1: the bracket is the last fine bucket, every token NB - 1 or more half-nats below the max, counted
    apart from the coarse bracket's fine buckets; the row's lowest token is the list's last entry, so a
    count that missed the bucket at exactly NB - 1 would cut it off."""
    deep = -STEP * (NB - 1) - 0.1                      # in the last fine bucket, at its top
    logits = torch.tensor([[0.0, -1.0, deep, deep - 0.2, -20.0, deep - 3.0, -60.0],
                           [-5.0, deep - 5.0, 0.0, -2.0, deep, -3.0, -45.0]])
    top_p = torch.ones(2)
    want = torch.softmax(logits, dim=1)
    for fn in (nucleus_probs_triton, bucket_nucleus_probs_triton):
        got = fn(logits, top_p)
        assert (got > 0).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-30), fn.__name__


def test_a_bracket_larger_than_the_register_search_is_searched_in_passes():
    """Nearly flat rows put every token (SEARCH_BLOCK + 1,500) in the top bucket: the bracket is searched
    in passes over its list in memory, not in registers."""
    g = torch.Generator().manual_seed(5)
    vocab = SEARCH_BLOCK + 1500
    logits = torch.randn(3, vocab, generator=g) * 0.01
    top_p = torch.tensor([0.9, 0.5, 0.999])
    want = nucleus_probs_ref(logits, top_p)
    assert ((want > 0).sum(1) > 2000).all()
    _assert_same(nucleus_probs_triton(logits, top_p), want)


def test_ties_masked_tokens_and_signed_zeros():
    inf = float("inf")
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0],       # a tie group crossing p: all of it stays
                           [2.0, 1.0, 1.0, 0.0, 0.0, 0.0],
                           [0.0, -0.0, 0.0, -inf, 1.0, 1.0],      # -0.0 ties with 0.0; -inf never kept
                           [-inf, -inf, 3.0, -inf, -inf, -inf]])
    top_p = torch.tensor([0.3, 0.5, 0.5, 0.9])
    want = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0, 0],
                         [0.5761, 0.2119, 0.2119, 0, 0, 0],
                         [0, 0, 0, 0, 0.5, 0.5],
                         [0, 0, 1.0, 0, 0, 0]])
    for fn in (nucleus_probs_ref, nucleus_probs_triton):
        assert torch.allclose(fn(logits, top_p), want, atol=1e-4), fn.__name__


def test_reference_is_the_smallest_prefix_reaching_p():
    """Untied rows: the kept tokens are the top ones, their mass reaches p, and without the smallest
    of them it would not."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=g) * 2
    top_p = torch.tensor([0.2, 0.5, 0.7, 0.9, 0.95, 0.99])
    probs = nucleus_probs_ref(logits, top_p)
    full = torch.softmax(logits, dim=1)
    for row in range(6):
        kept = probs[row] > 0
        assert full[row][~kept].max() < full[row][kept].min()
        assert full[row][kept].sum() >= top_p[row] - 1e-6
        assert full[row][kept].sum() - full[row][kept].min() < top_p[row]


def test_a_rows_result_does_not_depend_on_its_batch():
    logits = zipf_logits(4, 700, "cpu", 3)
    top_p = torch.tensor([0.9, 0.8, 0.95, 0.5])
    batch = nucleus_probs_triton(logits, top_p)
    for row in range(4):
        assert torch.equal(nucleus_probs_triton(logits[row:row + 1], top_p[row:row + 1])[0], batch[row])


def test_bad_arguments_are_typed_errors():
    with pytest.raises(KernelArgumentError, match="fp32"):
        nucleus_probs_triton(torch.zeros(2, 5, dtype=torch.float16), torch.ones(2))
    with pytest.raises(KernelArgumentError, match="top_p"):
        nucleus_probs_triton(torch.zeros(2, 5), torch.ones(3))
    with pytest.raises(KernelArgumentError, match="contiguous"):
        nucleus_probs_triton(torch.zeros(5, 2).t(), torch.ones(2))
    assert nucleus_probs_triton(torch.zeros(0, 5), torch.ones(0)).shape == (0, 5)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the interpreter's inf - inf
def test_a_chunk_of_masked_tokens_adds_nothing():
    """A whole chunk at -inf (a masked vocabulary tail) has no max of its own to count from."""
    g = torch.Generator().manual_seed(4)
    logits = torch.full((2, CHUNK + 300), float("-inf"))
    logits[:, CHUNK:] = torch.randn(2, 300, generator=g)
    logits[1, :CHUNK] = torch.randn(CHUNK, generator=g) - 3.0      # and a chunk whose max is below the row's
    top_p = torch.tensor([0.8, 0.95])
    _assert_same(nucleus_probs_triton(logits, top_p), nucleus_probs_ref(logits, top_p))


# -- the rounded nucleus (drafts) -----------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [37, CHUNK + 905])
def test_rounded_kernel_equals_its_reference(vocab):
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.cat([torch.randn(5, vocab, generator=g) * 3, zipf_logits(4, vocab, "cpu", vocab)])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.1, 0.9, 0.95, 0.6, 0.999])
    _assert_same(bucket_nucleus_probs_triton(logits, top_p), bucket_nucleus_probs_ref(logits, top_p))


def test_the_rounded_nucleus_holds_the_exact_one_and_whole_buckets():
    """It keeps every token the exact nucleus keeps, and besides those only tokens of the exact boundary
    token's bucket (within e^STEP of its weight)."""
    logits = torch.cat([zipf_logits(6, 3000, "cpu", 8),
                        torch.randn(3, 3000, generator=torch.Generator().manual_seed(2)) * 4])
    top_p = torch.tensor([0.9, 0.95, 0.8, 0.5, 0.9, 0.99, 0.9, 0.7, 0.95])
    exact, rounded = nucleus_probs_ref(logits, top_p), bucket_nucleus_probs_ref(logits, top_p)
    assert not ((exact > 0) & (rounded == 0)).any()
    extra = (rounded > 0) & (exact == 0)
    assert extra.any()                                   # the rounding is visible on these rows
    for row in range(logits.shape[0]):
        boundary = logits[row][exact[row] > 0].min()
        assert (logits[row][extra[row]] > boundary - STEP).all()


# -- the CUDA compile (no GPU needed) --------------------------------------------------------------------

def test_every_nucleus_kernel_compiles_for_the_h200():
    """The interpreter runs the kernels as numpy and lets through what the CUDA compiler refuses (types
    it would not promote, shapes it cannot lay out). tests/kernels/nucleus_cuda_compile.py compiles each
    kernel for sm_90 (the H200) ahead of time, down to a cubin with Triton's own ptxas, in a process of its
    own (this one runs Triton interpreted); it needs no GPU."""
    assert compiled_kernels("nucleus_cuda_compile.py") == ["_coarse_ladder", "_fine_ladder", "_fine_ladder",
                                                           "_rounded_write", "_compact", "_search", "_write"]
