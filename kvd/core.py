"""KvdCore: the whole of kvd's logic, with no sockets and injected time (docs/design/interfaces.md).

The server (kvd/server.py) owns sockets and threads and calls these methods; tests drive them
directly with a fake clock. Every public method takes the lock, so the server, the promotion
workers (kvd/mover.py) and the cleaner (kvd/cleaner.py) may call in from different threads; no copy
ever runs under it. Bad input raises KvdError(code).
"""
from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from kvd.block_index import BlockRecord
from kvd.cache_group import CacheGroup
from kvd.cleaner import Cleaner
from kvd.config import KvdConfig
from kvd.core_types import JointLookup, KvdError, LookupResult, PoolInfo, ReleaseHints, SessionHint
from kvd.demotion import Demotion
from kvd.hybrid_hits import needed_from, valid_ends
from kvd.latency import LatencyStat
from kvd.leases import Lease, LeaseTable
from kvd.mover import Mover
from kvd.prefetch_budget import best_cut
from kvd.promotion import Promotion, PromotionBatch, pair_slots
from kvd.temperature import bump, decayed
from kvd.tiers import pool_files
from kvd.tiers.base import shm_dir
from kvd.tier_rates import TierRates
from kvd.types import HASH_BYTES, BlockHash, BlockId, BlockKind, LeaseId, Tier
from kvd.watermarks import Watermarks

log = logging.getLogger(__name__)
BATCH_OPS = ("lookup", "warm", "allocate", "commit", "release", "heartbeat")
DEMOTE_COUNTERS = tuple(f"demote_{t}_{what}" for t in ("dram", "nvme") for what in ("blocks", "seconds"))
# per-group counters of the background cleaner and of the request path under pressure (also summed globally)
CLEAN_COUNTERS = ("clean_passes", "clean_batches", "clean_seconds", "demote_cancels", "demote_errors",
                  "pressure_drops", "pressure_waits", "pressure_wait_seconds", "spill_drops", "nvme_unpaid_drops")
MAX_BATCHES_PER_PASS = 256   # a pass yields (and re-reads the marks) after this many batches per group
# before each batch the cleaner waits this long at most for queued promotions to finish: promotions sit in
# a parked request's TTFT, demotions only keep a reserve (docs/design/kvd.md, "Promotions")
PROMOTION_YIELD_S = 0.02


