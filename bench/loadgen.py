"""The load generator: replays conversations against a running specd and measures them on the client side.

A *script* is one conversation: an arrival time, turns, think times, and a rule that builds the request of
turn k from the model's earlier answers (``SessionScript`` wraps a workload session; bench/trace_replay.py
has one for the Mooncake trace). ``run_load`` plays many scripts at once:

- **closed loop** (``arrivals="closed"``): every conversation is ready at t = 0 and ``concurrency`` of them
  run at a time; a finished one hands its slot to the next. This is how serving benchmarks compare
  configurations at a fixed concurrency level.
- **open loop** (``"poisson"``: arrivals at ``rate`` per second, seeded; ``"recorded"``: each script's own
  ``arrival_s``): conversations arrive on schedule whether or not the server keeps up. ``concurrency``
  still caps the conversations in flight, so an overloaded server queues arrivals instead of exhausting
  the client.

Inside a conversation the turns are sequential: turn k+1 is sent ``think_time_s x time_scale`` after the
answer to turn k ended, and its prompt holds that answer (the session format's history rule).

What a request records (``RequestRecord``), all on the client's monotonic clock:
- TTFT: from handing the request to the transport to the first streamed piece that carries a token.
- ITL: one sample per token after the first piece. A piece that carries n tokens after a gap g counts as
  n samples of g / n, so the samples sum to the streaming time and their count is the token count; a
  server that batches tokens into pieces is not rewarded with fewer, longer gaps dropped from the tail.
  Over HTTP a stream chunk carries text, not token ids: each chunk counts as one token there.
- prompt, cached and completion tokens and the finish reason: from the engine's final usage.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from bench.workloads.format import Session, prompt_messages
from client.specd_client import AsyncSpecdClient, SpecdError

Arrivals = Literal["closed", "poisson", "recorded"]


class LoadError(RuntimeError):
    """The load generator was set up wrongly (no scripts, bad rate, a stream without a final usage)."""


# ---- what is sent ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TurnRequest:
    """One request: exactly one of ``messages`` (chat) and ``prompt`` (text or token ids), plus sampling."""

    params: dict[str, Any]
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None


class Script(Protocol):
    """One conversation to replay. ``request`` is called when the turn is due, with the answers so far."""

    id: str
    arrival_s: float

    def num_turns(self) -> int: ...
    def think_time_s(self, turn: int) -> float: ...
    def request(self, turn: int, answers: list[str]) -> TurnRequest: ...


def stable_seed(*parts: object) -> int:
    """A per-request sampling seed that is the same in every process and every configuration, so two
    configurations sample the same answers (and so see the same next-turn prompts) wherever the engine
    is deterministic. blake2b, never Python's ``hash()``."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


@dataclass(frozen=True)
class SessionScript:
    """A workload session (bench/workloads/format.py) as a script.

    specd's chat messages have no ``name`` field, so a tool message keeps its role and content only.
    """

    session: Session
    max_tokens: int | None = None       # overrides every turn's max_tokens
    ignore_eos: bool = False            # generate exactly max_tokens (fixed answer lengths)
    seed_salt: str = ""                 # varies the sampling seeds between repeats

    @property
    def id(self) -> str:
        return self.session.id

    @property
    def arrival_s(self) -> float:
        return self.session.arrival_s

    def num_turns(self) -> int:
        return len(self.session.turns)

    def think_time_s(self, turn: int) -> float:
        return self.session.turns[turn].think_time_s

    def request(self, turn: int, answers: list[str]) -> TurnRequest:
        s = self.session.sampling
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens or self.session.turns[turn].max_tokens,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "seed": stable_seed(self.seed_salt, self.session.id, turn)}
        if self.ignore_eos:
            params["ignore_eos"] = True
        messages = [{"role": m["role"], "content": m["content"]}
                    for m in prompt_messages(self.session, turn, answers)]
        return TurnRequest(params=params, messages=messages)


