"""Client library for specd over ZeroMQ IPC: ``SpecdClient`` (blocking) and ``AsyncSpecdClient`` (asyncio).

Each client owns one DEALER socket. Requests are numbered per client, so the server's replies are
matched by id; the async client multiplexes many concurrent requests over its one socket (the HTTP
gateway relies on that). A stream that is closed early (``break``, an exception, a task cancelled)
sends ``cancel``, so the server frees the request's KV blocks at once.

``timeout_s`` bounds the wait for the *next* reply, not the whole generation: a long answer that keeps
streaming never times out, a dead or stuck server does, with ``SpecdTimeoutError``.
"""
from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from specd import protocol
from specd.engine.request import Usage

DEFAULT_RUN_DIR = "/run/specd"
# Codes of requests the server refused because of what was asked (HTTP 4xx territory).
REQUEST_ERROR_CODES = frozenset({"empty_prompt", "prompt_too_long", "bad_request", "invalid_params",
                                 "duplicate_id", "malformed", "bad_version", "unknown_type", "frame_too_large"})
UNAVAILABLE_CODES = frozenset({"overloaded"})


class SpecdError(Exception):
    """Base of every error this library raises; ``code`` is the server's (or ``timeout``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SpecdRequestError(SpecdError):
    """The request itself is wrong (empty or too long prompt, invalid parameters): do not retry as is."""


class SpecdUnavailableError(SpecdError):
    """The server cannot take the request now (overloaded); retrying later may work."""


class SpecdTimeoutError(SpecdError):
    """No reply within ``timeout_s``: the server is down, not started yet, or stuck."""


class SpecdServerError(SpecdError):
    """The server accepted the request but failed it (engine error)."""


def error_from_code(code: str, message: str) -> SpecdError:
    if code in REQUEST_ERROR_CODES:
        return SpecdRequestError(code, message)
    if code in UNAVAILABLE_CODES:
        return SpecdUnavailableError(code, message)
    return SpecdServerError(code, message)


@dataclass(frozen=True)
class Delta:
    """One streamed piece. The last one of a stream has ``finish_reason`` and ``usage`` set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage


def default_address(run_dir: str | os.PathLike | None = None) -> str:
    """``ipc://$SPECD_RUN_DIR/specd.sock``, the same rule the daemon uses to bind."""
    return protocol.socket_address(run_dir or os.environ.get("SPECD_RUN_DIR") or DEFAULT_RUN_DIR)


# keyword arguments of generate/stream that are request fields, not sampling parameters;
# speculation= is a method name or {"method", "schedule", "num_speculative_tokens"} (specd.sampling_params)
REQUEST_FIELDS = ("speculation", "expected_return_s", "tools")


def _generate_message(msg_id: int, prompt: str | list[int] | None, messages: list[dict] | None,
                      session: str | None, params: dict[str, Any]) -> bytes:
    if (prompt is None) == (messages is None):
        raise SpecdRequestError("bad_request", "pass exactly one of prompt and messages")
    params = dict(params)
    fields = {name: params.pop(name) for name in REQUEST_FIELDS if name in params}
    return protocol.pack(protocol.generate_request(msg_id, prompt=prompt, messages=messages,
                                                   params=params, session=session, **fields))


def _delta(reply: protocol.Reply) -> Delta:
    """Turn a tokens/done/error reply into a Delta (raising for errors)."""
    if reply.type == "error":
        raise error_from_code(reply.error.get("code", "unknown"), reply.error.get("message", ""))
    if reply.type == "done":
        return Delta(finish_reason=reply.finish_reason, usage=Usage(**reply.usage))
    return Delta(text=reply.text, token_ids=list(reply.token_ids))


def _collect(deltas: list[Delta]) -> Result:
    last = deltas[-1]
    return Result(text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
                  finish_reason=last.finish_reason or "stop", usage=last.usage or Usage())


