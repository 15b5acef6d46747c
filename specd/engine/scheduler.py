"""Continuous batching: which sequences run this step, and how many tokens each computes.

Decoding sequences go first (one token each, so latency stays flat), then prompt chunks fill the rest
of the token budget (chunked prefill: a long prompt never stalls the decoders for a whole prefill).
Prompts, running and waiting alike, go in arrival order, or (``prefill_order="shortest"``) fewest tokens
left to compute first once the waiting ones' cache hits are known, with prompts that waited ``starve_s``
in arrival order ahead of them (``_rank``). When blocks run out, the newest
running sequence is preempted: its blocks are freed and it is recomputed later, usually from the cache,
since its full blocks were published.

A hit that kvd cut short for want of GPU room (every GPU block leased) is given back and asked for again
once a running sequence has released its blocks, rather than recomputed: recomputing needs the same
room (``_waits_for_room``).

Promotions never stop the engine: a prompt whose cache hit is still being copied up from DRAM/NVMe
is *parked* (it keeps its lookup lease, nothing more) while everything else steps on. Each step
takes the readiness answers that have arrived without waiting; a parked sequence whose promotion
landed goes back to the head of the queue (later arrivals ran meanwhile),
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
STARVE_S = 1.0       # a prompt waiting this long since arrival is served in arrival order, whatever its length
PREFILL_ORDERS = ("arrival", "shortest")


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 park_limit_s: float = PARK_LIMIT_S, prefill_order: str = "arrival", starve_s: float = STARVE_S):
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {prefill_order!r}")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.park_limit_s = park_limit_s
        self.prefill_order = prefill_order
        self.starve_s = starve_s
        self._releases = 0      # running sequences finished or preempted so far: when GPU room can come back
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []        # hits whose promotions are in flight, in arrival order
        self.num_preemptions = 0
        self.counters: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        if seq.queued_s is None:
            seq.queued_s = time.monotonic()
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._releases += 1                           # its blocks are freed: room may have come
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
        now = time.monotonic()
        running = list(self.running)
        waiting = self._look_up_admissions(budget - sum(s.num_pending == 1 for s in running), now)
        ranked = sorted([(s, True) for s in running] + [(s, False) for s in waiting],
                        key=lambda pair: self._rank(pair[0], now))
        admitting = True
        for seq, was_running in ranked:
            if budget == 0:
                break
            if was_running:
                if seq not in self.running:
                    continue                              # preempted by an earlier iteration
                chunk = min(seq.num_pending, budget)
                if not self._grow(seq, chunk, out):
                    continue
            else:
                if not admitting or len(self.running) >= self.max_num_seqs:
                    continue
                chunk = min(seq.num_pending, budget)
                try:
                    self.blocks.ensure_slots(seq, chunk)
                except OutOfBlocks:
                    admitting = False                     # no room left: admit nobody else this step
                    continue
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                if seq.admitted_s is None:
                    seq.admitted_s = time.monotonic()
                self.running.append(seq)
            out.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        return out

    def _rank(self, seq: Sequence, now: float) -> tuple[int, float]:
        """Step order: decoders first (one token each, so inter-token latency stays flat); then prompts
        oldest first ("arrival", the default). With "shortest": prompts that waited ``starve_s`` since
        arrival, oldest first, so no prompt waits for ever; then the rest, fewest tokens left to compute
        first, so a turn whose history came from the cache is not queued behind long recomputes. On the
        8B agentic load that did not lower mean TTFT beyond run-to-run noise and raised p95 (runs BP, BQ:
        docs/results/kv.md), which is why it is not the default."""
        if seq.num_pending <= 1:
            return (0, 0.0)
        arrived = seq.queued_s if seq.queued_s is not None else now
        if self.prefill_order == "arrival" or now - arrived >= self.starve_s:
            return (1, arrived)
        return (2, float(seq.num_pending))

    def _look_up_admissions(self, budget: int, now: float) -> list[Sequence]:
        """Look up the waiting prompts this step may admit; returns them (in queue order) once their
        cached prefixes are known, so they can be ranked by what is left to compute.

        The head of the queue goes in one kvd round trip: up to the free seats and until the prompts'
        tokens fill ``budget`` (an estimate before the lookup: hits leave room for more). Then, while
        the prompts known so far leave the budget unfilled, more are looked up one at a time. Each hit's
        promotion state is handled at once (parked while in flight, dropped if it never lands), so no
        sequence keeps a hit that was never checked to have landed; a hit cut for want of GPU room may
        be given back to wait for room (``_waits_for_room``)."""
        seats = self.max_num_seqs - len(self.running)
        queue = list(self.waiting)[:max(seats, 0)]
        asking, tokens = [], 0
        for seq in queue:
            if tokens >= budget:
                break
            if self._needs_lookup(seq):
                asking.append(seq)
            tokens += seq.num_pending
        if len(asking) >= 2:
            self.blocks.match_prefixes(asking)
        else:
            asking = []
        known, tokens, full = [], 0, False
        for seq in queue:
            batched = seq in asking           # looked up above: its answer must be handled, whatever follows
            if tokens >= budget and not batched:
                continue
            if not batched and self._needs_lookup(seq):
                if full or self._room_pending(seq, now):
                    continue                  # the GPU is full: this lookup would be cut for room too
                self.blocks.match_prefix(seq)
            elif not batched:
                known.append(seq)                         # looked up in an earlier step (or skips it)
                tokens += seq.num_pending
                continue
            if self._waits_for_room(seq, now):
                full = True
                continue
            if self._parked_on_lookup(seq, self.waiting.index(seq)):
                continue
            known.append(seq)
            tokens += seq.num_pending
        return known

    def _room_pending(self, seq: Sequence, now: float) -> bool:
        """Waiting for GPU room, and no running sequence has released blocks since its last lookup: asking
        again would only be cut again (session 20, run BP: retrying every step cost 104 lookups, each
        promoting part of a hit and giving it back, in one burst)."""
        return (self._held_for_room(seq) and seq.room_tried_at == self._releases
                and now - seq.room_wait_s < self.park_limit_s and bool(self.running))

    @staticmethod
    def _held_for_room(seq: Sequence) -> bool:
        """It gave a hit back to wait for GPU room and has not taken one since."""
        return seq.room_wait_s is not None and not seq.block_table

    def _waits_for_room(self, seq: Sequence, now: float) -> bool:
        """A hit cut short because kvd had no free GPU slot to promote the rest into (every GPU block
        leased): recomputing the rest would need as many GPU blocks, and a compute queue besides. While
        running sequences will release blocks, give the hit back and ask again once one has (``_room_pending``),
        up to ``park_limit_s``; then (or with nothing running) keep the short hit and recompute the rest."""
        if not seq.room_cut_blocks:
            return False
        if seq.room_wait_s is None:
            seq.room_wait_s = now
            self.counters["room_waits_total"] += 1
        if not self.running or now - seq.room_wait_s >= self.park_limit_s:
            self.counters["room_waits_given_up_total"] += 1
            seq.room_cut_blocks = 0                       # keeps the short hit from now on
            return False
        self.blocks.drop_hit(seq)                         # no skip_lookup: asked again once room may be back
        seq.room_cut_blocks, seq.room_tried_at = 0, self._releases
        self.counters["room_retries_total"] += 1
        return True

    @staticmethod
    def _needs_lookup(seq: Sequence) -> bool:
        return not seq.block_table and not seq.skip_lookup

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
            if self._held_for_room(seq):
                continue            # reserving blocks for it would take the room its hit waits for
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
                "parked_seconds_max", "room_waits_total", "room_retries_total", "room_waits_given_up_total")
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
        self._releases += 1
        self.blocks.free(seq)
        seq.reset_computed()
        seq.status, seq.skip_lookup = SeqStatus.WAITING, False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
