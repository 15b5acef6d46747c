"""The snapshot difference behind a cell's daemon stats (bench/cell_stats.py) and its report tables:
counters are differenced at any depth, gauges and strings keep their after value, missing keys count as
0, a failed fetch becomes an error string, repeats pool by summing."""
from __future__ import annotations

from bench.cell_stats import cell_stats, difference, is_gauge, pool, take
from bench.report import markdown_report, summarize_results

BEFORE = {"steps_total": 10, "forward_seconds_total": 1.5, "free_blocks": 40, "policy": "reuse",
          "lock_wait": {"count": 3, "total_s": 0.25, "max_s": 0.2, "p99_s": 0.2},
          "server": {"busy": {"lookup": {"count": 5, "seconds": 0.5, "max_s": 0.1}}},
          "tiers": {"gpu": {"used_blocks": 9}}, "gone_total": 7}
AFTER = {"steps_total": 25, "forward_seconds_total": 2.0, "free_blocks": 12, "policy": "reuse",
         "lock_wait": {"count": 10, "total_s": 0.75, "max_s": 0.3, "p99_s": 0.25},
         "server": {"busy": {"lookup": {"count": 9, "seconds": 0.75, "max_s": 0.1},
                             "commit": {"count": 2, "seconds": 0.125, "max_s": 0.1}}},
         "tiers": {"gpu": {"used_blocks": 30}}, "nvme_degraded": False, "tail_blocks": None,
         "spec_sps_b4": 1.2, "hit_rate": 0.5}


def test_counters_are_differenced_at_every_depth_and_gauges_keep_their_after_value():
    counters, gauges = difference(BEFORE, AFTER)
    assert counters == {"steps_total": 15, "forward_seconds_total": 0.5,
                        "lock_wait": {"count": 7, "total_s": 0.5},
                        "server": {"busy": {"lookup": {"count": 4, "seconds": 0.25},
                                            "commit": {"count": 2, "seconds": 0.125}}}}
    assert gauges == {"free_blocks": 12, "policy": "reuse", "lock_wait": {"max_s": 0.3, "p99_s": 0.25},
                      "server": {"busy": {"lookup": {"max_s": 0.1}, "commit": {"max_s": 0.1}}},
                      "tiers": {"gpu": {"used_blocks": 30}}, "nvme_degraded": False, "tail_blocks": None,
                      "spec_sps_b4": 1.2, "hit_rate": 0.5}
    assert "gone_total" not in counters and "gone_total" not in gauges  # only in before: dropped


def test_gauge_names():
    assert all(map(is_gauge, ("hit_rate", "p50_s", "spec_scheduled_tokens_mean", "promote_dram_bps", "watermarks",
                              "kvd_recompute_block_seconds")))
    assert not any(map(is_gauge, ("lookups", "kvd_rpc_lookup_seconds_total", "pressure_drops", "total_s")))


def test_a_failed_fetch_is_an_error_not_a_failure():
    def broken() -> dict:
        raise TimeoutError("no reply in 10 s")
    snap, errors = take({"specd": lambda: {"steps_total": 1}, "kvd": broken})
    assert snap == {"specd": {"steps_total": 1}}
    assert errors == ["kvd: TimeoutError: no reply in 10 s"]
    stats = cell_stats({"specd": {"steps_total": 1}}, snap, [f"after, {e}" for e in errors])
    assert stats == {"specd": {"counters": {"steps_total": 0}, "gauges": {}},
                     "errors": ["after, kvd: TimeoutError: no reply in 10 s"]}


def test_pool_sums_counters_keeps_the_last_gauges_and_every_error():
    one = cell_stats({"kvd": BEFORE}, {"kvd": AFTER})
    two = cell_stats({"kvd": {}}, {"kvd": {"steps_total": 5, "free_blocks": 3, "extra_total": 2}}, ["x"])
    pooled = pool([one, two])
    assert pooled["kvd"]["counters"]["steps_total"] == 20 and pooled["kvd"]["counters"]["extra_total"] == 2
    assert pooled["kvd"]["counters"]["lock_wait"] == {"count": 7, "total_s": 0.5}
    assert pooled["kvd"]["gauges"] == {"free_blocks": 3} and pooled["errors"] == ["x"]


def _cell(stats: dict) -> dict:
    return {"gpus": 1, "wall_time_s": 1.0, "requests": 4, "prompt_tokens": 100, "cached_prompt_tokens": 50,
            "completion_tokens": 40, "ttft_s": [0.1] * 4, "itl_s": [0.01] * 36, "stats": stats}


def test_report_says_where_the_time_went():
    specd = {"steps_total": 20, "schedule_seconds_total": 0.02, "forward_seconds_total": 0.4,
             "output_seconds_total": 0.04, "commit_seconds_total": 0.06, "kvd_rpc_lookup_total": 8,
             "kvd_rpc_lookup_seconds_total": 0.004, "kvd_rpc_attach_total": 0, "kvd_rpc_attach_seconds_total": 0.0,
             "kvd_post_commit_total": 6, "kvd_post_commit_seconds_total": 0.002}
    kvd = {"server": {"busy": {"lookup": {"count": 8, "seconds": 0.0032}, "stats": {"count": 1, "seconds": 1.0}}},
           "lock_wait": {"count": 30, "total_s": 0.0015}, "promotions": 3, "demote_dram_blocks": 5,
           "demote_nvme_blocks": 2, "pressure_drops": 4, "evictions": 1, "hit_blocks": 6, "lookup_blocks": 12}
    results = {"configs": {
        "standard": {1: _cell({"specd": {"counters": {"steps_total": 10}, "gauges": {}}, "errors": []})},
        "ours": {1: _cell({"specd": {"counters": specd, "gauges": {}}, "kvd": {"counters": kvd, "gauges": {}},
                           "errors": ["before, kvd: TimeoutError: slow"]})}}}
    md = markdown_report(results, summarize_results(results, "standard"), "standard", [], [])
    assert "## Where the time went" in md
    assert "| ours | 1 | 20 | 1.00 | 20.00 | 2.00 | 3.00 | lookup 2.0×/1.00 ms | commit 1.5×/0.50 ms |" in md
    assert "attach" not in md  # a verb not used in the cell is left out
    assert "| ours | 1 | lookup 3.2 | 1.5 (30) | 3 | 5/2 | 4 | 1 | 6/12 |" in md  # the snapshot's own 'stats' is not
    assert "| standard | 1 | 10 | 0.00 |" in md
    assert "ours@1: before, kvd: TimeoutError: slow" in md


def test_no_stats_no_section():
    results = {"configs": {"standard": {1: {k: v for k, v in _cell({}).items() if k != "stats"}}}}
    assert "Where the time went" not in markdown_report(results, summarize_results(results), "standard", [], [])
