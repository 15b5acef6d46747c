"""Synchronous kvd client: one DEALER socket, request ids, timeouts, typed errors.

Why DEALER and not REQ: a REQ socket wedges after a lost reply, while a DEALER can time out, drop
the late reply (its id no longer matches) and carry on. The ZeroMQ routing id is the ``client`` kvd
leases are held under, so every call (the optional heartbeat thread's included) goes through the one
socket, serialized by a lock.

Errors arrive as :class:`KvdClientError` subclasses, one per KvdError code; they subclass
``kvd.core_types.KvdError`` so code written against an in-process KvdCore catches them unchanged.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import zmq

from kvd import protocol as P
from kvd.config import KvdConfig
from kvd.core_types import JointLookup, KvdError, LookupResult, PoolInfo
from kvd.types import BlockHash, BlockId, LeaseId, Tier


class KvdClientError(KvdError):
    """Base of every error the client raises; ``code`` is the wire error code."""


class KvdUnavailable(KvdClientError):
    """No reply in time: kvd is not running, or wedged."""


class BadRequest(KvdClientError): ...
class BadVersion(KvdClientError): ...
class UnknownType(KvdClientError): ...
class Forbidden(KvdClientError): ...
class BadChain(KvdClientError): ...
class BadBlock(KvdClientError): ...
class UnknownGroup(KvdClientError): ...
class GroupMismatch(KvdClientError): ...
class NoCapacity(KvdClientError): ...
class UnknownLease(KvdClientError): ...
class NotOwner(KvdClientError): ...
class OutOfBlocks(KvdClientError): ...
class ReadyTimeout(KvdClientError): ...
class PromotionFailed(KvdClientError): ...
class InternalError(KvdClientError): ...


ERRORS: dict[str, type[KvdClientError]] = {
    "bad_request": BadRequest, "bad_frame": BadRequest, "too_large": BadRequest, "bad_hash": BadRequest,
    "bad_version": BadVersion, "unknown_type": UnknownType, "forbidden": Forbidden,
    "bad_chain": BadChain, "bad_block": BadBlock, "unknown_group": UnknownGroup,
    "group_mismatch": GroupMismatch, "no_capacity": NoCapacity, "unknown_lease": UnknownLease,
    "not_owner": NotOwner, "out_of_blocks": OutOfBlocks, "timeout": ReadyTimeout,
    "promotion_failed": PromotionFailed,
    "internal": InternalError,
}


def error_from_wire(err: dict[str, Any]) -> KvdClientError:
    code = str(err.get("code", "internal"))
    return ERRORS.get(code, KvdClientError)(code, str(err.get("message", "")))


def _pool_info(d: dict[str, Any]) -> PoolInfo:
    handle = d.get("ipc_handle")
    return PoolInfo(**{**d, "ipc_handle": tuple(handle) if handle is not None else None})


def _lookup_result(d: dict[str, Any]) -> LookupResult:
    return LookupResult(LeaseId(d["lease"]), [BlockId(b) for b in d["hits"]],
                        [Tier(t) for t in d["tiers"]], bool(d["ready"]), int(d["first"]),
                        int(d.get("room_cut", 0)))   # absent from a kvd older than session 20


def _outcome(op_type: str, reply: Optional[dict[str, Any]]) -> Any:
    """A posted op's typed result, or the KvdClientError its reply (or its loss) means."""
    if reply is None:
        return KvdUnavailable("unavailable", "kvd never answered (restarted?)")
    if not reply.get("ok"):
        return error_from_wire(reply.get("error") or {})
    return decode_result(op_type, reply)


