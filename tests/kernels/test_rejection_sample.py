"""Rejection sampling: the kernel (interpreted) equals the reference exactly, greedy rows follow the
argmax chain, and the emitted token is distributed as the target (chi-square, losslessness)."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.rejection_sample import MAX_SPLITS, rejection_sample_ref, rejection_sample_triton, vocab_splits

# Significance level of the chi-square tests. With fixed seeds the outcome is deterministic; the
# level bounds how likely a correct sampler would have failed on the seed that was chosen.
ALPHA = 1e-3


def _random_case(batch, k_max, vocab, num_draft, generator):
    target = torch.rand(batch, k_max + 1, vocab, generator=generator) ** 3
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(batch, k_max, vocab, generator=generator) ** 3
    draft[:, :, ::5] = 0.0  # tokens the drafter never proposes: residual mass only
    draft /= draft.sum(-1, keepdim=True)
    tokens = torch.multinomial(draft.flatten(0, 1), 1, generator=generator).view(batch, k_max)
    # Make some drafts likely to pass: copy the target row onto the draft row at random positions.
    copy = torch.rand(batch, k_max, generator=generator) < 0.5
    draft = torch.where(copy[..., None], target[:, :k_max], draft)
    tokens = torch.where(copy, torch.multinomial(target[:, :k_max].flatten(0, 1), 1,
                                                 generator=generator).view(batch, k_max), tokens)
    tokens[torch.arange(k_max)[None, :] >= num_draft[:, None]] = -1  # garbage past num_draft
    uniforms = torch.rand(batch, k_max, generator=generator)
    bonus = torch.rand(batch, generator=generator)
    return target, draft, tokens, num_draft.int(), uniforms, bonus


def test_kernel_equals_reference_exactly():
    generator = torch.Generator().manual_seed(1)
    num_draft = torch.tensor([0, 1, 4, 4, 2, 3, 4, 0, 1])
    args = _random_case(9, 4, 37, num_draft, generator)
    want_len, want_out = rejection_sample_ref(*args)
    got_len, got_out = rejection_sample_triton(*args)
    assert torch.equal(got_len, want_len) and got_len.dtype == torch.int32
    assert torch.equal(got_out, want_out) and got_out.dtype == torch.int64
    # the case covers rejections, full accepts and bonus tokens
    assert (want_len < num_draft).any() and ((want_len == num_draft) & (num_draft > 0)).any()


def test_kernel_equals_reference_with_vocab_over_several_chunks():
    generator = torch.Generator().manual_seed(2)
    args = _random_case(3, 2, 5000, torch.tensor([2, 1, 2]), generator)
    for want, got in zip(rejection_sample_ref(*args), rejection_sample_triton(*args)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_kernel_equals_reference_with_the_vocabulary_split_into_parts(splits):
    """The two passes over a row's vocabulary run in parts side by side (one part: one program a row, as
    before session 46); each part's CDF starts from the parts before it, so the emitted tokens are the
    reference's whichever part they fall in. 5,000 tokens in 2,048-token chunks: three parts, the last short."""
    generator = torch.Generator().manual_seed(7)
    num_draft = torch.tensor([2, 0, 1, 2, 2, 1])
    args = _random_case(6, 2, 5000, num_draft, generator)
    want_len, want_out = rejection_sample_ref(*args)
    got_len, got_out = rejection_sample_triton(*args, splits=splits)
    assert torch.equal(got_len, want_len) and torch.equal(got_out, want_out)
    last = want_out.gather(1, want_len.long()[:, None])
    assert (last >= 2048).sum() >= 2                  # tokens emitted from the later parts, not only the first
    assert (want_len < num_draft).any()               # residual draws among them


def test_parts_per_row_fill_the_gpu_at_small_batches_and_fall_to_one_at_large():
    assert vocab_splits(1, 75) == 75                  # Qwen's vocabulary: one 2,048-token chunk a part
    assert vocab_splits(8, 75) == 32
    assert vocab_splits(256, 75) == 1 and vocab_splits(1000, 75) == 1
    assert vocab_splits(1, 500) == MAX_SPLITS


@pytest.mark.parametrize("impl", [rejection_sample_ref, rejection_sample_triton])
def test_greedy_one_hot_follows_argmax_chain(impl):
    """T=0: one-hot target and draft. Drafts are accepted exactly while they equal the target's
    argmax; the next token is the target's argmax at the first mismatch (or the bonus)."""
    vocab, k_max = 11, 5
    target_ids = torch.tensor([[3, 3, 7, 1, 0, 9], [2, 5, 5, 5, 5, 5], [4, 4, 4, 4, 4, 6]])
    draft_ids = torch.tensor([[3, 3, 2, 1, 0], [9, 5, 5, 5, 5], [4, 4, 4, 4, 4]])
    num_draft = torch.tensor([5, 5, 5], dtype=torch.int32)
    target = torch.nn.functional.one_hot(target_ids, vocab).float()
    draft = torch.nn.functional.one_hot(draft_ids, vocab).float()
    uniforms = torch.full((3, k_max), 0.999999)  # the largest uniforms still accept a match
    bonus = torch.tensor([0.0, 0.5, 0.999999])
    accepted, out = impl(target, draft, draft_ids, num_draft, uniforms, bonus)
    assert accepted.tolist() == [2, 0, 5]
    assert out.tolist() == [[3, 3, 7, -1, -1, -1], [2, -1, -1, -1, -1, -1], [4, 4, 4, 4, 4, 6]]


