"""kvd's sockets and event loop around KvdCore.

Why single-threaded: KvdCore is plain logic with no locks, so one thread owns it. The loop polls two
ROUTER sockets (``kvd.sock`` for clients, ``kvd-admin.sock`` for admin verbs), answers each frame
with exactly one reply, and calls ``core.tick(now)`` every TICK_S for lease expiry and tier moves.
``wait_ready`` never blocks the loop: a request that is not ready yet is parked and answered from
the loop when its lease is ready or its deadline passes.

Invariant: no exception escapes ``handle_frames``; a bad frame or a core bug becomes a typed error
reply and the daemon keeps serving.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import zmq

from kvd import gc_pauses
from kvd import protocol as P
from kvd.core_types import KvdError, ReleaseHints
from kvd.hashing import chain_hashes, namespace_root
from kvd.types import BlockHash, BlockKind

log = logging.getLogger("kvd.server")

SOCKET_NAME = "kvd.sock"
ADMIN_SOCKET_NAME = "kvd-admin.sock"
PID_NAME = "kvd.pid"
# 50 ms: TTLs are seconds, and a tick costs well under a millisecond on an idle core.
TICK_S = 0.05
# While a wait_ready is parked, the loop checks it every 0.5 ms: a promotion's copy takes milliseconds, and an
# answer delayed to the next tick (up to 50 ms) would sit in the parked request's TTFT.
PARKED_POLL_S = 0.0005
# Frames above this are dropped by ZeroMQ itself (memory cap); between MAX_FRAME_BYTES and it they
# get a typed too_large reply.
TRANSPORT_MAX_BYTES = 4 * P.MAX_FRAME_BYTES
# Frames drained from one socket per loop turn, so the other socket and tick() are never starved.
DRAIN = 64


def socket_paths(run_dir: Path) -> tuple[Path, Path]:
    return run_dir / SOCKET_NAME, run_dir / ADMIN_SOCKET_NAME


def client_name(identity: bytes) -> str:
    """The core's ``client`` string: a printable ZeroMQ routing id as is, anything else in hex."""
    if identity.isascii() and identity.decode("ascii").isprintable() and identity[:1] != b"\0":
        return identity.decode("ascii")
    return identity.hex()


# ---- dispatch: one small function per op, each returning the reply's fields ----

def _hints(h: Optional[P.Hints]) -> Optional[ReleaseHints]:
    if h is None:
        return None
    kinds = {BlockHash(k): BlockKind(v) for k, v in h.kinds.items()}
    return ReleaseHints(session=h.session, kinds=kinds, turn_end=h.turn_end,
                        expected_return_s=h.expected_return_s)


def _hash_tokens(op: P.HashTokens) -> dict[str, Any]:
    root = namespace_root(op.model, op.tokenizer, op.dtype, op.layout, op.block_size, op.adapter, op.salt)
    return {"hashes": chain_hashes(root, op.tokens, op.block_size, op.extra)}


def _allocate(core: Any, client: str, op: P.Allocate) -> dict[str, Any]:
    lease, blocks = core.allocate(client, op.group, op.n)
    return {"lease": int(lease), "blocks": [int(b) for b in blocks]}


def _commit(core: Any, client: str, op: P.Commit) -> dict[str, Any]:
    blocks = [(b, BlockHash(h), None if p is None else BlockHash(p)) for b, h, p in op.blocks]
    return {"blocks": [int(b) for b in core.commit(client, op.lease, blocks)]}


def _release(core: Any, client: str, op: P.Release) -> dict[str, Any]:
    if op.blocks is not None:
        core.release_blocks(client, op.lease, op.blocks)
    else:
        core.release(client, op.lease, _hints(op.hints))
    return {}


def _heartbeat(core: Any, client: str, op: P.Heartbeat) -> dict[str, Any]:
    core.heartbeat(client)
    return {}


