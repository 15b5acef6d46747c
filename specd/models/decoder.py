"""DecoderModel: the Llama / Qwen2 / Qwen3 decoder stack over a flat [T] batch of tokens.

Parameter names follow the HF checkpoints without their "model." prefix (embed_tokens, layers.N.self_attn.
q_proj, ..., norm, lm_head), so an HF state dict loads after stripping that prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor, nn

from specd.models.config import ModelConfig
from specd.models.layers import MLP, Attention, AttentionBackend, RMSNorm, Rotary


class BackendWindowError(ValueError):
    """The attention backend's per-layer windows differ from the model's: it would attend over the
    wrong keys on sliding-window layers and give plausible but wrong logits, so refuse instead."""


@dataclass
class ModelOutput:
    hidden: Tensor                                        # [T, d], after the final RMSNorm
    captured: list[Tensor] = field(default_factory=list)  # one [T, d] per capture_layers entry, same order


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:  # h: [T, d]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """The target model. Stateless apart from weights: all KV state lives in the attention backend.

    Capture convention (for drafters that read target features): `capture_layers=[i, ...]` returns the
    residual stream *output* of decoder layer i (0-based), before any final norm -- the tensor that is
    the input of layer i+1. This equals transformers' `output_hidden_states[i + 1]` for i < num_layers - 1
    (transformers applies the final norm to its last entry; we never do). Index -1 is not allowed.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,   # [T] int64, all sequences of the step, concatenated
        positions: Tensor,   # [T] int64, each token's position in its own sequence
        attn: AttentionBackend,
        capture_layers: Sequence[int] = (),
    ) -> ModelOutput:
        self._check_capture(capture_layers)
        self._check_windows(attn)
        h = self.embed_tokens(input_ids)                                    # [T, d]
        cos, sin = self.rotary(positions, h.dtype)
        wanted = {layer: slot for slot, layer in enumerate(capture_layers)}
        captured: list[Tensor | None] = [None] * len(capture_layers)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn)
            if i in wanted:
                captured[wanted[i]] = h
        return ModelOutput(hidden=self.norm(h), captured=captured)  # type: ignore[arg-type]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [T, d] -> [T, vocab] fp32 (matmul in the model dtype, then upcast)."""
        return self.lm_head(hidden).float()

    def _check_windows(self, attn: AttentionBackend) -> None:
        """Full-attention models accept any backend; sliding-window ones need `attn.windows` to match."""
        if self.config.has_sliding_window and tuple(getattr(attn, "windows", ())) != self.config.layer_windows:
            raise BackendWindowError(
                f"model layer windows {self.config.layer_windows} but the backend has {getattr(attn, 'windows', None)}"
            )

    def _check_capture(self, capture_layers: Sequence[int]) -> None:
        bad = [i for i in capture_layers if not 0 <= i < self.config.num_layers]
        if bad or len(set(capture_layers)) != len(capture_layers):
            raise ValueError(f"capture_layers must be distinct layer indices in [0, {self.config.num_layers}), got {list(capture_layers)}")


def empty_model(config: ModelConfig, device: str | torch.device = "cpu") -> DecoderModel:
    """A model whose parameters live on the meta device (no memory): loaders install every tensor
    with specd.loader.weights.fill_model, which fails if any is left out."""
    with torch.device("meta"):
        model = DecoderModel(config)
    model.rotary = Rotary(config, device)  # computed, not loaded: build it where the weights will live
    return model.eval()
