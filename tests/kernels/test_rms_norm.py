"""The one-launch RMSNorm (interpreted) against the torch reference, and where the model uses it."""
from __future__ import annotations

import pytest
import torch

from kvspec_kernels.errors import KernelArgumentError
from kvspec_kernels.rms_norm import rms_norm_ref, rms_norm_triton


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's resolution at each element's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(torch.float32).tiny)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


@pytest.mark.parametrize("shape,dtype", [((7, 24), torch.float32), ((5, 96), torch.bfloat16),
                                         ((3, 4, 16), torch.bfloat16), ((6, 40), torch.float16),
                                         ((1, 896), torch.bfloat16)])
def test_matches_the_reference_within_an_ulp(shape, dtype):
    x = (torch.randn(shape) * 3).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    got, want = rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:      # the statistic (sum order, 1/sqrt against rsqrt) differs by an ulp or two
        assert _ulps(got, want) <= 4.0
    else:                           # and rarely moves the rounding of a 16-bit output, by one ulp
        assert _ulps(got, want) <= 1.0
        assert (got == want).float().mean().item() > 0.95


def test_rows_are_independent_and_strided_rows_are_read_in_place():
    base = torch.randn(6, 40)
    x = base[:, :24]                                  # rows strided by 40
    w = torch.rand(24) + 0.5
    got = rms_norm_triton(x, w, 1e-5)
    assert torch.allclose(got, rms_norm_ref(x.contiguous(), w, 1e-5), atol=1e-6, rtol=1e-6)
    x2 = x.clone()
    x2[3] = 100.0
    again = rms_norm_triton(x2, w, 1e-5)
    assert torch.equal(again[[0, 1, 2, 4, 5]], got[[0, 1, 2, 4, 5]])


def test_empty_input_and_bad_arguments():
    assert rms_norm_triton(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    with pytest.raises(KernelArgumentError):
        rms_norm_triton(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(KernelArgumentError):
        rms_norm_triton(torch.randn(8, 2).t(), torch.ones(8), 1e-6)       # last dimension strided


def test_the_model_takes_the_kernels_only_for_inference_where_triton_runs(monkeypatch):
    """specd.models.layers: the kernels where ``fused_elementwise`` says so (where Triton
    runs, here the interpreter) and no gradient is wanted (they have no backward: drafter training
    differentiates these layers); the torch formula else."""
    import sys

    from specd.models import layers

    calls = []
    for name in ("rms_norm", "rotary"):         # the one-launch kernels, behind the modules' dispatchers
        module = sys.modules[f"kvspec_kernels.{name}"]
        real = getattr(module, f"{name}_triton")
        monkeypatch.setattr(module, f"{name}_triton",
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    norm = layers.RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    monkeypatch.delenv("KVSPEC_TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("KVSPEC_FUSED", "1")
    with torch.no_grad():
        norm(x)
    assert calls == []                                                   # CPU: the reference
    monkeypatch.setenv("KVSPEC_TRITON_INTERPRET", "1")
    with torch.no_grad():
        norm(x)
    assert calls == ["rms_norm"]
    calls.clear()
    norm(x)                                                              # the weight's gradient wanted
    norm(x.requires_grad_())                                             # and the input's: the reference
    with torch.no_grad():
        norm(x)
    assert calls == ["rms_norm"]
    calls.clear()
    monkeypatch.delenv("KVSPEC_FUSED")                                   # on by default
    with torch.no_grad():
        norm(x)
    assert calls == ["rms_norm"]
    calls.clear()
    monkeypatch.setenv("KVSPEC_FUSED", "0")                              # off on request
    with torch.no_grad():
        norm(x)
    assert calls == []


def test_a_tiny_model_forward_fused_and_unfused(monkeypatch):
    """A tiny Qwen-shaped model (fp32) gives the same hidden states through the kernels as through the
    torch formulas, and the kernels did run."""
    from bench.gpu_profile import random_model, rows_step
    from kvspec_kernels.paged_attention import paged_attention_ref
    from specd.engine.model_runner import device_inputs
    from specd.engine.paged_backend import PagedAttentionBackend

    torch.manual_seed(0)
    model = random_model("tiny", "cpu", torch.float32)
    cfg = model.config
    pool = torch.zeros(8, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    backend = PagedAttentionBackend(pool, cfg.attn_scale)
    step = rows_step([(0, 9), (0, 5)])
    inputs = device_inputs(step, [], torch.device("cpu"))
    monkeypatch.setattr("kvspec_kernels.paged_attention", lambda q, k, v, bt, cu, sl, scale, **kw:
                        paged_attention_ref(q, k, v, bt, cu, sl, scale, kw.get("sliding_window")))
    monkeypatch.setattr("kvspec_kernels.append_kv", __import__("kvspec_kernels").append_kv_ref)
    import sys

    launches = []
    for name in ("rms_norm_triton", "rotary_triton"):
        module = sys.modules[f"kvspec_kernels.{name.removesuffix('_triton')}"]
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: launches.append(_name) or _real(*a))
    out = {}
    for mode in ("fused", "unfused"):
        monkeypatch.setenv("KVSPEC_TRITON_INTERPRET", "1")
        monkeypatch.setenv("KVSPEC_FUSED", "1" if mode == "fused" else "0")
        backend.set_step(inputs.meta)
        with torch.inference_mode():
            out[mode] = model(inputs.input_ids, inputs.positions, backend).hidden
    assert torch.allclose(out["fused"], out["unfused"], atol=1e-4, rtol=1e-4)
    # one norm pair per layer plus the final norm, one rotary for q and one for k per layer, once (fused)
    layers = model.config.num_layers
    assert launches.count("rms_norm_triton") == 2 * layers + 1 and launches.count("rotary_triton") == 2 * layers
