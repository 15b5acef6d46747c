"""What kvd costs when nothing hits: throughput of each configuration plus where the time goes.

    python -m tests.kvd.zero_hit_probe --model models/stories260K.gguf --workload unique --scale tiny \\
        --configs standard,prefix-lru,ours-dram,ours --concurrency 8 --sessions 24 --repeats 3 \\
        --persistent --out /tmp/zh

``bench serve`` gives the throughput ratios but not the breakdown; this runs the same cells on the same
persistent stacks (bench/serve.py's plan, alternating configurations) and reads, around every cell,
specd's ``kvd_rpc_*`` counters (round trips by op type, specd/engine/kvd_source.py), its step count,
and kvd's ``server.busy`` (seconds the loop spent per verb) and ``demote_*`` counters (copies into
the lower tiers a request waited for). It writes ``probe.json`` and prints a table per configuration,
then the engine's phase timers in ms per step (``phase_summary``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from bench.serve import _drive, add_arguments, load_sessions, plan, script_factory, stack_options
from bench.stack import StackPool
from bench.stats import percentile
from client.kvd_client import KvdClient


def snapshot(stack: Any) -> dict[str, Any]:
    """specd's counters and (with kvd) kvd's stats, read at one moment."""
    out = {"specd": stack.stats(), "kvd": {}}
    if stack.kvd is not None:
        with KvdClient(stack.kvd.run_dir, timeout_s=10.0) as c:
            out["kvd"] = c.stats()
    return out


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """What one cell added: specd rpc counters and steps, kvd busy seconds by verb, demotions."""
    s0, s1 = before["specd"], after["specd"]
    keys = [k for k in s1 if k.startswith(("kvd_rpc_", "kvd_post_")) or k.endswith("_seconds_total")
            or k in ("steps_total", "requests_finished", "tokens_generated_total")]
    out = {k: s1[k] - s0.get(k, 0) for k in keys}
    k0, k1 = before["kvd"], after["kvd"]
    for verb, v in k1.get("server", {}).get("busy", {}).items():
        old = k0.get("server", {}).get("busy", {}).get(verb, {"count": 0, "seconds": 0.0})
        out[f"kvd_busy_{verb}_total"] = v["count"] - old["count"]
        out[f"kvd_busy_{verb}_seconds_total"] = v["seconds"] - old["seconds"]
    for k, v in k1.items():
        if k.startswith("demote_") or k in ("demotions", "evictions", "admission_rejects"):
            out[f"kvd_{k}"] = v - k0.get(k, 0)
    return out


def cell_numbers(result: Any) -> dict[str, float]:
    done = result.completed
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    itl = [x for r in done for x in r.itl_s]
    tokens = sum(r.completion_tokens for r in done)
    return {"requests": len(done), "out_tok_s": tokens / result.wall_time_s, "wall_s": result.wall_time_s,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95),
            "itl_p99_ms": 1e3 * percentile(itl, 99) if itl else float("nan")}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sessions = load_sessions(args)
    scripts_for = script_factory(args, sessions)
    rows: list[dict[str, Any]] = []
    with StackPool(args.configs, stack_options(args), args.out / "logs") as pool:
        for cell in plan(args.configs, args.concurrency, args.repeats):
            stack = pool.ready(cell.config)
            before = snapshot(stack)
            result = asyncio.run(_drive(stack, scripts_for(stack.info, cell.repeat), cell, args, lambda r: None, None))
            if result.failed:
                raise RuntimeError(f"{cell}: {len(result.failed)} requests failed: {result.failed[0].error}")
            rows.append({"config": cell.config, "repeat": cell.repeat, "concurrency": cell.concurrency,
                         **cell_numbers(result), **delta(before, snapshot(stack))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict[str, Any]], baseline: str) -> str:
    """Per configuration: p50 (min-max) of throughput vs the baseline's same repeat, and per-step costs."""
    base = {(r["repeat"], r["concurrency"]): r["out_tok_s"] for r in rows if r["config"] == baseline}
    lines = ["| config | tok/s p50 | vs base p50 (min-max) | TTFT p95 ms | ITL p99 ms | rpc/step | rpc ms/step "
             "| rpc by verb (per request) | kvd busy ms by verb (per request) | demote s (dram/nvme) |",
             "|" + "---|" * 10]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == cfg]
        ratios = [r["out_tok_s"] / base[(r["repeat"], r["concurrency"])] for r in rs]
        steps = sum(r["steps_total"] for r in rs)
        reqs = sum(r["requests"] for r in rs)
        rpc_n = sum(v for r in rs for k, v in r.items() if k.startswith("kvd_rpc_") and k.endswith("_total")
                    and not k.endswith("seconds_total") and "heartbeat" not in k)
        rpc_s = sum(v for r in rs for k, v in r.items() if k.endswith("_seconds_total") and k.startswith("kvd_rpc_")
                    and "heartbeat" not in k)
        verbs = sorted({k[8:-6] for r in rs for k in r if k.startswith("kvd_rpc_") and not k.endswith("seconds_total")})
        by_verb = ", ".join(f"{v} {sum(r.get(f'kvd_rpc_{v}_total', 0) for r in rs) / reqs:.1f}" for v in verbs)
        busy = sorted({k[9:-6] for r in rs for k in r if k.startswith("kvd_busy_") and not k.endswith("seconds_total")})
        by_busy = ", ".join(f"{v} {1e3 * sum(r.get(f'kvd_busy_{v}_seconds_total', 0) for r in rs) / reqs:.2f}"
                            for v in busy)
        dem = "/".join(f"{sum(r.get(f'kvd_demote_{t}_seconds', 0) for r in rs):.2f}" for t in ("dram", "nvme"))
        lines.append(f"| {cfg} | {statistics.median(r['out_tok_s'] for r in rs):.0f} "
                     f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
                     f"| {statistics.median(r['ttft_p95_ms'] for r in rs):.0f} "
                     f"| {statistics.median(r['itl_p99_ms'] for r in rs):.1f} "
                     f"| {rpc_n / max(1, steps):.2f} | {1e3 * rpc_s / max(1, steps):.3f} | {by_verb or '-'} "
                     f"| {by_busy or '-'} | {dem} |")
    return "\n".join(lines)


PHASES = ("schedule", "forward", "output", "commit")


def phase_summary(rows: list[dict[str, Any]]) -> str:
    """Per configuration: the engine's own phase timers (``<phase>_seconds_total`` / ``steps_total``) in
    ms per step, the median over the cells (min-max). Wall-clock throughput on a shared machine is noisy;
    these say where a step's time went, cell by cell."""
    lines = ["| config | steps/cell | " + " | ".join(f"{ph} ms/step p50 (min-max)" for ph in PHASES)
             + " | total ms/step p50 |", "|" + "---|" * (len(PHASES) + 3)]
    for cfg in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == cfg]
        cells = []
        for ph in PHASES:
            per = [1e3 * r.get(f"{ph}_seconds_total", 0.0) / max(1, r["steps_total"]) for r in rs]
            cells.append(f"{statistics.median(per):.3f} ({min(per):.3f}-{max(per):.3f})")
        total = [1e3 * sum(r.get(f"{ph}_seconds_total", 0.0) for ph in PHASES) / max(1, r["steps_total"]) for r in rs]
        lines.append(f"| {cfg} | {statistics.median(r['steps_total'] for r in rs):.0f} | " + " | ".join(cells)
                     + f" | {statistics.median(total):.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args)
    (args.out / "probe.json").write_text(json.dumps(rows, indent=1))
    text = summary(rows, args.configs[0]) + "\n\n" + phase_summary(rows)
    (args.out / "probe.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
