"""Decoder model code (Llama, Qwen2, Qwen3) in plain torch; see docs/design/models.md."""
from specd.models.config import ModelConfig, UnsupportedModelError
from specd.models.contiguous import ContiguousKV
from specd.models.decoder import BackendWindowError, DecoderModel, ModelOutput
from specd.models.layers import AttentionBackend

__all__ = ["AttentionBackend", "BackendWindowError", "ContiguousKV", "DecoderModel", "ModelConfig", "ModelOutput", "UnsupportedModelError"]
