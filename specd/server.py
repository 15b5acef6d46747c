"""The ZeroMQ face of the engine: one thread owns both the ROUTER socket and the engine.

Why one thread: ``SpecEngine`` is not thread-safe and ZeroMQ sockets must not be shared between threads,
so the loop that steps the engine is also the loop that reads requests and writes token deltas. The
socket is polled without blocking while the engine has work, and for ``idle_poll_ms`` when it is idle.

Invariants:
- every accepted generate gets exactly one terminal reply (``done`` or ``error``) unless its client is gone;
- a request whose client cancels, or whose client can no longer be reached (ROUTER_MANDATORY makes the
  send fail), is aborted in the engine at once, which frees its KV blocks;
- no input can stop the loop: bad frames get an ``error`` reply, engine refusals become typed errors,
  and an engine crash fails the in-flight requests but keeps the server up.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq

from specd import protocol
from specd.engine.errors import EngineError
from specd.engine.hints import chat_prefix_kinds
from specd.engine.request import Request, RequestOutput

log = logging.getLogger("specd.server")

SOCKET_MODE = 0o660
# Frames a slow client may have queued before its request is dropped (each is one token delta).
SEND_HIGH_WATER = 100_000
MAX_RECV_PER_TURN = 256  # bounds how long a burst of requests can delay the next engine step
PARKED_POLL_MS = 1        # every sequence parked: a promotion lands in ms, so wait this long per turn


class Engine(Protocol):
    """What the server needs from ``SpecEngine`` (tests pass a fake with the same methods)."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def stats(self) -> dict[str, float | int]: ...


@dataclass
class Arrived:
    """One frame read from the socket, decoded, and for a generate its prompt tokenized: read during a long
    forward (``SpecdServer._in_forward``) and handled after the step, or read and handled at once."""

    identity: bytes
    msg: Any = None                               # the decoded request, or None when ``refusal`` is set
    refusal: protocol.ProtocolError | None = None
    prompt_ids: list[int] | None = None           # a generate's prompt (None: tokenizing failed, ``failure``)
    prefix_kinds: list[tuple[int, int]] | None = None
    failure: BaseException | None = None          # what tokenizing raised, reported as add_request's would be
    read_s: float = 0.0                           # when it was read (monotonic): the request's arrival


@dataclass(frozen=True)
class Route:
    """Where an engine request's replies go: the client's socket identity and its own request id."""

    identity: bytes
    msg_id: int


class ClientGone(Exception):
    """The peer of a route cannot be reached (disconnected) or has stopped reading."""


