"""Continuous batching: which sequences run this step, and how many tokens each computes.

Decoding sequences go first (one token each, so latency stays flat), then prompt chunks fill the rest
of the token budget (chunked prefill: a long prompt never stalls the decoders for a whole prefill).
When blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed later, usually from the cache, since its full blocks were published.

Promotions never stop the engine: a prompt whose cache hit is still being copied up from DRAM/NVMe
is *parked* (it keeps its lookup lease, nothing more) while everything else steps on. Each step
takes the readiness answers that have arrived without waiting; a parked sequence whose promotion
landed goes back to the head of the queue (its place in FCFS order; later arrivals ran meanwhile),
one whose promotion failed, or that waited ``park_limit_s``, gives up its hit and recomputes.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

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

    # One token that samples the next: a decode step's sequence (drafts may be verified after it). Set once,
    # when scheduled: the gate asks it of every sequence in each step with prompt chunks, and as a property
    # walking two more it was ~5 µs of such a step at c = 32 on the CPU machine. Scheduling is final for
    # the step (preemption takes only unscheduled sequences), so the answer cannot change before the forward.
    decodes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.decodes = self.num_tokens == 1 and self.samples


PARK_LIMIT_S = 2.0   # past this a promotion is slower than recomputing all but the longest prompts


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 park_limit_s: float = PARK_LIMIT_S):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.park_limit_s = park_limit_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []        # hits whose promotions are in flight, in arrival order
        self.num_preemptions = 0
        self.counters: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.parked:
            self.parked.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def only_parked(self) -> bool:
        """Every sequence waits on a promotion: a step can do nothing but poll for the answers."""
        return bool(self.parked) and not self.waiting and not self.running

    def schedule(self) -> list[ScheduledSeq]:
        self.blocks.take_arrived()
        self._unpark()
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
        looked = self._look_up_admissions(budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._needs_lookup(seq, looked):        # past the batched lookup's estimate
                self.blocks.match_prefix(seq)
                if self._parked_on_lookup(seq):
                    continue
            chunk = min(seq.num_pending, budget)
            try:
                self.blocks.ensure_slots(seq, chunk)
            except OutOfBlocks:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.admitted_s is None:
                seq.admitted_s = time.monotonic()
            self.running.append(seq)
            out.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        return out

    def _look_up_admissions(self, budget: int) -> set[int]:
        """Look up, in one kvd round trip, the waiting prompts this step will likely admit: the head of
        the queue, up to the free seats and until their uncached tokens fill ``budget`` (an estimate:
        hits leave room for more, which then look up one by one). Each hit's promotion state is handled
        at once, so no sequence keeps a hit that was never checked to have landed. Returns the ids of
        the sequences looked up (a miss has an empty table too, and must not ask again this step)."""
        seats = self.max_num_seqs - len(self.running)
        asking, tokens = [], 0
        for seq in self.waiting:
            if len(asking) >= seats or tokens >= budget:
                break
            if self._needs_lookup(seq, set()):
                asking.append(seq)
            tokens += seq.num_pending
        if len(asking) < 2:
            return set()
        self.blocks.match_prefixes(asking)
        for seq in asking:
            self._parked_on_lookup(seq, self.waiting.index(seq))
        return {id(seq) for seq in asking}

    @staticmethod
    def _needs_lookup(seq: Sequence, looked: set[int]) -> bool:
        return not seq.block_table and not seq.skip_lookup and id(seq) not in looked

    def _parked_on_lookup(self, seq: Sequence, at: int = 0) -> bool:
        """After a lookup: park ``seq`` (at queue position ``at``) if its hit is still being promoted,
        drop a hit that never will land; returns whether it was parked."""
        landed = self.blocks.hit_landed(seq)
        if landed is None:
            del self.waiting[at]
            self._park(seq)
            return True
        if not landed:
            self._give_up(seq)
        return False

    def expected_blocks(self) -> int:
        """Blocks the next step will likely take: its prompt chunks (what is left to compute of running
        and waiting prompts, up to the token budget) plus decode growth (about one block per
        ``block_size`` running sequences). Sizes the reserve refill posted during the forward."""
        bs = self.blocks.block_size
        tokens = 0
        for seq in (*self.running, *self.waiting):
            if tokens >= self.max_num_batched_tokens:
                break
            tokens += seq.num_pending
        return -(-min(tokens, self.max_num_batched_tokens) // bs) + -(-len(self.running) // bs)

    def _park(self, seq: Sequence) -> None:
        seq.status, seq.parked_s = SeqStatus.PARKED, time.monotonic()
        self.parked.append(seq)
        self.counters["parked_total"] += 1

    def _unpark(self) -> None:
        """Requeue, at the head of the queue, the parked sequences whose hits landed (used as they are)
        or will not land in time (dropped: recomputed)."""
        if not self.parked:
            return
        self.blocks.poll()
        now = time.monotonic()
        back = []
        for seq in self.parked:
            landed = self.blocks.hit_landed(seq)
            waited = now - seq.parked_s
            if landed is None and waited < self.park_limit_s:
                continue
            if landed:
                self.counters["parked_admitted_total"] += 1
            else:
                self._give_up(seq)
            self.counters["parked_seconds_total"] += waited
            seq.parked_total_s += waited
            self.counters["parked_seconds_max"] = max(self.counters["parked_seconds_max"], waited)
            back.append(seq)
        self.parked = [seq for seq in self.parked if seq not in back]
        for seq in reversed(back):
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def _give_up(self, seq: Sequence) -> None:
        """Drop a hit that will not land (in time): the prompt is recomputed, never read from it."""
        self.blocks.drop_hit(seq)
        seq.skip_lookup = True
        self.counters["parked_giveups_total"] += 1

    def stats(self) -> dict[str, float]:
        """Parked admissions: how many, how they ended, how long they waited (seconds)."""
        keys = ("parked_total", "parked_admitted_total", "parked_giveups_total", "parked_seconds_total",
                "parked_seconds_max")
        return {**{k: self.counters[k] for k in keys}, "requests_parked": len(self.parked)}

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
        seq.status, seq.skip_lookup = SeqStatus.WAITING, False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
