"""The session JSONL format: the one contract between workload builders, user traffic and the load generator.

One line is one session. A turn holds only the *new* messages of that turn; the conversation history is
implied, so a file stays small and a replay can append the model's own answers:

    prompt(turn k) = system + turn_1.messages + answer_1 + ... + turn_(k-1).messages + answer_(k-1)
                     + turn_k.messages

`docs/workloads.md` documents every field with an example, so users can write this format from their logs.
Serialisation is canonical (fixed key order, no whitespace, UTF-8), so the same sessions give the same bytes.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FORMAT_VERSION = 1

Role = Literal["system", "user", "assistant", "tool"]
Split = Literal["train", "eval"]


class FormatError(ValueError):
    """A session file line that is not valid JSON or does not match the schema; carries the line number."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


class Message(BaseModel):
    """One chat message. `tool` messages carry a tool's result; `name` says which tool produced it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str
    name: str | None = Field(None, description="Tool name for role=tool; omitted otherwise.")


class Turn(BaseModel):
    """One request of a session: what the user (or tools) add, and how long the answer may be."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[Message] = Field(min_length=1, description="Only the NEW messages of this turn.")
    max_tokens: int = Field(ge=1, description="Generated tokens at most for this turn's answer.")
    think_time_s: float = Field(0.0, ge=0.0, description="Pause before sending this turn, after the previous answer.")
    reference: dict[str, Any] | None = Field(None, description="Optional gold answer, for quality scoring.")


class Sampling(BaseModel):
    """Sampling of every turn of the session; the same conventions as specd's SamplingParams."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 disables.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")


class Session(BaseModel):
    """One conversation to replay: arrival time, optional shared system prompt, turns, sampling and tools."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = Field(FORMAT_VERSION, description="Bumped on any incompatible change.")
    id: str = Field(min_length=1, description="Unique within a file.")
    workload: str = Field(min_length=1, description="Profile name, e.g. 'support', or your own label.")
    split: Split
    arrival_s: float = Field(ge=0.0, description="Seconds from the start of the run when the session opens.")
    system: str | None = None
    turns: list[Turn] = Field(min_length=1)
    sampling: Sampling
    tools: list[dict[str, Any]] | None = Field(None, description="JSON tool schemas (OpenAI 'function' style).")
    meta: dict[str, Any] = Field(default_factory=dict, description="Free-form provenance (source item ids...).")


def session_to_line(session: Session) -> str:
    """Canonical one-line JSON: fixed field order, compact separators, unset optional fields left out."""
    return json.dumps(session.model_dump(mode="json", exclude_none=True), ensure_ascii=False, separators=(",", ":"))


def session_from_line(line: str) -> Session:
    """Parse and validate one line; raises ValueError (json) or ValidationError (schema)."""
    session = Session.model_validate_json(line)
    if session.format_version != FORMAT_VERSION:
        raise ValueError(f"format_version {session.format_version} is not supported (expected {FORMAT_VERSION})")
    return session


def write_sessions(path: str | Path, sessions: Iterable[Session]) -> int:
    """Write sessions one per line; returns how many were written. Rejects duplicate ids."""
    seen: set[str] = set()
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for session in sessions:
            if session.id in seen:
                raise FormatError(str(path), len(seen) + 1, f"duplicate session id {session.id!r}")
            seen.add(session.id)
            f.write(session_to_line(session) + "\n")
    return len(seen)


def read_sessions(path: str | Path) -> list[Session]:
    """Read and validate a session file; blank lines are skipped; errors name the line."""
    sessions: list[Session] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                session = session_from_line(line)
            except (ValidationError, ValueError) as e:
                raise FormatError(str(path), lineno, str(e)) from e
            if session.id in seen:
                raise FormatError(str(path), lineno, f"duplicate session id {session.id!r}")
            seen.add(session.id)
            sessions.append(session)
    return sessions


def prompt_messages(session: Session, turn_index: int, answers: list[str]) -> list[dict[str, str]]:
    """The full chat prompt of one turn, given the model's answers to the earlier turns.

    This is the history rule of the format written once, so the replay and the tests agree on it.
    """
    if len(answers) < turn_index:
        raise ValueError(f"turn {turn_index} needs {turn_index} earlier answers, got {len(answers)}")
    out: list[dict[str, str]] = []
    if session.system is not None:
        out.append({"role": "system", "content": session.system})
    for k, turn in enumerate(session.turns[: turn_index + 1]):
        out.extend(m.model_dump(exclude_none=True) for m in turn.messages)
        if k < turn_index:
            out.append({"role": "assistant", "content": answers[k]})
    return out
