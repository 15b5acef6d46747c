"""``bench serve --persistent`` on the CPU with stories260K: a reset stack starts each cell as cold as a
fresh process (kvd holds no published block, and the same replay gets the same prompt tokens from cache
as fresh processes do), and the 0%-hit workload gets no hit at all."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.report import check_report
from bench.stack import Stack, StackOptions, published_blocks
from client.kvd_client import KvdClient
from client.specd_client import SpecdClient

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "stories260K.gguf"
PROMPT = "Once upon a time there was a little girl named Lily. She loved to play outside in the park. " * 2


@pytest.mark.slow
def test_reset_releases_the_engine_reserve_flushes_and_the_next_request_is_cold():
    """After a reset kvd holds no published block and the same prompt is cold again. (An idle engine now
    gives its reserve lease back, so kvd's flush alone usually empties it; the sweeps cover an engine that
    is still busy, whose open reserve lease keeps the blocks committed through it.)"""
    with Stack("prefix-lru", StackOptions(model=MODEL, max_model_len=512)) as stack:
        stack.warm_up()
        with SpecdClient(stack.run_dir, timeout_s=60) as specd, \
                KvdClient(stack.kvd.run_dir, admin=True, timeout_s=10) as admin:
            first = specd.generate(PROMPT, max_tokens=4, temperature=0.0)
            assert specd.generate(PROMPT, max_tokens=4, temperature=0.0).usage.cached_tokens > 0
            done = stack.reset()
            assert done["sweeps"] >= 2 and published_blocks(admin.stats()) == 0
            again = specd.generate(PROMPT, max_tokens=4, temperature=0.0)
        assert again.usage.cached_tokens == 0 and again.token_ids == first.token_ids


def _serve(out: Path, *extra: str) -> dict:
    argv = ["serve", "--model", str(MODEL), "--max-model-len", "512", "--time-scale", "0.001", "--scale", "tiny",
            "--out", str(out), "--no-progress", *extra]
    assert bench_main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _cached_by_request(out: Path) -> dict[tuple, int]:
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return {(r["repeat"], r["config"], r["script_id"], r["turn"]): r["cached_tokens"] for r in rows}


@pytest.mark.slow
def test_persistent_and_fresh_runs_get_the_same_prompt_tokens_from_cache(tmp_path):
    """Concurrency 1 (a deterministic order), two repeats: the second repeat of a persistent run replays the
    very sessions the first one cached, so any state the reset missed would show up as extra hits."""
    flags = ("--workload", "all", "--sessions", "1", "--configs", "prefix-lru,ours", "--concurrency", "1",
             "--repeats", "2", "--gpu-blocks", "96", "--dram-blocks", "64", "--nvme-blocks", "64")
    fresh = _serve(tmp_path / "fresh", *flags)
    persistent = _serve(tmp_path / "persistent", *flags, "--persistent")
    assert check_report(fresh) == [] and check_report(persistent) == []
    assert "persistent" in persistent["meta"]["stacks"]
    by_fresh, by_persistent = _cached_by_request(tmp_path / "fresh"), _cached_by_request(tmp_path / "persistent")
    assert by_persistent == by_fresh and sum(by_fresh.values()) > 0
    for name in ("prefix-lru", "ours"):
        shares = [r["cache_share"] for r in persistent["configs"][name]["1"]["repeats"]]
        assert shares[0] == shares[1] > 0
    assert (tmp_path / "persistent" / "logs" / "ours" / "kvd.log").exists()
    for results in (fresh, persistent):
        _assert_daemon_stats(results, ("prefix-lru", "ours"))


def _assert_daemon_stats(results: dict, kvd_configs: tuple[str, ...]) -> None:
    """Each cell recorded what specd and kvd did during it (bench/cell_stats.py): the engine's steps
    and kvd lookups, as differences (the warm-up and the reset sweeps happened before the snapshot)."""
    for name, per in results["configs"].items():
        for cell in per.values():
            stats = cell["stats"]
            assert stats["errors"] == []
            specd = stats["specd"]["counters"]
            assert specd["steps_total"] > 0 and specd["forward_seconds_total"] > 0
            assert specd["requests_total"] == cell["requests"]  # only the cell's own requests
            if name in kvd_configs:
                kvd = stats["kvd"]["counters"]
                assert kvd["lookups"] > 0 and kvd["server"]["busy"]["lookup"]["count"] > 0
                assert specd["kvd_rpc_lookup_total"] > 0 and "tiers" in stats["kvd"]["gauges"]


@pytest.mark.slow
def test_unique_prompts_get_no_hit_and_levels_can_replay_fewer_sessions(tmp_path):
    results = _serve(tmp_path / "u", "--workload", "unique", "--sessions", "4", "--configs", "standard,ours",
                     "--concurrency", "1,2", "--level-sessions", "1:2", "--persistent", "--max-tokens", "4")
    assert check_report(results) == []
    for name in ("standard", "ours"):
        assert results["configs"][name]["1"]["requests"] == 2 and results["configs"][name]["2"]["requests"] == 4
        assert results["configs"][name]["1"]["cached_prompt_tokens"] == 0
        assert results["configs"][name]["2"]["cached_prompt_tokens"] == 0
