"""The fused Markov slot (interpreted): its logits are the torch formula bit for bit, its probabilities the
reference's softmax or one-hot on strided slot views spanning several chunks, its tokens the reference's
draws (greedy rows: the first argmax), never a token of zero probability, and its draws follow the row's
distribution (chi-square)."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.inverse_cdf import CHUNK, draw_ref
from kvspec_kernels.markov_slot import plain_slot_ref, plain_slot_triton, slot_logits_triton
from kernel_checks import assert_draws_follow, compiled_kernels

ALPHA = 1e-3
GAMMA, K = 3, 1                                  # slot K of a [R, GAMMA, V] buffer: row stride GAMMA·V
TEMPERATURES = torch.tensor([0.7, 1.0, 1.3, 0.35])


def _slot(rows: int, vocab: int, dtype: torch.dtype, g: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """A [rows, vocab] view ``[:, K]`` of a [rows, GAMMA, vocab] tensor, as the drafter's logits are."""
    return (torch.randn(rows, GAMMA, vocab, generator=g) * scale).to(dtype)[:, K]


def _slot_out(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled [rows, GAMMA, vocab] buffer and its slot K view: the other slots must stay NaN."""
    full = torch.full((rows, GAMMA, vocab), float("nan"))
    return full, full[:, K]


def _column(values: torch.Tensor) -> torch.Tensor:
    """values as a column of an [R, GAMMA] tensor (stride GAMMA), as a round's uniforms are: column 0, whose
    address is aligned, so the kernels get the strided view itself (``aligned`` copies a misaligned one)."""
    full = torch.ones(values.shape[0], GAMMA, dtype=values.dtype)
    full[:, 0] = values
    return full[:, 0]


@pytest.mark.parametrize("base_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, None),
                                                   (torch.float32, torch.bfloat16)])
def test_slot_logits_are_the_torch_formula_bit_for_bit(base_dtype, bias_dtype):
    g = torch.Generator().manual_seed(1)
    rows, vocab = 4, CHUNK + 77
    base = _slot(rows, vocab, base_dtype, g)
    bias = None if bias_dtype is None else (torch.randn(rows, vocab, generator=g) * 0.5).to(bias_dtype)
    x = base.float() if bias is None else base.float() + bias.float()
    want = x / TEMPERATURES[:, None]
    # the inputs tell a correctly rounded division from a reciprocal multiply (an approximate division)
    assert (x * (1.0 / TEMPERATURES)[:, None] != want).any()
    full, out = _slot_out(rows, vocab)
    got = slot_logits_triton(base, bias, _column(TEMPERATURES), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    assert full[:, [k for k in range(GAMMA) if k != K]].isnan().all()
    assert torch.equal(slot_logits_triton(base, bias, TEMPERATURES), want)     # allocated out


def _uniforms_inside(probs: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Per row, the midpoint of the CDF step of the token holding that quantile: far from every step's edge
    compared with the rounding of any fp32 running sum, so every correct draw picks that token."""
    cdf = torch.cumsum(probs.double(), dim=1)
    total = cdf[:, -1:]
    token = (cdf <= quantiles.double()[:, None] * total).sum(dim=1, keepdim=True)
    p = probs.double().gather(1, token)
    assert (p / total > 1e-4).all(), "pick other quantiles: a step is too narrow"
    return ((cdf.gather(1, token) - p / 2) / total).float()[:, 0]


def test_plain_slot_matches_the_reference_on_strided_views():
    g = torch.Generator().manual_seed(2)
    rows, vocab = 6, 2 * CHUNK + 333
    base = _slot(rows, vocab, torch.bfloat16, g)
    bias = (torch.randn(rows, vocab + 8, generator=g) * 0.5).to(torch.bfloat16)[:, :vocab]    # row stride V + 8
    base[1, CHUNK + 9] = 40.0                                       # a greedy row whose argmax is in chunk 1
    base[4, 2 * CHUNK + 300] = 40.0                                 # and one in the last, partial chunk
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.35, 1.0, 0.9])
    greedy = torch.tensor([False, True, False, False, True, False])
    x = (base.float() + bias.float()) / temperature[:, None]
    u = _uniforms_inside(torch.softmax(x, dim=1), torch.tensor([0.3, 0.5, 0.95, 0.6, 0.5, 0.02]))
    u[1], u[4] = 0.999, 0.0                                         # greedy rows: whatever their uniform
    uniforms, temperature, greedy = _column(u), _column(temperature), _column(greedy)    # any stride, too

    want_out = torch.empty(rows, vocab)
    want = plain_slot_ref(base, bias, temperature, uniforms, greedy, want_out)
    full, out = _slot_out(rows, vocab)
    got = plain_slot_triton(base, bias, temperature, uniforms, greedy, out)

    assert full[:, [k for k in range(GAMMA) if k != K]].isnan().all()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-7)
    argmax = x.argmax(dim=1)
    assert argmax[greedy].tolist() == [CHUNK + 9, 2 * CHUNK + 300]
    assert torch.equal(out[greedy], torch.zeros(2, vocab).scatter_(1, argmax[greedy, None], 1.0))
    assert torch.equal(got, want)
    assert torch.equal(got[greedy], argmax[greedy])
    assert len(set(got[~greedy].div(CHUNK, rounding_mode="floor").tolist())) > 1      # draws in several chunks
    assert (out.gather(1, got[:, None]) > 0).all()
    assert torch.equal(draw_ref(out.contiguous(), uniforms), got)


