"""The benchmark report: results.json, a markdown table and PNG plots, from one results dict.

Input schema (what a bench run collects; JSON object keys are strings, Python callers may use ints):

    {"meta": {...free: model, workload, command, git commit...},
     "configs": {<config name>: {<concurrency>: {
         "gpus": int,                   # GPUs the config ran on (billed for the whole wall time)
         "wall_time_s": float,          # first request sent -> last token received
         "requests": int,               # completed requests (turns)
         "prompt_tokens": int,          # summed over requests
         "cached_prompt_tokens": int,   # of those, served from the KV cache (never more than prompt_tokens)
         "completion_tokens": int,      # generated tokens
         "ttft_s": [float],             # one per request
         "itl_s": [float],              # gaps between consecutive streamed tokens, all requests pooled
         "speculation": {               # optional, once speculation exists
             "verifications": int,      # verify passes
             "drafted": int,            # draft tokens proposed for verification
             "accepted": int,           # draft tokens accepted (the bonus token is not a draft token)
             "acceptance_by_position": [float]},  # [k]: share of verifications accepting >= k+1 drafts
         "quality": {name: float},      # optional, e.g. extraction field accuracy
         "stats": {                     # optional: what specd and kvd counted during the cell(s)
             "specd": {"counters": {...}, "gauges": {...}},   # counters: after - before; gauges: after
             "kvd": {"counters": {...}, "gauges": {...}},     # only for configs with kvd
             "errors": [str]}}}}}       # stats that could not be fetched (bench/cell_stats.py)

Derived here, in one place: output tokens/s per GPU, requests/s, TTFT and ITL p50/p95/p99/mean, the share of
prompt tokens from cache, tau = accepted / verifications + 1 (the bonus token counts), cost per 1M output
tokens at $3.99 per GPU-hour, and the throughput ratio to a baseline config measured in the same run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.cost import GPU_HOUR_USD, cost_per_million_output_tokens
from bench.stats import PERCENTILES, summarize, tau

SCHEMA_VERSION = 1
COUNT_FIELDS = ("gpus", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
POSITIVE_FIELDS = ("gpus", "requests", "prompt_tokens", "completion_tokens")


class ReportError(ValueError):
    """The results are inconsistent; `problems` lists every check that failed."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("inconsistent results:\n  " + "\n  ".join(problems))
        self.problems = problems


# ---- consistency ---------------------------------------------------------------------------------------

def check_report(results: dict) -> list[str]:
    """Every inconsistency found in a results dict (raw input or a written results.json); [] if none."""
    configs = results.get("configs")
    if not isinstance(configs, dict) or not configs:
        return ["no configs"]
    problems: list[str] = []
    levels = {name: set(map(str, per.keys())) for name, per in configs.items()}
    every = set().union(*levels.values())
    for name, have in levels.items():
        if have != every:
            problems.append(f"{name}: missing concurrency levels {sorted(every - have)}")
    for name, per in configs.items():
        for conc, m in per.items():
            where = f"{name}@{conc}"
            if not str(conc).isdigit() or int(conc) < 1:
                problems.append(f"{where}: concurrency must be a positive integer")
            problems.extend(f"{where}: {p}" for p in _check_metrics(m))
    problems.extend(_check_summary(results.get("summary", {})))
    return problems


def _check_metrics(m: dict) -> list[str]:
    missing = [f for f in (*COUNT_FIELDS, "wall_time_s", "ttft_s", "itl_s") if f not in m]
    if missing:
        return [f"missing fields {missing}"]
    problems = [f"{f} must be a positive integer" for f in POSITIVE_FIELDS if not _positive_int(m[f])]
    if not isinstance(m["cached_prompt_tokens"], int) or m["cached_prompt_tokens"] < 0:
        problems.append("cached_prompt_tokens must be a non-negative integer")
    elif isinstance(m["prompt_tokens"], int) and m["cached_prompt_tokens"] > m["prompt_tokens"]:
        problems.append(f"cached_prompt_tokens {m['cached_prompt_tokens']} > prompt_tokens {m['prompt_tokens']}")
    if not _finite(m["wall_time_s"]) or m["wall_time_s"] <= 0:
        problems.append("wall_time_s must be positive")
    problems.extend(_check_samples(m))
    if m.get("speculation") is not None:
        problems.extend(_check_speculation(m["speculation"]))
    return problems


