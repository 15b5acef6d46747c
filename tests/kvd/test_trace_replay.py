"""The reuse policy against LRU on the real Mooncake trace, through KvdCore (GPU only, same capacity)."""
from collections import OrderedDict

import pytest

from tests.kvd.trace_replay import TRACE, load, replay

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace missing")


def reference_lru(rows, capacity):
    """The textbook block LRU (tail touched first) that defines the 28.4% figure."""
    cap = int(capacity * len({h for r in rows for h in r["hash_ids"]}))
    od, hit, tot = OrderedDict(), 0, 0
    for r in rows:
        n = 0
        for x in r["hash_ids"]:
            if x not in od:
                break
            n += 1
        hit += min(n * 512, r["input_length"])
        tot += r["input_length"]
        for x in reversed(r["hash_ids"]):
            od[x] = 1
            od.move_to_end(x)
            if len(od) > cap:
                od.popitem(last=False)
    return hit / tot


def test_core_lru_matches_reference_lru(tmp_path):
    rows = load(limit=2000)
    got = replay(rows, 0.1, "lru", tmp_path)["token_hit_rate"]
    assert got == pytest.approx(reference_lru(rows, 0.1), abs=1e-3)


@pytest.mark.slow
def test_reuse_beats_lru_at_10_percent(tmp_path):
    rows = load()
    lru = replay(rows, 0.1, "lru", tmp_path)
    reuse = replay(rows, 0.1, "reuse", tmp_path)
    assert lru["token_hit_rate"] == pytest.approx(0.284, abs=0.002)
    assert reuse["token_hit_rate"] > lru["token_hit_rate"] + 0.01
    assert reuse["seconds"] < 30  # the core stays fast: seconds for 12k requests
