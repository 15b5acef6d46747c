"""``python -m bench serve``: the same sessions against each serving configuration, side by side in one run.

    python -m bench serve --model models/stories260K.gguf --workload support --scale tiny \\
        --configs standard,ours --concurrency 1,2 --sessions 3 --out runs/support-cpu

For each repeat and each concurrency level it runs every configuration in turn (``standard``, ``ours``,
``standard``, ``ours``, ...): by default as fresh processes (bench/stack.py), warmed with one short
request, replaying the eval sessions through bench/loadgen.py, then stopped. ``--persistent`` starts
each configuration once instead (all of them side by side) and resets its cache to a fresh process's
state before each cell (``Stack.reset``): the same measurement without a model load per cell. Every
cell gives its sessions their own ids, so no engine or kvd keeps per-session state from an earlier cell. Alternating the configurations inside one
(repeat, level) exposes them to the same machine noise, and the per-repeat pairs give ratios with a spread.
At the end it writes under ``--out``: results.json, report.md and the plots (bench/report.py), plus
sessions.jsonl (what was replayed), requests.jsonl (every request as measured) and logs/ (daemon logs),
then prints the report.

Sessions come from a workload profile (built on the fly, eval split; ``--scale tiny`` fits a 512-token
model), a session JSONL file (its eval sessions), or a Mooncake trace (``--trace``, see
bench/trace_replay.py). Throughput per GPU counts one GPU per configuration; on the CPU the CPU counts as
that one GPU and the report says so.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import cell_stats
from bench.arg_types import positive_ints
from bench.loadgen import HttpTransport, IpcTransport, LoadResult, RequestRecord, Script, SessionScript, run_load
from bench.report import baseline_name, write_report
from bench.stack import CONFIGS, Stack, StackOptions, StackPool
from bench.stats import percentile
from bench.workloads.format import Session, read_sessions, write_sessions
from specd.loader.random_weights import model_label

REPO = Path(__file__).resolve().parents[1]


class ServeError(RuntimeError):
    """The run cannot produce an honest report (no sessions, failed requests, a stack that did not start)."""


# ---- arguments ---------------------------------------------------------------------------------------

def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {bad or text!r}; choose from {', '.join(CONFIGS)}")
    return list(dict.fromkeys(names))


def _level_sessions(text: str) -> dict[int, int]:
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        out = {int(level): int(n) for level, n in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --level-sessions {text!r}; expected LEVEL:N,LEVEL:N") from None
    if not out or min(out.values()) < 1:
        raise argparse.ArgumentTypeError("--level-sessions counts must be positive")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", help="profile (creative, support, knowledge, coding, extraction, all) "
                                        "or a session JSONL file (its eval sessions are replayed)")
    src.add_argument("--trace", type=Path, help="a Mooncake trace JSONL, replayed as token-id prompts")
    p.add_argument("--model", type=Path, required=True, help="GGUF file or HF directory served by specd")
    p.add_argument("--configs", type=_names, default=["standard", "ours"],
                   help=f"comma list of {', '.join(CONFIGS)}; the first is the baseline of the ratios")
    p.add_argument("--concurrency", type=positive_ints, default=[1], help="comma list of levels, e.g. 1,8,32")
    p.add_argument("--sessions", type=int, default=None,
                   help="sessions per profile (default 16), or the first N of a session file (default: all)")
    p.add_argument("--level-sessions", type=_level_sessions, default={}, metavar="LEVEL:N,...",
                   help="replay only the first N sessions at LEVEL (e.g. 1:4,8:16): low levels need fewer "
                        "sessions to be measured and would otherwise dominate the run time")
    p.add_argument("--repeats", type=int, default=1, help="runs of every (level, config) cell, alternated")
    p.add_argument("--persistent", action="store_true",
                   help="start each configuration once and reset its cache before every cell (bench/stack.py "
                        "StackPool) instead of fresh processes per cell")
    p.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, plots, logs")
    p.add_argument("--http", action="store_true", help="drive the OpenAI HTTP gateway with openai.AsyncOpenAI "
                                                       "instead of the IPC client")
    p.add_argument("--scale", choices=["tiny", "full"], default="full",
                   help="workload size preset; tiny fits a 512-token model such as stories260K")
    p.add_argument("--seed", type=int, default=0, help="workload build seed and arrival seed")
    p.add_argument("--max-tokens", type=int, default=None, help="override every turn's answer length")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per turn")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies think times and arrival times (0.01: a 3-minute pause becomes 1.8 s)")
    p.add_argument("--arrivals", choices=["closed", "poisson", "recorded"], default="closed",
                   help="closed loop (default), Poisson at --rate, or the sessions'/trace's own arrival times; "
                        "the concurrency level caps conversations in flight in every mode")
    p.add_argument("--rate", type=float, default=None, help="conversations per second for --arrivals poisson")
    p.add_argument("--device", default="auto", help="specd --device (auto, cpu, cuda); kvd's pool follows it")
    p.add_argument("--gpu-blocks", type=int, default=256, help="GPU KV blocks, the same for every config")
    p.add_argument("--dram-blocks", type=int, default=1024, help="DRAM tier blocks (lru-offload, ours)")
    p.add_argument("--nvme-blocks", type=int, default=4096, help="NVMe tier blocks (ours)")
    p.add_argument("--kvd-half-life-s", type=float, default=None,
                   help="kvd's temperature half-life (default kvd's 300 s); scale it with --time-scale")
    p.add_argument("--max-model-len", type=int, default=None, help="specd --max-model-len")
    p.add_argument("--max-num-seqs", type=int, default=None, help="specd --max-num-seqs")
    p.add_argument("--specd-arg", action="append", default=[], metavar="ARG",
                   help="extra specd flag passed through (repeat it), e.g. --specd-arg=--no-cuda-graphs")
    p.add_argument("--trace-limit", type=int, default=64, help="--trace: replay the first N requests")
    p.add_argument("--tokens-per-hash", type=int, default=16, help="--trace: tokens standing for one 512-token block")
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for the next streamed piece")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")


# ---- what is replayed --------------------------------------------------------------------------------

def load_sessions(args: argparse.Namespace) -> list[Session]:
    """The eval sessions of a profile (built now) or of a session file (the first ``--sessions``).

    A file's default is all its eval sessions: a fixed cap silently shrank the concurrency-32 cells of
    the first GPU plan run to 16 sessions. ``args.sessions`` is set to the count actually replayed."""
    path = Path(args.workload)
    if path.suffix == ".jsonl" or path.is_file():
        sessions = [s for s in read_sessions(path) if s.split == "eval"][: args.sessions]
    else:
        from bench.workloads.build import build_sessions
        from bench.workloads.profile import SCALES, BuildOptions

        sessions = build_sessions(args.workload, BuildOptions(split="eval", sessions=args.sessions or 16,
                                                              scale=SCALES[args.scale], seed=args.seed))
    if not sessions:
        raise ServeError(f"no eval sessions in {args.workload}")
    args.sessions = len(sessions)
    return sessions


def script_factory(args: argparse.Namespace, sessions: list[Session]) -> Callable[[dict, int], list[Script]]:
    """(served model info, repeat) -> scripts. Trace prompts depend on the context length, known once a
    stack is up; the seeds of sampled answers vary by repeat so repeats are independent samples."""
    if args.trace is not None:
        from bench.trace_replay import load_trace_scripts

        def trace(info: dict, repeat: int) -> list[Script]:
            return list(load_trace_scripts(args.trace, limit=args.trace_limit, model=args.model,
                                           tokens_per_hash=args.tokens_per_hash, max_model_len=info["max_model_len"],
                                           max_tokens=args.max_tokens or 64))
        return trace

    def workload(info: dict, repeat: int) -> list[Script]:
        return [SessionScript(s, args.max_tokens, args.ignore_eos, seed_salt=f"r{repeat}") for s in sessions]
    return workload


def scripts_at(scripts: list[Script], level: int, level_sessions: dict[int, int]) -> list[Script]:
    """The scripts a cell at ``level`` replays: the first ``level_sessions[level]``, or all."""
    return scripts[: level_sessions[level]] if level in level_sessions else scripts


# ---- the plan ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    repeat: int
    concurrency: int
    config: str


def plan(configs: Sequence[str], levels: Sequence[int], repeats: int) -> list[Cell]:
    """Every measurement in run order: configurations alternate inside each (repeat, level)."""
    return [Cell(r, c, name) for r in range(repeats) for c in levels for name in configs]


def stack_options(args: argparse.Namespace, log_dir: Path | None = None) -> StackOptions:
    return StackOptions(model=args.model, device=args.device, gpu_blocks=args.gpu_blocks,
                        dram_blocks=args.dram_blocks, nvme_blocks=args.nvme_blocks,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        half_life_s=args.kvd_half_life_s, specd_args=tuple(args.specd_arg), log_dir=log_dir)


class BudgetExceeded(RuntimeError):
    """A cell did not finish before the run's deadline; its partial records are in ``result``."""

    def __init__(self, cell: "Cell", result: LoadResult):
        super().__init__(f"{cell} stopped at the time budget")
        self.result = result


