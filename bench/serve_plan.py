"""``python -m bench serve-plan``: every serving benchmark of a plan file, back to back, under one time budget.

    python -m bench serve-plan --plan gpu-all --build --sessions .carry/sessions        # CPU: session files
    python -m bench serve-plan --plan gpu-all --model Q.gguf --device cuda \\
        --sessions .carry/sessions --out $OUT --budget-s 480                            # GPU: the runs

A plan (``bench/plans/<name>.json``, or a path) lists *groups*; a group is one set of stacks (its
``configs``, started together once, bench/stack.py ``StackPool``) and the ``bench serve`` flags that size
them (``stack``: GPU/DRAM/NVMe blocks, context, kvd half-life, specd flags). Its *steps* are ``bench serve``
runs on those stacks in ``--persistent`` mode: a session file (or trace) from ``--sessions`` and the load
flags (levels, sessions per level, answer length, time scale, configs subset). Each step's ``build`` is the
``bench.workloads.build`` command line that writes its session file on the CPU machine (``--build``;
``trace_head`` copies the first lines of a trace instead), since the corpora do not travel.

What ``--out`` gets, and nothing else (the device tool brings back at most 8 files, 2 folder levels):
one ``<part>.json`` per part named in the plan (every step of the part: results as bench/report.py writes
them, plus the raw request records without answer texts), ``report.md`` (status and every step's
tables) and the PNGs the plan asks for (``plot`` of a step). Logs and scratch stay in ``--work``.
Progress goes to stderr; when the budget runs out, the cell in flight is cut off, the stacks are
stopped and everything finished so far is written.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import serve
from bench.report import check_report, write_report
from bench.stack import StackError, StackPool
from specd.loader.random_weights import model_label

PLANS_DIR = Path(__file__).resolve().parent / "plans"
MAX_OUT_FILES = 8
STACK_FLAGS = ("model", "device", "gpu_blocks", "dram_blocks", "nvme_blocks", "max_model_len", "max_num_seqs",
               "kvd_half_life_s", "specd_arg")  # fixed by the running stacks: a step may not change them


class PlanError(ValueError):
    """The plan file is malformed or would write more than the device tool brings back."""


# ---- the plan file -------------------------------------------------------------------------------------

def load_plan(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.is_file():
        path = PLANS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise PlanError(f"no plan {name_or_path!r} (looked for a file and {path})")
    plan = json.loads(path.read_text(encoding="utf-8"))
    steps = [s for g in plan["groups"] for s in g["steps"]]
    names = [s["name"] for s in steps]
    if len(set(names)) != len(names):
        raise PlanError("step names must be unique")
    files = len({s["part"] for s in steps}) + 1 + sum(1 for s in steps if s.get("plot"))
    if files > MAX_OUT_FILES:
        raise PlanError(f"the plan writes {files} files; at most {MAX_OUT_FILES} come back")
    return plan


def flags(values: dict[str, Any]) -> list[str]:
    """A dict of ``bench serve`` options (underscores or dashes) as command-line flags."""
    out: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list) and key == "specd_arg":
            out += [f"--specd-arg={v}" for v in value]
        elif isinstance(value, list):
            out += [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):
            out += [flag, ",".join(f"{k}:{v}" for k, v in value.items())]
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def step_args(group: dict, step: dict, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    """The ``bench serve`` namespace of one step: group stack flags + step load flags, ``--persistent``."""
    load = dict(step["serve"])
    for key in ("workload", "trace"):
        if key in load:
            load[key] = str(args.sessions / load[key])
    load.setdefault("configs", group["configs"])
    if bad := [k for k in load if k.replace("-", "_") in STACK_FLAGS]:
        raise PlanError(f"step {step['name']}: {bad} belong to the group's stack flags")
    parser = argparse.ArgumentParser(prog=f"serve-plan step {step['name']}")
    serve.add_arguments(parser)
    argv = ["--model", str(args.model), "--device", args.device, "--out", str(out), "--persistent",
            *(["--no-progress"] if args.no_progress else []), *flags(group.get("stack", {})), *flags(load)]
    ns = parser.parse_args(argv)
    if missing := set(ns.configs) - set(group["configs"]):
        raise PlanError(f"step {step['name']}: configs {sorted(missing)} are not started by its group")
    return ns


# ---- building the session files (CPU machine) ----------------------------------------------------------

def build(plan: dict, sessions: Path) -> list[str]:
    """Write every step's session file (or trace head) under ``sessions``; returns one line per file."""
    sessions.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in (s for g in plan["groups"] for s in g["steps"]):
        target = sessions / (step["serve"].get("workload") or step["serve"]["trace"])
        if "build" in step:
            cmd = [sys.executable, "-m", "bench.workloads.build", *step["build"], "--out", str(target)]
            subprocess.run(cmd, check=True)
        elif "trace_head" in step:
            head = step["trace_head"]
            src = Path(head["source"])
            if not src.is_absolute():
                src = Path(__file__).resolve().parents[1] / src
            with open(src, encoding="utf-8") as f, open(target, "w", encoding="utf-8") as w:
                for _, line in zip(range(head["lines"]), f):
                    w.write(line)
        else:
            continue
        lines.append(f"{target.name}: {target.stat().st_size / 1e6:.2f} MB")
    total = sum(p.stat().st_size for p in sessions.iterdir() if p.is_file())
    lines.append(f"total: {total / 1e6:.2f} MB in {sessions}")
    return lines