class SpecdServer:
    """Serve ``engine`` on ``address`` (``ipc://.../specd.sock``) from a background thread."""

    def __init__(self, engine: Engine, address: str, *, idle_poll_ms: int = 20, read_in_forward: bool = False):
        self.engine = engine
        self.address = address
        self.idle_poll_ms = idle_poll_ms
        # read requests while a long forward runs (the engine's ``forward_hook``), warming their cached
        # prefixes in kvd at once; they are still added to the engine after the step
        self.read_in_forward = read_in_forward and hasattr(engine, "forward_hook")
        self._routes: dict[str, Route] = {}  # engine request id -> route; only the loop thread mutates it
        self._early: list[Arrived] = []      # read during the last forward, handled at the next turn
        self._sock: zmq.Socket | None = None
        self._counters = {"ipc_requests_total": 0, "ipc_errors_total": 0, "ipc_client_gone_total": 0,
                          "ipc_cancels_total": 0, "engine_failures_total": 0, "ipc_read_in_forward_total": 0}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)

    # ---- lifecycle ----

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind the socket on the loop thread and return once it accepts connections."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"specd server did not bind {self.address} in {timeout_s}s")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _bind(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES * 2)
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
        sock.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address[len("ipc://"):], SOCKET_MODE)
        return sock

    def _run(self) -> None:
        try:
            sock = self._bind()
        except BaseException as exc:  # reported to start(); the thread has nothing else to do
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        log.info("specd serving %s on %s", self.engine.model_name, self.address)
        self._sock = sock
        if self.read_in_forward:
            self.engine.forward_hook = self._in_forward   # type: ignore[attr-defined]
        try:
            while not self._stop.is_set():
                self._turn(sock)
        finally:
            if self.read_in_forward:
                self.engine.forward_hook = None   # type: ignore[attr-defined]
            for request_id in list(self._routes):
                self._abort(request_id)
            sock.close(linger=0)

    def _turn(self, sock: zmq.Socket) -> None:
        """One loop iteration: take what arrived, then run one engine step if there is work. When every
        sequence waits on a kvd promotion (parked), a step can only poll for the answers, so the loop
        waits PARKED_POLL_MS for a request instead of spinning."""
        early, self._early = self._early, []
        for arrived in early:        # read during the last step's forward, in arrival order, before newer ones
            self._dispatch(sock, arrived)
        busy = self.engine.has_work()
        parked = busy and getattr(self.engine, "only_parked", lambda: False)()
        if sock.poll(PARKED_POLL_MS if parked else 0 if busy else self.idle_poll_ms, zmq.POLLIN):
            for _ in range(MAX_RECV_PER_TURN):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(sock, frames)
        elif not busy:           # idle for a whole poll: the block reserve goes back to kvd
            getattr(self.engine, "release_idle", lambda: False)()
        if self.engine.has_work():
            self._step(sock)

    # ---- requests ----

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        self._dispatch(sock, self._read(frames))

    def _in_forward(self) -> None:
        """The engine's ``forward_hook``: while a long prompt step runs on the GPU, read the requests that
        have arrived, tokenize them and ask kvd to start promoting their cached prefixes (``engine.warm``).
        Nothing else happens to them until the step is over (``_turn`` adds them, in order): the engine's
        state is not touched mid-step. Why: a request read after the step was looked up in the next step,
        and a hit still being promoted then waited for that whole step (docs/design/kvd.md, "Prefetch on
        arrival"). Called in a loop until the forward is done, so it must be cheap when nothing came."""
        sock = self._sock
        if sock is None or len(self._early) >= MAX_RECV_PER_TURN or not sock.poll(0, zmq.POLLIN):
            return
        while len(self._early) < MAX_RECV_PER_TURN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            arrived = self._read(frames)
            if arrived.prompt_ids:
                self.engine.warm(arrived.prompt_ids)   # type: ignore[attr-defined]
            self._counters["ipc_read_in_forward_total"] += 1
            self._early.append(arrived)

    def _read(self, frames: list[bytes]) -> Arrived:
        """Decode a frame; for a generate, also its prompt's token ids and prefix kinds (the slow part)."""
        identity, payload = frames[0], frames[1:]
        try:
            if len(payload) != 1:
                raise protocol.ProtocolError("malformed", f"expected 1 frame, got {len(payload)}")
            arrived = Arrived(identity, protocol.decode_request(payload[0]), read_s=time.monotonic())
        except protocol.ProtocolError as exc:
            return Arrived(identity, refusal=exc)
        if isinstance(arrived.msg, protocol.Generate):
            try:
                arrived.prompt_ids = self._prompt_ids(arrived.msg)
                arrived.prefix_kinds = self._prefix_kinds(arrived.msg, arrived.prompt_ids)
            except Exception as exc:  # reported by _generate, as add_request's refusals are
                arrived.prompt_ids, arrived.failure = None, exc
        return arrived

    def _dispatch(self, sock: zmq.Socket, arrived: Arrived) -> None:
        identity, msg = arrived.identity, arrived.msg
        if arrived.refusal is not None:
            exc = arrived.refusal
            self._counters["ipc_errors_total"] += 1
            self._send_quietly(sock, identity, protocol.error_reply(exc.msg_id, exc.code, exc.message))
            return
        if isinstance(msg, protocol.Generate):
            self._generate(sock, arrived)
        elif isinstance(msg, protocol.Cancel):
            self._cancel(identity, msg.id)
        elif isinstance(msg, protocol.StatsRequest):
            self._send_quietly(sock, identity, protocol.stats_reply(msg.id, self.stats()))
        else:
            self._send_quietly(sock, identity, protocol.info_reply(
                msg.id, self.engine.model_name, self.engine.max_model_len))

    def _generate(self, sock: zmq.Socket, arrived: Arrived) -> None:
        identity, msg = arrived.identity, arrived.msg
        request_id = _request_id(identity, msg.id)
        self._counters["ipc_requests_total"] += 1
        try:
            if request_id in self._routes:
                raise EngineError("duplicate_id", f"request id {msg.id} is already in flight on this connection")
            if arrived.failure is not None:
                raise arrived.failure
            self.engine.add_request(Request(id=request_id, prompt_ids=arrived.prompt_ids, params=msg.params,
                                            session=msg.session, arrival_s=arrived.read_s,
                                            prefix_kinds=arrived.prefix_kinds,
                                            expected_return_s=msg.expected_return_s,
                                            **(msg.speculation.request_fields() if msg.speculation else {})))
        except EngineError as exc:
            self._counters["ipc_errors_total"] += 1
            self._send_quietly(sock, identity, protocol.error_reply(msg.id, exc.code, exc.message))
            return
        except Exception as exc:  # a tokenizer or engine bug must not take the server down
            log.exception("add_request failed for %s", request_id)
            self._counters["ipc_errors_total"] += 1
            self._send_quietly(sock, identity, protocol.error_reply(msg.id, "internal", f"{type(exc).__name__}: {exc}"))
            return
        self._routes[request_id] = Route(identity, msg.id)

    def _prompt_ids(self, msg: protocol.Generate) -> list[int]:
        """Token ids of the prompt: given, encoded from text (BOS by the model's own convention; an
        empty text stays empty so the engine refuses it), or rendered from chat messages."""
        tokenizer = self.engine.tokenizer
        if isinstance(msg.prompt, list):
            return list(msg.prompt)
        if msg.prompt is not None:
            return tokenizer.encode(msg.prompt) if msg.prompt else []
        extra = {"tools": msg.tools} if msg.tools else {}
        return tokenizer.encode_chat([m.model_dump() for m in msg.messages], **extra)

    def _prefix_kinds(self, msg: protocol.Generate, prompt_ids: list[int]) -> list[tuple[int, int]] | None:
        """System / tool-schema spans of a chat prompt (specd/engine/hints.py says how), so kvd knows
        which blocks every session of the application shares. Hints are advice: a tokenizer that cannot
        render a system-only chat costs the hint, never the request."""
        if msg.messages is None:
            return None
        try:
            return chat_prefix_kinds(self.engine.tokenizer.encode_chat, [m.model_dump() for m in msg.messages],
                                     prompt_ids, msg.tools)
        except Exception:
            log.debug("no prefix kinds for this chat", exc_info=True)
            return None

    def _cancel(self, identity: bytes, msg_id: int) -> None:
        request_id = _request_id(identity, msg_id)
        if request_id in self._routes:
            self._counters["ipc_cancels_total"] += 1
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)

    # ---- outputs ----

    def _step(self, sock: zmq.Socket) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_all(sock, exc)
            return
        for out in outputs:
            route = self._routes.get(out.id)
            if route is None:
                continue  # cancelled or client gone; the engine was told already
            try:
                self._deliver(sock, route, out)
            except ClientGone:
                self._counters["ipc_client_gone_total"] += 1
                log.info("client of %s is gone; aborting it", out.id)
                self._abort(out.id)
                continue
            if out.finished:
                self._routes.pop(out.id, None)

    def _deliver(self, sock: zmq.Socket, route: Route, out: RequestOutput) -> None:
        if out.finish_reason == "error" or out.error:
            message = out.error or "engine error"
            self._send(sock, route.identity, protocol.error_reply(route.msg_id, "engine_error", message))
            return
        if out.token_ids or out.text:
            self._send(sock, route.identity, protocol.tokens_reply(route.msg_id, list(out.token_ids), out.text))
        if out.finished:
            usage = {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens,
                     "cached_tokens": out.usage.cached_tokens, "ttft_s": out.usage.ttft_s,
                     "queue_s": out.usage.queue_s, "parked_s": out.usage.parked_s,
                     "speculation": out.usage.speculation}
            self._send(sock, route.identity, protocol.done_reply(route.msg_id, out.finish_reason or "stop", usage))

    def _fail_all(self, sock: zmq.Socket, exc: Exception) -> None:
        """The engine raised inside step(): fail every in-flight request, free it, and keep serving."""
        log.exception("engine step failed; failing %d in-flight requests", len(self._routes))
        self._counters["engine_failures_total"] += 1
        for request_id, route in list(self._routes.items()):
            self._send_quietly(sock, route.identity, protocol.error_reply(
                route.msg_id, "engine_failure", f"{type(exc).__name__}: {exc}"))
            self._abort(request_id)

    def _send(self, sock: zmq.Socket, identity: bytes, message: dict[str, Any]) -> None:
        try:
            sock.send_multipart([identity, protocol.pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise ClientGone() from None
            raise

    def _send_quietly(self, sock: zmq.Socket, identity: bytes, message: dict[str, Any]) -> None:
        """Send a one-off reply; a vanished peer just means nobody is waiting for it."""
        try:
            self._send(sock, identity, message)
        except ClientGone:
            self._counters["ipc_client_gone_total"] += 1

    def stats(self) -> dict[str, float | int]:
        """Engine counters plus the server's own (``ipc_*``); read on the loop thread only."""
        try:
            engine_stats = dict(self.engine.stats())
        except Exception:
            log.exception("engine.stats() failed")
            engine_stats = {}
        return {**engine_stats, **self._counters, "ipc_requests_in_flight": len(self._routes)}


def _request_id(identity: bytes, msg_id: int) -> str:
    """Engine-wide request id: client ids are only unique per connection."""
    return f"{identity.hex()}-{msg_id}"
