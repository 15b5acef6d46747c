"""A duplicate commit of a block whose promotion is still in flight must not hand out the promotion's
destination slot: its bytes have not landed yet, and the engine would read them in its next forward."""
import torch

from kvd.types import Tier

from tests.kvd.conftest import BB, h, put_chain, settle


def test_duplicate_of_a_moving_block_keeps_the_writers_own_copy(make_core):
    core = make_core(policy="lru-offload", admission="none", gpu_blocks=3, dram_blocks=2, move_workers=0)
    g = core.groups["full"]
    put_chain(core, [0], fill=lambda i: 7)
    put_chain(core, [1], fill=lambda i: 1)
    put_chain(core, [2], fill=lambda i: 2)
    settle(core)                                           # GPU full: the cleaner moves the oldest (0) to DRAM
    assert g.index.get(h(0)).tier == Tier.DRAM
    res = core.lookup("c", "full", [h(0)])                 # promotion queued (no mover threads): in flight
    rec = g.index.get(h(0))
    assert rec.moving and not res.ready
    lease2, (mine,) = core.allocate("d", "full", 1)
    g.gpu.tensor[mine].fill_(7)                            # the writer computed the same block
    (got,) = core.commit("d", lease2, [(mine, h(0), None)])
    assert got == mine != rec.dest                         # never the not-yet-filled destination
    assert torch.equal(g.gpu.tensor[got], torch.full((BB,), 7, dtype=torch.uint8))
    core.release("d", lease2)                              # the private copy is freed with its lease
    assert core.wait_ready(res.lease, timeout=10)          # the promotion still lands as the canonical block
    assert torch.equal(g.gpu.tensor[res.hits[0]], torch.full((BB,), 7, dtype=torch.uint8))
    core.release("c", res.lease)