def test_a_greedy_tie_takes_the_first_index():
    vocab = 3 * CHUNK
    base = torch.zeros(3, vocab)
    base[0, [CHUNK + 7, 2 * CHUNK + 1]] = 5.0                       # tied across chunks 1 and 2
    base[1, [CHUNK + 20, CHUNK + 3]] = 5.0                          # tied inside one chunk
    base[2, [5, 2 * CHUNK]] = 5.0
    greedy = torch.ones(3, dtype=torch.bool)
    out = torch.empty(3, vocab)
    for u in (0.0, 0.5, 0.99999994, 1.0):
        tokens = plain_slot_triton(base, None, torch.ones(3), torch.full((3,), u), greedy, out)
        assert tokens.tolist() == [CHUNK + 7, CHUNK + 3, 5], u
        assert torch.equal(out.nonzero()[:, 1], tokens)
        assert out.sum(dim=1).tolist() == [1.0, 1.0, 1.0]


def test_minus_infinity_gets_exactly_zero_and_is_never_drawn():
    g = torch.Generator().manual_seed(4)
    rows, vocab = 4, 2 * CHUNK + 50
    base = _slot(rows, vocab, torch.bfloat16, g)
    bias = torch.zeros(rows, vocab, dtype=torch.bfloat16)
    bias[:, ::2] = float("-inf")
    bias[:, :CHUNK] = float("-inf")                                 # a whole chunk of -inf (its max is -inf)
    bias[:, 2 * CHUNK - 5:] = float("-inf")                         # and the tail: the last finite token ends chunk 1
    finite = (~bias[0].isinf()).nonzero()[:, 0]
    base[1, finite[-1]] = 20.0                                      # mass enough for u at the top to reach it
    base[3, CHUNK + 1] = 50.0                                       # the greedy row's max, beside -inf
    temperature = torch.tensor([1.0, 0.5, 1.3, 1.0])
    greedy = torch.tensor([False, False, False, True])
    uniforms = torch.tensor([0.0, 0.99999994, 0.5, 0.7])
    out = torch.empty(rows, vocab)
    tokens = plain_slot_triton(base, bias, temperature, uniforms, greedy, out)
    want_out = torch.empty(rows, vocab)
    plain_slot_ref(base, bias, temperature, uniforms, greedy, want_out)

    banned = bias.isinf()
    assert (out[banned] == 0).all() and not out.isnan().any()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-7)
    assert not banned.gather(1, tokens[:, None]).any()
    assert tokens[0] == finite[0] and tokens[1] == finite[-1]      # u = 0 and u at the top of the range
    assert tokens[3] == CHUNK + 1


def test_fused_draws_follow_the_distribution():
    """2,000 rows of the same logits (a zero row stride) with independent uniforms, one call."""
    draws = 2000
    p = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.25, 0.25])
    g = torch.Generator().manual_seed(3)
    base = p.log().expand(draws, -1)
    out = torch.empty(draws, p.numel())
    tokens = plain_slot_triton(base, None, torch.ones(draws), torch.rand(draws, generator=g),
                               torch.zeros(draws, dtype=torch.bool), out)
    torch.testing.assert_close(out[0], p, rtol=1e-6, atol=0.0)
    assert_draws_follow(tokens, p, torch.tensor([0.10, 0.0, 0.25, 0.15, 0.0, 0.25, 0.25]), ALPHA)


