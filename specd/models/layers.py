"""Building blocks of the Llama/Qwen decoder: RMSNorm, rotary embedding, SwiGLU MLP, attention.

Every block works on flat token-major tensors ([T, ...], all sequences of a step concatenated), so a
ragged batch needs no padding: positions carry each token's place in its own sequence.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kvspec_kernels as kernels
from kvspec_kernels.rms_norm import MAX_DIM
from specd.models.config import ModelConfig


class AttentionBackend(Protocol):
    """Owns the KV layout and the step's sequence boundaries (see docs/design/interfaces.md).

    It also owns each layer's attention span: a backend for a model with sliding-window layers carries
    `windows` (one W or None per layer, equal to `config.layer_windows`; DecoderModel checks) and looks
    the window up by `layer`, so the model code never passes a mask.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D], already rotated. Returns [T, Hq, D]."""
        ...


def _no_gradient(*tensors: Tensor) -> bool:
    """May these layers take the dispatching kernels (``kernels.rms_norm``, ``kernels.rotary``: the
    one-launch Triton kernel where ``kernels.fused_elementwise`` says so: where Triton runs, unless
    ``KVSPEC_FUSED=0``; else the torch formula)? Only when no gradient is wanted: the kernels have no backward, and
    drafter training differentiates these layers."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in fp32 and cast back (as transformers does, so bf16 matches).
    On CUDA, for inference, one Triton launch with the same rounding (kvspec_kernels/rms_norm.py; ``KVSPEC_FUSED=0``
    turns it off)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # x: [..., dim]
        if x.shape[-1] <= MAX_DIM and x.stride(-1) == 1 and _no_gradient(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.rms_norm_ref(x, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE tables from explicit positions, in the HF "rotate_half" pairing (dim i with i + D/2).

    GGUF llama checkpoints are stored for the interleaved pairing; the GGUF loader un-permutes Q/K
    rows so this single pairing is right for every checkpoint. inv_freq is a plain fp32 attribute, not
    a buffer, so `model.to(bfloat16)` cannot round the frequencies (that would shift long positions).
    """

    def __init__(self, config: ModelConfig, device: str | torch.device | None = None):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
        if config.rope_type == "linear":
            inv_freq = inv_freq / config.rope_factor
        self.inv_freq = inv_freq.float()

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D] in `dtype` (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]        # [T, D/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]               # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] (the drafters pass batched shapes, which take the torch formula).
    On CUDA, for inference, one Triton launch with the same rounding (kvspec_kernels/rotary.py; ``KVSPEC_FUSED=0``
    turns it off)."""
    if (x.dim() == 3 and cos.shape == (x.shape[0], 1, x.shape[2]) and x.stride(-1) == 1
            and cos.stride(-1) == 1 and sin.stride(-1) == 1 and _no_gradient(x)):
        return kernels.rotary(x, cos, sin)
    return kernels.rotary_ref(x, cos, sin)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: [T, d]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Q/K/V projections (+ Qwen2 bias, + Qwen3 per-head q/k RMSNorm), RoPE, backend call, output proj.

    The attention itself (softmax over the KV history) belongs to the backend, which knows where each
    sequence's cached keys live; this module only prepares rotated q, k, v for it.
    """

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.hq, self.hkv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.d, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        t = x.shape[0]                                                    # x: [T, d]
        q = self.q_proj(x).view(t, self.hq, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attn(self.layer, q, k, v)                                   # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.hq * self.d))
