"""Drafter pipeline: train dspark/dflash/eagle3 on one target, tune dspark per workload, measure τ; resumable.

    # CPU side (the GPU box has no ../shared): the session files, five workloads x {train, eval}
    python -m bench drafter-pipeline --prepare --sessions runs/sessions --train-sessions 48 --eval-sessions 16
    # GPU side: everything, inside a wall-time budget; re-running after a kill resumes stage by stage
    python -m bench drafter-pipeline --target Q.gguf --sessions runs/sessions --work /tmp/dp --out OUT \\
        --budget-s 600 --gamma 7 --device cuda
    # anywhere: the plots from OUT/acceptance-qwen.json (when the GPU box has no matplotlib)
    python -m bench drafter-pipeline --plot-only --out OUT

Stages (a marker WORK/stages/<stage>.json each; a stage with a marker is skipped on the next run):
1. data: the target answers every turn of the *train* sessions of all five workloads, in shared batches
   (one data.jsonl for all three methods: same data, same steps, same target), through the serving engine
   (``--answers engine``, the default on CUDA: continuous batching, CUDA graphs) or the eager harness
   (``--answers harness``, the default on the CPU); the marker records which;
2. train-dspark / train-dflash / train-eagle3: the same steps on that data, STS calibration for dspark;
3. tune-<workload>: the generic dspark fine-tuned (`--init`) on that workload's train sequences;
4. eval-<row>: chain verification on every workload's *eval* sessions at T = 0 and T = 1 in one batched
   run per drafter (bench.acceptance.run_prompts), tuned drafters on their own workload only;
5. report: OUT/<name>.json (every number, stage wall times, device, commit), OUT/<name>.md (τ tables and
   the dspark/dflash, dspark/eagle3 ratios next to the paper's) and acceptance-by-position plots.

Budget: stage s must end by ``start + budget · SHARES[s]`` (the clock includes the wall time of stages
finished by an earlier run). Training and tuning stop at their deadline (the step reached is recorded);
an evaluation that would start past its deadline is skipped and listed under "skipped".
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("creative", "support", "knowledge", "coding", "extraction")
METHODS = ("dspark", "dflash", "eagle3")
ROWS = ("dspark", "dflash", "eagle3", "ngram", "dspark-tuned")
TEMPERATURES = (0.0, 1.0)
PAPER_RATIOS = {"dspark/dflash": 1.18, "dspark/eagle3": 1.27}   # DSpark paper: +18% τ over DFlash, +27% over EAGLE-3
# Cumulative share of the budget by the end of each stage; slack of an early stage passes to the next.
SHARES = {"data": 0.20, "train": 0.62, "tune": 0.72, "eval": 0.97}
# The last stage of a run cut by --stop-after takes the windows of the stages it skips, less what comes
# after its loop (calibration, writing): session 10, run AB (--stop-after train, 565 s) stopped training at
# 0.62 of the budget and left 176 s of it unused; its calibration and writing took 41 s (7%).
STOP_SHARE = 0.90


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not names or any(m not in METHODS for m in names):
        raise argparse.ArgumentTypeError(f"--methods must name one or more of {', '.join(METHODS)}; got {text!r}")
    return names


def _warm_start(text: str) -> tuple[str, Path]:
    method, sep, path = text.partition("=")
    if not sep or method.strip() not in METHODS or not path.strip():
        raise argparse.ArgumentTypeError(f"--init takes METHOD=DIR, METHOD one of {', '.join(METHODS)}; got {text!r}")
    return method.strip(), Path(path.strip())


def _train_weights(text: str) -> dict[str, float]:
    """``dspark=2,dflash=1``: each named method's weight in the training window (unnamed ones weigh 1)."""
    out: dict[str, float] = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        method, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or method.strip() not in METHODS or not 0 < weight < math.inf or method.strip() in out:
            raise argparse.ArgumentTypeError(f"--train-weights takes METHOD=WEIGHT,... (METHOD one of "
                                             f"{', '.join(METHODS)}, once each, finite WEIGHT > 0); got {text!r}")
        out[method.strip()] = weight
    return out


