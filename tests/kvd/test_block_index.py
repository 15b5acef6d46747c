from kvd.block_index import BlockIndex, BlockRecord
from kvd.types import Tier

from tests.kvd.conftest import h


def rec(i, parent=None, depth=0):
    return BlockRecord(h(i), h(parent) if parent is not None else None, depth, Tier.GPU, i)


def test_prefix_stops_at_first_gap():
    idx = BlockIndex()
    for r in (rec(0), rec(1, 0, 1), rec(3, 2, 3)):  # 2 is missing: 3 is present but unreachable
        idx.insert(r)
    got = idx.prefix([h(0), h(1), h(2), h(3)])
    assert [r.hash for r in got] == [h(0), h(1)]
    assert idx.prefix([h(9), h(0)]) == []


def test_children_counts_survive_parent_drop_and_recommit():
    idx = BlockIndex()
    idx.insert(rec(0))
    idx.insert(rec(1, 0, 1))
    idx.insert(rec(2, 0, 1))
    assert idx.get(h(0)).children == 2
    idx.remove(h(1))
    assert idx.get(h(0)).children == 1
    idx.remove(h(0))  # 2 becomes an orphan
    idx.insert(rec(0))  # re-committed parent sees its present child
    assert idx.get(h(0)).children == 1
    idx.remove(h(2))
    assert idx.get(h(0)).children == 0
