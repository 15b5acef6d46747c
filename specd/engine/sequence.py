"""One request's state inside the engine. Mutated only by the scheduler and the engine step."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvd.types import BlockHash, BlockId, LeaseId
from specd.engine.detokenizer import Detokenizer
from specd.engine.gate_records import Acceptance
from specd.engine.request import Request, Usage


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # admitted to the queue, no blocks yet
    PARKED = "parked"        # holds a cache hit whose promotion to the GPU has not landed yet
    RUNNING = "running"      # holds blocks; prefilling (in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Compared by identity: a sequence is one live request, never equal to another."""

    request: Request
    detok: Detokenizer
    generator: torch.Generator | None          # per-request RNG (seeded requests are reproducible)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[BlockId] = field(default_factory=list)
    block_leases: list[LeaseId | None] = field(default_factory=list)   # allocate lease per block; None = hit
    leases: list[LeaseId] = field(default_factory=list)
    # hashes[i] is the chained hash of full block i of the token stream (prompt + output)
    hashes: list[BlockHash] = field(default_factory=list)
    num_hit_blocks: int = 0                     # leading blocks that came from a cache lookup
    num_committed_blocks: int = 0               # blocks published to the cache (prefix of block_table)
    num_cached_tokens: int = 0                  # prompt tokens whose KV came from the cache
    num_computed_tokens: int = 0                # tokens whose KV is in the pool
    first_token_s: float | None = None
    admitted_s: float | None = None             # when the scheduler first ran it (after waiting and parking)
    parked_total_s: float = 0.0                 # time parked on kvd promotions before that
    draft_feats: torch.Tensor | None = None     # [n, d] fused target features not yet absorbed by the drafter
    draft_ctx: Any = None                       # the drafter's DraftContext: K/V of the absorbed positions
    ngram_index: Any = None                     # prompt lookup's NgramIndex over all_ids (ngram requests only)
    num_draft_published: int = 0                # leading blocks of draft_ctx in kvd's draft group (or hit there)
    spec_verifications: int = 0                 # verify passes that carried drafts for this sequence
    spec_drafted: int = 0
    spec_accepted: int = 0
    gate_acceptance: Acceptance = field(default_factory=Acceptance)   # its drafting steps, for the spec gate
    gate_key: str | None = None                 # its spec gate cell family (None: not gated), set at admission
    auto_choice: tuple | None = None            # admitted as auto: (chooser or None, prompt class, load bucket,
                                                # sent to measure its method: ``Choice.measures``), the chooser
                                                # that chose its method, told its decode rate when it finishes
    batch_steps: int = 0                        # auto requests: steps it emitted in, and over them the sum of the
    batch_own: float = 0.0                      # share of the batch on its own method and of the batch's size
    batch_size_sum: int = 0                     # (``SpecEngine._count_batch``; ``MethodChoice.observe``'s mix, load)
    method: str = "none"                        # its speculation method: the request's, else the deployment's,
                                                # set at admission; an attribute, not a lookup: every step's
                                                # walks over the batch read it (timed alone, 4.3 → 2.1 µs a
                                                # walk of 32; the CPU rest probe did not resolve it from noise)
    prompt_captures: bool | None = None         # the gate's answer for its prefill's first chunk (None: not
                                                # asked yet); the later chunks follow it (``_rest_prompts``)
    prompt_forced: bool = False                 # captured only by ``SpecGate.capture_prompts``: absorbing it
                                                # at a rest is that setting's cost, not drafting's (``_rest``)
    finish_reason: str | None = None
    parked_s: float | None = None               # when its hit's promotion was found still in flight
    skip_lookup: bool = False                   # gave up a hit that did not land: recompute the prompt
    queued_s: float | None = None               # when the scheduler first queued it (its prompts' aging clock)
    room_cut_blocks: int = 0                    # its last lookup's blocks kvd holds but had no GPU room for
    room_wait_s: float | None = None            # when it first waited for GPU room to take its whole hit
    room_tried_at: int = -1                     # the scheduler's release count at its last cut lookup

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def all_ids(self) -> list[int]:
        """A new list of every token: O(context). The step's hot paths read ``ids`` or ``last_id``."""
        return self.request.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (0 ≤ start ≤ end): per step and sequence,
        the concatenation cost O(context), ~50 µs at 22k tokens, several times per step."""
        prompt = self.request.prompt_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return prompt[start:] + self.output_ids[:end - n]

    @property
    def last_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.request.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def reset_computed(self) -> None:
        """Forget all computed KV (preemption, kvd re-attach): it will be recomputed, features too."""
        self.num_computed_tokens = 0
        self.draft_feats = None
        self.draft_ctx = None
        self.num_draft_published = 0
        self.prompt_captures = None
        self.prompt_forced = False

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet: 1 when decoding, more while (re)filling the prompt."""
        return self.num_tokens - self.num_computed_tokens

    def usage(self) -> Usage:
        ttft = None if self.first_token_s is None else self.first_token_s - self.request.arrival_s
        queue = None if self.admitted_s is None else self.admitted_s - self.request.arrival_s
        return Usage(
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.num_cached_tokens,
            ttft_s=ttft,
            queue_s=queue,
            parked_s=self.parked_total_s,
            speculation=None if not self.spec_verifications and self.auto_choice is None else {
                "verifications": self.spec_verifications, "drafted_tokens": self.spec_drafted,
                "accepted_tokens": self.spec_accepted,
                **({"method": self.method} if self.auto_choice is not None else {})},   # auto: which one ran
        )