def train_windows(methods: tuple[str, ...], weights: dict[str, float]) -> list[tuple[float, float]]:
    """(weight, weight of it and every later method) per method in training order: a method's part of what
    is left of the window when its stage starts. Why: equal windows are not equal steps (session 61: a dspark
    step cost ~1.9x a dflash step, and dspark got 630 steps to dflash's 1,056 in the same time)."""
    w = [weights.get(m, 1.0) for m in methods]
    return [(w[i], sum(w[i:])) for i in range(len(methods))]


def warm_starts(args: argparse.Namespace) -> dict[str, Path]:
    """Method -> the trained drafter its generic stage starts from (``--init METHOD=DIR``, ``--init-dspark DIR``).
    Refused before any work when a method is named twice or a directory holds no drafter: a typo must not
    cost a device session's training window by training from scratch."""
    pairs = list(args.init or []) + ([("dspark", args.init_dspark)] if args.init_dspark else [])
    out: dict[str, Path] = {}
    for method, path in pairs:
        if method in out:
            raise SystemExit(f"--init names {method} twice ({out[method]} and {path})")
        if method not in args.methods:
            raise SystemExit(f"--init {method}={path}: --methods {','.join(args.methods)} does not train {method}")
        if not (path / "drafter.safetensors").is_file():
            raise SystemExit(f"--init {method}={path}: no drafter.safetensors there")
        out[method] = path
    return out


def check_methods(methods: tuple[str, ...], stop_after: str | None) -> None:
    """dspark is needed past training (the tuned rows start from it); a run that stops after training may
    leave it out, so the whole window goes to the others (a deployment keeping a longer-trained dspark)."""
    if "dspark" not in methods and stop_after not in ("data", "train"):
        raise SystemExit(f"--methods {','.join(methods)} leaves out dspark, which tuning and the evaluation "
                         "start from: add it, or stop the run with --stop-after train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specd.drafter.data import SERVED_DTYPES

    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="only write the session files into --sessions (CPU)")
    mode.add_argument("--plot-only", action="store_true", help="only draw the plots from OUT/<name>.json")
    p.add_argument("--target", type=Path, help="GGUF file or HF directory of the target")
    p.add_argument("--methods", type=_methods, default=METHODS,
                   help="comma-separated trained methods (default dspark,dflash,eagle3): e.g. 'dspark' to spend the "
                        "whole training budget on one drafter; dspark is required unless --stop-after train "
                        "(the tuned rows start from it)")
    p.add_argument("--sessions", type=Path, help="directory of <workload>.{train,eval}.jsonl session files")
    p.add_argument("--work", type=Path, help="stage markers, data, drafters, checkpoints (kept for resume)")
    p.add_argument("--out", type=Path, required=True, help="results: JSON, markdown, PNG plots")
    p.add_argument("--name", default="acceptance-qwen", help="file name stem of the results")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-time budget of the whole run")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", help="target dtype (the drafters train in fp32)")
    p.add_argument("--no-tf32", action="store_true", help="keep fp32 matmuls exact on CUDA (slower)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", choices=["data", "train", "tune"],
                   help="end after this stage (and write no report), e.g. to smoke-test the data stage")
    # session files (--prepare) and how much of them a run reads
    p.add_argument("--train-sessions", type=int, default=48, help="train sessions per workload")
    p.add_argument("--eval-sessions", type=int, default=16, help="eval sessions per workload")
    p.add_argument("--turns", type=int, default=2, help="--prepare: turns per session")
    p.add_argument("--max-tokens", type=int, default=128, help="--prepare: answer tokens per turn")
    p.add_argument("--max-chars", type=int, default=3000, help="--prepare: cut every long text (support's "
                   "system prompt is ~95k characters) to this many characters")
    p.add_argument("--scale", default="full", help="--prepare: workload scale preset (tiny fits stories260K)")
    # stage sizes
    p.add_argument("--answers", choices=("engine", "harness"), default=None,
                   help="answer generator of the data stage (specd.drafter.data.ANSWERS): engine (serving engine, "
                        "CUDA graphs) or harness (eager); default: engine on CUDA, harness on the CPU")
    p.add_argument("--answers-from", type=Path, default=None, metavar="DIR",
                   help="take the data stage from an earlier run's work folder (its data/ and stages/data.json, "
                        "e.g. carried back from a device session) instead of answering again: same sessions, "
                        "--train-sessions, --max-len and --seed, checked before any work; the answers cost this "
                        "run's budget nothing (session 42: the stage took 178 of a 570 s call)")
    p.add_argument("--answers-dtype", default="auto", choices=SERVED_DTYPES,
                   help="dtype the data stage answers in: auto = bfloat16 on CUDA (what specd serves in; 2.4x "
                        "faster than fp32 in session 8; a copy of the target, 2 bytes per parameter, during the "
                        "data stage), the target's dtype elsewhere; target = --dtype")
    p.add_argument("--features-dtype", default="auto", choices=SERVED_DTYPES,
                   help="dtype of the training stages' target pass (the drafter's features): auto = bfloat16 on "
                        "CUDA, as specd serves; target = the target's dtype (before session 9)")
    p.add_argument("--gen-batch", type=int, default=128, help="sequences per answer-generation batch (the "
                   "engine's max_num_seqs)")
    p.add_argument("--max-len", type=int, default=3072, help="prompt + answer tokens at most (longer turns dropped)")
    p.add_argument("--steps", type=int, default=400, help="training steps of each generic drafter")
    p.add_argument("--init-dspark", type=Path, default=None,
                   help="warm-start the generic dspark drafter from this trained drafter directory (its "
                        "layers, Markov rank and γ; a bf16 copy loads into fp32 training weights): more steps "
                        "on more data without repeating the ones a device session already paid for")
    p.add_argument("--init", type=_warm_start, action="append", metavar="METHOD=DIR",
                   help="warm-start that method's generic drafter from this trained drafter directory, as "
                        "--init-dspark does for dspark (repeat for several: --init dflash=DIR --init eagle3=DIR), "
                        "so dflash and eagle3 also add up their training across device sessions")
    p.add_argument("--train-weights", type=_train_weights, default={}, metavar="METHOD=WEIGHT,...",
                   help="each method's part of the training window, e.g. dspark=2 gives dspark twice the time "
                        "of each other method (default: equal parts)")
    p.add_argument("--tune-steps", type=int, default=80, help="tuning steps per workload")
    p.add_argument("--layers", type=int, default=1, help="dspark/dflash draft layers")
    p.add_argument("--markov-rank", type=int, default=64, help="dspark Markov rank (2·V·r parameters)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--tune-lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8, help="training sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="random anchors per training sequence")
    p.add_argument("--sts-temperature", type=float, default=1.0, help="temperature STS observes survival at")
    p.add_argument("--eval-batch", type=int, default=256, help="chains verified together per round")