def test_bad_arguments_are_typed_errors():
    base, t = torch.zeros(2, 5), torch.ones(2)
    u, greedy, out = torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.empty(2, 5)
    cases = [
        ("base", lambda: slot_logits_triton(torch.zeros(2, 5, dtype=torch.int32), None, t)),
        ("base", lambda: slot_logits_triton(torch.zeros(5, 2).t(), None, t)),
        ("bias", lambda: slot_logits_triton(base, torch.zeros(2, 4), t)),
        ("bias", lambda: slot_logits_triton(base, torch.zeros(5, 2).t(), t)),
        ("temperature", lambda: slot_logits_triton(base, None, torch.ones(2, dtype=torch.float64))),
        ("out", lambda: slot_logits_triton(base, None, t, out=torch.empty(2, 5, dtype=torch.float16))),
        ("out", lambda: plain_slot_triton(base, None, t, u, greedy, None)),
        ("out", lambda: plain_slot_triton(base, None, t, u, greedy, torch.empty(5, 2).t())),
        ("uniforms", lambda: plain_slot_triton(base, None, t, torch.zeros(3), greedy, out)),
        ("greedy", lambda: plain_slot_triton(base, None, t, u, torch.zeros(2, dtype=torch.int64), out)),
        ("on meta", lambda: plain_slot_triton(base, None, t.to("meta"), u, greedy, out)),
    ]
    for match, call in cases:
        with pytest.raises(KernelArgumentError, match=match):
            call()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # numpy's, on the interpreter's 1 / 0 and 0 · inf
def test_a_row_without_finite_logits_writes_no_nan():
    """A bug upstream, not a NaN in the draft's probabilities: a sampled row writes zeros and draws V - 1
    (inverse_cdf's row without mass), a greedy one the one-hot at 0 (torch.argmax's first index)."""
    vocab = CHUNK + 5
    base = torch.full((2, vocab), float("-inf"))
    out = torch.empty(2, vocab)
    tokens = plain_slot_triton(base, None, torch.ones(2), torch.full((2,), 0.5), torch.tensor([False, True]), out)
    assert tokens.tolist() == [vocab - 1, 0]
    assert torch.equal(out, torch.zeros(2, vocab).index_put_((torch.tensor([1]), torch.tensor([0])),
                                                             torch.tensor(1.0)))


def test_every_markov_slot_kernel_compiles_for_sm90_with_a_correctly_rounded_division():
    """tests/kernels/markov_slot_cuda_compile.py compiles each kernel for sm_90 down to a cubin with Triton's
    own ptxas, in a process without the interpreter, and checks the PTX divides with ``div.rn.f32`` (an
    approximate division would break ``slot_logits``'s bit identity with torch on the GPU); no GPU needed."""
    assert compiled_kernels("markov_slot_cuda_compile.py") == ["_logits", "_logits", "_stats", "_write"]


@pytest.mark.parametrize("greedy_rows", [(True, True, True), (False, False, False)])
def test_the_references_host_hints_change_nothing(greedy_rows):
    """``any_sampled=False`` (every row greedy) and ``any_greedy=False`` (every row sampled) only skip work in the
    reference: the probabilities and tokens are those of the full reference."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 3, 700
    base = _slot(rows, vocab, torch.float32, g)
    temperature, u = torch.tensor([0.7, 1.0, 1.3]), torch.tensor([0.2, 0.5, 0.9])
    greedy = torch.tensor(greedy_rows)
    full_out, hinted_out = torch.empty(rows, vocab), torch.empty(rows, vocab)
    want = plain_slot_ref(base, None, temperature, u, greedy, full_out)
    hints = dict(any_sampled=False) if greedy.all() else dict(any_greedy=False)
    got = plain_slot_ref(base, None, temperature, u, greedy, hinted_out, **hints)
    assert torch.equal(got, want) and torch.equal(hinted_out, full_out)


def test_kvspec_markov_slot_0_sends_cuda_tensors_to_the_references(monkeypatch):
    from kvspec_kernels.dispatch import MARKOV_SLOT_ENV, markov_slot_kernels

    monkeypatch.delenv("KVSPEC_TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(MARKOV_SLOT_ENV, raising=False)
    assert markov_slot_kernels("cuda") and not markov_slot_kernels("cpu")
    monkeypatch.setenv(MARKOV_SLOT_ENV, "0")
    assert not markov_slot_kernels("cuda")