# ---- running ------------------------------------------------------------------------------------------

@dataclass
class StepOutcome:
    name: str
    part: str
    status: str                      # done, cut at budget, failed: ..., skipped
    results: dict | None = None      # as results.json (with summary), when any level finished
    report: str = ""                 # its markdown tables
    requests: list[dict] = field(default_factory=list)
    plot: Path | None = None


class Clock:
    """Seconds since the plan started, against its budget."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - time.monotonic()


def say(clock: Clock, text: str) -> None:
    print(f"[{clock.elapsed():6.1f}s / {clock.budget_s:.0f}s] {text}", file=sys.stderr, flush=True)


def run_step(group: dict, step: dict, pool: StackPool, args: argparse.Namespace, clock: Clock,
             work: Path) -> StepOutcome:
    ns = step_args(group, step, args, work / step["name"])
    ns.out.mkdir(parents=True, exist_ok=True)
    sessions = [] if ns.trace else serve.load_sessions(ns)
    cells = serve.plan(ns.configs, ns.concurrency, ns.repeats)
    outcome = StepOutcome(step["name"], step["part"], "done")
    runs: dict = {}   # filled cell by cell, so a cut or failed step keeps what finished
    log_path = ns.out / "requests.jsonl"
    with open(log_path, "w", encoding="utf-8") as log, serve._progress(ns, cells, sessions) as bar:
        try:
            serve.run_cells(cells, ns, serve.PersistentStacks(pool), serve.script_factory(ns, sessions),
                            log, bar, clock.deadline, runs)
        except serve.BudgetExceeded as cut:
            outcome.status = f"cut at budget ({cut})"
        except (serve.ServeError, StackError) as exc:
            outcome.status = f"failed: {exc}"
    outcome.requests = [{k: v for k, v in json.loads(line).items() if k != "text"}
                        for line in log_path.read_text(encoding="utf-8").splitlines()]
    results = serve.collect_results(ns, runs, serve.extraction_quality(sessions))
    if any(results["configs"][name] for name in ns.configs):
        paths = write_report(results, ns.out, baseline=ns.configs[0], allow_problems=True)
        outcome.results = json.loads(paths["results"].read_text(encoding="utf-8"))
        outcome.report = _tables_only(paths["report"].read_text(encoding="utf-8"))
        if step.get("plot"):
            outcome.plot = paths[step["plot"]]
    return outcome


def _tables_only(report: str) -> str:
    """A step's report.md without its image links (the PNGs are renamed in OUT)."""
    return "\n".join(line for line in report.splitlines() if not line.startswith("!["))