def decode_result(op_type: str, reply: dict[str, Any]) -> Any:
    """The typed value of a successful reply (the same types KvdCore returns)."""
    if op_type == "attach":
        return _pool_info({k: v for k, v in reply.items() if k not in ("v", "id", "ok")})
    if op_type == "lookup":
        return _lookup_result(reply)
    if op_type == "lookup_groups":
        return JointLookup(int(reply["hit"]), {g: _lookup_result(r) for g, r in reply["results"].items()})
    if op_type == "allocate":
        return LeaseId(reply["lease"]), [BlockId(b) for b in reply["blocks"]]
    if op_type == "commit":
        return [BlockId(b) for b in reply["blocks"]]
    if op_type == "hash":
        return [BlockHash(h) for h in reply["hashes"]]
    return {k: v for k, v in reply.items() if k not in ("v", "id", "ok")}


class KvdClient:
    """Talks to one kvd. ``admin=True`` connects to ``kvd-admin.sock`` (pin/unpin/evict/flush)."""

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *, admin: bool = False, timeout_s: float = 5.0,
                 identity: Optional[bytes] = None):
        if run_dir is None:  # the daemon's own default: $KVD_RUN_DIR, else /run/kvd
            run_dir = KvdConfig.load().run_dir
        name = "kvd-admin.sock" if admin else "kvd.sock"
        self.path = Path(run_dir) / name
        self.endpoint = f"ipc://{self.path}"
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, identity or f"pid{os.getpid()}-{os.urandom(4).hex()}".encode())
        self._sock.connect(self.endpoint)
        self._hb_stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None
        # op type -> [round trips, wall seconds] (the heartbeat thread's included): what kvd costs the caller
        self.round_trips: dict[str, list[float]] = {}
        self.posts: dict[str, list[float]] = {}     # op type -> [posted ops, seconds to send them]
        self.frames_posted = 0                      # frames sent without waiting (a corked batch is one)
        self._posted: dict[int, tuple[str, Optional[Callable[[Any], None]]]] = {}   # id -> (op type, on_reply)
        self._posted_at: dict[int, float] = {}   # posted id -> when it was sent (monotonic), for ``drain``
        self._arrived: dict[int, Optional[dict[str, Any]]] = {}   # posted id -> its reply (None: lost)
        self._needed = 0          # the last posted id whose reply ``settle`` must wait for
        # posted ops kvd answers out of order (a parked wait_ready): id -> (op type, on_reply, deadline)
        self._watches: dict[int, tuple[str, Callable[[Any], None], float]] = {}
        self._watched: dict[int, dict[str, Any]] = {}     # watch id -> its reply, not handed out yet
        # posts held while corked (``cork``): (op's wire map, on_reply, needed), sent as one batch frame by ``uncork``
        self._corked: Optional[list[tuple[dict[str, Any], Optional[Callable[[Any], None]], bool]]] = None

    # ---- transport ----
    def _unreachable(self, why: str) -> KvdUnavailable:
        return KvdUnavailable("unavailable", f"kvd is not reachable at {self.endpoint} ({why})")

    def request(self, op: P.Op, timeout_s: Optional[float] = None) -> dict[str, Any]:
        """Send one op, return the raw reply map (``ok`` true) or raise its typed error."""
        return self.request_fields(P.op_fields(op), timeout_s)

    def request_fields(self, fields: dict[str, Any], timeout_s: Optional[float] = None) -> dict[str, Any]:
        """``request`` for an op's wire map (``P.op_fields``, or a ``P.*_fields`` builder for values the
        caller built itself: kvd validates them)."""
        if not self.path.exists():
            raise self._unreachable("no socket file")
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        with self._lock:
            self._send_held()                  # held posts go first: kvd sees every frame in call order
            t0 = time.perf_counter()
            req_id = next(self._ids)
            self._sock.send(P.encode_fields(req_id, fields))
            try:
                reply = self._await(req_id, timeout_ms)
            finally:
                self._count(self.round_trips, fields["type"], t0)
        if not reply.get("ok"):
            raise error_from_wire(reply.get("error") or {})
        return reply

    def post(self, op: P.Op, on_reply: Optional[Callable[[Any], None]] = None, needed: bool = True) -> None:
        """Send ``op`` without waiting for its reply (a release, a commit whose answer is needed only
        before the next forward step). kvd serves one connection's frames in order, so a later call sees
        its effect. ``settle()`` reads the replies and calls ``on_reply`` with each typed result or
        KvdClientError, on the caller's thread (never the heartbeat thread's). ``needed=False`` (a
        release): ``settle`` does not wait for this reply; a later settle or ``drain`` hands it out.
        While corked (``cork``) the op is held and sent with the others at ``uncork``."""
        self.post_fields(P.op_fields(op), on_reply, needed)

    def post_fields(self, fields: dict[str, Any], on_reply: Optional[Callable[[Any], None]] = None,
                    needed: bool = True) -> None:
        """``post`` for an op's wire map (``P.commit_fields``: a step's commits, built by the engine from
        its own block ids and hashes, skip the client-side validation; kvd still validates them)."""
        if self._corked is not None and self._hold(fields, on_reply, needed):
            return
        self._send_unanswered(fields, self._booking(fields["type"], on_reply, needed))

    def _booking(self, op_type: str, on_reply: Optional[Callable[[Any], None]], needed: bool) -> Callable[[int], None]:
        """Who takes a posted frame's reply (``settle``), and whether ``settle`` must wait for it."""
        def book(req_id: int) -> None:
            self._posted[req_id] = (op_type, on_reply)
            self._posted_at[req_id] = time.monotonic()
            if needed:
                self._needed = req_id
        return book

    # ---- corked posts: one frame per engine step ----
    def cork(self) -> bool:
        """Hold the ops posted from now on until ``uncork``, which sends them as one ``batch`` frame:
        one send, one wake-up of each side's ZeroMQ I/O thread and one reply instead of one per op (a
        decode step of 32 sequences posts ~3 commits and a release; each send cost ~0.07 ms of the
        engine's thread in a CPU profile, docs/design/kvd.md "Session 5"). What kvd does and answers is
        the same: it runs a batch's ops in order, each with its own result, and every reply is handed to
        its op's ``on_reply`` as before. Any other frame (a waited call, a watch, the heartbeat thread's)
        and ``settle`` send what is held first, so kvd still sees every op in call order. Returns False
        (and changes nothing) when already corked: the outer ``uncork`` sends."""
        with self._lock:
            if self._corked is not None:
                return False
            self._corked = []
            return True

    def uncork(self) -> None:
        """Send what was held (one frame; a lone op as itself) and stop holding. Raises what ``post``
        raises; the held ops are dropped then, as a failed ``post`` sends nothing."""
        with self._lock:
            try:
                self._send_held()
            finally:
                self._corked = None

    def _hold(self, fields: dict[str, Any], on_reply: Optional[Callable[[Any], None]], needed: bool) -> bool:
        """Keep a post for the corked frame; False when not corked any more (the caller sends it)."""
        with self._lock:
            if self._corked is None:
                return False
            t0 = time.perf_counter()
            self._corked.append((fields, on_reply, needed))
            self._count(self.posts, fields["type"], t0)
            return True

    def _send_held(self) -> None:
        """Send the held posts, in order, as one posted ``batch`` frame (``uncork``). The reference path,
        one frame each as ``post`` sends them, serves a lone op and a batch too large for one frame. The
        frame is packed from the held wire maps directly (``P.batch_fields``): the same bytes as
        ``P.encode_op(id, P.Batch(ops=...))``, without re-validating and copying every op on the way out.
        Caller holds the lock."""
        held = self._corked
        if not held:
            return
        self._corked = []
        if not self.path.exists():
            raise self._unreachable("no socket file")
        if 1 < len(held) <= P.MAX_BATCH_OPS:
            t0 = time.perf_counter()
            req_id = next(self._ids)
            frame = P.encode_fields(req_id, P.batch_fields([fields for fields, _, _ in held]))
            if len(frame) <= P.MAX_FRAME_BYTES:
                self._sock.send(frame)
                self._booking("batch", _split_batch(held), any(n for _, _, n in held))(req_id)
                self._count(self.posts, "batch", t0)
                self.frames_posted += 1
                return
        for fields, on_reply, needed in held:       # the reference path: one posted frame per op
            self._send_posted(fields, self._booking(fields["type"], on_reply, needed))

    def settle(self, timeout_s: Optional[float] = None, needed_only: bool = False) -> int:
        """Wait for every posted op's reply (``needed_only``: only up to the last one sent with
        ``needed``; kvd answering in order, every op before it too) and hand out, in send order, every
        reply that has come; returns how many. Raises KvdUnavailable if one does not come in time (the
        unanswered ones are dropped)."""
        timeout_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        with self._lock:
            self._send_held()                  # a held post is posted: settle waits for it too
            t0 = time.perf_counter()
            try:
                self._read_ready()
                last = self._needed if needed_only else max(self._posted, default=0)
                if last in self._posted and last not in self._arrived:
                    self._await(last, timeout_ms)
            except KvdUnavailable:
                self._forget_posted()
                raise
            finally:
                self._count(self.round_trips, "settle", t0)
            done = self._take_answered()
        return self._hand_out(done)

    def drain(self) -> int:
        """Hand out, in send order, the replies of posted ops that have already come, without waiting
        (up to the first one still unanswered); returns how many. The scheduler takes a posted
        ``allocate``'s blocks this way at the start of a step. Raises KvdUnavailable (the unanswered
        ones are dropped) when the oldest unanswered post was sent over ``timeout_s`` ago: a caller that
        never waits (an engine whose commits are posted and not needed) still learns that kvd is gone
        within the timeout of a waited call."""
        late = None
        with self._lock:
            self._read_ready()
            done = self._take_answered()
            if self._posted:
                oldest = min(self._posted)
                age = time.monotonic() - self._posted_at.get(oldest, time.monotonic())
                if oldest not in self._arrived and age > self.timeout_s:
                    late = self._unreachable(f"a posted {self._posted[oldest][0]} unanswered for {age:.1f}s")
                    self._forget_posted()
        count = self._hand_out(done)          # outside the lock: a reply's handler may post
        if late is not None:
            raise late
        return count

    def _forget_posted(self) -> None:
        """Drop every posted op still unanswered (kvd is gone). Caller holds the lock."""
        self._posted.clear()
        self._posted_at.clear()
        self._arrived.clear()

    def _read_ready(self) -> None:
        """File every reply already on the socket (never waits). Caller holds the lock."""
        while self._sock.poll(0, zmq.POLLIN):
            self._keep(P.unpack(self._sock.recv()))

    def _take_answered(self) -> list[tuple[tuple[str, Optional[Callable[[Any], None]]], Any]]:
        """Pop the answered posted ops in send order, stopping at the first unanswered. Caller holds the lock."""
        done = []
        for i in sorted(self._posted):
            if i not in self._arrived:
                break
            self._posted_at.pop(i, None)
            done.append((self._posted.pop(i), self._arrived.pop(i)))
        return done

    @staticmethod
    def _hand_out(done: list[tuple[tuple[str, Optional[Callable[[Any], None]]], Any]]) -> int:
        for (op_type, on_reply), reply in done:
            if on_reply is not None:
                on_reply(_outcome(op_type, reply))
        return len(done)

    def watch(self, op: P.WaitReady, on_reply: Callable[[Any], None]) -> int:
        """Post a ``wait_ready`` that kvd parks until the lease's promotions land (or ``op.timeout_s``
        passes) and hand its answer to ``on_reply`` at a later ``poll_watches``, which never blocks. Why not
        ``post``: kvd answers a parked op out of order, and ``settle`` (before every forward) would wait
        for it. Returns the id, for ``unwatch``."""
        deadline = time.monotonic() + op.timeout_s + self.timeout_s
        return self._send_unanswered(P.op_fields(op),
                                     lambda req_id: self._watches.__setitem__(req_id, (op.type, on_reply, deadline)))

    def _send_unanswered(self, fields: dict[str, Any], book: Callable[[int], None]) -> int:
        """Send an op (its wire map) without waiting; ``book(id)`` records, under the same lock, who takes its reply
        (``post``'s settle or ``watch``'s poll). Returns the request id."""
        if not self.path.exists():
            raise self._unreachable("no socket file")
        with self._lock:
            self._send_held()
            t0 = time.perf_counter()
            req_id = self._send_posted(fields, book)
            self._count(self.posts, fields["type"], t0)
        return req_id

    def _send_posted(self, fields: dict[str, Any], book: Callable[[int], None]) -> int:
        """One posted frame: send the op's wire map under a new id and ``book`` its reply. Caller holds
        the lock."""
        req_id = next(self._ids)
        self._sock.send(P.encode_fields(req_id, fields))
        book(req_id)
        self.frames_posted += 1
        return req_id

    def unwatch(self, req_id: int) -> None:
        """Forget a watch: its answer, if one still comes, is dropped."""
        with self._lock:
            self._watches.pop(req_id, None)
            self._watched.pop(req_id, None)

    def poll_watches(self) -> int:
        """Hand out the answers of watches that have come, without waiting: read what is already on
        the socket, then call each answered watch's ``on_reply`` (on the caller's thread). A watch past
        its deadline gets KvdUnavailable: kvd died or restarted, and a new kvd never answers it."""
        now = time.monotonic()
        with self._lock:
            self._read_ready()
            answered, self._watched = self._watched, {}
            expired = {i: None for i, (_, _, deadline) in self._watches.items() if deadline <= now and i not in answered}
            handlers = [(self._watches.pop(i), reply) for i, reply in sorted({**answered, **expired}.items())]
        for (op_type, on_reply, _), reply in handlers:
            on_reply(_outcome(op_type, reply))
        return len(handlers)

    @property
    def watching(self) -> int:
        """Watches whose answers ``poll_watches`` has not handed out yet."""
        return len(self._watches)

    def _keep(self, reply: Any) -> Any:
        """File a reply that belongs to a posted op or a watch; returns its id."""
        rid = reply.get("id") if isinstance(reply, dict) else None
        if rid in self._posted:
            self._arrived[rid] = reply
            self._lose_before(rid)
        elif rid in self._watches:
            self._watched[rid] = reply
        return rid

    @property
    def unsettled(self) -> int:
        """Posted frames (held ones included) whose replies ``settle()`` has not handed out yet."""
        return len(self._posted) + len(self._corked or ())

    @property
    def awaiting(self) -> bool:
        """Whether a posted op sent with ``needed`` has not been handed out: ``settle`` may have to wait."""
        return self._needed in self._posted or any(needed for _, _, needed in self._corked or ())

    @staticmethod
    def _count(table: dict[str, list[float]], op_type: str, t0: float) -> None:
        seen = table.setdefault(op_type, [0, 0.0])
        seen[0] += 1
        seen[1] += time.perf_counter() - t0

    def _await(self, req_id: int, timeout_ms: int) -> dict[str, Any]:
        """Wait for the reply with our id. Replies to posted ops are kept for ``settle`` (to watches, for
        ``poll_watches``); since kvd answers the others in order, a posted op still unanswered when a later
        id's reply comes is lost (kvd restarted), and gets None. A late reply to an earlier, timed-out
        request is dropped."""
        deadline = _now_ms() + timeout_ms
        while True:
            left = deadline - _now_ms()
            if left <= 0 or not self._sock.poll(left, zmq.POLLIN):
                raise self._unreachable(f"no reply in {timeout_ms / 1000:g}s")
            reply = P.unpack(self._sock.recv())
            rid = self._keep(reply)
            if rid == req_id:
                self._lose_before(req_id)
                return reply

    def _lose_before(self, rid: int) -> None:
        """kvd answers posted and waited ops in order: one still unanswered before ``rid`` is lost."""
        for lost in [i for i in self._posted if i < rid and i not in self._arrived]:
            self._arrived[lost] = None

    def call(self, op: P.Op, timeout_s: Optional[float] = None) -> Any:
        return decode_result(op.type, self.request(op, timeout_s))

    # ---- the KvdCore API, remotely ----
    def attach(self, group: str, block_bytes: int, tail_blocks: Optional[int] = None) -> PoolInfo:
        return self.call(P.Attach(group=group, block_bytes=block_bytes, tail_blocks=tail_blocks))

    def lookup(self, group: str, hashes: Sequence[bytes], session: Optional[str] = None,
               tokens: Optional[int] = None, block_tokens: Optional[int] = None,
               recompute_s: Optional[float] = None) -> LookupResult:
        """``tokens``/``block_tokens`` (optional) let kvd count token hit rates in its stats;
        ``recompute_s`` (seconds to recompute one block) turns the prefetch budget on."""
        return self.call(P.Lookup(group=group, hashes=list(hashes), session=session, tokens=tokens,
                                  block_tokens=block_tokens, recompute_s=recompute_s))

    def lookup_groups(self, groups: Sequence[str], hashes: Sequence[bytes], session: Optional[str] = None,
                      tokens: Optional[int] = None, block_tokens: Optional[int] = None,
                      recompute_s: Optional[float] = None) -> JointLookup:
        """One prefix hit across cache groups (a hybrid model's full + sliding-window groups)."""
        return self.call(P.LookupGroups(groups=list(groups), hashes=list(hashes), session=session, tokens=tokens,
                                        block_tokens=block_tokens, recompute_s=recompute_s))

    def warm(self, groups: Sequence[str], hashes: Sequence[bytes], recompute_s: Optional[float] = None) -> int:
        """Prefetch on arrival: start promoting what a lookup of ``hashes`` would hit (no lease); returns
        the blocks queued. The engine posts it instead (``P.warm_fields``) while a forward runs."""
        return int(self.call(P.Warm(groups=list(groups), hashes=list(hashes), recompute_s=recompute_s))["blocks"])

    def allocate(self, group: str, n: int) -> tuple[LeaseId, list[BlockId]]:
        return self.call(P.Allocate(group=group, n=n))

    def commit(self, lease: int, blocks: Sequence[tuple[int, bytes, Optional[bytes]]]) -> list[BlockId]:
        return self.call(P.Commit(lease=lease, blocks=list(blocks)))

    def release(self, lease: int, hints: Optional[dict[str, Any]] = None,
                blocks: Optional[Sequence[int]] = None) -> None:
        """``blocks``: give back only these blocks of the lease (it stays open)."""
        self.call(P.Release(lease=lease, hints=hints, blocks=None if blocks is None else [int(b) for b in blocks]))

    def heartbeat(self) -> None:
        self.call(P.Heartbeat())

    def wait_ready(self, lease: int, timeout_s: float = 10.0) -> bool:
        """Blocks until the lease's promoted blocks have landed; raises ReadyTimeout otherwise."""
        return bool(self.call(P.WaitReady(lease=lease, timeout_s=timeout_s), timeout_s + self.timeout_s)["ready"])

    def batch(self, ops: Sequence[P.Op]) -> list[Any]:
        """Run several ops in one round trip; each item is its typed result or a KvdClientError
        instance (returned, not raised, so one failure does not hide the other results)."""
        return self.batch_fields([P.op_fields(op) for op in ops])

    def batch_fields(self, ops: Sequence[dict[str, Any]]) -> list[Any]:
        """``batch`` for op wire maps (``P.lookup_fields``: the admissions' lookups, built by the engine
        from its own hashes; kvd validates them)."""
        reply = self.request_fields(P.batch_fields(list(ops)))
        return [decode_result(op["type"], r) if r.get("ok") else error_from_wire(r.get("error") or {})
                for op, r in zip(ops, reply["results"])]

    def stats(self) -> dict[str, Any]:
        return self.call(P.Stats())["stats"]

    def top(self, n: int = 20) -> list[dict[str, Any]]:
        return self.call(P.Top(n=n))["top"]

    def leases(self) -> Any:
        return self.call(P.Leases())["leases"]

    def roots(self, group: str, known: Optional[int] = None, recompute_s: Optional[float] = None) -> dict[str, Any]:
        """The first-block hashes ``group`` holds (KvdCore.roots): ``{version, filterable, roots}``, or
        against a ``known`` version ``{version, filterable, since, added, removed}``."""
        return self.call(P.Roots(group=group, known=known, recompute_s=recompute_s))

    def sessions(self) -> Any:
        return self.call(P.Sessions())["sessions"]

    def hash(self, tokens: Sequence[int], block_size: int, **namespace: Any) -> list[BlockHash]:
        return self.call(P.HashTokens(tokens=list(tokens), block_size=block_size, **namespace))

    def pin(self, hashes: Sequence[bytes]) -> Any:
        return self.call(P.Pin(hashes=list(hashes)))["result"]

    def unpin(self, hashes: Sequence[bytes]) -> Any:
        return self.call(P.Unpin(hashes=list(hashes)))["result"]

    def evict(self, hashes: Sequence[bytes]) -> Any:
        return self.call(P.Evict(hashes=list(hashes)))["result"]

    def flush(self, tier: Optional[int] = None) -> Any:
        return self.call(P.Flush(tier=tier))["result"]

    # ---- heartbeats ----
    def start_heartbeat(self, interval_s: float) -> None:
        """Renew this client's leases every ``interval_s`` from a daemon thread (below the TTL)."""
        if self._hb_thread is not None:
            return
        self._hb_stop.clear()
        self._hb_thread = threading.Thread(target=self._beat, args=(interval_s,), name="kvd-heartbeat", daemon=True)
        self._hb_thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._hb_stop.wait(interval_s):
            try:
                self.heartbeat()
            except KvdClientError:
                pass  # kvd restarting: the next beat retries; the leases are gone anyway

    def close(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join()
            self._hb_thread = None
        self._sock.close(0)

    def __enter__(self) -> "KvdClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _split_batch(held: list[tuple[dict[str, Any], Optional[Callable[[Any], None]], bool]]) -> Callable[[Any], None]:
    """The on_reply of a corked batch frame: hand each op's own result (or the frame's error: kvd lost,
    the whole frame refused) to that op's on_reply, in order, as if it had been posted alone."""
    def on_reply(out: Any) -> None:
        results = out.get("results") if isinstance(out, dict) else None
        for i, (fields, cb, _) in enumerate(held):
            if cb is None:
                continue
            if results is None:
                cb(out)
            else:
                cb(_outcome(fields["type"], results[i] if i < len(results) else None))
    return on_reply


def map_pool(info: PoolInfo) -> Any:
    """The group's GPU pool as a uint8 tensor ``[gpu_blocks, block_bytes]`` shared with kvd.

    kind "shm": the same /dev/shm file kvd maps, so writes are visible to both. kind "cuda": rebuilt
    from the CUDA IPC handle (best effort: untested without a GPU)."""
    import torch  # heavy: only processes that touch KV bytes pay for it

    size = info.gpu_blocks * info.block_bytes
    if info.kind == "shm":
        flat = torch.from_file(info.path, shared=True, size=size, dtype=torch.uint8)
    else:
        storage = torch.UntypedStorage._new_shared_cuda(*info.ipc_handle)
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info.device or 0}").set_(storage)[:size]
    return flat.view(info.gpu_blocks, info.block_bytes)


def _now_ms() -> float:
    return time.monotonic() * 1000