HANDLERS: dict[str, Callable[[Any, str, Any], dict[str, Any]]] = {
    "attach": lambda core, c, op: core.attach(c, op.group, op.block_bytes, op.tail_blocks).to_dict(),
    "lookup": lambda core, c, op: core.lookup(c, op.group, op.hashes, session=op.session, tokens=op.tokens,
                                              block_tokens=op.block_tokens, recompute_s=op.recompute_s).to_dict(),
    "lookup_groups": lambda core, c, op: core.lookup_groups(
        c, op.groups, op.hashes, session=op.session, tokens=op.tokens, block_tokens=op.block_tokens,
        recompute_s=op.recompute_s).to_dict(),
    "warm": lambda core, c, op: {"blocks": core.warm(c, op.groups, op.hashes, op.recompute_s)},
    "allocate": _allocate,
    "commit": _commit,
    "release": _release,
    "heartbeat": _heartbeat,
    "stats": lambda core, c, op: {"stats": core.stats(c)},
    "top": lambda core, c, op: {"top": core.top(c, op.n)},
    "leases": lambda core, c, op: {"leases": core.leases(c)},
    "sessions": lambda core, c, op: {"sessions": core.sessions(c)},
    "roots": lambda core, c, op: core.roots(c, op.group, op.known, op.recompute_s, op.skipped, op.skipped_blocks),
    "hash": lambda core, c, op: _hash_tokens(op),
    "pin": lambda core, c, op: {"result": core.pin(c, op.hashes)},
    "unpin": lambda core, c, op: {"result": core.unpin(c, op.hashes)},
    "evict": lambda core, c, op: {"result": core.evict(c, op.hashes)},
    "flush": lambda core, c, op: {"result": core.flush(c, op.tier)},
}


def run_op(core: Any, client: str, op: P.Op) -> dict[str, Any]:
    """Run one validated op; KvdError passes through, anything else is a bug -> internal."""
    try:
        return HANDLERS[op.type](core, client, op)
    except KvdError:
        raise
    except Exception as err:
        log.exception("core raised on %s from %s", op.type, client)
        raise KvdError(P.ErrorCode.INTERNAL, f"{type(err).__name__} in {op.type}") from None


def run_batch(core: Any, client: str, ops: tuple[P.Op, ...]) -> dict[str, Any]:
    """Each op runs in order and gets its own result or error; one failing op does not undo the
    others (the loop is single-threaded, so no other client interleaves with the batch)."""
    results: list[dict[str, Any]] = []
    for op in ops:
        try:
            results.append({"ok": True, **run_op(core, client, op)})
        except KvdError as err:
            results.append({"ok": False, "error": {"code": err.code, "message": err.message}})
    return {"results": results}


@dataclass
class _Parked:
    """A wait_ready request not ready yet: answered by the loop later."""

    sock: zmq.Socket
    envelope: list[bytes]
    req_id: int
    client: str
    lease: int
    deadline: float


