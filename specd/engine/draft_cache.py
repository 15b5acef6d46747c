"""DraftCache: the drafter's context K/V of cached prefixes, kept in kvd's "draft" cache group.

Why: on a target prefix hit the engine skips the target prefill, so the drafter never sees the
features of the cached positions. Without this cache its context would start at the first computed
token (shifted to position 0) and miss the prefix, which costs acceptance on every cached turn.

What is stored: one draft block = the context K/V of ``block_size`` positions for every draft layer,
``[L, 2, bs, Hkv, D]`` in the drafter's dtype, contiguous bytes. Its key mixes the target block's
chained hash with the drafter's namespace (checkpoint sha256, method, layers, dtype, block size), so a
block written by another drafter never matches, and the draft chain mirrors the target chain.

Publish (``publish``, end of a step): a sequence whose context holds positions from 0 (``offset == 0``)
writes each newly complete block into a draft-group slot. A shifted context never publishes: its keys
are rotated at the wrong positions. A finished sequence first absorbs its last step's features, so
its draft chain reaches as far as its target chain (the next conversation turn then hits both).

Reuse (``restore``, at a sequence's first proposal): after a target hit of h blocks the draft group is
looked up for the same h blocks, separately, so a missing draft block never shortens the target hit (a
target hit is worth more). A draft hit still being promoted from DRAM/NVMe is not waited for (skipped,
``draft_not_ready_total``). Only a draft hit of all h blocks is used: the positions of a shorter one's
missing blocks would need the target's features there, i.e. a target recompute of what was just
skipped; the context then falls back to the shifted one. EAGLE-3 is not served: its context element
at position p pairs feature p with token p+1 and its last feature stays raw, so a hit would need the
target feature at h·bs − 1, which only a recompute gives.

Ordering on CUDA: the copies into draft slots are asynchronous, so a block is committed (made visible
to kvd and other clients) only once a CUDA event recorded after its copy has completed, polled without
blocking at the next ``settle``; restored blocks stay leased until the sequence ends. No host sync.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from math import prod
from typing import Callable

import torch

from kvd.hashing import block_hash, namespace_root
from kvd.types import BlockHash, BlockId, LeaseId
from specd.drafter.context_cache import DraftContext
from specd.engine.block_source import BlockSource, OutOfBlocks
from specd.engine.sequence import Sequence, SeqStatus

log = logging.getLogger("specd.draft_cache")

GROUP = "draft"


@dataclass
class _Pending:
    """Draft blocks written but not yet committed: waiting for their copies to land."""

    event: torch.cuda.Event | None          # None: the copies were synchronous (CPU)
    lease: LeaseId
    entries: list[tuple[BlockId, BlockHash, BlockHash | None]]


class DraftCache:
    """Bound to one feature drafter (the first one offered that can use it) and one BlockSource."""

    def __init__(self, source: BlockSource, block_size: int, method_of: Callable[[Sequence], str]):
        self.source = source
        self.block_size = block_size
        self.method_of = method_of              # a sequence's speculation method
        self.method: str | None = None          # the bound drafter's method
        self.proposer = None
        self.pool: torch.Tensor | None = None   # [N, block_bytes] uint8, the draft group's GPU pool
        self.root: BlockHash | None = None      # the draft namespace
        self._pending: list[_Pending] = []
        self.counters: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.pool is not None and self.source.connected

    def offer(self, method: str, proposer) -> None:
        """Attach the draft group for ``proposer`` if kvd serves this engine and its drafter's context is
        K/V over positions alone (not EAGLE-3); a group that exists with another block size disables it."""
        drafter = getattr(proposer, "drafter", None)
        if self.pool is not None or drafter is None or getattr(drafter, "keeps_tail", True):
            return
        if not hasattr(self.source, "attach_group") or not self.source.connected:
            return
        ctx = drafter.new_context()
        shape = block_shape(ctx, self.block_size)
        from specd.engine.kvd_source import KvdUnavailable

        try:
            self.pool = self.source.attach_group(GROUP, prod(shape) * ctx.dtype.itemsize)
        except KvdUnavailable as exc:
            log.warning("no draft group in kvd (%s): drafter context is recomputed after prefix hits", exc)
            return
        self.method, self.proposer = method, proposer
        self.root = namespace_root(f"draft:{proposer.weights_sha256}", method, str(ctx.dtype),
                                   f"layers={ctx.num_layers}", self.block_size)
        proposer.prefix_cache = self

    def key(self, target_hash: BlockHash) -> BlockHash:
        """The draft block's hash: the target block's chained hash in the drafter's namespace."""
        return block_hash(self.root, [], bytes(target_hash))

    # -- reuse ---------------------------------------------------------------------------------
    def restore(self, seq: Sequence, first: int) -> DraftContext | None:
        """A context holding positions 0..first-1 from the draft group, or None (a shorter draft hit,
        or no cache): the caller then shifts. The lease stays with the sequence (the copy is async)."""
        bs = self.block_size
        n = first // bs
        if not self.enabled or first % bs or n == 0 or len(seq.hashes) < n:
            return None
        self.counters["draft_lookups_total"] += 1
        lease, hits = self.source.lookup([self.key(h) for h in seq.hashes[:n]], None, group=GROUP)[:2]
        short = len(hits) < n
        if short or not self._landed(lease):
            self.counters["draft_short_hits_total" if short else "draft_not_ready_total"] += 1
            if lease is not None:
                self.source.release([lease])
            return None
        seq.leases.append(lease)
        ctx = self.proposer.drafter.new_context()
        layers, (hkv, d) = ctx.num_layers, ctx.position_shape()
        blocks = torch.stack([self._slot(b, ctx) for b in hits])          # [n, L, 2, bs, Hkv, D]
        ctx.append([(blocks[:, i, 0].reshape(-1, hkv, d), blocks[:, i, 1].reshape(-1, hkv, d))
                    for i in range(layers)])
        seq.num_draft_published = n
        self.counters["draft_hit_blocks_total"] += n
        self.counters["draft_hit_tokens_total"] += n * bs
        return ctx

    def _landed(self, lease: LeaseId | None) -> bool:
        """Whether the draft hit is on the GPU now. One still being promoted is not waited for (the engine
        never blocks on a promotion): the context is then the shifted one, an optimization lost, no more.
        Its promotion still lands, so the next turn of the conversation finds it on the GPU."""
        landed = getattr(self.source, "landed", None)
        return lease is None or landed is None or landed([lease]) is True

    # -- publish -------------------------------------------------------------------------------
    def publish(self, seqs: list[Sequence]) -> None:
        """Write every newly complete, unshifted block of these sequences' contexts into draft slots
        (one allocation for the step), then commit what has landed."""
        if not self.enabled:
            return
        todo = [(seq, i) for seq in seqs for i in self._new_blocks(seq)]
        if todo:
            self._write(todo)
        self.settle()

    def _new_blocks(self, seq: Sequence) -> range:
        ctx = seq.draft_ctx
        if self.method_of(seq) != self.method or ctx is None or ctx.offset:
            return range(0)
        if seq.status is SeqStatus.FINISHED:
            self.proposer.absorb(seq)
        full = min(ctx.n // self.block_size, len(seq.hashes))
        done, seq.num_draft_published = seq.num_draft_published, max(seq.num_draft_published, full)
        return range(done, full)

    def _write(self, todo: list[tuple[Sequence, int]]) -> None:
        try:
            lease, slots = self.source.allocate(len(todo), group=GROUP)
        except OutOfBlocks:
            self.counters["draft_publish_skipped_blocks_total"] += len(todo)
            return
        entries = []
        for (seq, i), slot in zip(todo, slots):
            ctx = seq.draft_ctx
            start = i * self.block_size
            torch.stack([t[start:start + self.block_size] for layer in range(ctx.num_layers)
                         for t in ctx.layer(layer)], out=self._slot(slot, ctx).flatten(0, 1))   # [2L, bs, Hkv, D]
            entries.append((slot, self.key(seq.hashes[i]), self.key(seq.hashes[i - 1]) if i else None))
        event = None
        if self.pool.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(event, lease, entries))

    def settle(self) -> None:
        """Commit the written blocks whose copies have landed, and give their write leases back."""
        keep = []
        for p in self._pending:
            if p.event is not None and not p.event.query():
                keep.append(p)
                continue
            if self.source.commit(p.lease, p.entries) is not None:
                self.counters["draft_published_blocks_total"] += len(p.entries)
            self.source.release([p.lease])
        self._pending = keep

    def _slot(self, block: BlockId, ctx: DraftContext) -> torch.Tensor:
        """One draft block of the pool as [L, 2, bs, Hkv, D] in the drafter's dtype (a view)."""
        return self.pool[block].view(ctx.dtype).view(block_shape(ctx, self.block_size))

    def stats(self) -> dict[str, int]:
        return {k: self.counters[k] for k in ("draft_lookups_total", "draft_hit_blocks_total",
                                              "draft_hit_tokens_total", "draft_short_hits_total", "draft_not_ready_total",
                                              "draft_published_blocks_total", "draft_publish_skipped_blocks_total")}


def block_shape(ctx: DraftContext, block_size: int) -> tuple[int, ...]:
    """[L, 2, bs, Hkv, D]: one draft block, every layer's keys then values."""
    return (ctx.num_layers, 2, block_size, *ctx.position_shape())
