"""Per-request sampling settings, validated once at the edge (IPC or HTTP) so the engine can trust them."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request samples. Unknown fields are rejected: a typo must not silently become a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(128, ge=1, le=1 << 20, description="Generated tokens at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 disables.")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="Per-request RNG seed, for reproducible samples.")
    stop: list[str] = Field(default_factory=list, description="Stop strings; not included in the output.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop tokens besides EOS.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")

    @field_validator("stop")
    @classmethod
    def _stops_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
