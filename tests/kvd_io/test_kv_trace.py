"""The kv-trace benchmark end to end on a small Mooncake-format trace, and the trace reader."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.mooncake import TraceHasher, block_tokens, ideal_token_hit_rate, read_trace, unique_blocks

ROOT = Path(__file__).resolve().parents[2]


def write_trace(path: Path) -> Path:
    rows = [{"timestamp": i * 10, "input_length": 512 * len(ids) - 100, "output_length": 5, "hash_ids": ids}
            for i, ids in enumerate([[0, 1, 2], [0, 1, 3], [4], [0, 1, 2, 5], [4, 6]] * 4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_reader_is_deterministic_and_chains_share_prefixes(tmp_path):
    trace = read_trace(write_trace(tmp_path / "t.jsonl"))
    assert len(trace) == 20 and unique_blocks(trace) == 7
    assert block_tokens(3) == block_tokens(3) and block_tokens(3) != block_tokens(4)
    a, b = TraceHasher().chain(trace[0].hash_ids), TraceHasher().chain(trace[1].hash_ids)
    assert a[:2] == b[:2] and a[2] != b[2]  # equal ids -> equal blocks; a new id -> a new hash
    # first pass: nothing hits; later passes hit everything but the first request of its kind
    assert 0 < ideal_token_hit_rate(trace) < 1


@pytest.mark.slow
def test_kv_trace_runs_policies_against_a_real_kvd(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "bench", "kv-trace", "--trace", str(trace), "--policy", "lru,reuse",
                          "--capacity", "0.5,10", "--speedup", "0", "--no-progress", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "token hit" in res.stdout
    data = json.loads(out.read_text())
    assert [(r["policy"], r["capacity"]) for r in data["runs"]] == [("lru", 0.5), ("reuse", 0.5), ("lru", 10), ("reuse", 10)]
    for r in data["runs"]:
        assert r["kvd_stats"]["lookups"] == 20
        assert r["lookup_p99_us"] >= r["lookup_p50_us"] > 0
    big = [r for r in data["runs"] if r["capacity"] == 10]
    assert all(r["token_hit_rate"] == pytest.approx(data["ideal_token_hit_rate"]) for r in big)