async def _drive(stack: Stack, scripts: list[Script], cell: Cell, args: argparse.Namespace,
                 on_request: Callable[[RequestRecord], None], timeout_s: float | None) -> LoadResult:
    transport = (HttpTransport(stack.base_url, stack.info["model"], args.timeout_s) if args.http
                 else IpcTransport(str(stack.run_dir), args.timeout_s))
    records: list[RequestRecord] = []

    def seen(r: RequestRecord) -> None:
        records.append(r)
        on_request(r)
    try:
        load = run_load(transport, scripts_at(scripts, cell.concurrency, args.level_sessions), cell.concurrency,
                        arrivals=args.arrivals, rate=args.rate, time_scale=args.time_scale,
                        seed=args.seed + cell.repeat, on_request=seen, session_tag=cell_tag(cell))
        return await asyncio.wait_for(load, timeout_s)
    except asyncio.TimeoutError:
        raise BudgetExceeded(cell, LoadResult(records, 0.0)) from None
    finally:
        await transport.close()


def cell_tag(cell: Cell) -> str:
    """Prefix of a cell's session ids: each cell's sessions are new to the engine and to kvd."""
    return f"r{cell.repeat}c{cell.concurrency}{cell.config}/"


@dataclass
class CellRun(LoadResult):
    """A cell's replay plus what its daemons counted during it (bench/cell_stats.py ``cell_stats``)."""

    stats: dict = field(default_factory=dict)


