"""Copy named checkpoint tensors into a DecoderModel, strictly: every parameter exactly once.

A missing or unexpected tensor is a loader bug or a foreign checkpoint; both must fail at load time,
not produce a model that silently runs with uninitialised weights.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable

import torch
from torch import Tensor

from specd.models.decoder import DecoderModel


class CheckpointError(ValueError):
    """The checkpoint does not match the model built from its own config."""


def fill_model(model: DecoderModel, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy each (name, tensor) into the parameter of that name (dtype/device converted)."""
    params = dict(model.named_parameters())  # tied lm_head is deduplicated into embed_tokens.weight
    seen: set[str] = set()
    with torch.no_grad():
        for name, value in tensors:
            if name not in params:
                raise CheckpointError(f"unexpected tensor {name!r}")
            if tuple(value.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(value)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def sample_file(path: str | os.PathLike, start: int, n_samples: int = 16, chunk: int = 4096) -> bytes:
    """Digest of the file size plus `n_samples` evenly spaced chunks after `start` (cheap: 64 KiB read).

    Feeds the model fingerprint: header bytes alone cannot tell apart two fine-tunes of one base.
    """
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    span = max(size - start - chunk, 0)
    with open(path, "rb") as f:
        for i in range(n_samples):
            f.seek(start + span * i // max(n_samples - 1, 1))
            h.update(f.read(chunk))
    return h.digest()
