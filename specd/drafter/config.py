"""DrafterConfig: what a drafter is (method, block size, fused target layers, heads) plus the backbone
shapes it copies from its target.

The drafter's transformer layers have the target's shapes (DESIGN.md §5), so the config carries the
target's hidden size, heads, KV heads, head_dim, intermediate size and RoPE settings. Two facts are
chosen here once and must never change for a trained drafter, because the weights depend on them:
the fused target layers and the MASK token id (see `default_mask_token_id`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from specd.models.config import ModelConfig

METHODS = ("dspark", "dflash", "eagle3", "ngram")
FUSED_LAYERS = {"dspark": 5, "dflash": 5, "eagle3": 3, "ngram": 0}

# First embedding rows that no tokenizer piece uses, so a MASK id never collides with real text.
# Qwen3: 151669 is the id DeepSpec's released checkpoints use (right after </think> = 151668).
# Qwen2.5: its tokenizer ends at <|file_sep|> = 151664, so 151665 is the first padding row.
_QWEN_MASK_IDS = {"qwen3": 151669, "qwen2": 151665}


class DrafterConfigError(ValueError):
    """A drafter config that cannot describe a working drafter (bad method, layer list or MASK id)."""


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    method: str                          # "dspark" | "dflash" | "eagle3" | "ngram"
    gamma: int = 7                       # tokens proposed per verification (block size)
    num_layers: int = 1                  # draft transformer layers (dspark/dflash); eagle3 is 1
    target_layers: tuple[int, ...] = ()  # target layer outputs that are fused, in this order
    markov_rank: int = 256               # 0 disables the Markov head (dflash)
    confidence: bool = True              # confidence head on [h_k ; W1[x_{k-1}]] (needs markov_rank > 0)
    mask_token_id: int = 0               # id embedded at block slots 1..gamma-1 (see default_mask_token_id)
    ngram_max: int = 4                   # n-gram: longest suffix tried first
    # backbone shapes, copied from the target's ModelConfig by for_target
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise DrafterConfigError(f"method {self.method!r} unknown (have {METHODS})")
        if self.gamma < 1:
            raise DrafterConfigError(f"gamma must be >= 1, got {self.gamma}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterConfigError(f"mask_token_id {self.mask_token_id} outside vocab [0, {self.vocab_size})")
        if self.markov_rank < 0:
            raise DrafterConfigError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.confidence and (self.method != "dspark" or self.markov_rank == 0):
            raise DrafterConfigError("the confidence head reads W1[x_{k-1}]: only dspark with markov_rank > 0 has it")
        if self.method == "eagle3" and self.num_layers != 1:
            raise DrafterConfigError("eagle3 has exactly one decoder layer")
        if self.method != "ngram":
            self._check_layers()

    def _check_layers(self) -> None:
        layers = list(self.target_layers)
        if not layers or sorted(set(layers)) != layers or layers[0] < 0:
            raise DrafterConfigError(f"target_layers must be distinct, increasing and >= 0, got {layers}")

    def backbone(self) -> ModelConfig:
        """The draft layers' shapes as a ModelConfig, so specd.models.layers (RMSNorm, Rotary, MLP) apply."""
        return ModelConfig(
            arch="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_type=self.rope_type, rope_factor=self.rope_factor,
            max_position_embeddings=self.max_position_embeddings, qk_norm=True,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "DrafterConfig":
        d = dict(d)
        d["target_layers"] = tuple(d.get("target_layers", ()))
        return DrafterConfig(**d)

    @staticmethod
    def for_target(target_config: ModelConfig, method: str, **overrides: Any) -> "DrafterConfig":
        """A drafter for `target_config` with the method's defaults; `overrides` win over every default.

        dflash: markov_rank 0, no confidence (DeepSpec's DFlash baseline). eagle3: one layer, 3 fused
        layers, no Markov/confidence head. ngram: no weights (shapes kept only to size the probs).
        """
        if method not in METHODS:
            raise DrafterConfigError(f"method {method!r} unknown (have {METHODS})")
        t = target_config
        fields: dict[str, Any] = dict(
            method=method, vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_type=t.rope_type,
            rope_factor=t.rope_factor, max_position_embeddings=t.max_position_embeddings,
            mask_token_id=default_mask_token_id(t),
            target_layers=default_target_layers(t.num_layers, FUSED_LAYERS[method]),
        )
        if method != "dspark":
            fields.update(markov_rank=0, confidence=False)
        fields.update(overrides)
        if "target_layers" in overrides:
            fields["target_layers"] = tuple(overrides["target_layers"])
        bad = [i for i in fields["target_layers"] if i >= t.num_layers - 1]
        if bad:
            raise DrafterConfigError(
                f"target layers {bad} include the last layer (or beyond) of a {t.num_layers}-layer target")
        return DrafterConfig(**fields)


def default_target_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly over 1..L-3, as DFlash and DeepSpec do (Qwen3-8B, L=36: 1,9,17,25,33).

    Never the last layer (its HF hidden state is final-normed). Small targets widen the range to
    1..L-2, then 0..L-2, and fuse fewer layers when even that is too short (stories260K, L=5: 0,1,2,3).
    """
    if count == 0:
        return ()
    for lo, hi in ((1, num_layers - 3), (1, num_layers - 2), (0, num_layers - 2)):
        if hi - lo + 1 >= count:
            return tuple(int(x) for x in np.rint(np.linspace(lo, hi, count)))
    return tuple(range(0, max(num_layers - 1, 1)))


def default_mask_token_id(target_config: ModelConfig) -> int:
    """The MASK id: an embedding row no text ever produces.

    Qwen targets with the padded 151936-row vocab use their first unused row (DeepSpec's 151669 for
    Qwen3). Llama/SentencePiece targets use id 0, `<unk>`, which generation never emits. The MASK
    embedding is the target's (frozen) row: the drafter learns to read it, so changing the id needs
    retraining.
    """
    qwen_id = _QWEN_MASK_IDS.get(target_config.arch)
    if qwen_id is not None and qwen_id < target_config.vocab_size:
        return qwen_id
    return 0