def measure_cell(cell: Cell, stack: Stack, args: argparse.Namespace,
                 scripts_for: Callable[[dict, int], list[Script]], on_request: Callable[[RequestRecord], None],
                 timeout_s: float | None = None) -> CellRun:
    """One configuration at one level on a ready stack (fresh or reset): the replay, between two
    snapshots of the daemons' stats (taken outside the timed part)."""
    scripts = scripts_for(stack.info, cell.repeat)
    before, errors_before = cell_stats.take(stack.stats_sources())
    load = asyncio.run(_drive(stack, scripts, cell, args, on_request, timeout_s))
    after, errors_after = cell_stats.take(stack.stats_sources())
    errors = [f"before, {e}" for e in errors_before] + [f"after, {e}" for e in errors_after]
    return CellRun(load.records, load.wall_time_s, cell_stats.cell_stats(before, after, errors))


class FreshStacks:
    """Stacks for the default mode: a fresh, warmed stack per cell, stopped after it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    @contextlib.contextmanager
    def ready(self, cell: Cell) -> Iterator[Stack]:
        logs = self.args.out / "logs" / f"r{cell.repeat}-c{cell.concurrency}-{cell.config}"
        with Stack(cell.config, stack_options(self.args, logs)) as stack:
            stack.warm_up(self.args.timeout_s)
            yield stack


class PersistentStacks:
    """Stacks for ``--persistent``: a running StackPool, each stack reset before its cell."""

    def __init__(self, pool: StackPool):
        self.pool = pool

    @contextlib.contextmanager
    def ready(self, cell: Cell) -> Iterator[Stack]:
        yield self.pool.ready(cell.config)


StackSource = FreshStacks | PersistentStacks


def run_cells(cells: Sequence[Cell], args: argparse.Namespace, stacks: StackSource,
              scripts_for: Callable[[dict, int], list[Script]], log: Any, bar: Any,
              deadline: float | None = None, runs: dict | None = None) -> dict[tuple[str, int], list[LoadResult]]:
    """Every cell in order, into ``runs`` ((config, level) -> results; pass a dict to keep the finished
    cells when a later one raises); each request is written to ``log`` as a JSON line. With a
    ``deadline`` (time.monotonic), a cell still running then is cut off and raises BudgetExceeded after
    logging what it finished."""
    runs = {} if runs is None else runs
    for cell in cells:
        bar.set_description(f"r{cell.repeat} c{cell.concurrency} {cell.config}")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise BudgetExceeded(cell, LoadResult([], 0.0))
        try:
            with stacks.ready(cell) as stack:
                result = measure_cell(cell, stack, args, scripts_for, lambda r: bar.update(1),
                                      None if deadline is None else deadline - time.monotonic())
        except BudgetExceeded as cut:
            _log_records(log, cell, cut.result.records)
            raise
        _log_records(log, cell, result.records)
        if result.failed:
            raise ServeError(f"{cell}: {len(result.failed)} requests failed, first: {result.failed[0].error}")
        runs.setdefault((cell.config, cell.concurrency), []).append(result)
    return runs


def _log_records(log: Any, cell: Cell, records: list[RequestRecord]) -> None:
    for r in records:
        log.write(json.dumps({**asdict(cell), **asdict(r)}) + "\n")
    log.flush()


# ---- results -----------------------------------------------------------------------------------------

def cell_metrics(runs: list[LoadResult], quality: Callable[[list[RequestRecord]], dict[str, float]]) -> dict:
    """The report's input for one (config, level): repeats pooled (samples joined, tokens and wall time
    summed), plus each repeat's own throughput and TTFT for paired ratios, and (measured cells) the
    daemons' counters during the cells, summed over repeats (bench/cell_stats.py ``pool``)."""
    done = [r for run in runs for r in run.completed]
    m: dict[str, Any] = {
        "gpus": 1, "wall_time_s": sum(run.wall_time_s for run in runs), "requests": len(done),
        "prompt_tokens": sum(r.prompt_tokens for r in done), "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "completion_tokens": sum(r.completion_tokens for r in done), "ttft_s": [r.ttft_s for r in done],
        "itl_s": [x for r in done for x in r.itl_s], "failed_requests": sum(len(run.failed) for run in runs),
        "repeats": [_repeat_summary(run) for run in runs]}
    stats = [run.stats for run in runs if isinstance(run, CellRun)]
    if stats:
        m["stats"] = cell_stats.pool(stats)
    scores = quality(done)
    if scores:
        m["quality"] = scores
    return m