# ---- budget and stage markers ------------------------------------------------------------------------

class Budget:
    """Wall clock of the whole pipeline, counting the stages an earlier (killed) run finished."""

    def __init__(self, total_s: float, spent_s: float, last: str | None = None):
        self.total_s = total_s
        self.t0 = time.perf_counter() - spent_s
        self.last = last          # --stop-after: no stage after this one runs

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def deadline(self, stage: str) -> float:
        """perf_counter() value by which `stage` (data/train/tune/eval) must end."""
        share = max(SHARES[stage], STOP_SHARE) if stage == self.last else SHARES[stage]
        return self.t0 + self.total_s * share

    def share(self, stage: str, parts_left: float) -> float:
        """Deadline for the next of `parts_left` equal parts of what is left of `stage`'s window (a fraction
        of parts: a weighted method's ``weight_left / weight``)."""
        now = time.perf_counter()
        return now + max(0.0, self.deadline(stage) - now) / max(parts_left, 1)


class Stages:
    """WORK/stages/<name>.json: a finished stage's summary, with its wall time."""

    def __init__(self, work: Path):
        self.dir = work / "stages"
        self.dir.mkdir(parents=True, exist_ok=True)

    def done(self, name: str) -> dict | None:
        path = self.dir / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def record(self, name: str, summary: dict) -> dict:
        tmp = self.dir / f"{name}.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.dir / f"{name}.json")       # atomic: a kill never leaves half a marker
        return summary

    def all(self) -> dict[str, dict]:
        """Every marker, in the order the stages finished."""
        paths = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
        return {p.stem: json.loads(p.read_text()) for p in paths}

    def spent_s(self) -> float:
        return sum(s.get("wall_s", 0.0) for s in self.all().values())


