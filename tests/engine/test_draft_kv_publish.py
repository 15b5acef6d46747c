"""DraftCache's publish and restore rules against an in-memory source (no kvd process, no model):
a gapped (shifted) context never publishes, an unshifted one publishes each complete block once under
the target chain in the drafter's namespace, and a restore gives back the same K/V bit for bit."""
from __future__ import annotations

import torch

from kvd.hashing import chain_hashes
from kvd.types import BlockId, LeaseId
from specd.drafter.context_cache import DraftContext
from specd.engine.detokenizer import Detokenizer
from specd.engine.draft_cache import DraftCache
from specd.engine.request import Request
from specd.engine.sequence import Sequence, SeqStatus
from specd.sampling_params import SamplingParams

BS, LAYERS, HKV, D = 4, 2, 2, 3


class MemorySource:
    """A kvd stand-in for one side group: published hash -> slot, one pool, call log."""

    def __init__(self, blocks: int = 16):
        self.connected = True
        self.pool: torch.Tensor | None = None
        self.blocks = blocks
        self.published: dict[bytes, int] = {}
        self.free = list(range(blocks))
        self.calls: list[str] = []
        self.next_lease = 1

    def attach_group(self, group: str, block_bytes: int) -> torch.Tensor:
        if self.pool is None:                        # one group shared by every attached engine
            self.pool = torch.zeros(self.blocks, block_bytes, dtype=torch.uint8)
        return self.pool

    def allocate(self, n: int, group=None):
        self.calls.append("allocate")
        taken, self.free = self.free[:n], self.free[n:]
        self.next_lease += 1
        return LeaseId(self.next_lease), [BlockId(b) for b in taken]

    def commit(self, lease, entries):
        self.calls.append("commit")
        for block, h, parent in entries:
            assert parent is None or bytes(parent) in self.published    # chain order, like kvd's bad_chain
            self.published[bytes(h)] = block
        return [b for b, _, _ in entries]

    def lookup(self, hashes, session=None, group=None):
        hits = []
        for h in hashes:
            if bytes(h) not in self.published:
                break
            hits.append(BlockId(self.published[bytes(h)]))
        return (LeaseId(99) if hits else None), hits

    def release(self, leases, hints=None):
        self.calls.append("release")


class StubDrafter:
    keeps_tail = False

    def new_context(self) -> DraftContext:
        return DraftContext(LAYERS, HKV, D, torch.float32, torch.device("cpu"))


class StubProposer:
    def __init__(self, sha: str = "a" * 64):
        self.drafter = StubDrafter()
        self.weights_sha256 = sha
        self.prefix_cache = None

    def absorb(self, seq) -> None:
        pass


def sequence(n_tokens: int, offset: int = 0, seed: int = 0) -> Sequence:
    seq = Sequence(Request("r", list(range(1, n_tokens + 1)), SamplingParams()), Detokenizer(str, []), None)
    seq.hashes = chain_hashes(b"\0" * 16, seq.prompt_ids, BS)
    seq.status = SeqStatus.RUNNING
    ctx = StubDrafter().new_context()
    g = torch.Generator().manual_seed(seed)
    ctx.append([(torch.randn(n_tokens - offset, HKV, D, generator=g), torch.randn(n_tokens - offset, HKV, D, generator=g))
                for _ in range(LAYERS)])
    ctx.offset = offset
    seq.draft_ctx = ctx
    return seq


def cache(source: MemorySource, proposer: StubProposer | None = None) -> DraftCache:
    dc = DraftCache(source, BS, lambda seq: "dspark")
    dc.offer("dspark", proposer or StubProposer())
    return dc


def test_a_gapped_context_never_publishes():
    source = MemorySource()
    dc = cache(source)
    dc.publish([sequence(13, offset=4)])
    assert source.calls == [] and source.published == {}
    assert dc.stats()["draft_published_blocks_total"] == 0


def test_an_unshifted_context_publishes_each_complete_block_once():
    source = MemorySource()
    dc = cache(source)
    seq = sequence(13)                               # 3 full blocks, one partial
    dc.publish([seq])
    assert source.calls == ["allocate", "commit", "release"]
    assert set(source.published) == {bytes(dc.key(h)) for h in seq.hashes[:3]}
    assert not set(source.published) & {bytes(h) for h in seq.hashes}     # the drafter's namespace, not the target's
    dc.publish([seq])                                # nothing new: no round trip
    assert source.calls == ["allocate", "commit", "release"]
    assert dc.stats()["draft_published_blocks_total"] == 3 == seq.num_draft_published


def test_restore_gives_back_the_published_context_bit_for_bit():
    source = MemorySource()
    dc = cache(source)
    writer = sequence(13, seed=1)
    dc.publish([writer])
    reader = sequence(13, offset=13, seed=2)
    reader.draft_ctx = None
    ctx = dc.restore(reader, 8)                      # a target hit of 2 blocks
    assert ctx is not None and ctx.n == 8 and ctx.offset == 0 and reader.num_draft_published == 2
    for layer in range(LAYERS):
        for got, want in zip(ctx.layer(layer), writer.draft_ctx.layer(layer)):
            assert torch.equal(got, want[:8])
    assert dc.stats()["draft_hit_blocks_total"] == 2 and dc.stats()["draft_hit_tokens_total"] == 8


def test_a_short_draft_hit_falls_back_and_another_drafter_never_matches():
    source = MemorySource()
    cache(source).publish([sequence(9)])             # 2 blocks published
    dc = cache(source)
    reader = sequence(13)
    assert dc.restore(reader, 12) is None            # the target hit 3 blocks, the draft group 2
    assert dc.stats()["draft_short_hits_total"] == 1 and reader.num_draft_published == 0
    other = DraftCache(source, BS, lambda seq: "dspark")
    other.offer("dspark", StubProposer(sha="b" * 64))
    assert other.restore(sequence(13), 8) is None     # same target chain, other weights: no hit