def test_reference_position_zero_is_lossless():
    """Over many draws, the token at position 0 follows p_t although p_d differs (it even proposes
    a token p_t never emits and never proposes one p_t favours)."""
    draws, k_max = 40_000, 2
    p_t = torch.tensor([0.05, 0.30, 0.0, 0.25, 0.15, 0.25])
    p_d = torch.tensor([0.30, 0.10, 0.20, 0.40, 0.0, 0.00])
    counts = _position_zero_counts(rejection_sample_ref, p_t, p_d, draws, k_max, seed=3)
    _assert_chi_square(counts, p_t, draws)


def test_kernel_position_zero_is_lossless():
    """The same check on the kernel, with fewer draws (the interpreter runs one row in ~9 ms)."""
    draws = 800
    p_t = torch.tensor([0.10, 0.40, 0.0, 0.20, 0.30])
    p_d = torch.tensor([0.40, 0.10, 0.30, 0.20, 0.00])
    counts = _position_zero_counts(rejection_sample_triton, p_t, p_d, draws, 1, seed=4)
    _assert_chi_square(counts, p_t, draws)


def _position_zero_counts(impl, p_t, p_d, draws, k_max, seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = p_t.shape[0]
    target = p_t.expand(draws, k_max + 1, vocab).contiguous()
    draft = p_d.expand(draws, k_max, vocab).contiguous()
    tokens = torch.multinomial(p_d, draws * k_max, replacement=True, generator=generator).view(draws, k_max)
    num_draft = torch.full((draws,), k_max, dtype=torch.int32)
    uniforms = torch.rand(draws, k_max, generator=generator)
    bonus = torch.rand(draws, generator=generator)
    _, out = impl(target, draft, tokens, num_draft, uniforms, bonus)
    return torch.bincount(out[:, 0], minlength=vocab)


def _assert_chi_square(counts, p, draws):
    support = p > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    expected = p[support] * draws
    statistic = ((counts[support].double() - expected.double()) ** 2 / expected.double()).sum()
    dof = int(support.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0)
    assert p_value > ALPHA, f"chi-square {statistic:.2f} with {dof} dof, p={p_value:.2e}"


def test_chi_square_detects_the_draft_distribution():
    """The statistical test has power: draft tokens accepted blindly (the bug it guards against)
    fail it at the kernel test's sample size."""
    draws = 800
    p_t = torch.tensor([0.10, 0.40, 0.0, 0.20, 0.30])
    p_d = torch.tensor([0.40, 0.10, 0.30, 0.20, 0.00])
    counts = torch.bincount(torch.multinomial(p_d, draws, replacement=True,
                                              generator=torch.Generator().manual_seed(5)), minlength=5)
    with pytest.raises(AssertionError):
        _assert_chi_square(counts, p_t, draws)


def test_rejects_wrong_dtype():
    generator = torch.Generator().manual_seed(6)
    target, draft, tokens, num_draft, uniforms, bonus = _random_case(2, 2, 7, torch.tensor([1, 2]), generator)
    with pytest.raises(KernelArgumentError):
        rejection_sample_triton(target, draft, tokens, num_draft.long(), uniforms, bonus)


def test_the_splits_setting_reaches_the_kernel_and_a_bad_one_is_refused(monkeypatch):
    """``KVSPEC_REJECTION_SPLITS`` (kvspec_kernels/dispatch.py) picks the parts a row's passes run in, so a
    serving run can measure one program a row against the split on the same machine."""
    import importlib

    from kvspec_kernels.dispatch import SPLITS_ENV, rejection_splits

    rs = importlib.import_module("kvspec_kernels.rejection_sample")   # the package re-exports a function of this name
    seen = []
    monkeypatch.setattr(rs, "rejection_sample_triton", lambda *args, splits=None: seen.append(splits))
    monkeypatch.setattr(rs, "use_triton", lambda device: True)
    args = _random_case(2, 2, 7, torch.tensor([1, 2]), torch.Generator().manual_seed(8))
    monkeypatch.delenv(SPLITS_ENV, raising=False)
    rs.rejection_sample(*args)
    monkeypatch.setenv(SPLITS_ENV, "1")
    rs.rejection_sample(*args)
    assert seen == [None, 1]
    monkeypatch.setenv(SPLITS_ENV, "zero")
    with pytest.raises(ValueError, match=SPLITS_ENV):
        rejection_splits()