def progress(budget: Budget, stage: str, message: str) -> None:
    print(f"[drafter-pipeline {budget.elapsed():7.1f}s / {budget.total_s:.0f}s] {stage}: {message}", flush=True)


# ---- CPU side: session files ---------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> int:
    """Write <workload>.train.jsonl and <workload>.eval.jsonl for the five workloads into --sessions."""
    from bench.workloads.build import build_sessions
    from bench.workloads.format import write_sessions
    from bench.workloads.profile import SCALES, BuildOptions

    args.sessions.mkdir(parents=True, exist_ok=True)
    for w in WORKLOADS:
        for split, n in (("train", args.train_sessions), ("eval", args.eval_sessions)):
            opts = BuildOptions(split=split, sessions=n, turns=args.turns, scale=SCALES[args.scale],
                                max_chars=args.max_chars, max_tokens=args.max_tokens, seed=args.seed)
            path = args.sessions / f"{w}.{split}.jsonl"
            write_sessions(path, build_sessions(w, opts))
            print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)", file=sys.stderr)
    return 0


def read_workload_sessions(directory: Path, split: str, limit: int) -> dict[str, list]:
    from bench.workloads.format import read_sessions

    out = {}
    for w in WORKLOADS:
        path = directory / f"{w}.{split}.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} is missing: write the session files with --prepare first")
        out[w] = [s for s in read_sessions(path) if s.split == split][:limit]
    return out


# ---- the GPU run --------------------------------------------------------------------------------------

@dataclass
class Run:
    args: argparse.Namespace
    budget: Budget
    stages: Stages
    skipped: list[str] = field(default_factory=list)
    load_s: float | None = None
    _target: tuple | None = None

    @property
    def work(self) -> Path:
        return self.args.work

    def target(self):
        """(model, tokenizer), loaded on first use: a fully resumed run never loads it."""
        if self._target is None:
            from specd.loader import load_model

            t0 = time.perf_counter()
            model, tok = load_model(self.args.target, self.args.dtype, self.args.device)
            model.requires_grad_(False)
            self._target = (model, tok)
            self.load_s = time.perf_counter() - t0
            progress(self.budget, "load", f"{self.args.target.name} on {_device_name(model)} in {self.load_s:.1f}s")
        return self._target

    def stage(self, name: str, fn) -> dict:
        """Run `fn() -> summary` unless its marker exists; record the summary with the stage's wall time
        (skipped stages are only listed, so a resumed run retries them; a truncated one is continued)."""
        done = self.stages.done(name)
        earlier = 0.0
        if done is not None and done.get("status") == "truncated":
            # a training stage the budget cut: go on from its checkpoint (the trainer always resumes), so a
            # later call with time left finishes the schedule instead of skipping it (session 10, run AB:
            # the second call skipped a stage cut at 1,600 of 2,500 steps)
            progress(self.budget, name, f"cut earlier at step {done.get('steps_done')} of {done.get('steps')}, "
                                        "resuming")
            earlier = done.get("wall_s", 0.0)
        elif done is not None:
            progress(self.budget, name, "done earlier, skipped")
            return done
        t0 = time.perf_counter()
        summary = fn()
        summary["wall_s"] = time.perf_counter() - t0 + earlier     # the budget counts both attempts
        progress(self.budget, name, f"{summary['status']} in {summary['wall_s']:.1f}s"
                                    + (f" ({summary['reason']})" if "reason" in summary else ""))
        if summary["status"] == "skipped":          # no marker: a later run with time left tries again
            self.skipped.append(f"{name}: {summary['reason']}")
            return summary
        return self.stages.record(name, summary)


