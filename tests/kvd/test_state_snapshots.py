"""Linear-attention state snapshots as a kvd cache group (tail_blocks=1): one fixed-size recurrent
state per block boundary, stored under the hash of the prefix it summarises. A synthetic recurrent
layer resumed from a snapshot hit gives exactly the states of recomputing; a prefix whose snapshot is
gone (passed by a longer chain) is not served."""
from __future__ import annotations

import torch

from kvd.hashing import block_hash, namespace_root

BS, D = 4, 8
STATE_BYTES = D * 4   # one fp32 state [D]


class Recurrent:
    """s_t = tanh(A s_{t-1} + E[x_t]): the simplest layer whose past is one fixed-size state."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(D, D, generator=g) / D ** 0.5
        self.e = torch.randn(50, D, generator=g)

    def run(self, tokens: list[int], state: torch.Tensor | None = None) -> list[torch.Tensor]:
        """States after each token, starting from ``state`` (zeros: the empty prefix)."""
        s = torch.zeros(D) if state is None else state
        out = []
        for t in tokens:
            s = torch.tanh(self.a @ s + self.e[t])
            out.append(s)
        return out


def chain(tokens: list[int]) -> list[bytes]:
    root = namespace_root("synthetic", "tok", "float32", "state", BS)
    out, parent = [], root
    for i in range(len(tokens) // BS):
        parent = block_hash(parent, tokens[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


def store(core, layer: Recurrent, tokens: list[int]) -> None:
    """Compute and publish one snapshot per full block (the state after its last token)."""
    hashes = chain(tokens)
    states = layer.run(tokens)
    lease, ids = core.allocate("c", "state", len(hashes))
    pool = core.groups["state"].gpu.tensor
    for i, b in enumerate(ids):
        pool[b].copy_(states[(i + 1) * BS - 1].view(torch.uint8))
    core.commit("c", lease, [(b, h, hashes[i - 1] if i else None) for i, (b, h) in enumerate(zip(ids, hashes))])
    core.release("c", lease)


def test_resuming_from_a_snapshot_equals_recomputing(make_core):
    core = make_core(gpu_blocks=16)
    core.attach("c", "state", STATE_BYTES, tail_blocks=1)
    layer = Recurrent()
    first = list(range(1, 21))                        # 5 blocks
    store(core, layer, first)
    assert core.stats()["groups"]["state"]["blocks"] == 1       # only the chain end's snapshot is kept
    turn2 = first + [7, 8, 9, 10, 11, 12]
    res = core.lookup_groups("c", ["state"], chain(turn2))
    assert res.hit == 5 and res.results["state"].first == 4 and len(res.results["state"].hits) == 1
    snap = core.groups["state"].gpu.tensor[res.results["state"].hits[0]].view(torch.float32).clone()
    resumed = layer.run(turn2[5 * BS:], snap)
    assert torch.equal(resumed[-1], layer.run(turn2)[-1])         # bit-exact: same ops from the same state
    assert not torch.equal(layer.run(turn2[5 * BS:])[-1], resumed[-1])   # the snapshot mattered
    core.release("c", res.results["state"].lease)
    # a prefix ending inside the old chain has no snapshot any more: no hit (recompute), never a wrong one
    assert core.lookup_groups("c", ["state"], chain(first[:12] + [1, 2, 3, 4])).hit == 0
