"""Where a serving cell's time went: specd's and kvd's own counters, snapshotted around the cell.

Request timings say *that* a configuration is slow, not *why*. specd's stats (engine step phases, kvd
round trips per verb) and kvd's (server time per verb, lock wait, tier moves, cleaner work, hits) do,
but they are totals since each daemon started: a persistent stack has served earlier cells, a fresh one
its warm-up. So ``bench serve`` takes a snapshot right before and right after the timed replay and keeps
the difference of every counter. A gauge (occupancy, a rate, a percentile, a max) cannot be differenced:
its after value is kept apart, under ``gauges``. A snapshot that fails leaves the error string instead
of failing the cell: the request timings are still a valid measurement.

Shape of a cell's stats (``cell_stats``), also after pooling repeats (``pool``)::

    {"specd": {"counters": {...}, "gauges": {...}}, "kvd": {"counters": {...}, "gauges": {...}},
     "errors": ["kvd before: ...", ...]}                 # "kvd" only where the configuration has one
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# names whose values are levels, not running totals: their after value is kept, never a difference
GAUGE_NAMES = frozenset({
    "tiers", "watermarks", "blocks", "block_bytes", "tail_blocks", "leases", "sessions", "free_blocks",
    "requests_running", "requests_waiting", "kvd_connected", "ipc_requests_in_flight", "nvme_degraded",
    "policy", "hit_rate", "token_hit_rate", "spec_step_overhead_seconds",
    # the prefetch budget's price of recomputing a block (session 9: run Y's reports held its change
    # over the cell, -10 ms, instead of the price)
    "kvd_recompute_block_seconds",
    # the garbage collector's longest pause so far and the frozen heap's size (kvd/gc_pauses.py)
    "gc_longest_pause_seconds", "gc_frozen_objects"})
GAUGE_SUFFIXES = ("_mean", "_bps", "max_s", "p50_s", "p99_s")
GAUGE_PREFIXES = ("spec_sps_",)

Snapshot = dict[str, Any]


def is_gauge(name: str) -> bool:
    return name in GAUGE_NAMES or name.endswith(GAUGE_SUFFIXES) or name.startswith(GAUGE_PREFIXES)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def difference(before: dict, after: dict) -> tuple[dict, dict]:
    """(counters, gauges) of two nested stats dicts: every numeric counter of ``after`` minus its value
    in ``before`` (0 where ``before`` lacks it: a verb first used during the cell), and the after value
    of every gauge and non-numeric field. Keys only in ``before`` are dropped; empty subtrees too."""
    counters: dict[str, Any] = {}
    gauges: dict[str, Any] = {}
    for key, value in after.items():
        prior = before.get(key) if isinstance(before, dict) else None
        if is_gauge(key) or not (_number(value) or isinstance(value, dict)):
            gauges[key] = value
        elif isinstance(value, dict):
            sub_c, sub_g = difference(prior if isinstance(prior, dict) else {}, value)
            if sub_c:
                counters[key] = sub_c
            if sub_g:
                gauges[key] = sub_g
        else:
            counters[key] = value - (prior if _number(prior) else 0)
    return counters, gauges


def take(fetchers: dict[str, Callable[[], dict]]) -> tuple[Snapshot, list[str]]:
    """One snapshot per daemon; a fetch that raises is left out and its error returned instead."""
    snap: Snapshot = {}
    errors: list[str] = []
    for name, fetch in fetchers.items():
        try:
            snap[name] = fetch()
        except Exception as exc:  # any failure (timeout, dead daemon, bad reply) must not fail the cell
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return snap, errors


def cell_stats(before: Snapshot, after: Snapshot, errors: Iterable[str] = ()) -> dict[str, Any]:
    """Counters and gauges per daemon present in both snapshots, plus the errors of either."""
    out: dict[str, Any] = {}
    for name in after:
        if name in before:
            counters, gauges = difference(before[name], after[name])
            out[name] = {"counters": counters, "gauges": gauges}
    out["errors"] = list(errors)
    return out


def add(a: dict, b: dict) -> dict:
    """Nested sum of two counter trees (a key missing on one side counts as 0)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict):
            out[key] = add(a.get(key) if isinstance(a.get(key), dict) else {}, value)
        elif _number(value):
            out[key] = (a.get(key) if _number(a.get(key)) else 0) + value
    return out


def pool(cells: Iterable[dict]) -> dict[str, Any]:
    """The repeats of one (config, level) as one: counters summed, gauges of the last repeat, all errors."""
    out: dict[str, Any] = {"errors": []}
    for cell in cells:
        out["errors"] += cell.get("errors", [])
        for name, part in cell.items():
            if name == "errors":
                continue
            have = out.setdefault(name, {"counters": {}, "gauges": {}})
            have["counters"] = add(have["counters"], part["counters"])
            have["gauges"] = part["gauges"]
    return out
