"""The one-launch rotary embedding (interpreted) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.rotary import rotary_ref, rotary_triton


def _tables(t: int, dim: int, dtype):
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, dim, 2) / dim))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("t,heads,dim,dtype", [(5, 3, 16, torch.bfloat16), (4, 14, 64, torch.bfloat16),
                                               (3, 2, 24, torch.float16), (6, 4, 8, torch.float32)])
def test_matches_the_reference(t, heads, dim, dtype):
    x = torch.randn(t, heads, dim).to(dtype)
    cos, sin = _tables(t, dim, dtype)
    got, want = rotary_triton(x, cos, sin), rotary_ref(x, cos, sin)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:      # a product and the sum may contract into one fused multiply-add
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    else:                           # each product and the sum rounded as the reference rounds them
        assert torch.equal(got, want)


def test_reads_q_and_k_as_the_model_makes_them():
    """Column slices of one projection output: strided tokens and heads, contiguous head dimension."""
    t, hq, hkv, d = 4, 6, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 3).to(torch.bfloat16)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    cos, sin = _tables(t, d, torch.bfloat16)
    assert torch.equal(rotary_triton(q, cos, sin), rotary_ref(q, cos, sin))
    assert torch.equal(rotary_triton(k, cos, sin), rotary_ref(k, cos, sin))


def test_bad_arguments():
    x = torch.randn(3, 2, 8)
    cos, sin = _tables(3, 8, torch.float32)
    with pytest.raises(KernelArgumentError):
        rotary_triton(torch.randn(3, 2, 7), cos[..., :7], sin[..., :7])        # odd head dimension
    with pytest.raises(KernelArgumentError):
        rotary_triton(x, cos[:2], sin[:2])                                   # tables for other tokens
    with pytest.raises(KernelArgumentError):
        rotary_triton(x, cos.to(torch.bfloat16), sin.to(torch.bfloat16))     # dtype mismatch
    assert rotary_triton(torch.empty(0, 2, 8), cos[:0], sin[:0]).shape == (0, 2, 8)