def _repeat_summary(run: LoadResult) -> dict[str, float]:
    done = run.completed
    tokens = sum(r.completion_tokens for r in done)
    ttft = [r.ttft_s for r in done]
    return {"wall_time_s": run.wall_time_s, "output_tok_s": tokens / run.wall_time_s if run.wall_time_s else 0.0,
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "cache_share": sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done))}


def extraction_quality(sessions: list[Session]) -> Callable[[list[RequestRecord]], dict[str, float]]:
    """Mean field accuracy and JSON validity of answers that have an extraction reference; {} if none."""
    from bench.workloads.extraction import FIELDS, score_extraction

    refs = {(s.id, k): t.reference for s in sessions for k, t in enumerate(s.turns)
            if t.reference and all(f in t.reference for f in FIELDS)}

    def score(done: list[RequestRecord]) -> dict[str, float]:
        scored = [score_extraction(r.text, refs[(r.script_id, r.turn)]) for r in done if (r.script_id, r.turn) in refs]
        if not scored:
            return {}
        return {"field_accuracy": sum(s["field_accuracy"] for s in scored) / len(scored),
                "json_valid": sum(bool(s["json_valid"]) for s in scored) / len(scored)}
    return score


def paired_ratios(configs: dict[str, dict[int, dict]], baseline: str) -> list[dict]:
    """Per config and level: output throughput and TTFT p50 over the baseline's, repeat by repeat
    (the two ran back to back), summarized as p50 and p99 over repeats."""
    rows = []
    for name, per in configs.items():
        if name == baseline:
            continue
        for level, m in per.items():
            base = configs[baseline][level]["repeats"]
            tput = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(m["repeats"], base) if b["output_tok_s"]]
            ttft = [a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(m["repeats"], base)
                    if a["ttft_p50_s"] is not None and b["ttft_p50_s"]]
            rows.append({"config": name, "concurrency": level, "repeats": len(tput),
                         "throughput_ratio": _p50_p99(tput), "ttft_p50_ratio": _p50_p99(ttft)})
    return rows


def _p50_p99(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50) if values else None, "p99": percentile(values, 99) if values else None}