def _check_samples(m: dict) -> list[str]:
    problems = []
    for field in ("ttft_s", "itl_s"):
        if not all(_finite(v) and v >= 0 for v in m[field]):
            problems.append(f"{field} holds negative or non-finite values")
    if len(m["ttft_s"]) != m["requests"]:
        problems.append(f"{len(m['ttft_s'])} TTFT samples for {m['requests']} requests")
    if _positive_int(m["completion_tokens"]) and _positive_int(m["requests"]):
        if len(m["itl_s"]) > m["completion_tokens"] - m["requests"]:
            problems.append(f"{len(m['itl_s'])} ITL samples, but only {m['completion_tokens'] - m['requests']} "
                            "tokens follow a first token")
    return problems


def _check_speculation(s: dict) -> list[str]:
    if not _positive_int(s.get("verifications")):
        return ["speculation.verifications must be a positive integer"]
    problems = []
    if not (0 <= s.get("accepted", -1) <= s.get("drafted", -1)):
        problems.append(f"speculation: need 0 <= accepted ({s.get('accepted')}) <= drafted ({s.get('drafted')})")
    by_pos = s.get("acceptance_by_position") or []
    if not all(_finite(a) and 0.0 <= a <= 1.0 for a in by_pos):
        problems.append("acceptance_by_position values must lie in [0, 1]")
    elif any(later > earlier + 1e-9 for earlier, later in zip(by_pos, by_pos[1:])):
        problems.append("acceptance_by_position rises with position (a chain cannot accept k+1 without k)")
    elif by_pos and "accepted" in s:
        implied = sum(by_pos) * s["verifications"]
        if abs(implied - s["accepted"]) > 0.01 * s["accepted"] + 1:
            problems.append(f"acceptance_by_position implies {implied:.0f} accepted tokens, counted {s['accepted']}")
    return problems


def _check_summary(summary: dict) -> list[str]:
    problems = []
    for name, per in summary.items():
        for conc, row in per.items():
            for metric in ("ttft_s", "itl_s"):
                ps = [row[metric][f"p{q}"] for q in PERCENTILES]
                if None not in ps and sorted(ps) != ps:
                    problems.append(f"{name}@{conc}: {metric} percentiles out of order {ps}")
            if row["cache_share"] is not None and not 0.0 <= row["cache_share"] <= 1.0:
                problems.append(f"{name}@{conc}: cache share {row['cache_share']} outside [0, 1]")
    return problems


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# ---- derived metrics -----------------------------------------------------------------------------------

def summarize_level(m: dict) -> dict:
    """The derived metrics of one (config, concurrency) cell."""
    spec = m.get("speculation")
    return {
        "output_tok_s_per_gpu": m["completion_tokens"] / m["wall_time_s"] / m["gpus"],
        "requests_per_s": m["requests"] / m["wall_time_s"],
        "ttft_s": summarize(m["ttft_s"]),
        "itl_s": summarize(m["itl_s"]),
        "cache_share": m["cached_prompt_tokens"] / m["prompt_tokens"],
        "tau": tau(spec["verifications"], spec["accepted"]) if spec else None,
        "acceptance_by_position": list(spec.get("acceptance_by_position") or []) if spec else None,
        "cost_per_1m_output_usd": cost_per_million_output_tokens(m["completion_tokens"], m["wall_time_s"], m["gpus"]),
        "quality": dict(m.get("quality") or {}),
    }


def baseline_name(configs: dict, preferred: str | None = None) -> str:
    """The config the others are compared with: the one asked for, else `standard`, else the first."""
    if preferred is not None:
        if preferred not in configs:
            raise ValueError(f"baseline {preferred!r} is not among the configs {list(configs)}")
        return preferred
    return "standard" if "standard" in configs else next(iter(configs))