# ---- what comes back -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Final:
    """The engine's account of a finished request."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    engine_ttft_s: float | None = None
    engine_queue_s: float | None = None     # of the engine's TTFT, before its first scheduled step
    engine_parked_s: float | None = None    # of that, parked on kvd promotions


@dataclass(frozen=True)
class Piece:
    """One streamed piece: its text, how many tokens it carries, and (last piece only) the final usage."""

    text: str = ""
    tokens: int = 0
    final: Final | None = None


class Transport(Protocol):
    """How requests reach specd: IPC (``IpcTransport``) or the OpenAI HTTP gateway (``HttpTransport``)."""

    errors: tuple[type[Exception], ...]   # what a failed request raises: recorded, not propagated

    def stream(self, request: TurnRequest, session: str) -> AsyncIterator[Piece]: ...
    async def close(self) -> None: ...


class IpcTransport:
    """One ``AsyncSpecdClient`` for the whole run: every concurrent request shares its socket."""

    errors = (SpecdError,)

    def __init__(self, run_dir: str, timeout_s: float = 120.0):
        self.client = AsyncSpecdClient(run_dir, timeout_s=timeout_s)

    async def stream(self, request: TurnRequest, session: str) -> AsyncIterator[Piece]:
        async for d in self.client.stream(request.prompt, messages=request.messages, session=session,
                                          **request.params):
            final = None
            if d.usage is not None:
                u = d.usage
                final = Final(d.finish_reason or "stop", u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                              u.ttft_s, u.queue_s, u.parked_s)
            yield Piece(d.text, len(d.token_ids), final)

    async def close(self) -> None:
        await self.client.close()


class HttpTransport:
    """The official ``openai.AsyncOpenAI`` client against specd's gateway, streaming with usage.

    specd's extensions (top_k, ignore_eos, session) travel in ``extra_body``. Chunks carry text only, so
    each content chunk counts as one token; the engine's completion_tokens come from the usage chunk.
    """

    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0):
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
        self.model = model
        self.errors = (openai.APIError,)

    async def stream(self, request: TurnRequest, session: str) -> AsyncIterator[Piece]:
        p = dict(request.params)
        extra = {k: p.pop(k) for k in ("top_k", "ignore_eos") if k in p}
        extra["session"] = session
        common = dict(model=self.model, stream=True, stream_options={"include_usage": True}, extra_body=extra, **p)
        if request.messages is not None:
            chunks = await self.client.chat.completions.create(messages=request.messages, **common)
        else:
            chunks = await self.client.completions.create(prompt=request.prompt, **common)
        finish = None
        async for chunk in chunks:
            if chunk.choices:
                choice = chunk.choices[0]
                text = getattr(choice, "text", None) if request.messages is None else choice.delta.content
                finish = choice.finish_reason or finish
                if text:
                    yield Piece(text, 1)
            if chunk.usage is not None:
                u = chunk.usage
                cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                yield Piece(final=Final(finish or "stop", u.prompt_tokens, u.completion_tokens, cached or 0))

    async def close(self) -> None:
        await self.client.close()


# ---- measurement -------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One finished (or failed) request, timed on the client's clock; seconds relative to the run start."""

    script_id: str
    turn: int
    sent_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    done_s: float | None = None
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    engine_ttft_s: float | None = None
    engine_queue_s: float | None = None
    engine_parked_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None


