"""ModelConfig: the architecture facts the decoder code needs, whatever file they came from.

Loaders (GGUF metadata, HF config.json) translate their own key names into this one dataclass, so the
model code never branches on the file format. `fingerprint` names the exact weights for the KV-cache
namespace (DESIGN.md §2): two models share cached KV only if their fingerprints are equal.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear")


class UnsupportedModelError(NotImplementedError):
    """The checkpoint uses a feature this model code does not implement (raised at load, never mid-run)."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                       # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int                # d
    intermediate_size: int          # SwiGLU inner width
    num_layers: int
    num_heads: int                  # Hq
    num_kv_heads: int               # Hkv (GQA when < Hq)
    head_dim: int                   # D
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"      # "default" | "linear"
    rope_factor: float = 1.0        # linear scaling: position / factor
    max_position_embeddings: int = 2048
    qkv_bias: bool = False          # Qwen2: True; Llama: config.attention_bias
    o_bias: bool = False            # Llama attention_bias also biases o_proj
    qk_norm: bool = False           # Qwen3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool = False
    # Per layer: sliding window W (the query at position p sees keys p - W < j <= p) or None (full
    # attention). Empty means all full; __post_init__ expands it to one entry per layer.
    layer_windows: tuple[int | None, ...] = ()
    fingerprint: str = ""           # set by the loader; see fingerprint_of()

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {self.arch!r} not supported (have {ARCHITECTURES})")
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling {self.rope_type!r} not implemented (have {ROPE_TYPES}); refusing to run with wrong positions"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        object.__setattr__(self, "layer_windows", self._checked_windows())

    def _checked_windows(self) -> tuple[int | None, ...]:
        """One window per layer, each None or a positive int (W = 0 would leave a query no key)."""
        windows = tuple(self.layer_windows) or (None,) * self.num_layers
        if len(windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries for {self.num_layers} layers")
        if any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"sliding windows must be positive ints or None, got {windows}")
        return windows

    @property
    def has_sliding_window(self) -> bool:
        """True when some layer attends over a window instead of the whole prefix."""
        return any(w is not None for w in self.layer_windows)

    @property
    def attn_scale(self) -> float:
        """Softmax scale every attention backend must use: 1/sqrt(head_dim)."""
        return self.head_dim ** -0.5

    def arch_dict(self) -> dict[str, Any]:
        """The fields that define the computation (everything but the fingerprint)."""
        d = dataclasses.asdict(self)
        d.pop("fingerprint")
        return d


def fingerprint_of(config: ModelConfig, tensors: Iterable[tuple[str, tuple[int, ...], str]], content: bytes) -> str:
    """A stable 128-bit hex id of (architecture, tensor names/shapes/dtypes, weight content sample).

    `content` is a cheap digest of the weight file(s) chosen by the loader: the GGUF header and
    metadata bytes or safetensors JSON headers, the file sizes, and a fixed sample of data bytes (so
    two fine-tunes with identical headers still differ). It never uses mtimes or paths, so copying a
    model to another machine keeps its cache namespace.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(config.arch_dict(), sort_keys=True).encode())
    for name, shape, dtype in sorted(tensors):
        h.update(f"{name}:{list(shape)}:{dtype};".encode())
    h.update(content)
    return h.hexdigest()