def run_plan(plan: dict, args: argparse.Namespace) -> list[StepOutcome]:
    clock = Clock(args.budget_s)
    outcomes: list[StepOutcome] = []
    for group in plan["groups"]:
        if clock.left() < group.get("start_s", 30.0):
            outcomes += [StepOutcome(s["name"], s["part"], "skipped: budget spent") for s in group["steps"]]
            continue
        say(clock, f"group {group['name']}: starting {', '.join(group['configs'])}")
        first = step_args(group, group["steps"][0], args, args.work / group["steps"][0]["name"])
        try:
            with StackPool(group["configs"], serve.stack_options(first), args.work / "logs" / group["name"]) as pool:
                say(clock, f"group {group['name']}: stacks ready")
                for step in group["steps"]:
                    if clock.left() <= 0:
                        outcomes.append(StepOutcome(step["name"], step["part"], "skipped: budget spent"))
                        continue
                    say(clock, f"step {step['name']}")
                    outcome = run_step(group, step, pool, args, clock, args.work)
                    say(clock, f"step {step['name']}: {outcome.status}")
                    outcomes.append(outcome)
        except StackError as exc:
            say(clock, f"group {group['name']}: stacks failed: {exc}")
            done = {o.name for o in outcomes}
            outcomes += [StepOutcome(s["name"], s["part"], f"failed: {exc}") for s in group["steps"]
                         if s["name"] not in done]
    say(clock, "plan finished" if clock.left() > 0 else "budget spent")
    return outcomes


def write_outputs(plan: dict, outcomes: list[StepOutcome], args: argparse.Namespace, elapsed_s: float) -> list[Path]:
    """``<part>.json`` per part, ``report.md``, the requested PNGs; returns what was written."""
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for part in dict.fromkeys(o.part for o in outcomes):
        doc = {"plan": plan["name"], "steps": {o.name: {"status": o.status, "results": o.results,
                                                         "requests": o.requests}
                                               for o in outcomes if o.part == part}}
        path = args.out / f"{part}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
        written.append(path)
    for o in outcomes:
        if o.plot is not None and o.plot.exists():
            dest = args.out / f"{o.name}-{o.plot.name}"
            shutil.copyfile(o.plot, dest)
            written.append(dest)
    lines = [f"# Plan `{plan['name']}`", "", plan.get("description", ""), "",
             f"Model {model_label(args.model)}, device {args.device}, budget {args.budget_s:.0f} s, ran {elapsed_s:.0f} s.", "",
             "| step | part | status | consistency |", "|---|---|---|---|"]
    for o in outcomes:
        problems = check_report(o.results) if o.results else ["no finished level"]
        lines.append(f"| {o.name} | {o.part} | {o.status} | {'ok' if not problems else '; '.join(problems)} |")
    for o in outcomes:
        if o.report:
            lines += ["", f"# Step `{o.name}`", "", o.report]
    report = args.out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [*written, report]


# ---- the command --------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help=f"a plan name in {PLANS_DIR} or a plan file")
    p.add_argument("--sessions", type=Path, required=True, help="folder of the plan's session files")
    p.add_argument("--build", action="store_true", help="only write the session files (CPU machine) and exit")
    p.add_argument("--model", type=Path, help="GGUF file or HF directory served by specd")
    p.add_argument("--device", default="auto", help="specd --device (auto, cpu, cuda)")
    p.add_argument("--out", type=Path, help="folder for <part>.json, report.md and the PNGs (at most 8 files)")
    p.add_argument("--work", type=Path, default=None, help="scratch and logs (default: a new folder in /tmp)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-time budget for the whole plan")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars (the progress lines stay)")


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.build:
        print("\n".join(build(plan, args.sessions)))
        return 0
    if args.model is None or args.out is None:
        raise PlanError("a run needs --model and --out (or --build)")
    args.work = args.work or Path(tempfile.mkdtemp(prefix="serve-plan-"))
    t0 = time.monotonic()
    outcomes = run_plan(plan, args)
    for path in write_outputs(plan, outcomes, args, time.monotonic() - t0):
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)
    print((args.out / "report.md").read_text(encoding="utf-8"))
    return 0 if all(o.status == "done" for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench serve-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