class KvdServer:
    """Owns the sockets, the pid file and the loop; all cache state lives in ``core``."""

    def __init__(self, core: Any, run_dir: Path, socket_mode: int = 0o660,
                 clock: Callable[[], float] = time.monotonic):
        self.core = core
        self.run_dir = Path(run_dir)
        self.socket_mode = socket_mode
        self.clock = clock
        self.ctx = zmq.Context()
        self.main: Optional[zmq.Socket] = None
        self.admin: Optional[zmq.Socket] = None
        self._stop = False
        self._bound = False  # only a server that bound may unlink the sockets and pid file
        self._parked: list[_Parked] = []
        self.counters = {"requests": 0, "errors": 0}
        self._gc = gc_pauses.pauses()     # counts the collector's passes from now on (one counter per process)
        # op type (and "tick") -> [count, seconds, max seconds] the loop spent on it: kvd's serving time by verb
        self.busy: dict[str, list[float]] = {}

    # ---- lifecycle ----
    def bind(self) -> None:
        """Create the run dir, refuse to start over a live kvd, bind both sockets at socket_mode."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._check_not_running()
        main_path, admin_path = socket_paths(self.run_dir)
        self.main = self._bind_router(main_path)
        self.admin = self._bind_router(admin_path)
        self._bound = True
        (self.run_dir / PID_NAME).write_text(f"{os.getpid()}\n")
        log.info("kvd ready: %s and %s (pid %d)", main_path, admin_path, os.getpid())

    def _check_not_running(self) -> None:
        pid_file = self.run_dir / PID_NAME
        try:
            pid = int(pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        # Our own pid in the file is stale too: a container restart reuses low pids.
        if pid != os.getpid() and _alive(pid):
            raise RuntimeError(f"kvd already running in {self.run_dir} (pid {pid})")
        log.warning("replacing stale pid file (pid %d is not a running kvd)", pid)

    def _bind_router(self, path: Path) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_BYTES)
        old = os.umask(0o777 & ~self.socket_mode)  # no window where the socket is wider than mode
        try:
            sock.bind(f"ipc://{path}")
        finally:
            os.umask(old)
        os.chmod(path, self.socket_mode)
        return sock

    def request_stop(self, *_: Any) -> None:
        """Signal-safe: the loop sees the flag within one TICK_S."""
        self._stop = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def close(self) -> None:
        """Flush the core (the NVMe index) first, then drop sockets and the pid file."""
        close = getattr(self.core, "close", None)
        if close is not None:
            close()
        for sock in (self.main, self.admin):
            if sock is not None:
                sock.close(0)
        self.ctx.term()
        if self._bound:
            for path in (*socket_paths(self.run_dir), self.run_dir / PID_NAME):
                path.unlink(missing_ok=True)
        log.info("kvd stopped")

    # ---- loop ----
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.main, zmq.POLLIN)
        poller.register(self.admin, zmq.POLLIN)
        next_tick = self.clock()
        while not self._stop:
            timeout_ms = max(0.0, next_tick - self.clock()) * 1000
            if self._parked:      # a parked wait_ready is answered within PARKED_POLL_S of its copy landing
                timeout_ms = min(timeout_ms, PARKED_POLL_S * 1000)
            ready = dict(poller.poll(timeout_ms))
            for sock in (self.main, self.admin):
                if sock in ready:
                    self._drain(sock, admin=sock is self.admin)
            now = self.clock()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + TICK_S
            if self._parked:
                self._answer_parked(now)

    def _tick(self, now: float) -> None:
        t0 = time.perf_counter()
        try:
            self.core.tick(now)
        except Exception:
            log.exception("core.tick failed; continuing")
        self._busy("tick", t0)

    def _busy(self, kind: str, t0: float) -> None:
        seen = self.busy.setdefault(kind, [0, 0.0, 0.0])
        took = time.perf_counter() - t0
        seen[0] += 1
        seen[1] += took
        seen[2] = max(seen[2], took)

    def _drain(self, sock: zmq.Socket, admin: bool) -> None:
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self.handle_frames(sock, frames, admin)
            except Exception:  # last line of defence for the invariant in the module docstring
                log.exception("unhandled failure on a frame; answering internal")
                reply = frames[:1] + [self._error(None, P.ErrorCode.INTERNAL, "unhandled server failure")]
            if reply is not None:
                self._send(sock, reply)

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as err:  # peer gone or its queue full: its problem, not ours
            log.warning("reply dropped: %s", err)

    # ---- one request ----
    def handle_frames(self, sock: zmq.Socket, frames: list[bytes], admin: bool) -> Optional[list[bytes]]:
        """Envelope handling: ``[identity, (b"",) payload]`` from DEALER or REQ peers. Returns the
        reply frames, or None when the reply is parked (wait_ready)."""
        identity, rest = frames[0], frames[1:]
        envelope = [identity]
        if len(rest) > 1 and rest[0] == b"":  # a REQ peer's delimiter
            envelope.append(b"")
            rest = rest[1:]
        self.counters["requests"] += 1
        if len(rest) != 1:
            return envelope + [self._error(None, P.ErrorCode.BAD_FRAME, f"expected 1 payload frame, got {len(rest)}")]
        try:
            req = P.decode_request(rest[0])
        except P.ProtocolError as err:
            return envelope + [self._error(err.req_id, err.code, err.message)]
        return self._serve(sock, envelope, client_name(identity), req, admin)

    def _serve(self, sock: zmq.Socket, envelope: list[bytes], client: str, req: P.Request,
               admin: bool) -> Optional[list[bytes]]:
        kind = req.op.type
        if kind in P.ADMIN_TYPES and not admin:
            return envelope + [self._error(req.id, P.ErrorCode.FORBIDDEN, f"{kind} needs the admin socket")]
        t0 = time.perf_counter()
        try:
            return self._run(sock, envelope, client, req)
        finally:
            self._busy(kind, t0)

    def _run(self, sock: zmq.Socket, envelope: list[bytes], client: str, req: P.Request) -> Optional[list[bytes]]:
        kind = req.op.type
        try:
            if kind == "wait_ready":
                return self._wait_ready(sock, envelope, client, req)
            if kind == "batch":
                result = run_batch(self.core, client, req.sub_ops)
            elif kind == "stats":
                result = {"stats": {**self.core.stats(client), "server": self.server_stats()}}
            else:
                result = run_op(self.core, client, req.op)
            return envelope + [P.encode_reply(req.id, result)]
        except KvdError as err:
            return envelope + [self._error(req.id, err.code, err.message)]
        except Exception as err:  # an unpackable result or a broken core: still a reply, never a crash
            log.exception("unexpected failure on %s", kind)
            return envelope + [self._error(req.id, P.ErrorCode.INTERNAL, type(err).__name__)]

    def server_stats(self) -> dict[str, Any]:
        """Request/error counts and, per op type, how many the loop served, its seconds on them and the
        longest one (server-side latency per verb: where a GPU run's time goes); and the garbage
        collector's passes in this process (``gc``: each one stops the loop and the mover threads)."""
        return {**self.counters, "busy": {k: {"count": int(n), "seconds": s, "max_s": m}
                                          for k, (n, s, m) in self.busy.items()},
                "gc": self._gc.stats()}

    def _error(self, req_id: Optional[int], code: str, message: str) -> bytes:
        self.counters["errors"] += 1
        log.debug("error reply %s: %s", code, message)
        return P.encode_error(req_id, code, message)

    # ---- wait_ready without blocking the loop ----
    def _ready(self, client: str, lease: int) -> bool:
        """A non-blocking check: KvdCore.wait_ready with a zero timeout."""
        return bool(self.core.wait_ready(lease, 0.0))

    def _wait_ready(self, sock: zmq.Socket, envelope: list[bytes], client: str,
                    req: P.Request) -> Optional[list[bytes]]:
        op: P.WaitReady = req.op  # type: ignore[assignment]
        if self._ready(client, op.lease):
            return envelope + [P.encode_reply(req.id, {"ready": True})]
        self._parked.append(_Parked(sock, envelope, req.id, client, op.lease, self.clock() + op.timeout_s))
        return None

    def _answer_parked(self, now: float) -> None:
        still: list[_Parked] = []
        for p in self._parked:
            try:
                if self._ready(p.client, p.lease):
                    self._send(p.sock, p.envelope + [P.encode_reply(p.req_id, {"ready": True})])
                elif now >= p.deadline:
                    self._send(p.sock, p.envelope + [self._error(p.req_id, "timeout", "blocks not ready in time")])
                else:
                    still.append(p)
            except KvdError as err:
                self._send(p.sock, p.envelope + [self._error(p.req_id, err.code, err.message)])
        self._parked = still


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
