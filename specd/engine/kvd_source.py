"""Blocks leased from kvd: the shared, cached pool.

If kvd stops answering, the source degrades instead of failing requests: it adopts the pool mapping
it already holds as a private pool (the blocks live sequences use stay where they are, every other
block becomes free), stops looking up and publishing, and says so through ``connected``. The engine
re-attaches to a restarted kvd when it is idle, so no live block table ever spans two pools. A wrong KV block is never served: in degraded mode nothing is looked up at all.

One kvd cache group per group of the layout (specd/engine/kv_layout.py): ``full`` for a full-attention
model, ``full`` + ``swa`` for one with sliding-window layers (attached with the swa group's tail rule).
Lookups carry the engine's recompute time per block (``prefill``, fed by the engine's steps) so kvd can
apply its prefetch budget. A side group that is not part of the layout (``attach_group``: the drafter's
context K/V, specd/engine/draft_cache.py) lives in ``pools`` too, but never joins a joint lookup.
"""
from __future__ import annotations

import itertools
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from client.kvd_client import KvdClient, KvdClientError, map_pool
from client.kvd_client import KvdUnavailable as _ClientUnavailable
from client.kvd_client import OutOfBlocks as _KvdOutOfBlocks
from client.kvd_client import PromotionFailed
from kvd import protocol as P
from kvd.types import BlockHash, BlockId, LeaseId
from specd.engine.block_source import OutOfBlocks
from specd.engine.kv_layout import KVLayout
from specd.engine.prefill_rate import PrefillRate
from specd.engine.root_filter import RootFilter

log = logging.getLogger("specd.kvd")

ATTACH_TIMEOUT_S = 30.0   # a first attach may make kvd allocate (and pin) its pools: seconds for GBs
PROBE_TIMEOUT_S = 0.5     # probing for a restarted kvd while serving must not delay requests
CALL_TIMEOUT_S = 2.0      # a dead kvd must not stall a decode step for long
HEARTBEAT_S = 2.0         # well under kvd's default 30 s lease TTL
WATCH_TIMEOUT_S = 30.0    # kvd answers a parked wait_ready by then; the engine gives up far sooner


class KvdUnavailable(Exception):
    """kvd cannot be used (not running, or its pool cannot be mapped on this device)."""