def run(args: argparse.Namespace) -> int:
    if args.plot_only:
        return write_plots(args.out, json.loads((args.out / f"{args.name}.json").read_text()))
    if args.sessions is None:
        raise SystemExit("--sessions is required")
    if args.prepare:
        return prepare(args)
    if args.target is None or args.work is None:
        raise SystemExit("--target and --work are required")
    check_methods(args.methods, args.stop_after)
    args.warm_starts = warm_starts(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True     # fp32 target on tensor cores; verification stays exact
        torch.backends.cudnn.allow_tf32 = True            # w.r.t. the target as computed
    args.work.mkdir(parents=True, exist_ok=True)
    stages = Stages(args.work)
    if args.answers_from is not None and stages.done("data") is None:
        stages.record("data", carried_data_stage(args))
    r = Run(args, Budget(args.budget_s, stages.spent_s(), args.stop_after), stages)
    progress(r.budget, "start", f"work {args.work}, out {args.out}")
    r.stage("data", lambda: stage_data(r))
    if args.stop_after == "data":
        return 0
    methods = args.methods
    for m, part in zip(methods, train_windows(methods, args.train_weights)):
        r.stage(f"train-{m}", lambda m=m, part=part: stage_train(r, m, *part))
    if args.stop_after == "train":
        return 0
    for i, w in enumerate(WORKLOADS):
        r.stage(f"tune-{w}", lambda w=w, i=i: stage_tune(r, w, len(WORKLOADS) - i))
    if args.stop_after == "tune":
        return 0
    for name, drafter, workloads in eval_plan(args.work, methods):
        r.stage(f"eval-{name}", lambda d=drafter, ws=workloads: stage_eval(r, d, ws))
    report = build_report(r)
    write_report(args.out, args.name, report)
    write_plots(args.out, report)
    progress(r.budget, "report", f"{args.out / args.name}.json/.md written")
    return 0


def stage_data(r: Run) -> dict:
    """Stage 1: the target's answers to all train turns of all workloads, one data.jsonl for every method."""
    from bench.workloads.split import file_sha256
    from specd.drafter import data

    model, tok = r.target()
    answers = r.args.answers or data.default_answers(next(model.parameters()).device)
    model = data.served_copy(model, r.args.answers_dtype)
    per_w = read_workload_sessions(r.args.sessions, "train", r.args.train_sessions)
    sessions = [s for w in WORKLOADS for s in per_w[w]]
    # the answers' progress bar goes to stderr (the device log): in session 7 this stage ran 540 s on the
    # H200 with nothing in its log to say how far it had got
    pairs = data.answer_sessions(model, tok, sessions, r.args.seed, r.args.max_len, None, r.args.gen_batch,
                                 progress=True, answers=answers)
    ddir = r.work / "data"
    ddir.mkdir(exist_ok=True)
    data.save_sequences(ddir / "all.jsonl", [seq for _, seq in pairs])
    counts = {}
    for w in WORKLOADS:
        mine = [seq for i, seq in pairs if sessions[i].workload == w]
        data.save_sequences(ddir / f"{w}.jsonl", mine)
        counts[w] = {"sequences": len(mine), "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in mine)}
    return {"status": "done", "answers": answers, "answers_dtype": str(model.embed_tokens.weight.dtype),
            "sequences": len(pairs), "per_workload": counts,
            "answer_tokens": sum(c["answer_tokens"] for c in counts.values()),
            "answers_sha256": file_sha256(ddir / "all.jsonl"), "sessions_sha256": sessions_sha256(r.args.sessions),
            "settings": answer_settings(r.args)}


def sessions_sha256(sessions: Path) -> str:
    """One hash of the five workloads' train session files: which prompts the answers are to."""
    from bench.workloads.split import file_sha256

    return _sha("".join(file_sha256(sessions / f"{w}.train.jsonl") for w in WORKLOADS))


def answer_settings(args: argparse.Namespace) -> dict:
    """The settings besides the sessions that decide which answers the data stage writes."""
    return {"train_sessions": args.train_sessions, "max_len": args.max_len, "seed": args.seed}


def carried_data_stage(args: argparse.Namespace) -> dict:
    """The data stage's marker for answers carried from an earlier run (``--answers-from DIR``), after
    copying them into this run's work folder; SystemExit, before any work, when they are not the answers
    this run would write (other sessions or settings) or did not arrive whole (their sha256). Its wall
    time is 0: the carried answers cost this run's budget nothing (the original time is kept apart)."""
    import shutil

    from bench.workloads.split import file_sha256

    src = args.answers_from
    marker_path = src / "stages" / "data.json"
    if not marker_path.is_file():
        raise SystemExit(f"--answers-from {src}: no stages/data.json there (a drafter-pipeline work folder)")
    marker = json.loads(marker_path.read_text())
    if marker.get("status") != "done":
        raise SystemExit(f"--answers-from {src}: its data stage is {marker.get('status')!r}, not done")
    if marker.get("sessions_sha256") != sessions_sha256(args.sessions):
        raise SystemExit(f"--answers-from {src}: its answers are to other sessions than {args.sessions}")
    if marker.get("settings") != answer_settings(args):
        raise SystemExit(f"--answers-from {src}: answered with {marker.get('settings')}, this run asks for "
                         f"{answer_settings(args)}")
    files = ["all.jsonl"] + [f"{w}.jsonl" for w in WORKLOADS]
    missing = [f for f in files if not (src / "data" / f).is_file()]
    if missing:
        raise SystemExit(f"--answers-from {src}: data/{', data/'.join(missing)} missing")
    if file_sha256(src / "data" / "all.jsonl") != marker.get("answers_sha256"):
        raise SystemExit(f"--answers-from {src}: data/all.jsonl is not the file its marker hashed (cut short?)")
    dest = args.work / "data"
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(src / "data" / f, dest / f)
    return {**marker, "carried_from": str(src), "carried_wall_s": marker.get("wall_s"), "wall_s": 0.0}


def _trainer_args(r: Run, method: str, out: Path, steps: int, lr: float, init: Path | None) -> argparse.Namespace:
    """The `specd train-drafter` namespace for one drafter, so the pipeline trains exactly as the CLI does."""
    from specd.drafter.cli import build_parser

    a = r.args
    argv = ["--target", str(a.target), "--data", str(a.sessions), "--method", method, "--out", str(out),
            "--steps", str(steps), "--lr", str(lr), "--gamma", str(a.gamma), "--layers", str(a.layers),
            "--markov-rank", str(a.markov_rank), "--batch-size", str(a.batch_size), "--anchors", str(a.anchors),
            "--sts-temperature", str(a.sts_temperature), "--seed", str(a.seed), "--ckpt-every", "100", "--resume",
            "--features-dtype", a.features_dtype]
    if init is not None:
        argv += ["--init", str(init)]
    return build_parser().parse_args(argv)


def _fit(r: Run, args: argparse.Namespace, seq_file: Path, deadline: float) -> dict:
    from bench.workloads.split import file_sha256
    from specd.drafter import cli, data

    model, _ = r.target()
    seqs = data.load_sequences(seq_file)
    done = r.stages.done("data")
    prov = {"source_sha256": done["sessions_sha256"], "answers_sha256": file_sha256(seq_file),
            "data_s": done["wall_s"], "answers": done.get("answers")}
    rep = cli.fit(args, model, seqs, prov, "python -m bench drafter-pipeline (stage of)", deadline=deadline)
    curves = rep["loss_curves"]
    return {"status": "done" if rep["steps_done"] >= args.steps else "truncated",
            "steps": args.steps, "steps_done": rep["steps_done"], "parameters": rep["parameters"],
            "drafter": rep["drafter"], "train_s": rep["wall_s"]["train"],
            "final_loss": curves["total"][-1] if curves["total"] else None, "sts": rep["sts"],
            "sequences": rep["data"]["train_sequences"], "heldout": rep["data"]["heldout_sequences"]}


def stage_train(r: Run, method: str, weight: float, weight_left: float) -> dict:
    """Stage 2: one generic drafter on the shared data, within its share of the training window: ``weight``
    of the ``weight_left`` that this and the later methods share (``train_windows``)."""
    out = r.work / "drafters" / method
    init = r.args.warm_starts.get(method)
    args = _trainer_args(r, method, out, r.args.steps, r.args.lr, init)
    return _fit(r, args, r.work / "data" / "all.jsonl", r.budget.share("train", weight_left / weight))


def stage_tune(r: Run, workload: str, left: int) -> dict:
    """Stage 3: the generic dspark fine-tuned on one workload's train sequences."""
    seq_file = r.work / "data" / f"{workload}.jsonl"
    if r.stages.done("data")["per_workload"][workload]["sequences"] < 2:
        return {"status": "skipped", "reason": "fewer than 2 train sequences"}
    if time.perf_counter() > r.budget.deadline("tune"):
        return {"status": "skipped", "reason": "past the tuning deadline"}
    args = _trainer_args(r, "dspark", r.work / "drafters" / f"dspark-{workload}", r.args.tune_steps,
                         r.args.tune_lr, r.work / "drafters" / "dspark")
    return _fit(r, args, seq_file, r.budget.share("tune", left))


def eval_plan(work: Path, methods: tuple[str, ...] = METHODS) -> list[tuple[str, str, tuple[str, ...]]]:
    """(stage name, drafter dir or 'ngram', workloads) in priority order: generic rows first."""
    plan = [(m, str(work / "drafters" / m), WORKLOADS) for m in methods]
    plan.append(("ngram", "ngram", WORKLOADS))
    plan += [(f"dspark-tuned-{w}", str(work / "drafters" / f"dspark-{w}"), (w,)) for w in WORKLOADS]
    return plan


def stage_eval(r: Run, drafter: str, workloads: tuple[str, ...]) -> dict:
    """Stage 4: one batched acceptance run over `workloads` × {T=0, T=1}; summaries keyed 'workload|T'."""
    from bench.acceptance import EvalPrompt, load_proposer, run_prompts, summarize
    from specd.sampling_params import SamplingParams

    if drafter != "ngram" and not (Path(drafter) / "drafter.safetensors").exists():
        return {"status": "skipped", "reason": "no drafter"}
    if time.perf_counter() > r.budget.deadline("eval"):
        return {"status": "skipped", "reason": "past the evaluation deadline"}
    model, tok = r.target()
    proposer, temps = load_proposer(drafter, model, r.args.gamma)
    per_w = read_workload_sessions(r.args.sessions, "eval", r.args.eval_sessions)
    prompts = [EvalPrompt(session=s, max_new_tokens=None, params=SamplingParams(temperature=t), key=(w, t))
               for w in workloads for t in TEMPERATURES for s in per_w[w]]
    t0 = time.perf_counter()
    records = run_prompts(model, tok, proposer, prompts, SamplingParams(temperature=0.0), r.args.gamma,
                          r.args.seed, r.args.eval_batch, progress=False)
    results = {f"{w}|{t:g}": summarize(rec, r.args.gamma, temps) for (w, t), rec in records.items()}
    return {"status": "done", "drafter": drafter, "eval_s": time.perf_counter() - t0, "results": results,
            "sts_temperatures": temps}


# ---- report --------------------------------------------------------------------------------------------

def build_report(r: Run) -> dict:
    """Everything the stages recorded, with the τ tables and ratios derived from the eval summaries."""
    stages = r.stages.all()
    results: dict[str, dict[str, dict]] = {row: {} for row in ROWS}
    for name, _, _ in eval_plan(r.work, r.args.methods):
        done = stages.get(f"eval-{name}", {})
        row = "dspark-tuned" if name.startswith("dspark-tuned") else name
        for key, summary in done.get("results", {}).items():
            w, t = key.split("|")
            results[row].setdefault(w, {})[t] = summary
    tables = {f"{t:g}": tau_table(results, f"{t:g}") for t in TEMPERATURES}
    return {
        "target": str(r.args.target), "device": _device_name(r._target[0]) if r._target else r.args.device,
        "commit": _commit(), "gamma": r.args.gamma, "budget_s": r.budget.total_s, "elapsed_s": r.budget.elapsed(),
        "tf32": not r.args.no_tf32, "settings": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(r.args).items() if k != "run"},
        "stages": stages, "stage_wall_s": {k: v.get("wall_s") for k, v in stages.items()},
        "model_load_s": r.load_s, "answers": stages.get("data", {}).get("answers"),
        "skipped": list(r.skipped),
        "truncated": [f"{k}: {v['steps_done']} of {v['steps']} steps" for k, v in stages.items()
                      if v.get("status") == "truncated"],
        "results": results, "tau": tables,
        "ratios": {t: ratios(tab) for t, tab in tables.items()}, "paper_ratios": PAPER_RATIOS,
    }


def tau_table(results: dict, t: str) -> dict[str, dict[str, float | None]]:
    """{row: {workload: τ, 'mean': mean over the workloads that have one}} at temperature key t."""
    table = {}
    for row in ROWS:
        taus = {w: results[row].get(w, {}).get(t, {}).get("tau") for w in WORKLOADS}
        have = [v for v in taus.values() if v is not None]
        table[row] = {**taus, "mean": sum(have) / len(have) if have else None}
    return table


def ratios(table: dict) -> dict[str, float | None]:
    d = table["dspark"]["mean"]
    return {f"dspark/{b}": (d / table[b]["mean"] if d and table[b]["mean"] else None) for b in ("dflash", "eagle3")}


def write_report(out: Path, name: str, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(render_markdown(report))


def _fmt(x, pct: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def render_markdown(rep: dict) -> str:
    lines = [f"# Drafter acceptance: {Path(rep['target']).name}", "",
             f"Device {rep['device']}, commit {rep['commit']}, γ = {rep['gamma']}, "
             f"{rep['elapsed_s']:.0f} s of a {rep['budget_s']:.0f} s budget; training data answered by the "
             f"{rep.get('answers') or 'unrecorded'} generator.", ""]
    for t in ("1", "0"):
        lines += [f"## τ at T = {t}", "", "| drafter | " + " | ".join(WORKLOADS) + " | mean |",
                  "|---" * (len(WORKLOADS) + 2) + "|"]
        for row, taus in rep["tau"][t].items():
            lines.append(f"| {row} | " + " | ".join(_fmt(taus[w]) for w in (*WORKLOADS, "mean")) + " |")
        rat = rep["ratios"][t]
        lines += ["", "Ratios of mean τ: " + ", ".join(
            f"{k} = {_fmt(v)} (paper {rep['paper_ratios'][k]:.2f})" for k, v in rat.items()), ""]
    lines += ["## ECE of dspark's confidence (raw → after STS)", "", "| drafter | T | " + " | ".join(WORKLOADS) + " |",
              "|---" * (len(WORKLOADS) + 2) + "|"]
    for row in ("dspark", "dspark-tuned"):
        for t in ("0", "1"):
            cells = [rep["results"][row].get(w, {}).get(t) for w in WORKLOADS]
            lines.append(f"| {row} | {t} | " + " | ".join(
                f"{_fmt(c['ece_raw'], True)} → {_fmt(c['ece_sts'], True)}" if c else "–" for c in cells) + " |")
    lines += ["", "## Draft cost (draft time / verify time, mean over workloads, T = 0)", ""]
    for row in ROWS:
        costs = [c["0"]["draft_cost_fraction"] for c in rep["results"][row].values() if "0" in c]
        lines.append(f"- {row}: {_fmt(sum(costs) / len(costs)) if costs else '–'}")
    lines += ["", "## Stage wall times (s)", ""] + [f"- {k}: {v:.1f}" for k, v in rep["stage_wall_s"].items()]
    if rep["skipped"] or rep["truncated"]:
        lines += ["", "## Cut by the budget", ""] + [f"- {x}" for x in rep["skipped"] + rep["truncated"]]
    return "\n".join(lines) + "\n"


def mean_by_position(rep: dict, row: str, t: str) -> list[float | None]:
    """Acceptance by position averaged over the workloads that reached each position."""
    curves = [c[t]["acceptance_by_position"] for c in rep["results"][row].values() if t in c]
    out = []
    for j in range(rep["gamma"]):
        vals = [c[j] for c in curves if j < len(c) and c[j] is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def write_plots(out: Path, rep: dict) -> int:
    """One PNG per temperature: acceptance by position, a line per drafter row, averaged over workloads."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: run again with --plot-only where it is installed", file=sys.stderr)
        return 0
    for t in ("0", "1"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for row in ROWS:
            ys = mean_by_position(rep, row, t)
            pts = [(j + 1, y) for j, y in enumerate(ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=row)
        ax.set(xlabel="draft position j", ylabel="P(accept j | accepted < j)", ylim=(0, 1),
               title=f"Acceptance by position, T = {t}, mean over workloads")
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"acceptance-by-position-t{t}.png", dpi=100)
        plt.close(fig)
    return 0


def _device_name(model) -> str:
    import torch

    dev = next(model.parameters()).device
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} thread(s))"


def _commit() -> str:
    from bench.provenance import git_commit

    return git_commit()


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()