def ratios_markdown(rows: list[dict], baseline: str) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [f"## Paired ratios over `{baseline}` (per repeat, back to back)", "",
             "| config | concurrency | repeats | out tok/s ratio p50 | p99 | TTFT p50 ratio p50 | p99 |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['concurrency']} | {r['repeats']} | {f(r['throughput_ratio']['p50'])} "
              f"| {f(r['throughput_ratio']['p99'])} | {f(r['ttft_p50_ratio']['p50'])} "
              f"| {f(r['ttft_p50_ratio']['p99'])} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def device_label(device: str) -> str:
    import torch

    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        return f"{torch.cuda.get_device_name(0)} (1 GPU per configuration)"
    return "CPU (no GPU: throughput 'per GPU' counts the CPU as gpus=1, notionally)"


def git_commit() -> str:
    from bench.provenance import git_commit as commit

    return commit(short=True)


def command_line(args: argparse.Namespace) -> str:
    """The run as one command, rebuilt from the parsed flags (so it is complete whoever called ``run``)."""
    parts = ["python", "-m", "bench", "serve"]
    for key, value in vars(args).items():
        if key in ("run", "subcommand", "no_progress") or value is None or value is False or value in ([], {}):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif key == "specd_arg":
            parts += [f"--specd-arg={v}" for v in value]
        elif isinstance(value, dict):
            parts += [flag, ",".join(f"{k}:{v}" for k, v in value.items())]
        else:
            parts += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return shlex.join(parts)


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    source = f"trace {args.trace.name} (first {args.trace_limit})" if args.trace else args.workload
    loop = {"closed": "closed loop", "poisson": f"open loop, Poisson {args.rate}/s",
            "recorded": "open loop, recorded arrivals"}[args.arrivals]
    return {"model": model_label(args.model), "workload": source, "sessions": args.sessions, "scale": args.scale,
            "device": device_label(args.device), "transport": "HTTP (openai.AsyncOpenAI)" if args.http else "IPC",
            "load": f"{loop}; time scale {args.time_scale}; concurrency caps conversations in flight",
            "max_tokens": args.max_tokens or "per turn", "repeats": args.repeats,
            "sessions_per_level": {str(k): v for k, v in args.level_sessions.items()} or "all",
            "stacks": "persistent, reset before each cell" if args.persistent else "fresh processes per cell",
            "order": "configs alternate inside each (repeat, concurrency): " + " ".join(args.configs),
            "tiers": f"GPU {args.gpu_blocks} blocks (all configs), DRAM {args.dram_blocks}, NVMe {args.nvme_blocks}",
            "git": git_commit(), "command": command_line(args)}


# ---- the command -------------------------------------------------------------------------------------

def collect_results(args: argparse.Namespace, runs: dict[tuple[str, int], list[LoadResult]],
                    quality: Callable[[list[RequestRecord]], dict[str, float]]) -> dict:
    """The report's input from finished cells; levels not run by every configuration are left out
    (a run cut by a time budget), so the report stays complete for the levels it has."""
    levels = [c for c in args.concurrency if all((name, c) in runs for name in args.configs)]
    configs = {name: {c: cell_metrics(runs[(name, c)], quality) for c in levels} for name in args.configs}
    return {"meta": run_meta(args), "configs": configs}


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    sessions = [] if args.trace else load_sessions(args)
    if sessions:
        write_sessions(args.out / "sessions.jsonl", sessions)
    scripts_for = script_factory(args, sessions)
    cells = plan(args.configs, args.concurrency, args.repeats)
    with open(args.out / "requests.jsonl", "w", encoding="utf-8") as log, _progress(args, cells, sessions) as bar:
        if args.persistent:
            with StackPool(args.configs, stack_options(args), args.out / "logs") as pool:
                runs = run_cells(cells, args, PersistentStacks(pool), scripts_for, log, bar)
        else:
            runs = run_cells(cells, args, FreshStacks(args), scripts_for, log, bar)
    results = collect_results(args, runs, extraction_quality(sessions))
    configs = results["configs"]
    paths = write_report(results, args.out, baseline=args.configs[0])
    base = baseline_name(configs, args.configs[0])
    if args.repeats > 1 and len(args.configs) > 1:
        with open(paths["report"], "a", encoding="utf-8") as f:
            f.write("\n" + ratios_markdown(paired_ratios(configs, base), base))
    print(paths["report"].read_text(encoding="utf-8"))
    return 0


def _progress(args: argparse.Namespace, cells: list[Cell], sessions: list[Session]):
    from tqdm import tqdm

    def turns(level: int) -> int:
        if not sessions:
            return args.trace_limit
        return sum(len(s.turns) for s in sessions[: args.level_sessions.get(level, len(sessions))])
    return tqdm(total=sum(turns(c.concurrency) for c in cells), unit="req", disable=args.no_progress,
                file=sys.stderr)
