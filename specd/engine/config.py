"""Engine settings: one typed model, embedded in specd's daemon config (specd/config.py)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
TRAINED_METHODS = ("dspark", "dflash", "eagle3")    # the methods that need a drafter directory
SCHEDULES = ("confidence", "fixed", "gated")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path = Field(DEFAULT_MODEL, description="GGUF file or Hugging Face directory of the target model (or a random-weights directory, for timing only: specd/loader/random_weights.py).")
    dtype: str = Field("auto", description="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16.")
    device: str = Field("auto", description="auto, cpu or cuda.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block; must match kvd's namespace.")
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Requests decoded together in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one step; long prompts are prefilled in chunks of this size."
    )
    prefill_order: str = Field(
        "arrival", pattern="^(shortest|arrival)$",
        description="Which prompts fill a step's token budget first (after the decoders): arrival (first come, "
                    "first served) or shortest (fewest tokens left to compute once cache hits are known). "
                    "Measured on the 8B agentic load (docs/results/kv.md, runs BP and BQ), shortest did not "
                    "lower mean TTFT beyond noise and raised p95, so it is not the default.",
    )
    prefill_starve_s: float = Field(
        1.0, ge=0.0, description="With prefill_order=shortest: a prompt queued this long goes in arrival "
                                 "order, so a long prompt is never starved by a stream of short ones.",
    )
    max_model_len: int | None = Field(None, ge=1, description="Context limit; defaults to the model's.")
    kvd_run_dir: Path | None = Field(
        None, description="Where kvd's sockets live; None disables the shared cache (local blocks only)."
    )
    num_local_blocks: int = Field(
        2048, ge=1, description="KV blocks of the local pool, used when kvd is off or unreachable."
    )
    cuda_graphs: bool = Field(
        True, description="Capture every target step shape (decode, verify, prefill chunks) in CUDA graphs on the GPU."
    )
    spec_warmup: bool = Field(
        True, description="With cuda_graphs on the GPU: load the deployment's speculation methods (speculation, "
                          "drafters) at start and capture every decode, verify and draft-round shape a loaded "
                          "method can produce when it loads, so no request waits on a capture. Off: capture "
                          "on first use (fast start).",
    )
    tenant_salt: str = Field("", description="Cache namespace salt: blocks are shared only within one salt.")
    speculation: str = Field(
        "none", pattern="^(none|ngram|dspark|dflash|eagle3|auto)$",
        description="Speculative decoding method for requests that do not choose one. auto: each request "
                    "runs one of auto_methods, the one whose requests of its prompt class decoded fastest at "
                    "the load it starts at (specd/engine/method_choice.py).",
    )
    auto_methods: str = Field(
        "dspark,ngram", pattern="^(ngram|dspark|dflash|eagle3)(,(ngram|dspark|dflash|eagle3))*$",
        description="The methods an auto request chooses among, comma-separated, ties to the first. Those the "
                    "deployment cannot serve (no drafter) are left out; each runs behind the measured gate "
                    "(the confidence schedule where its drafter has a confidence head, else gated).",
    )
    num_speculative_tokens: int = Field(7, ge=1, le=32, description="Draft tokens proposed per verification (gamma).")
    drafter: Path | None = Field(None, description="Trained drafter directory (dspark, dflash, eagle3); its "
                                                   "method is the one in its drafter.json.")
    drafters: dict[str, Path] = Field(
        default_factory=dict,
        description="One trained drafter per method, so one engine serves every method and each request "
                    "picks its own: {method: directory}, or the flag form dspark=DIR,dflash=DIR. A method "
                    "listed here wins over `drafter`.",
    )
    spec_schedule: str | None = Field(
        None, pattern="^(confidence|fixed|gated)$",
        description="Drafts verified per request: confidence (the causal scheduler, needs a drafter with a "
                    "confidence head; the measured gate decides whether to draft at all), fixed (all "
                    "num_speculative_tokens, every step) or gated (all of them, in the steps where the measured "
                    "gate finds drafting faster: any method, ngram included). None: confidence when the drafts "
                    "carry confidences, fixed otherwise.",
    )

    @field_validator("drafters", mode="before")
    @classmethod
    def _parse_drafters(cls, value: object) -> object:
        """Accept the flag / env form ``method=DIR,method=DIR`` besides a mapping."""
        if isinstance(value, str):
            pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
            if any(len(pair) != 2 or not pair[0].strip() or not pair[1].strip() for pair in pairs):
                raise ValueError(f"drafters must read method=DIR,method=DIR, got {value!r}")
            value = {m.strip(): d.strip() for m, d in pairs}
        return value

    @field_validator("drafters")
    @classmethod
    def _known_methods(cls, value: dict[str, Path]) -> dict[str, Path]:
        bad = sorted(set(value) - set(TRAINED_METHODS))
        if bad:
            raise ValueError(f"drafters: {bad} are not trained methods ({', '.join(TRAINED_METHODS)})")
        return value

    def drafter_for(self, method: str) -> Path | None:
        """The drafter directory (or weights file) that serves ``method``, if configured."""
        return self.drafters.get(method, self.drafter)
