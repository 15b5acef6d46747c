"""`load_model(path, dtype, device) -> (model, tokenizer)`: one entry point for GGUF files and HF directories."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from specd.loader.gguf import load_gguf
from specd.loader.hf import load_hf
from specd.loader.weights import CheckpointError
from specd.models.decoder import DecoderModel
from specd.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" means bf16 on CUDA and fp32 on the CPU (CPU bf16 matmuls are slow and less exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (have auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> tuple[DecoderModel, Tokenizer]:
    """A GGUF file, an HF directory (config.json + *.safetensors + tokenizer.json), or a random-weights
    directory (specd/loader/random_weights.py: timing only), in eval mode."""
    path = Path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dt, dev)
    if path.is_dir():
        from specd.loader.random_weights import is_random_dir, load_random   # lazy: `python -m` runs it as a script
        if is_random_dir(path):
            return load_random(path, dt, dev)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf(path, dt, dev)
    raise CheckpointError(f"{path} is neither a .gguf file nor a directory with config.json (or random_weights.json)")


__all__ = ["load_model", "resolve_device", "resolve_dtype", "CheckpointError"]
