"""Per-request sampling settings, validated once at the edge (IPC or HTTP) so the engine can trust them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class SpeculationParams(BaseModel):
    """A request's own speculative decoding settings; each unset field keeps the deployment's.

    The HTTP body's ``"speculation": {...}`` and the IPC ``generate`` message carry it (IPC also takes the
    plain method string). What depends on the loaded drafters (is the method served, is γ within its
    block, does it have a confidence head) is checked by the engine at admission."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none", "ngram", "dspark", "dflash", "eagle3", "auto"] | None = Field(
        None, description="Speculation method; 'none' turns speculation off for this request; 'auto' lets the "
                          "engine pick one of its auto_methods by what ran fastest for this kind of prompt.")
    schedule: Literal["confidence", "fixed", "gated"] | None = Field(
        None, description="confidence: the causal scheduler picks how many drafts to verify; fixed: all of them, "
                          "every step; gated: all of them, in the steps where drafting is measured faster.")
    num_speculative_tokens: int | None = Field(None, ge=1, le=32, description="γ: drafts proposed per step.")

    @model_validator(mode="after")
    def _knobs_need_speculation(self) -> "SpeculationParams":
        if self.method == "none" and (self.schedule is not None or self.num_speculative_tokens is not None):
            raise ValueError("'schedule' and 'num_speculative_tokens' need a speculation method other than 'none'")
        if self.method == "auto" and (self.schedule is not None or self.num_speculative_tokens is not None):
            raise ValueError("'auto' picks the method and its schedule: leave 'schedule' and "
                             "'num_speculative_tokens' unset")
        return self

    def request_fields(self) -> dict:
        """The engine Request's keyword arguments for these settings."""
        return {"speculation": self.method, "spec_schedule": self.schedule,
                "num_speculative_tokens": self.num_speculative_tokens}
