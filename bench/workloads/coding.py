"""Coding agent: a fixed system prompt and tool schemas, then an MBPP task worked over many turns.

Every turn after the first appends tool results: a stdlib source file (read_file) and the MBPP test run
(run_tests); the replay appends the model's previous answer. So the context only grows, turn after turn,
on top of a prefix (system + tools + task) that never changes: the shape of agent traffic, where prefix
reuse across turns decides TTFT. `file_chars` and `turns` set how long it grows (10 turns of 12,000-character
files reach about 113k characters, roughly 30k tokens of code).
"""
from __future__ import annotations

import platform
import random
from pathlib import Path

from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import (BuildOptions, Timing, pick, read_keyed_jsonl, session_arrivals, stdlib_root,
                                     stdlib_sources, think_times)

WORKLOAD = "coding"
TIMING = Timing(rate=1 / 20, think_median_s=2.0, think_sigma=0.5)  # tool execution, not a human
DEFAULT_TURNS = 6
DEFAULT_MAX_TOKENS = 512
MIN_FILE_CHARS = 2000  # files shorter than this carry too little context to be worth a turn
SYSTEM = ("You are a coding agent working in a Python repository. Solve the user's task by reading code, "
          "writing files and running tests with the tools provided. Think step by step, explain each change "
          "briefly, and call one tool at a time. The final solution goes in solution.py.")


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    _function("read_file", "Read a text file from the repository.",
              {"path": {"type": "string", "description": "Path relative to the repository root."},
               "start_line": {"type": "integer", "minimum": 1, "description": "First line to return."},
               "max_lines": {"type": "integer", "minimum": 1, "maximum": 2000}}, ["path"]),
    _function("write_file", "Create or overwrite a text file in the repository.",
              {"path": {"type": "string", "description": "Path relative to the repository root."},
               "content": {"type": "string", "description": "The complete new file content."}}, ["path", "content"]),
    _function("run_tests", "Run test assertions against solution.py and report each result.",
              {"tests": {"type": "array", "items": {"type": "string"}, "description": "Python assert statements."},
               "timeout_s": {"type": "number", "minimum": 1, "maximum": 600}}, ["tests"]),
    _function("search", "Search the repository for a regular expression.",
              {"pattern": {"type": "string", "description": "A Python regular expression."},
               "path": {"type": "string", "description": "Folder to search in; the root if omitted."},
               "max_results": {"type": "integer", "minimum": 1, "maximum": 200}}, ["pattern"]),
]


def load_tasks(corpora_dir: Path) -> tuple[list[Path], dict[str, dict]]:
    path = corpora_dir / "code/mbpp.jsonl"
    return [path], read_keyed_jsonl(path, "mbpp", "task_id")


def context_files(file_chars: int) -> list[Path]:
    """Stdlib files long enough to fill a tool result of the requested size (or the longest ones)."""
    files = stdlib_sources()
    big = [p for p in files if p.stat().st_size >= max(file_chars, MIN_FILE_CHARS)]
    return big or files


def task_message(task: dict) -> str:
    tests = "\n".join(task["test_list"])
    return f"Task: {task['text']}\n\nYour code should pass these tests:\n{tests}\n\nWrite the solution in solution.py."


def tool_results(task: dict, path: Path, turn: int, opts: BuildOptions) -> list[Message]:
    """What the tools returned since the last answer: a source file, then the still-failing test run."""
    rel = path.relative_to(stdlib_root()).as_posix()
    text = opts.clip(path.read_text(encoding="utf-8", errors="replace")[:opts.file_chars])
    tests = "\n".join(f"FAILED {t}\n  AssertionError" for t in task["test_list"])
    run = opts.clip(f"run {turn}: 0 passed, {len(task['test_list'])} failed\n{tests}")
    return [tool_message("read_file", f"# Lib/{rel}\n{text}", opts),
            tool_message("run_tests", run, opts)]


def tool_message(tool: str, content: str, opts: BuildOptions) -> Message:
    """A tool result; as a user message when the scale drops tools (a plain chat template has no tool role)."""
    if opts.scale.keep_tools:
        return Message(role="tool", name=tool, content=content)
    return Message(role="user", content=f"[{tool}]\n{content}")


def make_session(index: int, item_id: str, task: dict, files: list[Path], arrival_s: float,
                 opts: BuildOptions, rng: random.Random) -> Session:
    n_turns = opts.turn_count(DEFAULT_TURNS)
    pauses = think_times(opts, rng, TIMING, n_turns)
    max_tokens = opts.answer_tokens(DEFAULT_MAX_TOKENS)
    reads = rng.sample(files, min(n_turns - 1, len(files)))
    turns = [Turn(messages=[Message(role="user", content=opts.clip(task_message(task)))], max_tokens=max_tokens)]
    for k in range(1, n_turns):
        path = reads[(k - 1) % len(reads)]
        turns.append(Turn(messages=tool_results(task, path, k, opts), max_tokens=max_tokens,
                          think_time_s=pauses[k]))
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=arrival_s,
        system=opts.clip(SYSTEM), turns=turns, sampling=Sampling(temperature=0.2, top_p=0.95, top_k=0),
        tools=TOOLS if opts.scale.keep_tools else None,
        meta={"corpus": WORKLOAD, "source_items": [item_id], "python": platform.python_version(),
              "files": [f"Lib/{p.relative_to(stdlib_root()).as_posix()}" for p in reads]},
    )


def build(opts: BuildOptions) -> list[Session]:
    sources, tasks = load_tasks(opts.corpora_dir)
    split = opts.split_of(WORKLOAD, sources, list(tasks))
    files = context_files(opts.file_chars)
    rng = opts.rng(WORKLOAD)
    chosen = pick(rng, split.ids(opts.split), opts.sessions)
    starts = session_arrivals(opts, rng, TIMING)
    return [make_session(i, item, tasks[item], files, t, opts, rng) for i, (item, t) in enumerate(zip(chosen, starts))]