class KvdCore:
    def __init__(self, config: KvdConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.groups: dict[str, CacheGroup] = {}
        self._leases = LeaseTable(config.lease_ttl_s)
        self._sessions: dict[str, SessionHint] = {}
        # roots() versions: random per start, so a client's ``known`` from an earlier kvd never matches
        self._roots_epoch = int.from_bytes(os.urandom(5), "little") << 20   # < 2**60: room to count up
        self.counters: Counter[str] = Counter()
        self._tag = f"kvd-{os.getpid()}-{id(self):x}"
        pool_files.reap_stale(shm_dir(config.run_dir))   # pools of kvd processes that died without cleaning up
        self._lock = threading.RLock()
        self._moved = threading.Condition(self._lock)
        self._backlog_s = 0.0   # predicted seconds of promotions queued or running (the budget's queue wait)
        self.rates = TierRates(config.promote_dram_gbps * 1e9, config.promote_nvme_gbps * 1e9)
        self.mover = Mover(config.move_workers, self._on_promoted)
        self.cleaner = Cleaner(config.move_workers > 0, self.clean)
        self.lock_wait = LatencyStat()   # how long request-path calls waited for the lock (recorded under it)

    # --- data plane setup -----------------------------------------------------------------------
    def attach(self, client: str, group: str, block_bytes: int, tail_blocks: int | None = None) -> PoolInfo:
        """Create (first call) or describe the pool of ``group``; its capacity is fixed at creation.
        ``tail_blocks``: None for a full-attention group, k for a group whose hits need only their last
        k blocks (sliding window, state snapshot); part of the group's identity like ``block_bytes``."""
        if not isinstance(group, str) or not group or not group.isidentifier():
            raise KvdError("bad_request", f"bad group name {group!r}")
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise KvdError("bad_request", f"block_bytes must be a positive int, got {block_bytes!r}")
        if tail_blocks is not None and (not isinstance(tail_blocks, int) or tail_blocks < 1):
            raise KvdError("bad_request", f"tail_blocks must be None or a positive int, got {tail_blocks!r}")
        with self._lock:
            g = self.groups.get(group)
            if g is None:
                if len(self.groups) >= self.config.max_groups:
                    raise KvdError("no_capacity", f"already {len(self.groups)} groups (max_groups)")
                try:
                    g = CacheGroup(group, block_bytes, self.config, self._tag, self.clock(), tail_blocks)
                except ValueError as e:
                    raise KvdError("no_capacity", str(e)) from e
                g.wake, g.wait_for_room, g.promote_s = self.cleaner.wake, self._wait_for_room, self.rates.seconds
                self.groups[group] = g
            elif g.block_bytes != block_bytes or g.tail_blocks != tail_blocks:
                raise KvdError("group_mismatch",
                               f"group {group} has block_bytes {g.block_bytes}, tail_blocks {g.tail_blocks}")
            gpu = g.gpu
            dram = g.pools.get(Tier.DRAM)
            return PoolInfo(
                group=group,
                block_bytes=block_bytes,
                gpu_blocks=gpu.blocks,
                kind=gpu.kind,  # type: ignore[arg-type]
                path=str(gpu.path) if gpu.path else None,
                ipc_handle=gpu.ipc_handle,
                device=gpu.tensor.device.index if gpu.tensor.is_cuda else None,
                dram_path=str(dram.path) if dram is not None else None,  # type: ignore[attr-defined]
            )

    # --- leases ---------------------------------------------------------------------------------
    def lookup(
        self,
        client: str,
        group: str,
        hashes: Sequence[BlockHash],
        session: str | None = None,
        tokens: int | None = None,
        block_tokens: int | None = None,
        recompute_s: float | None = None,
    ) -> LookupResult:
        """Lease the longest servable prefix of one group; queue promotions of lower-tier hits.

        ``tokens``/``block_tokens`` (optional) feed the token hit-rate stats:
        hit tokens = min(hits * block_tokens, tokens). ``recompute_s`` (optional): the client's
        seconds to recompute one block; the hit is cut where promoting costs more (prefetch budget)."""
        return self.lookup_groups(client, [group], hashes, session, tokens, block_tokens, recompute_s).results[group]

    def lookup_groups(
        self,
        client: str,
        groups: Sequence[str],
        hashes: Sequence[BlockHash],
        session: str | None = None,
        tokens: int | None = None,
        block_tokens: int | None = None,
        recompute_s: float | None = None,
    ) -> JointLookup:
        """One prefix hit across cache groups: the longest end every group can serve (kvd/hybrid_hits.py),
        cut by the prefetch budget (kvd/prefetch_budget.py); each group leases what it needs for it."""
        _check_joint(groups, hashes, recompute_s)
        with self._request_lock():
            gs = [self._group(name) for name in groups]
            now = self.clock()
            if recompute_s is not None:
                for g in gs:
                    g.recompute_s = recompute_s     # what an NVMe block must beat (CacheGroup.nvme_pays)
            recs, candidates = self._servable(gs, hashes)
            hit = self._budget(gs, recs, candidates, recompute_s)
            hit, held, jobs, room_cut = self._hold_hit(client, gs, recs, hit, now, session)
            self._count_lookup(len(hashes), hit, tokens, block_tokens)
            for g in gs:
                self._count_group_lookup(g, len(hashes), hit, tokens, block_tokens)
            if session is not None and hit:
                self._see_session(session, client, BlockHash(bytes(hashes[hit - 1])), hit, now)
            results = {
                g.name: LookupResult(
                    held[g.name][1],
                    [BlockId(r.dest if r.moving else r.slot) for r in held[g.name][0]],
                    [r.tier for r in held[g.name][0]],
                    not any(r.moving for r in held[g.name][0]),
                    hit - len(held[g.name][0]),
                    room_cut,
                )
                for g in gs
            }
        for batch in jobs:
            self.mover.submit(batch)
        return JointLookup(hit, results)

    def warm(self, client: str, groups: Sequence[str], hashes: Sequence[BlockHash],
             recompute_s: float | None = None) -> int:
        """Prefetch on arrival: start promoting the lower-tier blocks that a lookup of ``hashes`` across
        ``groups`` would hit, and return how many were queued. The engine sends it while a forward runs,
        as soon as a request arrives; its lookup comes at the next step and finds the blocks landed or in
        flight (``moving``: leased and waited for as its own). Why: a hit's promotion started by the lookup
        parked the request for the whole step that followed; on the 8B agentic load a late turn parked 50-65
        ms against ~20 ms for its copy (docs/design/kvd.md, "Prefetch on arrival").

        Nothing is leased and no access is counted (the lookup counts it). Only free GPU slots are taken:
        no wait for the cleaner, no victim dropped, so a warm never costs a request its room; it stops at
        the first block it cannot move (one the cleaner is copying down, or no free slot), since the
        lookup's hit ends there too. A promoted block lands unleased, like any promotion whose hit was
        given up, and stays evictable by the policy."""
        _check_joint(groups, hashes, recompute_s)
        jobs: list[PromotionBatch] = []
        with self._request_lock():
            gs = [self._group(name) for name in groups]
            recs, candidates = self._servable(gs, hashes)
            hit = self._budget(gs, recs, candidates, recompute_s, count=False)
            now = self.clock()
            for g in gs:
                promotions = self._warm_group(g, recs[g.name][needed_from(hit, g.tail_blocks):hit], now)
                if promotions:
                    jobs.append(self._batch(g, promotions))
            queued = sum(len(b.items) for b in jobs)
            self.counters["warm_ops"] += 1
            self.counters["warm_blocks"] += queued
        for batch in jobs:
            self.mover.submit(batch)
        return queued

    def _warm_group(self, g: CacheGroup, need: Sequence[BlockRecord | None], now: float) -> list[Promotion]:
        """``warm``'s promotions in one group: its unleased lower-tier blocks of the hit, in order, up to the
        first that cannot move now. Every block of the hit, on the GPU already or promoted, is made as recent
        as now without counting an access: the promotions take free slots, the cleaner refills them by
        demoting its oldest victims, and a hit block already on the GPU was often one of those (tested)."""
        out: list[Promotion] = []
        for rec in need:
            if rec is None or rec.moving:
                continue
            if rec.tier == Tier.GPU:
                self._refresh(g, rec, now)
                continue
            if rec.demoting or rec.refs or g.gpu.free_count == 0:
                break
            queued = rec.evictable
            job = g.start_promotion(rec, now)  # a free slot exists: never None, no victim taken
            if queued:
                g.policy.on_removed(rec)      # moving: no victim until it lands (``_on_promoted`` adds it back)
            self._refresh(g, rec, now)        # not queued in the policy while moving: only the temperature
            out.append(job)
        return out

    def _refresh(self, g: CacheGroup, rec: BlockRecord, now: float) -> None:
        """Make ``rec`` at least as hot as a block seen once now, no hotter (as a session's own lookup does
        with ``frequency_per_session``), and re-queue it in the policy (recency-only policies order by
        insertion). No sighting is added: the lookup that follows counts the access."""
        queued = rec.evictable
        if queued:
            g.policy.on_removed(rec)
        rec.count, rec.t_last = max(decayed(rec.count, rec.t_last, now, self.config.half_life_s), 1.0), now
        if queued:
            g.policy.on_created(rec, now)

    def _servable(self, gs: list[CacheGroup], hashes: Sequence[BlockHash]
                  ) -> tuple[dict[str, list[BlockRecord | None]], list[int]]:
        """Each group's records for the prefix, and the hit lengths every group can serve (ascending).

        Full groups are read up to their first gap (the old fast path); tail groups only that far."""
        recs: dict[str, list[BlockRecord | None]] = {}
        limit = len(hashes)
        for g in gs:
            if g.tail_blocks is None:
                recs[g.name] = list(g.index.prefix(hashes[:limit]))
                limit = len(recs[g.name])
        ok = [True] * (limit + 1)
        for g in gs:
            if g.tail_blocks is None:
                recs[g.name] = recs[g.name][:limit]
                continue
            recs[g.name] = [g.index.get(BlockHash(bytes(h))) for h in hashes[:limit]]
            valid = valid_ends([r is not None for r in recs[g.name]], g.tail_blocks)
            ok = [a and b for a, b in zip(ok, valid)]
        return recs, [h for h, v in enumerate(ok) if v]

    def _budget(self, gs: list[CacheGroup], recs: dict[str, list[BlockRecord | None]], candidates: list[int],
                recompute_s: float | None, count: bool = True) -> int:
        """The hit length after the prefetch budget; counts the decisions (``count``: a lookup's, not a warm's)."""
        longest = candidates[-1]
        if recompute_s is None or longest == 0:
            return longest
        cost = [0.0] * len(candidates)
        for g in gs:   # prefix sums of per-block promotion seconds: O(blocks) per group
            pre = [0.0]
            for r in recs[g.name]:
                pre.append(pre[-1] + (self.rates.seconds(r.tier, g.block_bytes) if r is not None and not r.moving
                                      else 0.0))
            if pre[-1] > 0:
                for i, c in enumerate(candidates):
                    cost[i] += pre[c] - pre[needed_from(c, g.tail_blocks)]
        if not any(cost):
            return longest   # every needed block is on the GPU already: nothing to decide
        # a promotion waits for the ones queued before it: on the H200, requests parked ~8x longer than
        # their own copies took (docs/design/kvd.md, "Queue-aware prefetch budget")
        cost = [c + self._backlog_s if c > 0 else c for c in cost]
        hit = best_cut(candidates, cost, recompute_s)
        if hit < longest and count:
            self.counters["prefetch_recompute_lookups"] += 1
            self.counters["prefetch_recompute_blocks"] += longest - hit
        return hit

    def _hold_hit(self, client: str, gs: list[CacheGroup], recs: dict[str, list[BlockRecord | None]], hit: int,
                  now: float, session: str | None = None
                  ) -> tuple[int, dict[str, tuple[list[BlockRecord], LeaseId]], list[PromotionBatch], int]:
        """Lease, per group, the blocks a hit of ``hit`` blocks needs, and start their promotions;
        returns the hit actually leased, and how many blocks of ``hit`` were cut for want of a GPU slot
        (``LookupResult.room_cut``).

        Where no GPU slot can be had (every GPU block leased) a lone full group keeps the prefix before
        it (a shorter hit is correct); with several groups or a tail group the whole hit is given up
        (a miss), since a cut there would leave some group without the blocks its end needs."""
        out: dict[str, tuple[list[BlockRecord], LeaseId]] = {}
        jobs: list[PromotionBatch] = []
        leases: list[tuple[CacheGroup, Lease]] = []
        short = no_room = False
        for g in gs:
            need = [r for r in recs[g.name][needed_from(hit, g.tail_blocks):hit] if r is not None]
            if not need:
                out[g.name] = ([], LeaseId(0))
                continue
            lease = self._leases.open(client, g.name, now)
            leases.append((g, lease))
            for rec in need:
                self._hold(g, lease, rec, now, session)
            promotions, cut_for_room = self._promote(g, lease, now)
            no_room = no_room or cut_for_room
            if promotions:   # one batch per lease and group: one copy pass, one wait, one lock trip
                jobs.append(self._batch(g, promotions))
            short = short or len(lease.held) < len(need)
            out[g.name] = (lease.held, lease.id)
        if no_room:
            self.counters["promotion_no_slot"] += 1
        if short and (len(gs) > 1 or gs[0].tail_blocks is not None):
            for g, lease in leases:   # queued jobs still land; their blocks stay published, unleased
                for rec in reversed(lease.held):
                    self._unhold(g, rec, now)
                self._leases.close(lease)
            self._submit_orphaned(jobs)
            if no_room:
                self.counters["promotion_no_slot_blocks"] += hit
            return 0, {g.name: ([], LeaseId(0)) for g in gs}, [], hit if no_room else 0
        room_cut = 0
        if short:
            kept = len(leases[0][1].held)
            room_cut = hit - kept if no_room else 0
            self.counters["promotion_no_slot_blocks"] += room_cut
            hit = kept
        for g, lease in leases:
            if not lease.held:
                self._leases.close(lease)
                out[g.name] = ([], LeaseId(0))
        self.counters["prefetch_promoted_blocks"] += sum(len(b.items) for b in jobs)
        return hit, out, jobs, room_cut

    def _batch(self, g: CacheGroup, promotions: list[Promotion]) -> PromotionBatch:
        """Under the lock: one group's promotions as one batch, its copy time priced into the backlog (the
        caller queues it after the lock)."""
        pair_slots(promotions)
        batch = PromotionBatch(g.name, g.gpu, promotions, predicted_s=sum(
            self.rates.seconds(p.src.tier, g.block_bytes) for p in promotions))
        self._backlog_s += batch.predicted_s
        return batch

    def _submit_orphaned(self, jobs: list[PromotionBatch]) -> None:
        """Promotions started for a hit that was then given up: they still run (their GPU slots are
        reserved and the records marked moving), so they land as unleased published blocks."""
        for batch in jobs:
            self.mover.submit(batch)

    def _promote(self, g: CacheGroup, lease: Lease, now: float) -> tuple[list[Promotion], bool]:
        """Start promotions of the lease's lower-tier hits; cut the prefix where no GPU slot can be
        had (every GPU block leased): a shorter hit is correct, a block never served is not. Returns
        the promotions and whether the lease was cut for want of a GPU slot."""
        jobs: list[Promotion] = []
        for i, rec in enumerate(lease.held):
            if rec.tier == Tier.GPU or rec.moving:
                continue
            # a lower-tier block the cleaner is copying further down: its source slot must stay put until
            # the copy lands, so it is not promoted now; the hit is cut before it (shorter, never wrong)
            job = None if rec.demoting else g.start_promotion(rec, now)
            if job is None:
                for r in reversed(lease.held[i:]):
                    self._unhold(g, r, now)
                del lease.held[i:]
                return jobs, not rec.demoting
            jobs.append(job)
        return jobs, False

    def allocate(self, client: str, group: str, n: int) -> tuple[LeaseId, list[BlockId]]:
        """A write lease on ``n`` free GPU blocks (evicting/demoting unleased blocks as needed)."""
        if not isinstance(n, int) or n < 0:
            raise KvdError("bad_request", f"n must be a non-negative int, got {n!r}")
        with self._request_lock():
            g = self._group(group)
            if n > g.gpu.blocks:
                raise KvdError("out_of_blocks", f"{n} blocks asked, pool has {g.gpu.blocks}")
            now = self.clock()
            slots = g.take_gpu_slots(n, now)
            if slots is None:
                raise KvdError("out_of_blocks", "every GPU block is leased or pinned")
            lease = self._leases.open(client, group, now)
            lease.writes.update(slots)
            return lease.id, [BlockId(s) for s in slots]

    def commit(
        self, client: str, lease_id: int, blocks: Sequence[tuple[int, BlockHash, BlockHash | None]]
    ) -> list[BlockId]:
        """Publish written blocks in chain order; validated in full before anything changes."""
        with self._request_lock():
            lease = self._leases.get(client, lease_id)
            g = self._group(lease.group)
            self._validate_commit(g, lease, blocks)
            now = self.clock()
            return [self._publish(g, lease, int(b), BlockHash(bytes(h)), p, now) for b, h, p in blocks]

    def _validate_commit(self, g: CacheGroup, lease: Lease, blocks: Sequence[Any]) -> None:
        seen_slots: set[int] = set()
        new_hashes: set[bytes] = set()
        for item in blocks:
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise KvdError("bad_request", "commit items are (block_id, hash, parent)")
            bid, h, parent = item
            if not isinstance(bid, int) or bid not in lease.writes or bid in seen_slots:
                raise KvdError("bad_block", f"block {bid!r} is not an uncommitted block of lease {lease.id}")
            _check_hashes([h])
            if parent is not None:
                _check_hashes([parent])
                if parent not in g.index and bytes(parent) not in new_hashes:
                    raise KvdError("bad_chain", f"parent {bytes(parent).hex()} of {bytes(h).hex()} is unknown")
            seen_slots.add(bid)
            new_hashes.add(bytes(h))

    def _publish(
        self, g: CacheGroup, lease: Lease, bid: int, h: BlockHash, parent: BlockHash | None, now: float
    ) -> BlockId:
        old = g.index.get(h)
        if old is not None and (old.moving or (old.demoting and old.tier != Tier.GPU)):
            # A duplicate of a block whose promotion has not landed: its destination slot holds no bytes
            # yet, and the writer would read it in its next forward. The writer keeps its own identical
            # copy, private to its lease (still a write slot, freed with the lease); the promotion stays
            # the canonical block for everyone else. Likewise for a lower-tier copy the cleaner is moving
            # down: dropping it would free the slot its copy still reads.
            return BlockId(bid)
        if old is not None and old.tier == Tier.GPU:
            # A duplicate: the published block stays canonical and this lease holds it too. The writer's
            # slot stays a private write slot of the lease until the writer gives it back
            # (``release_blocks``, once its block table points at the canonical block) or the lease ends.
            # Why not free it here: the writer posts commits without waiting (protocol v3), so its next
            # forward may still read that slot; freeing it at once made every engine step wait for its
            # commit answers before the forward (~0.24 ms per step on the CPU probe, docs/design/kvd.md).
            self._hold(g, lease, old, now)
            return BlockId(old.slot)
        lease.writes.discard(bid)
        pinned = False
        if old is not None:  # published in a lower tier (unleased): the fresh GPU copy replaces it
            pinned = old.pinned
            if old.evictable:
                g.policy.on_removed(old)
            g.drop(old)
            g.counters["evictions"] -= 1
        p = g.index.get(parent) if parent is not None else None
        rec = BlockRecord(h, parent, p.depth + 1 if p else 0, Tier.GPU, bid, t_last=now, refs=1, pinned=pinned)
        g.index.insert(rec)
        if p is not None:
            self._link_child(g, p, rec, now)
        lease.held.append(rec)
        if g.tail_blocks is not None:
            self._pass_ancestor(g, rec)
        return BlockId(bid)

    def _pass_ancestor(self, g: CacheGroup, rec: BlockRecord) -> None:
        """A tail group's new block ends a servable prefix that needs only its last ``tail_blocks``
        blocks: the ancestor that many generations up has fallen behind this chain's window. It is
        dropped as soon as no lease holds it (never demoted): out-of-window blocks are not stored."""
        a: BlockRecord | None = rec
        for _ in range(g.tail_blocks or 0):
            a = g.index.get(a.parent) if a is not None and a.parent is not None else None
        if a is not None:
            a.passed = True
            self._drop_if_passed(g, a)

    def _drop_if_passed(self, g: CacheGroup, rec: BlockRecord) -> None:
        if rec.passed and rec.evictable and rec.hash in g.index:
            g.policy.on_removed(rec)
            g.drop(rec)
            g.counters["evictions"] -= 1
            g.counters["window_drops"] += 1

    def _link_child(self, g: CacheGroup, p: BlockRecord, rec: BlockRecord, now: float) -> None:
        """A new child: the parent is no longer a tail; an older unreused leaf sibling is superseded."""
        sib = g.index.get(p.last_child) if p.last_child is not None else None
        if sib is not None and sib is not rec and sib.children == 0 and sib.sightings == 1:
            sib.superseded = True
            g.policy.on_touched(sib, now)
        p.last_child = rec.hash
        if p.tail:
            p.tail = False
            g.policy.on_touched(p, now)

    def release(self, client: str, lease_id: int, hints: ReleaseHints | dict | None = None) -> None:
        """Unpin the lease's blocks (tail first, as vLLM frees); uncommitted blocks return to free."""
        if isinstance(hints, dict) or hints is None:
            hints = ReleaseHints.from_dict(hints)
        with self._request_lock():
            if lease_id == 0:
                self._hint_named(hints, self.clock())
                return
            lease = self._leases.get(client, lease_id)
            self._end_lease(lease, hints)

    def release_blocks(self, client: str, lease_id: int, blocks: Sequence[int]) -> None:
        """Give back some blocks of a live lease: an uncommitted write slot is freed, a held block is
        unpinned once per listed id (a lease can hold a block twice, for two sequences that committed the
        same hash). Why: a sliding-window sequence is done with its blocks behind the window long before
        its write lease ends. Unknown ids are refused before anything changes (``bad_block``)."""
        with self._request_lock():
            lease = self._leases.get(client, lease_id)
            g = self.groups[lease.group]
            now = self.clock()
            held = [BlockId(r.dest if r.moving else r.slot) for r in lease.held]
            left, writes = list(held), set(lease.writes)
            for b in blocks:
                if b in left:
                    left.remove(b)
                elif isinstance(b, int) and b in writes:
                    writes.discard(b)
                else:
                    raise KvdError("bad_block", f"block {b!r} is not held by lease {lease.id}")
            for b in blocks:
                if b in lease.writes:
                    lease.writes.discard(b)
                    g.gpu.free(b)
                    continue
                i = held.index(b)
                rec = lease.held.pop(i)
                held.pop(i)
                self._unhold(g, rec, now)

    def _hint_named(self, hints: ReleaseHints, now: float) -> None:
        """Hints about published blocks named by hash (``kinds``), whatever lease holds them: an
        engine's write leases outlive the sequence that filled them (one lease feeds several
        sequences), so a release of "lease 0" is how it tells kvd about a finished turn's blocks."""
        for g in self.groups.values():
            named = [r for h in hints.kinds if (r := g.index.get(h)) is not None]
            if not named:
                continue
            for rec in named:
                rec.kind = BlockKind(hints.kinds[rec.hash])
                if hints.session is not None:
                    rec.session = hints.session
                if hints.turn_end and hints.expected_return_s is not None:
                    rec.protect_until = max(rec.protect_until, now + hints.expected_return_s)
                if rec.evictable:
                    g.policy.on_touched(rec, now)
            if hints.session is not None:
                self._see_session(hints.session, "", named[-1].hash, len(named), now, hints.expected_return_s)

    def _end_lease(self, lease: Lease, hints: ReleaseHints) -> None:
        g = self.groups[lease.group]
        now = self.clock()
        for slot in lease.writes:
            g.gpu.free(slot)
        held = lease.held
        if held:
            self._apply_hints(g, held, hints, now)
        for rec in reversed(held):
            self._unhold(g, rec, now)
        self._leases.close(lease)

    def _apply_hints(self, g: CacheGroup, held: list[BlockRecord], hints: ReleaseHints, now: float) -> None:
        for rec in held:
            kind = hints.kinds.get(rec.hash)
            if kind is not None:
                rec.kind = BlockKind(kind)
            if hints.session is not None:
                rec.session = hints.session
        tail = held[-1]
        expect = hints.expected_return_s
        if hints.turn_end and expect is not None:
            for rec in held:
                rec.protect_until = max(rec.protect_until, now + expect)
        elif tail.children == 0 and not hints.turn_end:
            tail.tail = True
        if hints.session is not None:
            self._see_session(hints.session, "", tail.hash, len(held), now, expect)

    def heartbeat(self, client: str) -> int:
        """Renew every lease of ``client``; returns how many it holds."""
        with self._request_lock():
            return self._leases.heartbeat(client, self.clock())

    def wait_ready(self, lease_id: int, timeout: float | None = None) -> bool:
        """Block until the lease's promotions have landed; False on timeout; ``promotion_failed`` when one
        of them failed (the reader must recompute those tokens)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.mover.run_pending()
        self.cleaner.run_pending()
        with self._moved:
            while self._moving(lease_id):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._moved.wait(left)
            if self._lost(lease_id):
                raise KvdError("promotion_failed", f"a promotion of lease {lease_id} failed: its block was dropped")
            return True

    def _lost(self, lease_id: int) -> bool:
        """A held block whose promotion failed (``finish_promotion`` dropped it; its GPU slot holds nothing):
        the lease must not be read. A landed promotion is on the GPU, and a leased GPU block never moves."""
        return lease_id != 0 and any(r.tier != Tier.GPU for r in self._leases.find(lease_id).held)

    def _moving(self, lease_id: int) -> bool:
        """Any block of the lease still mid-promotion (an unknown lease raises unknown_lease)."""
        if lease_id == 0:
            return False
        return any(r.moving for r in self._leases.find(lease_id).held)

    def tick(self, now: float | None = None) -> dict[str, int]:
        """Reclaim leases of silent clients, run inline promotions and cleaning, expire old sessions."""
        self.mover.run_pending()
        self.cleaner.run_pending()
        with self._lock:
            now = self.clock() if now is None else now
            dead = self._leases.expired(now)
            for lease in dead:
                log.info("reclaiming lease %d of silent client %s", lease.id, lease.client)
                self._end_lease(lease, ReleaseHints())
            self.counters["reclaimed_leases"] += len(dead)
            horizon = now - 4 * self.config.lease_ttl_s
            for s in [s for s, h in self._sessions.items() if max(h.last_seen, h.expected_return_at or 0) < horizon]:
                del self._sessions[s]
            return {"reclaimed": len(dead)}

    def batch(self, client: str, ops: Sequence[dict[str, Any]]) -> list[Any]:
        """Run several lease ops in order (one scheduler step, one message). Each item of the result
        is that op's return value or the KvdError it raised; a failed op does not stop the others."""
        out: list[Any] = []
        for op in ops:
            try:
                if not isinstance(op, dict) or op.get("op") not in BATCH_OPS:
                    raise KvdError("bad_request", f"batch op must be one of {BATCH_OPS}")
                args = {k: v for k, v in op.items() if k != "op"}
                out.append(getattr(self, op["op"])(client, **args))
            except KvdError as e:
                out.append(e)
            except TypeError as e:
                out.append(KvdError("bad_request", str(e)))
        return out

    # --- background cleaning (kvd/cleaner.py runs ``clean``; kvd/demotion.py has the protocol) ---------
    def clean(self) -> int:
        """One cleaning pass over every group; returns the blocks it moved. Takes the lock only to plan
        and to finish each batch: the copies run without it."""
        with self._lock:
            groups = list(self.groups.values())
        return sum(self._clean_group(g) for g in groups)

    def _clean_group(self, g: CacheGroup) -> int:
        moved = 0
        for _ in range(MAX_BATCHES_PER_PASS):
            if self.cleaner.threaded and not self.mover.wait_idle(PROMOTION_YIELD_S):
                with self._lock:
                    g.counters["clean_yields_timed_out"] += 1
            batch = self._plan_batch(g)
            if batch is None:
                break
            if batch:
                error: BaseException | None = None
                try:
                    seconds = Demotion.run_batch(batch)
                except Exception as e:  # noqa: BLE001 - reported per block by finish_demotions
                    error, seconds = e, 0.0
                self._finish_batch(g, batch, error, seconds)
                moved += len(batch)
        if moved:
            with self._lock:
                g.counters["clean_passes"] += 1
        return moved

    def _plan_batch(self, g: CacheGroup) -> list[Demotion] | None:
        """The next batch to copy: tiers top-down, so the GPU tier's reserve (what allocations need) is
        refilled at DRAM speed first and DRAM→NVMe writes run only when the GPU tier is not short (a
        full DRAM tier makes room for a GPU victim by dropping its own, CacheGroup._reserve). [] when
        only drops were needed (progress, nothing to copy); None when nothing more can be done now."""
        with self._lock:
            if self.groups.get(g.name) is not g:
                return None   # closed meanwhile
            for tier in list(g.marks):
                want = g.clean_want(tier)
                if not want:
                    continue
                free = g.pools[tier].free_count
                jobs = g.plan_demotions(tier, min(want, self.config.clean_batch))
                if jobs:
                    return jobs
                if g.pools[tier].free_count > free:
                    return []
            return None

    def _finish_batch(self, g: CacheGroup, batch: list[Demotion], error: BaseException | None,
                      seconds: float) -> None:
        with self._moved:
            g.finish_demotions(batch, error, seconds)
            g.counters["clean_seconds"] += seconds
            now = self.clock()
            for job in batch:
                rec = job.rec
                if rec.passed:
                    self._drop_if_passed(g, rec)
                elif rec.evictable and g.index.get(rec.hash) is rec:
                    g.policy.on_created(rec, now)
            self._moved.notify_all()   # a request waiting for room (pressure_wait_ms) looks again

    def _wait_for_room(self, g: CacheGroup, tier: Tier) -> None:
        """A request found ``tier`` full: wait up to ``pressure_wait_ms`` (lock released) for the cleaner
        to free a slot. Only with a cleaner thread; inline, nothing would free one."""
        wait_s = self.config.pressure_wait_ms / 1000
        if wait_s <= 0 or not self.cleaner.threaded or not g.ask_cleaning(tier):
            return   # nothing to wait for: the drop (or out_of_blocks) comes at once
        t0 = time.perf_counter()
        deadline = t0 + wait_s
        pool = g.pools[tier]
        while pool.free_count == 0 and (left := deadline - time.perf_counter()) > 0:
            self._moved.wait(left)
        g.counters["pressure_waits"] += 1
        g.counters["pressure_wait_seconds"] += time.perf_counter() - t0

    @contextmanager
    def _request_lock(self) -> Iterator[None]:
        """The lock, timing how long a request-path call waited for it (``stats()["lock_wait"]``)."""
        t0 = time.perf_counter()
        with self._lock:
            self.lock_wait.record(time.perf_counter() - t0)
            yield

    # --- block bookkeeping ----------------------------------------------------------------------
    def _hold(self, g: CacheGroup, lease: Lease, rec: BlockRecord, now: float, session: str | None = None) -> None:
        """Lease ``rec`` and count the access. A lookup by the session that last released the block
        (``frequency_per_session``) refreshes its recency without adding to its count: at least as hot
        as a block seen once now, no hotter."""
        if rec.evictable:
            g.policy.on_removed(rec)
        rec.refs += 1
        if self.config.frequency_per_session and session is not None and rec.session == session:
            rec.count = max(decayed(rec.count, rec.t_last, now, self.config.half_life_s), 1.0)
        else:
            rec.count = bump(rec.count, rec.t_last, now, self.config.half_life_s)
        rec.t_last = now
        rec.sightings += 1
        rec.tail = False
        lease.held.append(rec)

    def _unhold(self, g: CacheGroup, rec: BlockRecord, now: float) -> None:
        rec.refs -= 1
        if rec.passed:
            self._drop_if_passed(g, rec)
        elif rec.evictable and rec.hash in g.index:
            g.policy.on_created(rec, now)

    def _on_promoted(self, batch: PromotionBatch) -> None:
        """A batch's copies are over: finish every block under one lock trip, wake wait_ready."""
        with self._moved:
            self._backlog_s = max(0.0, self._backlog_s - batch.predicted_s)
            g = self.groups.get(batch.group)
            if g is None:
                return   # closed meanwhile (shutdown): its pools are gone
            now = self.clock()
            c = self.counters
            c["promotion_batches"] += 1
            c["promotion_queue_seconds"] += batch.queue_s
            c["promotion_queue_seconds_max"] = max(c["promotion_queue_seconds_max"], batch.queue_s)
            c["promotion_copy_seconds"] += batch.copy_s
            c["promotion_issue_seconds"] += batch.issue_s
            c["promotion_copies"] += batch.copies
            for tier, seconds in batch.seconds.items():
                self.rates.observe(tier, batch.landed_bytes(tier), seconds)
            for p in batch.items:
                g.finish_promotion(p)
                rec = p.rec
                if rec.passed:
                    self._drop_if_passed(g, rec)
                elif rec.evictable and g.index.get(rec.hash) is rec:
                    g.policy.on_created(rec, now)
            self._moved.notify_all()

    def _count_lookup(self, asked: int, hits: int, tokens: int | None, block_tokens: int | None) -> None:
        c = self.counters
        c["lookups"] += 1
        c["lookup_blocks"] += asked
        c["hit_blocks"] += hits
        if tokens is not None and block_tokens is not None:
            c["query_tokens"] += tokens
            c["hit_tokens"] += min(hits * block_tokens, tokens)

    @staticmethod
    def _count_group_lookup(g: CacheGroup, asked: int, hits: int, tokens: int | None,
                            block_tokens: int | None) -> None:
        """Per-group hits (the "draft" group's next to the target's), in ``stats()["groups"]``.
        ``block_tokens`` alone is enough here: hit tokens = hits * block_tokens, capped by ``tokens``."""
        c = g.counters
        c["lookups"] += 1
        c["lookup_blocks"] += asked
        c["hit_blocks"] += hits
        if block_tokens is not None:
            c["hit_tokens"] += min(hits * block_tokens, tokens if tokens is not None else hits * block_tokens)

    def _see_session(
        self, session: str, client: str, tail: BlockHash, blocks: int, now: float, expect: float | None = None
    ) -> None:
        h = self._sessions.get(session)
        if h is None:
            h = self._sessions[session] = SessionHint(session, client, tail, blocks, now, None)
        h.client = client or h.client
        h.tail, h.blocks, h.last_seen = tail, blocks, now
        if expect is not None:
            h.expected_return_at = now + expect

    def _group(self, group: str) -> CacheGroup:
        g = self.groups.get(group) if isinstance(group, str) else None
        if g is None:
            raise KvdError("unknown_group", f"group {group!r} is not attached")
        return g

    # --- admin ----------------------------------------------------------------------------------
    def pin(self, client: str, hashes: Sequence[BlockHash], group: str | None = None) -> int:
        """Pin present blocks (never evicted); returns how many were pinned."""
        _check_hashes(hashes)
        with self._lock:
            n = 0
            for g, rec in self._find(hashes, group):
                if not rec.pinned:
                    if rec.evictable:
                        g.policy.on_removed(rec)
                    rec.pinned = True
                    n += 1
            return n

    def unpin(self, client: str, hashes: Sequence[BlockHash], group: str | None = None) -> int:
        _check_hashes(hashes)
        with self._lock:
            n = 0
            for g, rec in self._find(hashes, group):
                if rec.pinned:
                    rec.pinned = False
                    if rec.evictable:
                        g.policy.on_created(rec, self.clock())
                    n += 1
            return n

    def evict(self, client: str, hashes: Sequence[BlockHash], group: str | None = None) -> int:
        """Drop present, unleased blocks; returns how many were dropped."""
        _check_hashes(hashes)
        with self._lock:
            n = 0
            for g, rec in self._find(hashes, group):
                if rec.refs == 0 and not rec.moving and not rec.demoting:
                    if rec.evictable:
                        g.policy.on_removed(rec)
                    g.drop(rec)
                    n += 1
            return n

    def flush(self, client: str, tier: str | int | None = None, group: str | None = None) -> int:
        """Drop every unleased, unpinned block of ``tier`` (name or number), or of all tiers."""
        want = _parse_tier(tier)
        with self._lock:
            n = 0
            for name, g in self.groups.items():
                if group is not None and name != group:
                    continue
                for rec in g.index:
                    if rec.evictable and (want is None or rec.tier == want):
                        g.policy.on_removed(rec)
                        g.drop(rec)
                        n += 1
            return n

    def _find(self, hashes: Sequence[BlockHash], group: str | None) -> list[tuple[CacheGroup, BlockRecord]]:
        groups = [self._group(group)] if group is not None else list(self.groups.values())
        return [(g, r) for g in groups for h in hashes if (r := g.index.get(BlockHash(bytes(h)))) is not None]

    def stats(self, client: str = "") -> dict[str, Any]:
        with self._lock:
            c = self.counters
            groups: dict[str, Any] = {}
            totals: dict[str, dict[str, int]] = {}
            agg: Counter[str] = Counter()
            for name, g in self.groups.items():
                occ = g.occupancy()
                groups[name] = {"block_bytes": g.block_bytes, "tail_blocks": g.tail_blocks, "blocks": len(g.index), "tiers": occ,
                                "nvme_degraded": g.nvme_degraded, "nvme_pays": Tier.NVME in g.pools and g.nvme_pays(),
                                **{k: g.counters[k] for k in CLEAN_COUNTERS},
                                **dict(g.counters), "watermarks": _marks(g.marks)}
                agg.update(g.counters)
                for t, o in occ.items():
                    tot = totals.setdefault(t, Counter())
                    tot.update(o)
            return {
                "policy": self.config.policy,
                "tiers": {t: dict(v) for t, v in totals.items()},
                "groups": groups,
                "lookups": c["lookups"],
                "lookups_skipped": c["lookups_skipped"],     # of them, skipped by a client's RootFilter
                "lookup_blocks": c["lookup_blocks"],
                "hit_blocks": c["hit_blocks"],
                "hit_rate": c["hit_blocks"] / c["lookup_blocks"] if c["lookup_blocks"] else 0.0,
                "query_tokens": c["query_tokens"],
                "hit_tokens": c["hit_tokens"],
                "token_hit_rate": c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0,
                "leases": len(self._leases),
                "reclaimed_leases": c["reclaimed_leases"],
                "sessions": len(self._sessions),
                "evictions": agg["evictions"],
                "promotions": agg["promotions"],
                "demotions": agg["demotions"],
                **{k: agg[k] for k in DEMOTE_COUNTERS},
                **{k: agg[k] for k in CLEAN_COUNTERS},
                "lock_wait": self.lock_wait.to_dict(),
                "admission_rejects": agg["admission_rejects"],
                "nvme_enospc": agg["nvme_enospc"],
                "nvme_degraded": any(g.nvme_degraded for g in self.groups.values()),
                "window_drops": agg["window_drops"],
                "prefetch_promoted_blocks": c["prefetch_promoted_blocks"],
                "prefetch_recompute_lookups": c["prefetch_recompute_lookups"],
                "prefetch_recompute_blocks": c["prefetch_recompute_blocks"],
                "promotion_no_slot": c["promotion_no_slot"],
                "promotion_no_slot_blocks": c["promotion_no_slot_blocks"],
                "promotion_backlog_s": self._backlog_s,
                # where a promotion's time goes: waiting in the mover's queue, then copying (kvd/mover.py)
                **{k: c[k] for k in ("promotion_batches", "promotion_queue_seconds", "promotion_queue_seconds_max",
                                     "promotion_copy_seconds", "promotion_issue_seconds", "promotion_copies",
                                     "warm_ops", "warm_blocks")},
                **self.rates.to_dict(),
            }

    def top(self, client: str = "", n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` hottest blocks by decayed temperature (an admin scan of the index)."""
        with self._lock:
            now = self.clock()
            h = self.config.half_life_s
            recs = ((decayed(r.count, r.t_last, now, h), name, r) for name, g in self.groups.items() for r in g.index)
            best = heapq.nlargest(max(0, int(n)), recs, key=lambda x: x[0])
            return [
                {"hash": r.hash.hex(), "group": name, "temperature": round(t, 4), "tier": r.tier.name.lower(),
                 "depth": r.depth, "refs": r.refs, "pinned": r.pinned, "kind": r.kind.name.lower()}
                for t, name, r in best
            ]

    def leases(self, client: str = "") -> list[dict[str, Any]]:
        with self._lock:
            now = self.clock()
            return [
                {"lease": int(l.id), "client": l.client, "group": l.group, "blocks": len(l.held),
                 "writes": len(l.writes), "age_s": now - l.created,
                 "expires_in_s": (self._leases.deadline(l.client) or now) - now}
                for l in self._leases
            ]

    def roots(self, client: str, group: str, known: int | None = None, recompute_s: float | None = None,
              skipped: int = 0, skipped_blocks: int = 0) -> dict[str, Any]:
        """The first-block hashes ``group`` holds, so a client can skip the lookup round trip for a prompt
        whose block 0 is not among them (it cannot hit: hits are prefixes). ``version`` changes whenever the
        set does, and differs across restarts. Against a ``known`` version the answer is the change since
        (``added``, ``removed``; both empty when nothing changed), while the index's log reaches back to it;
        otherwise the whole set (``roots``). A tail group (sliding window) serves hits without their first
        blocks: ``filterable`` False, and no set. What the lookups the client skipped would have said comes
        with the ask: ``recompute_s``, its price of a block, and ``skipped`` lookups of ``skipped_blocks``
        blocks, counted as the misses they were (``lookups_skipped`` says how many)."""
        with self._request_lock():
            g = self._group(group)
            if recompute_s is not None:
                g.recompute_s = recompute_s     # what an NVMe block must beat (CacheGroup.nvme_pays)
            if skipped:
                for c in (self.counters, g.counters):
                    c["lookups"] += skipped
                    c["lookup_blocks"] += skipped_blocks
                self.counters["lookups_skipped"] += skipped
            if g.tail_blocks is not None:
                return {"version": 0, "filterable": False}
            version = self._roots_epoch + g.index.roots_version
            since = None if known is None else known - self._roots_epoch
            changes = None if since is None or since < 0 else g.index.root_changes(since)
            if changes is None:
                return {"version": version, "filterable": True, "roots": [bytes(h) for h in g.index.roots()]}
            added, removed = changes
            return {"version": version, "filterable": True, "since": known,
                    "added": [bytes(h) for h in added], "removed": [bytes(h) for h in removed]}

    def sessions(self, client: str = "") -> list[dict[str, Any]]:
        with self._lock:
            return [s.to_dict() for s in self._sessions.values()]

    def close(self) -> None:
        """Clean shutdown: stop movers, unlink shared pools, close NVMe files (which persist).
        Idempotent."""
        self.cleaner.close()
        self.mover.close()
        with self._lock:
            for g in self.groups.values():
                g.close()
            self.groups.clear()


def _marks(marks: dict[Tier, Watermarks]) -> dict[str, dict[str, int]]:
    return {t.name.lower(): {"low_blocks": m.low, "high_blocks": m.high} for t, m in marks.items()}


def _check_joint(groups: Any, hashes: Any, recompute_s: Any) -> None:
    """The arguments of a joint lookup (or a warm): hashes, distinct group names, a non-negative price."""
    _check_hashes(hashes)
    if not isinstance(groups, (list, tuple)) or not groups or len(set(groups)) != len(groups):
        raise KvdError("bad_request", "groups must be a non-empty list of distinct names")
    if recompute_s is not None and not (isinstance(recompute_s, (int, float)) and recompute_s >= 0):
        raise KvdError("bad_request", f"recompute_s must be a non-negative number, got {recompute_s!r}")


def _check_hashes(hashes: Any) -> None:
    if not isinstance(hashes, (list, tuple)):
        raise KvdError("bad_request", "hashes must be a list")
    for h in hashes:
        if not isinstance(h, (bytes, bytearray)) or len(h) != HASH_BYTES:
            raise KvdError("bad_hash", f"a block hash is {HASH_BYTES} bytes")


def _parse_tier(tier: str | int | None) -> Tier | None:
    if tier is None or tier == "all":
        return None
    try:
        return Tier[tier.upper()] if isinstance(tier, str) else Tier(tier)
    except (KeyError, ValueError) as e:
        raise KvdError("bad_request", f"unknown tier {tier!r}") from e