def summarize_results(results: dict, baseline: str | None = None) -> dict:
    """{config: {concurrency: derived metrics + speedup over the baseline at the same concurrency}}."""
    configs = results["configs"]
    base = baseline_name(configs, baseline)
    out = {name: {str(c): summarize_level(m) for c, m in sorted(per.items(), key=lambda kv: int(kv[0]))}
           for name, per in configs.items()}
    for per in out.values():
        for conc, row in per.items():
            row["speedup_vs_baseline"] = row["output_tok_s_per_gpu"] / out[base][conc]["output_tok_s_per_gpu"]
    return out


# ---- markdown ------------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def markdown_table(summary: dict, baseline: str) -> str:
    head = ("| config | concurrency | out tok/s/GPU | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            f"| from cache | τ | $/1M out | × {baseline} |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for conc in _levels(summary):
        for name, per in summary.items():
            r = per[conc]
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            rows.append(f"| {name} | {conc} | {r['output_tok_s_per_gpu']:.1f} | {r['requests_per_s']:.2f} "
                        f"| {_ms(r['ttft_s']['p50'])} | {_ms(r['ttft_s']['p99'])} | {_ms(r['itl_s']['p50'])} "
                        f"| {_ms(r['itl_s']['p99'])} | {r['cache_share']:.1%} | {tau} "
                        f"| {r['cost_per_1m_output_usd']:.2f} | {r['speedup_vs_baseline']:.2f} |")
    return "\n".join(rows)


def _levels(summary: dict) -> list[str]:
    return sorted({c for per in summary.values() for c in per}, key=int)


def acceptance_table(summary: dict) -> str | None:
    cells = [(n, c, r["acceptance_by_position"]) for n, per in summary.items() for c, r in per.items()
             if r["acceptance_by_position"]]
    if not cells:
        return None
    width = max(len(a) for _, _, a in cells)
    rows = ["| config | concurrency | " + " | ".join(f"pos {k + 1}" for k in range(width)) + " |",
            "|---|---|" + "---|" * width]
    rows += [f"| {n} | {c} | " + " | ".join(f"{v:.2f}" for v in a) + " |" for n, c, a in cells]
    return "\n".join(rows)


def quality_table(summary: dict) -> str | None:
    names = sorted({q for per in summary.values() for r in per.values() for q in r["quality"]})
    if not names:
        return None
    rows = ["| config | concurrency | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for name, per in summary.items():
        for conc, r in per.items():
            rows.append(f"| {name} | {conc} | " + " | ".join(
                f"{r['quality'][q]:.3f}" if q in r["quality"] else "-" for q in names) + " |")
    return "\n".join(rows)


ENGINE_PHASES = ("schedule", "forward", "output", "commit")


def _per(total: float, n: float, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "-" if not n else f"{total / n * scale:{fmt}}"


def _verbs(table: dict[str, tuple[float, float]], requests: int) -> str:
    """'lookup 1.0×/0.32 ms' per verb: calls and milliseconds per request, busiest first."""
    if not requests or not table:
        return "-"
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    return ", ".join(f"{verb} {n / requests:.1f}×/{s / requests * 1000:.2f} ms" for verb, (n, s) in rows)


def _specd_kvd_calls(c: dict, kind: str) -> dict[str, tuple[float, float]]:
    """specd's kvd round trips (kind 'rpc') or posts ('post') per verb: (count, seconds)."""
    prefix = f"kvd_{kind}_"
    verbs = {k[len(prefix):-len("_total")] for k in c if k.startswith(prefix) and not k.endswith("_seconds_total")}
    return {v: (c[f"{prefix}{v}_total"], c.get(f"{prefix}{v}_seconds_total", 0.0)) for v in verbs
            if c[f"{prefix}{v}_total"]}


def engine_time_table(results: dict) -> str | None:
    """Per engine step ms by phase, and specd's kvd round trips and posts per request by verb."""
    def row(c: dict, m: dict) -> str:
        steps = c.get("steps_total", 0)
        phases = " | ".join(_per(c.get(f"{p}_seconds_total", 0.0), steps, 1000) for p in ENGINE_PHASES)
        return (f"{steps} | {phases} | {_verbs(_specd_kvd_calls(c, 'rpc'), m['requests'])} "
                f"| {_verbs(_specd_kvd_calls(c, 'post'), m['requests'])} |")
    return _counter_table(results, "specd", "steps | ms/step: schedule | forward | output | commit | kvd round trips "
                          "per request (calls×/ms) | kvd posts per request |", 7, row)


def kvd_time_table(results: dict) -> str | None:
    """kvd's side: server time per verb (ms in the cell), lock wait, tier moves, pressure drops, hits."""
    def row(c: dict, _: dict) -> str:
        busy = {v: b.get("seconds", 0.0) for v, b in c.get("server", {}).get("busy", {}).items()
                if v != "stats" and b.get("count")}   # 'stats' is the snapshot itself
        busy_s = ", ".join(f"{v} {s * 1000:.1f}" for v, s in sorted(busy.items(), key=lambda kv: -kv[1])) or "-"
        lock = c.get("lock_wait", {})
        return (f"{busy_s} | {lock.get('total_s', 0.0) * 1000:.1f} ({lock.get('count', 0)}) "
                f"| {c.get('promotions', 0)} | {c.get('demote_dram_blocks', 0)}/{c.get('demote_nvme_blocks', 0)} "
                f"| {c.get('pressure_drops', 0)} | {c.get('evictions', 0)} "
                f"| {c.get('hit_blocks', 0)}/{c.get('lookup_blocks', 0)} |")
    return _counter_table(results, "kvd", "server busy ms by verb | lock wait ms (n) | promotions | demotions "
                          "DRAM/NVMe | pressure drops | evictions | hit/lookup blocks |", 7, row)


def _counter_table(results: dict, side: str, header: str, columns: int, row) -> str | None:
    """One markdown row per cell that has ``side``'s ('specd' or 'kvd') counters: config, concurrency, then
    ``row(counters, cell metrics)``; None when no cell has them."""
    rows = [f"| config | conc | {header}", "|---|---|" + "---|" * columns]
    for name, conc, m, st in _stats_cells(results):
        c = st.get(side, {}).get("counters")
        if c is not None:
            rows.append(f"| {name} | {conc} | {row(c, m)}")
    return "\n".join(rows) if len(rows) > 2 else None


def _stats_cells(results: dict):
    """(config, concurrency, metrics, stats) of every cell that recorded stats, by level then config."""
    cells = [(name, str(conc), m) for name, per in results["configs"].items() for conc, m in per.items()]
    for name, conc, m in sorted(cells, key=lambda t: int(t[1])):
        if m.get("stats"):
            yield name, conc, m, m["stats"]


def stats_errors(results: dict) -> list[str]:
    return [f"{name}@{conc}: {e}" for name, conc, _, st in _stats_cells(results) for e in st.get("errors", [])]


def time_section(results: dict) -> list[str]:
    """'Where the time went': the engine and kvd tables (counters over the timed cells only)."""
    tables = [t for t in (engine_time_table(results), kvd_time_table(results)) if t]
    errors = stats_errors(results)
    if not tables and not errors:
        return []
    parts = ["## Where the time went", "",
             "Daemon counters over the timed cells only (after minus before; repeats summed). "
             "×/ms: calls and milliseconds per request.", ""]
    for table in tables:
        parts += [table, ""]
    parts += [f"- stats not fetched: {e}" for e in errors]
    return parts + ([""] if errors else [])


def markdown_report(results: dict, summary: dict, baseline: str, plots: list[str], problems: list[str]) -> str:
    meta = results.get("meta", {})
    parts = ["# Benchmark report", ""]
    parts += [f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v}" for k, v in meta.items()]
    parts += [f"- **price**: ${GPU_HOUR_USD} per GPU-hour; τ counts the bonus token; "
              f"× {baseline} is output throughput over `{baseline}` at the same concurrency, same run.", "",
              markdown_table(summary, baseline), ""]
    for title, table in (("Acceptance by position", acceptance_table(summary)), ("Quality", quality_table(summary))):
        if table:
            parts += [f"## {title}", "", table, ""]
    parts += time_section(results)
    if problems:
        parts += ["## Consistency problems", ""] + [f"- {p}" for p in problems] + [""]
    parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


# ---- plots ---------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib  # the `test` extra; `pip install matplotlib` where missing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_throughput(summary: dict, path: Path) -> None:
    """One curve per config over concurrency: TTFT p50 and ITL p50 against output tokens/s per GPU."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for metric, ax in zip(("ttft_s", "itl_s"), axes):
        for name, per in summary.items():
            levels = sorted(per, key=int)
            xs = [per[c]["output_tok_s_per_gpu"] for c in levels]
            ys = [(per[c][metric]["p50"] or 0.0) * 1000 for c in levels]
            ax.plot(xs, ys, marker="o", label=name)
            for x, y, c in zip(xs, ys, levels):
                ax.annotate(c, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s per GPU")
        ax.set_ylabel(f"{metric.split('_')[0].upper()} p50 (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("latency vs throughput (labels: concurrency)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_bars(summary: dict, path: Path) -> None:
    """Grouped bars of TTFT p50 per concurrency and config, with p99 drawn as a tick above each bar."""
    plt = _pyplot()
    levels, names = _levels(summary), list(summary)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(levels) * len(names) / 2), 4.2))
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(levels))]
        p50 = [(summary[name][c]["ttft_s"]["p50"] or 0.0) * 1000 for c in levels]
        p99 = [(summary[name][c]["ttft_s"]["p99"] or 0.0) * 1000 for c in levels]
        ax.bar(xs, p50, width, label=f"{name} p50")
        ax.scatter(xs, p99, marker="_", s=200, color="black", zorder=3, label="p99" if j == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"conc {c}" for c in levels])
    ax.set_ylabel("TTFT (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(summary: dict, path: Path) -> bool:
    """Acceptance by draft position per config and concurrency; False (no file) without speculation."""
    cells = [(n, c, r["acceptance_by_position"]) for n, per in summary.items() for c, r in per.items()
             if r["acceptance_by_position"]]
    if not cells:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, conc, acc in cells:
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} @ {conc}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of verifications accepting it")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- writer --------------------------------------------------------------------------------------------

def write_report(results: dict, out_dir: str | Path, baseline: str | None = None,
                 allow_problems: bool = False) -> dict[str, Path]:
    """Write results.json (input + summary), report.md and the plots; returns their paths by name.

    Inconsistent results raise ReportError, unless `allow_problems`, when the problems are listed in the report.
    """
    problems = check_report(results)
    if problems and not allow_problems:
        raise ReportError(problems)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = baseline_name(results["configs"], baseline)
    summary = summarize_results(results, base)
    paths = {"latency_vs_throughput": out / "latency_vs_throughput.png", "ttft": out / "ttft.png"}
    plot_latency_throughput(summary, paths["latency_vs_throughput"])
    plot_ttft_bars(summary, paths["ttft"])
    if plot_acceptance(summary, out / "acceptance_by_position.png"):
        paths["acceptance_by_position"] = out / "acceptance_by_position.png"
    written = {"schema_version": SCHEMA_VERSION, "meta": results.get("meta", {}), "baseline": base,
               "configs": {n: {str(c): m for c, m in per.items()} for n, per in results["configs"].items()},
               "summary": summary}
    paths["results"] = out / "results.json"
    paths["results"].write_text(json.dumps(written, indent=1) + "\n", encoding="utf-8")
    paths["report"] = out / "report.md"
    plots = [str(p) for k, p in paths.items() if p.suffix == ".png"]
    paths["report"].write_text(markdown_report(results, summary, base, plots, problems), encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Re-render a report from a results.json (its input part), e.g. after editing meta."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("results", type=Path, help="a results.json written by a bench run")
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, plots")
    parser.add_argument("--baseline", default=None, help="config the others are compared with")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text(encoding="utf-8"))
    paths = write_report({"meta": results.get("meta", {}), "configs": results["configs"]}, args.out, args.baseline)
    print(paths["report"].read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