def _new_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class SpecdClient:
    """Blocking client; one request at a time per instance (not thread-safe: use one per thread)."""

    def __init__(self, run_dir: str | os.PathLike | None = None, *, address: str | None = None,
                 timeout_s: float = 30.0):
        self.address = address or default_address(run_dir)
        self.timeout_s = timeout_s
        self._sock = _new_socket(zmq.Context.instance(), self.address)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "SpecdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 session: str | None = None, **params: Any) -> Result:
        """Run one request to the end and return its text, token ids, finish reason and usage."""
        return _collect(list(self.stream(prompt, messages=messages, session=session, **params)))

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               session: str | None = None, **params: Any) -> Iterator[Delta]:
        """Yield deltas as the server produces them; closing the iterator early cancels the request."""
        msg_id = next(self._ids)
        self._sock.send(_generate_message(msg_id, prompt, messages, session, params))
        finished = False
        try:
            while not finished:
                delta = _delta(self._await(msg_id))
                finished = delta.finish_reason is not None
                yield delta
            return
        except SpecdError as exc:
            finished = not isinstance(exc, SpecdTimeoutError)
            raise
        finally:
            if not finished:
                self.cancel(msg_id)

    def cancel(self, msg_id: int) -> None:
        self._sock.send(protocol.pack(protocol.simple_request("cancel", msg_id)))

    def stats(self) -> dict[str, float | int]:
        """The engine's and the server's counters."""
        return self._call("stats").stats

    def info(self) -> dict[str, Any]:
        reply = self._call("info")
        return {"model": reply.model, "max_model_len": reply.max_model_len}

    def _call(self, kind: str) -> protocol.Reply:
        msg_id = next(self._ids)
        self._sock.send(protocol.pack(protocol.simple_request(kind, msg_id)))
        reply = self._await(msg_id)
        if reply.type == "error":
            raise error_from_code(reply.error.get("code", "unknown"), reply.error.get("message", ""))
        return reply

    def _await(self, msg_id: int) -> protocol.Reply:
        """The next reply for ``msg_id``; replies to earlier, abandoned requests are dropped."""
        while True:
            if not self._sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise SpecdTimeoutError("timeout", f"no reply from {self.address} in {self.timeout_s}s")
            reply = protocol.decode_reply(self._sock.recv())
            if reply.id == msg_id:
                return reply


class AsyncSpecdClient:
    """asyncio client; any number of concurrent requests share one socket, demultiplexed by id.

    Create it inside the running event loop that will use it.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, *, address: str | None = None,
                 timeout_s: float = 30.0):
        self.address = address or default_address(run_dir)
        self.timeout_s = timeout_s
        self._sock = _new_socket(zmq.asyncio.Context.instance(), self.address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue[protocol.Reply]] = {}
        self._reader: asyncio.Task | None = None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)

    async def __aenter__(self) -> "AsyncSpecdClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       session: str | None = None, **params: Any) -> Result:
        return _collect([d async for d in self.stream(prompt, messages=messages, session=session, **params)])

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     session: str | None = None, **params: Any) -> AsyncIterator[Delta]:
        """Yield deltas; leaving the loop early (or being cancelled) cancels the request on the server."""
        msg_id = next(self._ids)
        frame = _generate_message(msg_id, prompt, messages, session, params)
        queue = self._open(msg_id)
        finished = False
        try:
            await self._sock.send(frame)
            while not finished:
                delta = _delta(await self._next(queue))
                finished = delta.finish_reason is not None
                yield delta
        except SpecdError as exc:
            finished = not isinstance(exc, SpecdTimeoutError)
            raise
        finally:
            self._pending.pop(msg_id, None)
            if not finished:
                await self._cancel_quietly(msg_id)

    async def cancel(self, msg_id: int) -> None:
        await self._sock.send(protocol.pack(protocol.simple_request("cancel", msg_id)))

    async def stats(self) -> dict[str, float | int]:
        return (await self._call("stats")).stats

    async def info(self) -> dict[str, Any]:
        reply = await self._call("info")
        return {"model": reply.model, "max_model_len": reply.max_model_len}

    async def _call(self, kind: str) -> protocol.Reply:
        msg_id = next(self._ids)
        queue = self._open(msg_id)
        try:
            await self._sock.send(protocol.pack(protocol.simple_request(kind, msg_id)))
            reply = await self._next(queue)
        finally:
            self._pending.pop(msg_id, None)
        if reply.type == "error":
            raise error_from_code(reply.error.get("code", "unknown"), reply.error.get("message", ""))
        return reply

    def _open(self, msg_id: int) -> asyncio.Queue[protocol.Reply]:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_forever(), name="specd-client-reader")
        queue: asyncio.Queue[protocol.Reply] = asyncio.Queue()
        self._pending[msg_id] = queue
        return queue

    async def _next(self, queue: asyncio.Queue[protocol.Reply]) -> protocol.Reply:
        try:
            return await asyncio.wait_for(queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise SpecdTimeoutError("timeout", f"no reply from {self.address} in {self.timeout_s}s") from None

    async def _read_forever(self) -> None:
        """Route every reply to the queue of its request; replies for abandoned requests are dropped."""
        while True:
            frame = await self._sock.recv()
            try:
                reply = protocol.decode_reply(frame)
            except protocol.ProtocolError:
                continue
            queue = self._pending.get(reply.id) if reply.id is not None else None
            if queue is not None:
                queue.put_nowait(reply)

    async def _cancel_quietly(self, msg_id: int) -> None:
        """Send cancel even while the calling task is being cancelled (the gateway's disconnect path)."""
        try:
            await asyncio.shield(self.cancel(msg_id))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