def stream_timings(sent: float, pieces: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """(TTFT, per-token ITLs) from the send time and (arrival time, tokens) of every streamed piece.

    Pieces without tokens (the final usage) are skipped. The first token piece fixes TTFT; each later
    piece with n tokens after a gap g gives n samples of g / n (see the module docstring).
    """
    ttft, last, itl = None, None, []
    for t, n in pieces:
        if n <= 0:
            continue
        if last is None:
            ttft = t - sent
        else:
            itl.extend([(t - last) / n] * n)
        last = t
    return ttft, itl


async def measure(transport: Transport, request: TurnRequest, session: str, record: RequestRecord,
                  clock: Callable[[], float]) -> RequestRecord:
    """Stream one request sent at ``record.sent_s`` to the end, filling ``record``; a server error is
    recorded, not raised."""
    arrivals, text = [], []
    try:
        async for piece in transport.stream(request, session):
            now = clock()
            arrivals.append((now, piece.tokens))
            text.append(piece.text)
            if piece.final is not None:
                f = piece.final
                record.finish_reason, record.prompt_tokens = f.finish_reason, f.prompt_tokens
                record.completion_tokens, record.cached_tokens = f.completion_tokens, f.cached_tokens
                record.engine_ttft_s, record.done_s = f.engine_ttft_s, now
                record.engine_queue_s, record.engine_parked_s = f.engine_queue_s, f.engine_parked_s
    except transport.errors as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a final usage"
    record.ttft_s, record.itl_s = stream_timings(record.sent_s, arrivals)
    if record.ok and record.ttft_s is None:  # finished without a token piece (HTTP: only EOS was generated)
        record.ttft_s = record.done_s - record.sent_s
    record.text = "".join(text)
    return record


# ---- the run -----------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_time_s: float      # first request sent -> last final usage received

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok]


def arrival_times(scripts: Sequence[Script], arrivals: Arrivals, rate: float | None, time_scale: float,
                  seed: int = 0) -> list[float]:
    """When each script opens, in run seconds: all at 0 (closed), Poisson at ``rate``, or as recorded."""
    if arrivals == "closed":
        return [0.0] * len(scripts)
    if arrivals == "recorded":
        return [s.arrival_s * time_scale for s in scripts]
    if rate is None or rate <= 0:
        raise LoadError("poisson arrivals need a positive rate")
    rng, t, out = random.Random(f"arrivals:{seed}"), 0.0, []
    for _ in scripts:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(transport: Transport, scripts: Sequence[Script], concurrency: int, *,
                   arrivals: Arrivals = "closed", rate: float | None = None, time_scale: float = 1.0,
                   seed: int = 0, on_request: Callable[[RequestRecord], None] | None = None,
                   session_tag: str = "") -> LoadResult:
    """Replay ``scripts`` with at most ``concurrency`` conversations in flight; see the module docstring.
    The server sees each conversation as session ``session_tag + script.id`` (records keep the script id),
    so runs against one server can keep their sessions apart."""
    if not scripts or concurrency < 1:
        raise LoadError("need at least one script and a concurrency of at least 1")
    starts = arrival_times(scripts, arrivals, rate, time_scale, seed)
    slots = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0  # noqa: E731
    records: list[RequestRecord] = []

    async def conversation(script: Script, start: float) -> None:
        await asyncio.sleep(max(0.0, start - clock()))
        async with slots:
            await _play(transport, script, session_tag + script.id, time_scale, clock, records, on_request)

    await asyncio.gather(*(conversation(s, t) for s, t in zip(scripts, starts)))
    done = [r.done_s for r in records if r.ok]
    first = min((r.sent_s for r in records), default=0.0)
    return LoadResult(records, (max(done) - first) if done else 0.0)


async def _play(transport: Transport, script: Script, session: str, time_scale: float, clock: Callable[[], float],
                records: list[RequestRecord], on_request: Callable[[RequestRecord], None] | None) -> None:
    """The turns of one conversation, in order; a failed turn ends it (later turns need its answer)."""
    answers: list[str] = []
    for turn in range(script.num_turns()):
        if turn:
            await asyncio.sleep(script.think_time_s(turn) * time_scale)
        request = script.request(turn, answers)
        record = RequestRecord(script.id, turn, sent_s=clock())
        records.append(record)
        await measure(transport, request, session, record, clock)
        if on_request is not None:
            on_request(record)
        if not record.ok:
            return
        answers.append(record.text)
