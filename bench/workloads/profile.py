"""What every workload builder shares: the build options, the size presets and the timing draws.

A profile module (creative, support, ...) turns corpus items into sessions with pure functions; this file
holds the knobs they all read, so a tiny CPU build and a 32k-token GPU build differ only in options.
All randomness flows from one `random.Random` seeded by (seed, workload, split): never Python's `hash()`,
so the same options give the same file bytes on every machine.
"""
from __future__ import annotations

import json
import math
import os
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.workloads.split import CorpusSplit, load_or_create_split

_REPO = Path(__file__).resolve().parents[2]


def default_corpora_dir() -> Path:
    """The shared corpora: `../shared/data/corpora` next to the repo, or `shared/` inside it (device copies)."""
    for candidate in (_REPO.parent / "shared/data/corpora", _REPO / "shared/data/corpora"):
        if candidate.is_dir():
            return candidate
    return _REPO.parent / "shared/data/corpora"


DEFAULT_MANIFEST_DIR = Path(__file__).resolve().parent / "splits"  # committed: the split is recorded once.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kvspec"


_STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The local CPython standard library's .py files, sorted (tests, GUIs and vendored wheels left out).

    Its content depends on the Python version, so sessions built from it record `python` in their meta.
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("config-"))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return found


def read_keyed_jsonl(path: Path, prefix: str, key: str) -> dict[str, dict]:
    """A corpus JSONL file as {"<prefix>/<record[key]>": record}: the stable item ids the split records."""
    records = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    return {f"{prefix}/{r[key]}": r for r in records}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Scale:
    """Size preset. `max_chars` truncates every long text (system prompt, passage, document, file)."""

    name: str
    max_chars: int | None  # None: keep texts whole
    max_tokens_cap: int | None  # None: the profile's own max_tokens
    max_turns: int | None  # None: no cap on turns per session
    keep_tools: bool  # False: no tool schemas (~1,500 characters) and tool results sent as user messages
    max_docs: int | None  # knowledge: retrieved documents per question at most


SCALES = {
    # stories260K has a 512-token context and a 512-piece vocabulary (about one token per character): two
    # short turns must fit with their answers, and its plain chat template has no tool role.
    "tiny": Scale("tiny", max_chars=100, max_tokens_cap=16, max_turns=2, keep_tools=False, max_docs=1),
    "full": Scale("full", max_chars=None, max_tokens_cap=None, max_turns=None, keep_tools=True, max_docs=None),
}


@dataclass(frozen=True)
class BuildOptions:
    """Everything a builder reads. Times in the output are real-time seconds multiplied by `time_scale`."""

    split: str = "train"
    sessions: int = 16
    turns: int | None = None  # None: the profile's default
    time_scale: float = 1.0  # 0.01 compresses a 3-minute pause into 1.8 s
    seed: int = 0
    scale: Scale = SCALES["full"]
    max_chars: int | None = None  # overrides scale.max_chars when set
    max_tokens: int | None = None  # overrides the profile's max_tokens when set
    rate: float | None = None  # session arrivals per real second; None: the profile's default
    corpora_dir: Path = field(default_factory=default_corpora_dir)
    manifest_dir: Path = DEFAULT_MANIFEST_DIR
    cache_dir: Path = DEFAULT_CACHE_DIR
    file_chars: int = 6000  # coding: characters of each stdlib file in a tool result
    docs_per_question: int = 4  # knowledge: retrieved chunks per question

    def __post_init__(self) -> None:
        if self.split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', not {self.split!r}")
        if self.sessions < 1 or (self.turns is not None and self.turns < 1):
            raise ValueError("sessions and turns must be at least 1")
        if self.time_scale <= 0 or (self.rate is not None and self.rate <= 0):
            raise ValueError("time_scale and rate must be positive")

    def rng(self, workload: str) -> random.Random:
        return random.Random(f"{self.seed}:{workload}:{self.split}")

    def char_limit(self) -> int | None:
        return self.max_chars if self.max_chars is not None else self.scale.max_chars

    def clip(self, text: str) -> str:
        """Keep the head of a long text within the size preset (the head is what a prefix cache shares)."""
        limit = self.char_limit()
        return text if limit is None or len(text) <= limit else text[:limit]

    def turn_count(self, default: int) -> int:
        n = self.turns if self.turns is not None else default
        return min(n, self.scale.max_turns) if self.scale.max_turns is not None else n

    def answer_tokens(self, default: int) -> int:
        n = self.max_tokens if self.max_tokens is not None else default
        return min(n, self.scale.max_tokens_cap) if self.scale.max_tokens_cap is not None else n

    def docs(self) -> int:
        cap = self.scale.max_docs
        return self.docs_per_question if cap is None else min(self.docs_per_question, cap)

    def split_of(self, corpus: str, sources: Sequence[Path], item_ids: Sequence[str]) -> CorpusSplit:
        return load_or_create_split(self.manifest_dir, corpus, sources, item_ids)


@dataclass(frozen=True)
class Timing:
    """A profile's pacing: Poisson arrivals and lognormal think times (median and log-space sigma)."""

    rate: float  # sessions per real second
    think_median_s: float
    think_sigma: float


def arrivals(rng: random.Random, n: int, rate: float, time_scale: float) -> list[float]:
    """Poisson process: exponential gaps, the first session at t=0 so a run starts at once."""
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(round(t * time_scale, 3))
    return out


def think_time(rng: random.Random, timing: Timing, time_scale: float) -> float:
    return round(timing.think_median_s * math.exp(rng.gauss(0.0, timing.think_sigma)) * time_scale, 3)


def pick(rng: random.Random, ids: Sequence[str], n: int) -> list[str]:
    """n items without repeats while the split lasts, then another shuffled pass (sessions may repeat items)."""
    if not ids:
        raise ValueError("the split has no items")
    out: list[str] = []
    while len(out) < n:
        batch = list(ids)
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out


def session_arrivals(opts: BuildOptions, rng: random.Random, timing: Timing) -> list[float]:
    return arrivals(rng, opts.sessions, opts.rate if opts.rate is not None else timing.rate, opts.time_scale)


def think_times(opts: BuildOptions, rng: random.Random, timing: Timing, turns: int) -> list[float]:
    """The first turn starts at the session's arrival; each later turn waits a lognormal pause."""
    return [0.0] + [think_time(rng, timing, opts.time_scale) for _ in range(turns - 1)]
