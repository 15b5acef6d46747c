"""What goes into and comes out of the engine: plain data, no sockets."""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.sampling_params import SamplingParams


@dataclass
class Request:
    """One generation request as the engine sees it: already tokenized and validated."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    session: str | None = None
    arrival_s: float = 0.0
    speculation: str | None = None     # per-request method override ("none" turns it off)
    # per-request overrides of EngineConfig.spec_schedule ("confidence" | "fixed" | "gated") and of γ (drafts per
    # verification, at most the drafter's block); None = the deployment's. Checked by engine.add_request.
    spec_schedule: str | None = None
    num_speculative_tokens: int | None = None
    # (token_count, BlockKind) spans from token 0: the system prompt, then the tool schemas
    # (specd/engine/hints.py turns them into per-block kinds for kvd); None = all conversation
    prefix_kinds: list[tuple[int, int]] | None = None
    expected_return_s: float | None = None   # the client's own guess of its think time; else learned


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens served from kvd instead of prefilled
    ttft_s: float | None = None     # engine-side time to first token
    queue_s: float | None = None    # of it, before the first scheduled step (waiting, kvd lookups, parked)
    parked_s: float = 0.0           # of that, parked on kvd promotions
    speculation: dict | None = None  # {verifications, drafted_tokens, accepted_tokens} when speculation ran


@dataclass
class RequestOutput:
    """The delta a step produced for one request. ``finished`` comes once, with the final usage."""

    id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    usage: Usage = field(default_factory=Usage)
    error: str | None = None