class KvdBlockSource:
    defers_commits = True      # commit(on_done=...) is posted; its answer is taken whenever it has come

    def __init__(self, client: KvdClient, pools: dict[str, torch.Tensor], layout: KVLayout, run_dir: Path):
        self.client = client
        self.pools = pools                     # group -> [N, block_bytes] uint8, mapped from kvd
        self.primary = layout.groups()[0].name
        self.pool = pools[self.primary]
        self.layout_groups = [g.name for g in layout.groups()]     # what a joint lookup spans
        self.num_blocks = self.pool.shape[0]
        self.layout = layout
        self.run_dir = run_dir
        self.prefill = PrefillRate(layout.block_size)   # fed by the engine; priced into every lookup
        self._connected = True
        self._held: dict[LeaseId, tuple[str, list[BlockId]]] = {}     # every live lease -> (group, its blocks)
        self._free: dict[str, list[BlockId]] = {}                     # used only when degraded
        self._next_local_lease = -1                        # degraded leases are negative: never sent to kvd
        # lookup leases whose promotions were in flight: lease -> (watch id, None pending | True landed | False lost)
        self._landing: dict[LeaseId, tuple[int, bool | None]] = {}
        # posted allocates not answered yet: token -> on_done, told None if kvd dies first
        self._ahead: dict[int, Callable[[LeaseId | None, list[BlockId]], None]] = {}
        self._ahead_ids = itertools.count(1)
        self.promotion_failures = 0
        self.lookup_errors = 0
        self.warmed_blocks = 0          # blocks kvd started promoting on our warms (prefetch on arrival)
        self.roots = RootFilter()       # the primary group's first blocks: a prompt outside them cannot hit
        self._price_sent = False        # has a roots ask carried the recompute price yet (refresh_roots)
        self._in_forward = False        # answers taken while a forward may still read our slots (drain_in_forward)
        self._late_give_back: list[tuple[LeaseId, list[BlockId]]] = []   # duplicates' slots, for after it

    @classmethod
    def connect(cls, run_dir: Path, layout: KVLayout, device: torch.device,
                attach_timeout_s: float = ATTACH_TIMEOUT_S) -> "KvdBlockSource":
        client = KvdClient(run_dir, timeout_s=attach_timeout_s)
        pools: dict[str, torch.Tensor] = {}
        try:
            for g in layout.groups():
                info = client.attach(g.name, g.layout.block_bytes, g.tail_blocks)
                pools[g.name] = map_pool(info)
                log.info("attached to kvd group %s at %s: %d blocks of %d bytes (%s)", g.name, run_dir,
                         info.gpu_blocks, info.block_bytes, info.kind)
            client.timeout_s = CALL_TIMEOUT_S
        except KvdClientError as exc:
            client.close()
            raise KvdUnavailable(str(exc)) from exc
        for pool in pools.values():
            if pool.device.type != device.type:
                client.close()
                raise KvdUnavailable(f"kvd's pool is on {pool.device.type}, the engine runs on {device.type}; "
                                     f"start kvd with --device {device.type}")
        client.start_heartbeat(HEARTBEAT_S)
        return cls(client, pools, layout, Path(run_dir))

    @property
    def connected(self) -> bool:
        return self._connected

    # -- the BlockSource interface ----------------------------------------------------------
    def attach_group(self, group: str, block_bytes: int) -> torch.Tensor:
        """Attach a side group (full-attention hits) and map its pool: [N, block_bytes] uint8."""
        if not self._connected:
            raise KvdUnavailable("kvd is not connected")
        try:
            pool = map_pool(self.client.attach(group, block_bytes, None))
        except KvdClientError as exc:
            raise KvdUnavailable(str(exc)) from exc
        if pool.device.type != self.pool.device.type:
            raise KvdUnavailable(f"group {group}'s pool is on {pool.device.type}, not {self.pool.device.type}")
        self.pools[group] = pool
        return pool

    def lookup(self, hashes: Sequence[BlockHash], session: str | None = None,
               group: str | None = None) -> tuple[LeaseId | None, list[BlockId], int]:
        """The longest cached prefix of ``group`` (default: the primary). A side group's lookup sends no
        recompute time: its hit is only taken after the primary's, so kvd promotes all of it. Never waits
        for promotions: ``landed`` says when the hit may be read."""
        if not self._connected:
            return None, [], 0
        group = group or self.primary
        side = group != self.primary
        if not side and not self.roots.may_hit(hashes):
            return None, [], 0
        recompute_s = None if side else self.prefill.block_seconds()
        try:     # a side lookup names its block size, for kvd's per-group hit-token counter
            res = self.client.lookup(group, list(hashes), session, block_tokens=self.layout.block_size if side else None,
                                     recompute_s=recompute_s)
        except KvdClientError as exc:
            self._degrade(exc)
            return None, [], 0
        return self._take_lookup(res, group)

    def lookup_many(self, requests: Sequence[tuple[Sequence[BlockHash], str | None]]
                    ) -> list[tuple[LeaseId | None, list[BlockId], int]]:
        """Primary-group lookups of several prompts in one round trip (kvd's ``batch``): what ``lookup``
        answers for each, in order. The scheduler's admissions of one step look up together. The ops go as
        wire maps (``P.lookup_fields``): the hashes are the engine's own, and validating 32 prompts' worth on
        the way out cost ~0.1 ms of the round trip (docs/design/kvd.md "Session 5"); kvd validates them."""
        if not self._connected:
            return [(None, [], 0)] * len(requests)
        asking = [i for i, (hashes, _) in enumerate(requests) if self.roots.may_hit(hashes)]
        out: list[tuple[LeaseId | None, list[BlockId], int]] = [(None, [], 0)] * len(requests)
        if not asking:
            return out
        recompute_s = self.prefill.block_seconds()
        ops = [P.lookup_fields(self.primary, list(requests[i][0]), requests[i][1], recompute_s=recompute_s)
               for i in asking]
        try:
            results = self.client.batch_fields(ops)
        except KvdClientError as exc:
            self._degrade(exc)
            return out
        for i, res in zip(asking, results):
            out[i] = self._take_lookup(res, self.primary)
        return out

    def _take_lookup(self, res, group: str) -> tuple[LeaseId | None, list[BlockId], int]:
        """Hold a lookup's hit (watching its promotions) or release an empty lease; a refused lookup
        in a batch is a miss. The third value is kvd's ``room_cut``: blocks past the hit that kvd holds
        but had no GPU slot to promote into."""
        if isinstance(res, KvdClientError):
            self.lookup_errors += 1
            log.warning("kvd refused a lookup: %s", res)
            return None, [], 0
        if not res.hits:
            if res.lease:
                self._release_remote(res.lease)
            return None, [], res.room_cut
        self._held[res.lease] = (group, list(res.hits))
        if not res.ready:
            self._watch(res.lease)
        return res.lease, list(res.hits), res.room_cut

    def lookup_groups(self, hashes: Sequence[BlockHash], session: str | None = None
                      ) -> tuple[int, dict[str, tuple[LeaseId | None, int, list[BlockId]]]]:
        """One joint hit across every group (kvd's ``lookup_groups``); like ``lookup``, never waits."""
        miss = {g: (None, 0, []) for g in self.layout_groups}
        if not self._connected or not self.roots.may_hit(hashes):
            return 0, miss
        try:
            res = self.client.lookup_groups(self.layout_groups, list(hashes), session,
                                            recompute_s=self.prefill.block_seconds())
        except KvdClientError as exc:
            self._degrade(exc)
            return 0, miss
        out: dict[str, tuple[LeaseId | None, int, list[BlockId]]] = {}
        for g, r in res.results.items():
            if r.hits:
                self._held[r.lease] = (g, list(r.hits))
                if not r.ready:
                    self._watch(r.lease)
            out[g] = (r.lease if r.hits else None, r.first, list(r.hits))
        return res.hit, out

    def warm(self, hashes: Sequence[BlockHash]) -> bool:
        """Post kvd's ``warm`` for a prompt that has just arrived (prefetch on arrival): its cached prefix
        starts moving up to the GPU while the running forward finishes, and the prompt's lookup in the next
        step finds it landed or in flight. Fire and forget: the answer (blocks queued) is only counted, a
        refusal only loses the head start. Returns whether a warm was sent (not for a prompt whose first
        block kvd does not hold, as a lookup would be skipped)."""
        if not self._connected or not self.roots.may_hit(hashes):
            return False
        def answered(out) -> None:
            if isinstance(out, _ClientUnavailable):
                self._degrade(out)
            elif isinstance(out, KvdClientError):
                log.debug("kvd refused a warm: %s", out)
            elif isinstance(out, dict):
                self.warmed_blocks += int(out.get("blocks", 0))
        with self._degrading():
            self.client.post_fields(P.warm_fields(self.layout_groups, list(hashes), self.prefill.block_seconds()),
                                    answered, needed=False)
            return True
        return False

    # -- promotions in flight -----------------------------------------------------------------
    def _watch(self, lease: LeaseId) -> None:
        """Ask kvd to say when ``lease``'s promotions land (a parked wait_ready), without waiting for it."""
        def answered(out) -> None:
            if lease not in self._landing:
                return                          # released meanwhile (an abort, a give-up)
            if isinstance(out, _ClientUnavailable):
                self._degrade(out)
            elif isinstance(out, PromotionFailed):
                self.promotion_failures += 1
                log.warning("kvd lost a promoted block of lease %d: recomputing", lease)
            self._landing[lease] = (wid, not isinstance(out, KvdClientError))
        try:
            wid = self.client.watch(P.WaitReady(lease=lease, timeout_s=WATCH_TIMEOUT_S), answered)
        except KvdClientError as exc:
            self._degrade(exc)
            wid = 0
        self._landing[lease] = (wid, None)

    def landed(self, leases: Sequence[LeaseId]) -> bool | None:
        """True when every promotion of these leases has landed (or none was needed), None while one is
        in flight, False when one never will: it failed, timed out, or kvd is gone (a hit that did not
        land is never read, even after a degrade adopted its slots)."""
        states = [self._landing[lease][1] for lease in leases if lease in self._landing]
        if False in states or (None in states and not self._connected):
            return False
        return None if None in states else True

    def poll(self) -> None:
        """Apply the readiness answers kvd has sent (never waits)."""
        if not self._connected or not self.client.watching:
            return
        with self._degrading():
            self.client.poll_watches()

    def allocate(self, n: int, group: str | None = None) -> tuple[LeaseId, list[BlockId]]:
        group = group or self.primary
        if self._connected:
            try:
                lease, blocks = self.client.allocate(group, n)
                self._held[lease] = (group, list(blocks))
                return lease, list(blocks)
            except _KvdOutOfBlocks as exc:
                raise OutOfBlocks(str(exc)) from exc
            except KvdClientError as exc:
                self._degrade(exc)
        return self._allocate_local(n, group)

    def allocate_ahead(self, n: int, on_done: Callable[[LeaseId | None, list[BlockId]], None]) -> None:
        """Post an allocate of ``n`` primary blocks: ``on_done(lease, blocks)`` runs when its answer is
        handed out (``drain`` at the next step, or ``settle``), ``on_done(None, [])`` if it is refused or
        kvd dies first. The caller uses no block before that: until then it knows no block id."""
        if not self._connected:
            on_done(None, [])
            return
        token = next(self._ahead_ids)
        self._ahead[token] = on_done

        def answered(out) -> None:
            if self._ahead.pop(token, None) is None:
                return                                   # told None at a degrade already
            if isinstance(out, KvdClientError):
                if isinstance(out, _ClientUnavailable):
                    self._degrade(out)
                on_done(None, [])
                return
            lease, blocks = out
            self._held[lease] = (self.primary, list(blocks))
            on_done(lease, list(blocks))
        with self._degrading():
            self.client.post(P.Allocate(group=self.primary, n=n), answered)

    def refresh_roots(self, now: float) -> None:
        """Post a ``roots`` ask when the mirror is due (``RootFilter.refresh_s``); its answer is taken with
        the other posted answers (``drain``/``settle``), during the forward."""
        price = self.prefill.block_seconds()
        if not self._connected or not self.roots.due(now, urgent=price is not None and not self._price_sent):
            return
        self._price_sent = price is not None
        def answered(out) -> None:
            self.roots.answered(out)
            if isinstance(out, _ClientUnavailable):
                self._degrade(out)
        skipped, skipped_blocks = self.roots.unreported
        known = self.roots.asked(now)
        with self._degrading():
            self.client.post_fields(P.roots_fields(self.primary, known, price, skipped, skipped_blocks), answered,
                                    needed=False)

    def drain(self) -> None:
        """Take the answers of posted ops that have arrived (a refill allocate's blocks), never waiting."""
        if not self._connected or not self.client.unsettled:
            return
        with self._degrading():
            self.client.drain()

    def commit(self, lease: LeaseId, entries, on_done=None) -> list[BlockId] | None:
        """Publish ``entries``. With ``on_done`` the commit is posted (no wait) and ``on_done(canonical or
        None)`` runs when its answer is taken (``drain`` or ``settle``, whichever comes first after it
        arrives); nothing waits for it, because kvd keeps a duplicate's slot leased to us (protocol v3)
        until ``_give_back_duplicates`` returns it after the switch. Without ``on_done`` it waits and
        returns the canonical ids; our duplicate slots then stay held until the lease ends. The posted
        commit goes as its wire map (``P.commit_fields``): ints and hashes the engine made, which kvd
        validates on receipt (a bad one comes back as a refused commit), not twice."""
        if not self._connected or lease < 0:
            return None
        wire = [(int(b), bytes(h), None if p is None else bytes(p)) for b, h, p in entries]
        if self.pools.get(self.primary) is not None and self._held.get(lease, (self.primary,))[0] == self.primary:
            for _, h, p in wire:
                if p is None:
                    self.roots.committed(h)
        if on_done is not None:
            def answered(out) -> None:
                canonical = self._committed(lease, entries, out)
                on_done(canonical)                      # the table points at the canonical blocks now
                self._give_back_duplicates(lease, entries, canonical)

            with self._degrading():   # not needed before the forward: kvd keeps a duplicate's slot ours
                self.client.post_fields(P.commit_fields(int(lease), wire), answered, needed=False)
            return None
        try:
            out = self.client.commit(lease, wire)
        except KvdClientError as exc:
            out = exc
        return self._committed(lease, entries, out)

    def _committed(self, lease: LeaseId, entries, out) -> list[BlockId] | None:
        """A commit's answer (canonical ids or the error): track duplicates in ``_held``."""
        if isinstance(out, _ClientUnavailable):
            self._degrade(out)
            return None
        if isinstance(out, KvdClientError):
            # a refused commit (e.g. the lease was reclaimed) only loses a cache entry, never correctness
            log.warning("kvd refused a commit: %s", out)
            return None
        if lease in self._held:
            held = self._held[lease][1]
            for (mine, _, _), block in zip(entries, out):
                if block != mine:      # a duplicate: kvd leased us its canonical block and kept ours ours
                    held.append(block)
        return out

    def _give_back_duplicates(self, lease: LeaseId, entries, canonical: list[BlockId] | None) -> None:
        """After ``on_done`` switched the table to a duplicate's canonical block, give our own slot back
        (posted). Safe then: the engine handles answers between steps, after the last forward that read
        the slot has finished (its step synchronised), and no later forward reads it. A lease already
        released took the slot with it."""
        if canonical is None or lease not in self._held:
            return
        dups = [mine for (mine, _, _), block in zip(entries, canonical) if block != mine]
        if dups and self._in_forward:            # the running forward may read them: after it (after_forward)
            self._late_give_back.append((lease, dups))
        elif dups:
            self.release_blocks(lease, dups)

    def drain_in_forward(self) -> None:
        """``drain`` while the GPU runs a forward the host has launched and not waited for: the answers'
        handlers (commit answers switch tables, refills fill the reserve) run in time the host would
        spend waiting, instead of before the next forward (``blocks.settle``: +0.054 ms a step over
        `standard` on the H200, tests/kvd/host_phase_probe.py). A duplicate's own slot is not given back
        now: the launched forward was built on the table before the switch and may read it; it goes back
        at ``after_forward``."""
        self._in_forward = True
        try:
            self.drain()
        finally:
            self._in_forward = False

    def after_forward(self) -> None:
        """The forward has been waited for: give back the duplicates' slots ``drain_in_forward`` held (a
        lease released meanwhile took its slots with it)."""
        late, self._late_give_back = self._late_give_back, []
        for lease, dups in late:
            if lease in self._held:
                held = self._held[lease][1]
                mine = [b for b in dups if b in held]
                if mine:
                    self.release_blocks(lease, mine)

    @contextmanager
    def posting(self) -> Iterator[None]:
        """Send the ops posted inside (a step's commits and releases) as one frame at the end
        (``KvdClient.cork``); kvd does and answers the same as for one frame each. A failure to send
        degrades, as a failed post does."""
        corked = self._connected and self.client.cork()
        try:
            yield
        finally:
            if corked:
                with self._degrading():
                    self.client.uncork()

    def settle(self) -> None:
        """Take the answers of every posted op, waiting for them."""
        if not self._connected or not self.client.unsettled:
            return
        with self._degrading():
            self.client.settle()

    def settle_needed(self) -> None:
        """Take the answers of posted commits and allocates (the engine calls this before a forward, the
        only reader of a committed block's slot): it waits only while one of those is unanswered; a
        release's answer, which nothing needs, is taken when it has come."""
        if not self._connected or not self.client.unsettled:
            return
        with self._degrading():
            if self.client.awaiting:
                self.client.settle(needed_only=True)
            else:
                self.client.drain()

    def release(self, leases: Sequence[LeaseId], hints: dict | None = None) -> None:
        """Unpin ``leases`` (posted: nothing waits on a release). Per-block hints (``kinds``) go once, by
        hash, as a release of lease 0: the blocks a finished turn wrote may sit in a write lease that
        stays open for other sequences."""
        if hints and hints.get("kinds") and self._connected:
            self._release_remote(LeaseId(0), hints)
            hints = {k: v for k, v in hints.items() if k != "kinds"}
        for lease in leases:
            self._unwatch(lease)
            group, blocks = self._held.pop(lease, (self.primary, []))
            if not self._connected or lease < 0:
                self._free_unshared(group, blocks)
            else:
                self._release_remote(lease, hints)

    def _unwatch(self, lease: LeaseId) -> None:
        wid, _ = self._landing.pop(lease, (0, None))
        if wid:
            self.client.unwatch(wid)

    def release_blocks(self, lease: LeaseId, blocks: Sequence[BlockId]) -> None:
        group, held = self._held[lease]
        for b in blocks:
            held.remove(b)
        if not self._connected or lease < 0:
            self._free_unshared(group, blocks)
            return
        self._post(P.Release(lease=lease, blocks=[int(b) for b in blocks]), "block release")

    def _free_unshared(self, group: str, blocks: Sequence[BlockId]) -> None:
        """Degraded mode: a block goes back to the private free list only when no live lease holds it.
        Several leases can name one block (each sequence that hit a cached prefix has its own lookup
        lease on it, and a published block can be another's hit), so freeing on the first release let
        a new allocation overwrite KV a running sequence still reads (found by tests/faults)."""
        still = {b for g, held in self._held.values() if g == group for b in held}
        free = set(self._free[group])
        for b in dict.fromkeys(blocks):
            if b not in still and b not in free:
                self._free[group].append(b)

    def num_free(self) -> int:
        return len(self._free[self.primary]) if not self._connected else -1

    def heartbeat(self) -> None:
        if self._connected:
            self.client.heartbeat()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def stats(self) -> dict[str, float]:
        """Calls to kvd by op type, count and wall seconds (the heartbeat thread's included): waited
        round trips (``kvd_rpc_*``; ``settle`` is the wait for posted answers) and posted ops
        (``kvd_post_*``, seconds to send). What the shared cache costs the engine (docs/design/kvd.md)."""
        out: dict[str, float] = {}
        for kind, table in (("rpc", self.client.round_trips), ("post", self.client.posts)):
            for op, (n, seconds) in sorted(table.items()):
                out[f"kvd_{kind}_{op}_total"] = n
                out[f"kvd_{kind}_{op}_seconds_total"] = seconds
        waited = [v for op, v in self.client.round_trips.items() if op != "heartbeat"]
        out["kvd_blocking_calls_total"] = sum(n for n, _ in waited)        # the engine's thread waited
        out["kvd_blocking_seconds_total"] = sum(sec for _, sec in waited)
        out["kvd_posted_total"] = sum(n for op, (n, _) in self.client.posts.items() if op != "batch")   # ops
        out["kvd_post_frames_total"] = self.client.frames_posted    # frames those ops went in (and watches)
        out["kvd_promotion_failures_total"] = self.promotion_failures
        out["kvd_warmed_blocks_total"] = self.warmed_blocks
        out["kvd_lookups_skipped_total"] = self.roots.skipped      # prompts whose first block kvd does not hold
        block = self.prefill.block_seconds()     # what each lookup prices recomputing a block at
        if block is not None:
            out["kvd_recompute_block_seconds"] = block
        return out

    # -- failure and recovery ---------------------------------------------------------------
    def _release_remote(self, lease: LeaseId, hints: dict | None = None) -> None:
        self._post(P.Release(lease=lease, hints=hints), "release")

    def _post(self, op: P.Op, what: str) -> None:
        """Send ``op`` without waiting; its error surfaces at the next settle (a refusal only loses
        cache state; no reply at all means kvd is gone)."""
        def answered(out) -> None:
            if isinstance(out, _ClientUnavailable):
                self._degrade(out)
            elif isinstance(out, KvdClientError):
                log.warning("kvd refused a %s: %s", what, out)
        with self._degrading():
            self.client.post(op, answered, needed=False)

    @contextmanager
    def _degrading(self) -> Iterator[None]:
        """A call whose only answer to a kvd error is to degrade to local blocks (then carry on)."""
        try:
            yield
        except KvdClientError as exc:
            self._degrade(exc)

    def _degrade(self, exc: Exception) -> None:
        if not self._connected:
            return
        self._connected = False
        for group, pool in self.pools.items():
            in_use = {b for g, blocks in self._held.values() if g == group for b in blocks}
            self._free[group] = [BlockId(b) for b in reversed(range(pool.shape[0])) if b not in in_use]
        log.warning("kvd stopped answering (%s): serving without the shared cache, recomputing prefixes", exc)
        ahead, self._ahead = self._ahead, {}
        for on_done in ahead.values():      # their answers will never come: no block of theirs is used
            on_done(None, [])

    def _allocate_local(self, n: int, group: str) -> tuple[LeaseId, list[BlockId]]:
        free = self._free[group]
        if n > len(free):
            raise OutOfBlocks(f"need {n} blocks, {len(free)} free (kvd unavailable)")
        blocks = [free.pop() for _ in range(n)]
        lease = LeaseId(self._next_local_lease)
        self._next_local_lease -= 1
        self._held[lease] = (group, blocks)
        return lease, blocks

    def close(self) -> None:
        self.client.close()
