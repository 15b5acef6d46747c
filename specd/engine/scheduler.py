"""Continuous batching: which sequences run this step, and how many tokens each computes.

Decoding sequences go first (one token each, so latency stays flat), then prompt chunks fill the rest
of the token budget (chunked prefill: a long prompt never stalls the decoders for a whole prefill).
When blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed later, usually from the cache, since its full blocks were published.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specd.engine.speculation import Draft

from specd.engine.block_manager import BlockManager
from specd.engine.block_source import OutOfBlocks
from specd.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int          # tokens computed this step: all_ids[num_computed : num_computed + num_tokens]
    draft: Draft | None = None   # speculative tokens verified after them (decode steps only)

    @property
    def num_draft(self) -> int:
        return len(self.draft.tokens) if self.draft else 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last logits give the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        for seq in sorted(self.running, key=lambda s: s.num_pending):   # decoders (1 pending) first
            if budget == 0:
                break
            if seq not in self.running:
                continue                                  # preempted by an earlier iteration
            chunk = min(seq.num_pending, budget)
            if not self._grow(seq, chunk, out):
                continue
            out.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            chunk = min(seq.num_pending, budget)
            try:
                self.blocks.ensure_slots(seq, chunk)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        return out

    def _grow(self, seq: Sequence, chunk: int, scheduled: list[ScheduledSeq]) -> bool:
        """Make room for ``chunk`` tokens, preempting the newest sequences if needed (``seq`` itself
        when it is the newest)."""
        while True:
            try:
                self.blocks.ensure_slots(seq, chunk)
                return True
            except OutOfBlocks:
                victim = self._newest_unscheduled(scheduled)
                if victim is None:
                    return False
                self.preempt(victim)
                if victim is seq:
                    return False

    def _newest_unscheduled(self, scheduled: list[ScheduledSeq]) -> Sequence | None:
        """The latest arrival not yet in this step's batch (possibly the one asking)."""
        taken = {id(s.seq) for s in scheduled}
        for cand in reversed(self.running):
            if id(cand) not in taken:
                return cand
        return None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_computed()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
