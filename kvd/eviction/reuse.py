"""``reuse``: keep the blocks most likely to save recompute per byte (DESIGN.md §3).

value(b) ~ P(reuse within the horizon) x recompute cost saved / bytes, kept as a log2 key:
  log2 temperature (decayed access count; the half-life is the horizon)  -- P(reuse) grows with
      frequency and decays with idle time (Mooncake conversation: 27% of once-seen blocks are reused,
      47% of twice-seen, 84% of 4+ times-seen)
  + log2(1 + depth / DEPTH_SCALE)        -- recompute cost grows with the prefix depth (off in service:
                                            with per-session counts it ranks a child above its parent)
  + log2(children)                       -- a prefix shared by several continuations
  + KIND_BONUS for SYSTEM / TOOL_SCHEMA  -- shared by many sessions
  live-session tails count as touched at their expected return time (protect_until)
  - DEAD_PENALTY for a lease's unreused tail leaf and for a branch superseded by a newer sibling
Bytes are equal inside one group's pool, so they drop out. Every term but the penalties is
non-decreasing from a child to its parent (a lookup touches the whole prefix), so leaves go before
ancestors, and equal keys go deepest first (the heap orders by key, then -depth, then age): a session's
turn often ties over its whole chain (per-session counts, one expected return), and the engine releases
the prefix's lookup lease before the new blocks' write lease, so by age alone the prefix's tail went
first and a pressure drop there stranded the newer blocks behind it (docs/design/eviction.md, session 5).
In the last tier (drop) only leaves are candidates. The key is time-invariant
(kvd.temperature.log_key), so a heap per tier orders the cache without re-sorting it.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from kvd.admission import seen_twice
from kvd.block_index import BlockRecord
from kvd.eviction.base import EvictionPolicy
from kvd.temperature import log_key
from kvd.types import BlockKind, Tier

DEPTH_SCALE = 2048  # blocks; cost(2048) = 2x cost(0). Stronger depth weights lost token hit rate on Mooncake (docs/design/kvd.md)
KIND_BONUS = 4.0  # x16 temperature: a system prompt outlives ordinary blocks
DEAD_PENALTY = 100.0  # ~100 half-lives: evicted before anything alive


@dataclass(frozen=True)
class ReuseTerms:
    """Which terms of the key are on: the defaults are the service's; bench/eviction_ablation.py flips
    one at a time to show each earns its place (docs/design/eviction.md). ``frequency`` off keeps recency
    (the key of a block touched once at its last access). ``depth`` is off: once a session's re-reads of
    its own history stop adding to the count (KvdConfig.frequency_per_session), parent and child have equal
    counts and the depth term ranks the child higher, so chains lost their heads first: -7.4 pt of token
    hit rate on the workload replay at GPU 10% / DRAM 20%, -0.07 pt on Mooncake without it."""

    frequency: bool = True
    depth: bool = False
    children: bool = True
    kinds: bool = True
    protection: bool = True
    dead: bool = True


class ReusePolicy(EvictionPolicy):
    name = "reuse"

    gated = True

    def __init__(self, tiers: tuple[Tier, ...], half_life_s: float, gate=seen_twice,
                 terms: ReuseTerms = ReuseTerms()) -> None:
        super().__init__(tiers, half_life_s, gate)
        self.terms = terms
        self._heaps: dict[Tier, list[tuple[float, int, int, BlockRecord]]] = {t: [] for t in tiers}
        self._seq = itertools.count()

    def key(self, rec: BlockRecord) -> float:
        t = self.terms
        last = max(rec.t_last, rec.protect_until) if t.protection else rec.t_last
        k = log_key(rec.count if t.frequency else 1.0, last, self.half_life_s)
        if t.depth:
            k += math.log2(1.0 + rec.depth / DEPTH_SCALE)
        if t.children and rec.children > 1:
            k += math.log2(rec.children)
        if t.kinds and rec.kind in (BlockKind.SYSTEM, BlockKind.TOOL_SCHEMA):
            k += KIND_BONUS
        if t.dead and (rec.tail or rec.superseded):
            k -= DEAD_PENALTY
        return k

    def on_created(self, rec: BlockRecord, now: float) -> None:
        """Track ``rec``; in the last tier a parent waits off-heap until its last child goes
        (the core touches it then), so victims() never wades through ancestors."""
        seq = next(self._seq)
        rec.policy_state = seq  # the one valid heap entry of rec
        if rec.children and rec.tier == self.tiers[-1]:
            return
        heapq.heappush(self._heaps[rec.tier], (self.key(rec), -rec.depth, seq, rec))   # ties: deepest first

    def on_touched(self, rec: BlockRecord, now: float) -> None:
        if rec.policy_state is not None:
            self.on_created(rec, now)

    def on_removed(self, rec: BlockRecord) -> None:
        rec.policy_state = None

    def victims(self, tier: Tier, n: int) -> list[BlockRecord]:
        heap, out, kept = self._heaps[tier], [], []
        leaves_only = tier == self.tiers[-1]
        while heap and len(out) < n:
            entry = heapq.heappop(heap)
            rec = entry[3]
            if rec.policy_state != entry[2] or rec.tier != tier:
                continue  # stale entry
            if leaves_only and rec.children:
                continue  # waits off-heap (see on_created)
            kept.append(entry)  # stays valid until the caller's on_removed
            out.append(rec)
        for entry in kept:
            heapq.heappush(heap, entry)
        return out
