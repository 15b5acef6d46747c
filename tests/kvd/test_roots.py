"""kvd's ``roots`` verb (KvdCore.roots): the first blocks a group holds, whole or as the change since a
version the client has, so specd can skip the lookups of prompts that cannot hit (specd/engine/root_filter.py)."""
from __future__ import annotations

import pytest

from kvd import block_index
from kvd.block_index import BlockIndex, BlockRecord
from kvd.types import Tier

from tests.kvd.conftest import h, put_chain


def as_set(reply) -> set[bytes]:
    return set(reply["roots"])


def test_whole_set_lists_first_blocks_only_and_the_version_moves_with_it(make_core):
    core = make_core(gpu_blocks=8)
    first = core.roots("c", "full")
    assert first["filterable"] and as_set(first) == set()
    put_chain(core, [1, 2, 3])                   # one chain: its first block is the only root
    put_chain(core, [10, 11])
    now = core.roots("c", "full")
    assert as_set(now) == {h(1), h(10)} and now["version"] != first["version"]
    same = core.roots("c", "full", known=now["version"])
    assert same["version"] == now["version"] and same["added"] == same["removed"] == []
    assert core.evict("c", [h(10)]) == 1
    changed = core.roots("c", "full", known=now["version"])
    assert changed["since"] == now["version"] and changed["added"] == [] and changed["removed"] == [h(10)]
    assert as_set(core.roots("c", "full")) == {h(1)}
    assert core.evict("c", [h(2)]) == 1          # not a first block: the set and its version stay
    assert core.roots("c", "full")["version"] == changed["version"]


def test_changes_net_out_and_unknown_versions_get_the_whole_set(make_core):
    core = make_core(gpu_blocks=8)
    v0 = core.roots("c", "full")["version"]
    put_chain(core, [1])
    core.evict("c", [h(1)])
    put_chain(core, [1])                          # removed and back: the latest change wins
    put_chain(core, [2])
    core.evict("c", [h(2)])                       # added and gone: the client never saw it, it is "removed"
    delta = core.roots("c", "full", known=v0)
    assert delta["added"] == [h(1)] and delta["removed"] == [h(2)]
    for stale in (v0 - 1, delta["version"] + 1, 0, 2**64 - 1):   # before, after, or from another kvd
        assert as_set(core.roots("c", "full", known=stale)) == {h(1)}


def test_the_log_is_bounded_and_too_old_a_version_gets_the_whole_set(monkeypatch):
    monkeypatch.setattr(block_index, "ROOT_LOG", 4)
    idx = BlockIndex()
    recs = [BlockRecord(hash=h(i), parent=None, depth=0, tier=Tier.GPU, slot=i) for i in range(6)]
    for r in recs[:2]:
        idx.insert(r)
    v2 = idx.roots_version
    for r in recs[2:]:
        idx.insert(r)                             # 4 more changes: the log (4) still reaches back to v2 + 1...
    added, removed = idx.root_changes(v2)
    assert set(added) == {h(2), h(3), h(4), h(5)} and removed == []
    idx.remove(h(0))                              # ...now it does not: the change after v2 fell out
    assert idx.root_changes(v2) is None
    added, removed = idx.root_changes(idx.roots_version - 1)
    assert added == [] and removed == [h(0)]
    assert set(idx.roots()) == {h(i) for i in range(1, 6)}


def test_tail_groups_cannot_be_filtered(make_core):
    core = make_core(gpu_blocks=8, max_groups=2)
    core.attach("c", "swa", 64, tail_blocks=2)
    reply = core.roots("c", "swa")
    assert reply["filterable"] is False and "roots" not in reply


def test_skipped_lookups_count_as_misses_and_the_price_is_taken(make_core):
    core = make_core(gpu_blocks=8)
    put_chain(core, [1, 2])
    lease = core.lookup("c", "full", [h(1), h(2)]).lease
    core.release("c", lease)
    before = core.stats()
    assert before["hit_rate"] == 1.0
    core.roots("c", "full", recompute_s=0.25, skipped=3, skipped_blocks=6)
    after = core.stats()
    assert after["lookups"] == before["lookups"] + 3 and after["lookups_skipped"] == 3
    assert after["hit_rate"] == pytest.approx(2 / 8)
    assert after["groups"]["full"]["lookup_blocks"] == 8
    assert core.groups["full"].recompute_s == 0.25


def test_unknown_group_is_a_typed_error(make_core):
    from kvd.core_types import KvdError
    core = make_core()
    with pytest.raises(KvdError):
        core.roots("c", "nope")


@pytest.mark.slow
def test_roots_over_the_wire_and_bad_input_is_a_typed_error(tmp_path):
    """A real kvd process: the verb answers through the client, posted or waited; bad fields are refused
    with BadRequest (client-side validation, or kvd's own for a raw frame) and kvd keeps serving."""
    from bench.kvd_process import KvdProcess
    from client.kvd_client import BadRequest, KvdClient, UnknownGroup
    from kvd import protocol as P

    with KvdProcess(tmp_path / "kvd", gpu_bytes=1 << 20, dram_bytes=0) as kvd, KvdClient(kvd.run_dir) as c:
        c.attach("full", 4096)
        first = c.roots("full")
        assert first["filterable"] and first["roots"] == []
        lease, blocks = c.allocate("full", 2)
        c.commit(lease, [(blocks[0], h(1), None), (blocks[1], h(2), h(1))])
        delta = c.roots("full", known=first["version"])
        assert delta["added"] == [h(1)] and delta["removed"] == [] and delta["since"] == first["version"]
        with pytest.raises(UnknownGroup):
            c.roots("nope")
        with pytest.raises(Exception):             # pydantic refuses it before it is sent
            P.Roots(group="full", known=-1)
        got = []
        c.post_fields({"type": "roots", "group": "full", "known": "seven"}, got.append)
        c.settle()
        assert isinstance(got[0], BadRequest)
        assert set(c.roots("full")["roots"]) == {h(1)}     # still serving
