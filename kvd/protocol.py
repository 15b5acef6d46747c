"""The kvd wire contract, defined once: message types, their fields, the version and the
validation of untrusted input.

Frames are msgpack maps. A request is ``{"v": PROTOCOL_VERSION, "type": str, "id": int, ...fields}``;
a reply is ``{"v", "id", "ok": True, ...result}`` or ``{"v", "id", "ok": False, "error": {"code",
"message"}}``. Why msgpack with ``use_bin_type`` and ``raw=False``: hashes stay ``bytes`` and names
stay ``str`` on both ends, and nothing on the wire can name a Python object (pickle is refused by
construction: ext types are rejected at decode).

Everything arriving on a socket is untrusted. :func:`decode_request` either returns a validated
:class:`Request` or raises :class:`ProtocolError` carrying the typed error code to send back; it
never raises anything else, so a bad frame cannot take the server loop down.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import msgpack
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from kvd.types import HASH_BYTES

# 2: attach carries tail_blocks, lookup carries recompute_s, lookup_groups, release may name blocks
# (hybrid cache groups and the prefetch budget; docs/design/kvd.md).
# 3: a commit that duplicates a published GPU block leaves the writer's slot leased to it (a private write
# slot, given back with ``release`` naming it, or with the lease) instead of freeing it, so a client may
# read that slot until it has switched to the canonical id. The wire format is v2's; the version changes
# because a v2 client relies on the old meaning. An older frame is refused with the typed error ``bad_version``.
PROTOCOL_VERSION = 3

# Bounds on untrusted input. A 128k-token prompt at block size 16 is 8192 hashes; 65536 leaves room
# for 1M-token contexts while capping one frame's decode work.
MAX_FRAME_BYTES = 8 << 20
MAX_HASHES = 65536
MAX_BATCH_OPS = 1024
MAX_TOKENS = 1 << 20
MAX_NAME_CHARS = 256
MAX_BLOCK_BYTES = 1 << 30
MAX_TOP = 10_000
MAX_WAIT_S = 3600.0

ADMIN_TYPES = frozenset({"pin", "unpin", "evict", "flush"})
BATCHABLE_TYPES = frozenset({"lookup", "lookup_groups", "warm", "allocate", "commit", "release", "heartbeat", "roots"})


class ErrorCode:
    """Codes the protocol layer itself produces; KvdCore adds its own (for example
    ``out_of_blocks``, ``bad_chain``) and they travel unchanged."""

    TOO_LARGE = "too_large"
    BAD_FRAME = "bad_frame"
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    BAD_REQUEST = "bad_request"
    FORBIDDEN = "forbidden"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request that cannot be served; ``req_id`` is echoed when it could be read."""

    def __init__(self, code: str, message: str, req_id: Optional[int] = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id


# ---- field types: strict leaves, so 1 is not a bool, "x" is not bytes, 1.5 is not an int ----
Hash = Annotated[bytes, Strict(), Field(min_length=HASH_BYTES, max_length=HASH_BYTES)]
Hashes = Annotated[list[Hash], Field(max_length=MAX_HASHES)]
Name = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_NAME_CHARS)]
OptName = Annotated[str, Strict(), Field(max_length=MAX_NAME_CHARS)]
LeaseField = Annotated[int, Strict(), Field(ge=0, lt=2**63)]
BlockIdField = Annotated[int, Strict(), Field(ge=0, lt=2**31)]
Count = Annotated[int, Strict(), Field(ge=1, le=MAX_HASHES)]
Seconds = Annotated[float, Strict(), Field(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)]
Token = Annotated[int, Strict(), Field(ge=0, lt=2**32)]
RequestId = Annotated[int, Strict(), Field(ge=0, lt=2**64)]
KindField = Annotated[int, Strict(), Field(ge=0, le=3)]  # kvd.types.BlockKind
TierField = Annotated[int, Strict(), Field(ge=0, le=2)]  # kvd.types.Tier


class Op(BaseModel):
    """One operation; ``type`` selects the model. Unknown fields are refused, not ignored.

    ``type`` has a default only so a client can build ``Lookup(group=..., hashes=...)``; a frame
    without ``type`` is refused before any model sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


TailBlocks = Annotated[int, Strict(), Field(ge=1, le=MAX_HASHES)]
RecomputeS = Annotated[float, Strict(), Field(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)]


class Attach(Op):
    """``tail_blocks``: None for a full-attention group; k when a hit needs only its last k blocks."""

    type: Literal["attach"] = "attach"
    group: Name
    block_bytes: Annotated[int, Strict(), Field(ge=1, le=MAX_BLOCK_BYTES)]
    tail_blocks: Optional[TailBlocks] = None


class Lookup(Op):
    """``recompute_s``: the client's seconds to recompute one block (prefetch budget); None: no budget."""

    type: Literal["lookup"] = "lookup"
    group: Name
    hashes: Hashes
    session: Optional[OptName] = None
    tokens: Optional[Annotated[int, Strict(), Field(ge=0, le=2**40)]] = None  # prompt length, for token stats
    block_tokens: Optional[Annotated[int, Strict(), Field(ge=1, le=1 << 16)]] = None
    recompute_s: Optional[RecomputeS] = None


class LookupGroups(Op):
    """One prefix hit across cache groups (KvdCore.lookup_groups); the reply is ``{hit, results}``."""

    type: Literal["lookup_groups"] = "lookup_groups"
    groups: Annotated[list[Name], Field(min_length=1, max_length=8)]
    hashes: Hashes
    session: Optional[OptName] = None
    tokens: Optional[Annotated[int, Strict(), Field(ge=0, le=2**40)]] = None
    block_tokens: Optional[Annotated[int, Strict(), Field(ge=1, le=1 << 16)]] = None
    recompute_s: Optional[RecomputeS] = None


class Warm(Op):
    """Prefetch on arrival (KvdCore.warm): start promoting the lower-tier blocks a later lookup of
    ``hashes`` across ``groups`` would hit, without a lease; the reply is ``{blocks}`` (how many were queued).
    ``recompute_s`` as in ``Lookup``: the prefetch budget applies."""

    type: Literal["warm"] = "warm"
    groups: Annotated[list[Name], Field(min_length=1, max_length=8)]
    hashes: Hashes
    recompute_s: Optional[RecomputeS] = None


class Allocate(Op):
    type: Literal["allocate"] = "allocate"
    group: Name
    n: Count


class Commit(Op):
    """``blocks``: ``[block_id, hash, parent_hash | None]`` each, in chain order."""

    type: Literal["commit"] = "commit"
    lease: LeaseField
    blocks: Annotated[list[tuple[BlockIdField, Hash, Optional[Hash]]], Field(max_length=MAX_HASHES)]


class Hints(BaseModel):
    """What specd knows about the released blocks (see KvdCore.release)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    session: Optional[OptName] = None
    kinds: Annotated[dict[Hash, KindField], Field(max_length=MAX_HASHES)] = {}
    turn_end: Annotated[bool, Strict()] = False
    expected_return_s: Optional[Seconds] = None


class Release(Op):
    """``blocks``: release only these blocks of the lease (KvdCore.release_blocks); hints then unused."""

    type: Literal["release"] = "release"
    lease: LeaseField
    hints: Optional[Hints] = None
    blocks: Optional[Annotated[list[BlockIdField], Field(max_length=MAX_HASHES)]] = None


class Heartbeat(Op):
    type: Literal["heartbeat"] = "heartbeat"


class WaitReady(Op):
    type: Literal["wait_ready"] = "wait_ready"
    lease: LeaseField
    timeout_s: Seconds = 10.0


class Batch(Op):
    """Several ops in one frame (one scheduler step); each item is a map with its own ``type``,
    restricted to BATCHABLE_TYPES, and is validated like a top-level op."""

    type: Literal["batch"] = "batch"
    ops: Annotated[list[dict[str, Any]], Field(max_length=MAX_BATCH_OPS)]


class Stats(Op):
    type: Literal["stats"] = "stats"


class Top(Op):
    type: Literal["top"] = "top"
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_TOP)] = 20


class Leases(Op):
    type: Literal["leases"] = "leases"


class Roots(Op):
    """The first-block hashes a group holds (KvdCore.roots); ``known``: the version the client has.
    A client that skips the lookups of prompts that cannot hit still tells kvd what they would have said:
    ``recompute_s`` as in ``Lookup`` (what an NVMe block must beat), and ``skipped`` lookups of
    ``skipped_blocks`` blocks in all since its last ask, counted as misses in kvd's hit rate."""

    type: Literal["roots"] = "roots"
    group: Name
    known: Optional[Annotated[int, Strict(), Field(ge=0, lt=2**64)]] = None
    recompute_s: Optional[RecomputeS] = None
    skipped: Annotated[int, Strict(), Field(ge=0, le=2**31)] = 0
    skipped_blocks: Annotated[int, Strict(), Field(ge=0, le=2**40)] = 0


class Sessions(Op):
    type: Literal["sessions"] = "sessions"


class HashTokens(Op):
    """Block hashes of a token list under a namespace (same chain as kvd.hashing)."""

    type: Literal["hash"] = "hash"
    tokens: Annotated[list[Token], Field(max_length=MAX_TOKENS)]
    block_size: Annotated[int, Strict(), Field(ge=1, le=1 << 16)]
    model: OptName = ""
    tokenizer: OptName = ""
    dtype: OptName = ""
    layout: OptName = ""
    adapter: OptName = ""
    salt: OptName = ""
    extra: Annotated[bytes, Strict(), Field(max_length=MAX_NAME_CHARS)] = b""


class Pin(Op):
    type: Literal["pin"] = "pin"
    hashes: Hashes


class Unpin(Op):
    type: Literal["unpin"] = "unpin"
    hashes: Hashes


class Evict(Op):
    type: Literal["evict"] = "evict"
    hashes: Hashes


class Flush(Op):
    """``tier`` None flushes every tier."""

    type: Literal["flush"] = "flush"
    tier: Optional[TierField] = None


OP_MODELS: dict[str, type[Op]] = {
    "attach": Attach, "lookup": Lookup, "lookup_groups": LookupGroups, "warm": Warm, "allocate": Allocate, "commit": Commit, "release": Release,
    "heartbeat": Heartbeat, "wait_ready": WaitReady, "batch": Batch, "stats": Stats, "top": Top,
    "leases": Leases, "sessions": Sessions, "roots": Roots, "hash": HashTokens, "pin": Pin, "unpin": Unpin,
    "evict": Evict, "flush": Flush,
}


@dataclass(frozen=True)
class Request:
    """A validated request: the envelope id plus one op (a Batch carries validated sub-ops)."""

    id: int
    op: Op
    sub_ops: tuple[Op, ...] = ()


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def unpack(frame: bytes) -> Any:
    """Decode one msgpack frame from an untrusted peer: bounded, no ext types, str map keys."""
    return msgpack.unpackb(
        frame, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext
    )


def _plain(obj: Any) -> Any:
    """Core results may hold numpy scalars, paths or dataclasses; the wire gets plain values."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (os.PathLike, set, frozenset)):
        return os.fspath(obj) if isinstance(obj, os.PathLike) else sorted(obj)
    raise TypeError(f"cannot send {type(obj).__name__} over the wire")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_plain)


def _short(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {first['msg']}{more}"


def validate_op(obj: Any, req_id: Optional[int], allowed: Optional[frozenset[str]] = None) -> Op:
    """Validate one op map; ``allowed`` narrows the accepted types (batch items)."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "an op must be a map", req_id)
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in OP_MODELS:
        # a batch item's type is one of the batch's fields: the request is known, its fields are bad
        code = ErrorCode.UNKNOWN_TYPE if allowed is None else ErrorCode.BAD_REQUEST
        raise ProtocolError(code, f"unknown message type {kind!r:.64}", req_id)
    if allowed is not None and kind not in allowed:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{kind!r} is not allowed here", req_id)
    try:
        return OP_MODELS[kind].model_validate(obj)
    except ValidationError as err:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{kind}: {_short(err)}", req_id) from None


def _read_id(msg: dict) -> Optional[int]:
    rid = msg.get("id")
    if type(rid) is int and 0 <= rid < 2**64:
        return rid
    return None


def decode_request(frame: bytes) -> Request:
    """Parse and validate one request frame, or raise ProtocolError (and nothing else)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        msg = unpack(frame)
    except Exception as err:  # msgpack raises many types (ExtraData, ValueError, TypeError...)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack frame: {type(err).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "a request must be a msgpack map")
    req_id = _read_id(msg)
    if req_id is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "id must be an integer in [0, 2**64)")
    if type(msg.get("v")) is not int or msg["v"] != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"client speaks protocol version {msg.get('v')!r:.32}, this kvd "
                            f"speaks {PROTOCOL_VERSION}: upgrade the client", req_id)
    fields = {k: v for k, v in msg.items() if k not in ("v", "id")}
    op = validate_op(fields, req_id)
    sub_ops: tuple[Op, ...] = ()
    if isinstance(op, Batch):
        sub_ops = tuple(validate_op(item, req_id, BATCHABLE_TYPES) for item in op.ops)
    return Request(req_id, op, sub_ops)


def encode_request(req_id: int, op_type: str, **fields: Any) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "type": op_type, "id": req_id, **fields})


def encode_op(req_id: int, op: Op) -> bytes:
    """A request frame for an already-built op (the client validates before sending)."""
    return encode_fields(req_id, op_fields(op))


# ---- wire maps: a validated op's map (the reference) and the engine's hot ops built directly ----
# Why: building a pydantic op validates every hash of it on the client, then ``model_dump`` copies it back
# out, and kvd validates the same values again on receipt. For values the engine built itself (ints and
# kvd.hashing's 16-byte hashes) the client-side pass buys nothing: a 32-prompt admission lookup batch cost
# ~125 us to build and encode, ~22 us directly (docs/design/kvd.md "Session 5"). Each ``*_fields`` returns
# exactly the map ``<Op>(...).model_dump()`` returns for the same arguments (same keys, same order: the same
# frame bytes; tests/kvd_io/test_wire_fields.py), without validating it: bad values are refused by kvd with
# the typed error ``bad_request``, as any frame is. Callers with untrusted values build the op instead.

def op_fields(op: Op) -> dict[str, Any]:
    """The wire map of a built (validated) op: the reference for the ``*_fields`` builders."""
    return op.model_dump()


def encode_fields(req_id: int, fields: dict[str, Any]) -> bytes:
    """A request frame for an op's wire map (``op_fields`` or a ``*_fields`` builder)."""
    return pack({"v": PROTOCOL_VERSION, "id": req_id, **fields})


def commit_fields(lease: int, blocks: list[tuple[int, bytes, Optional[bytes]]]) -> dict[str, Any]:
    """``Commit(lease=lease, blocks=blocks).model_dump()``, unvalidated (a step's posted commits)."""
    return {"type": "commit", "lease": lease, "blocks": blocks}


def roots_fields(group: str, known: Optional[int] = None, recompute_s: Optional[float] = None, skipped: int = 0,
                 skipped_blocks: int = 0) -> dict[str, Any]:
    """``Roots(...).model_dump()``, unvalidated (the engine's posted refresh: building the validated op cost
    ~0.1 ms a step on the CPU probe, tests/kvd/host_phase_probe.py)."""
    return {"type": "roots", "group": group, "known": known, "recompute_s": recompute_s, "skipped": skipped,
            "skipped_blocks": skipped_blocks}


def lookup_fields(group: str, hashes: list[bytes], session: Optional[str] = None, tokens: Optional[int] = None,
                  block_tokens: Optional[int] = None, recompute_s: Optional[float] = None) -> dict[str, Any]:
    """``Lookup(...).model_dump()`` for the same arguments, unvalidated (the admissions' lookups)."""
    return {"type": "lookup", "group": group, "hashes": hashes, "session": session, "tokens": tokens,
            "block_tokens": block_tokens, "recompute_s": recompute_s}


def warm_fields(groups: list[str], hashes: list[bytes], recompute_s: Optional[float] = None) -> dict[str, Any]:
    """``Warm(...).model_dump()``, unvalidated (posted by the engine while a forward runs)."""
    return {"type": "warm", "groups": groups, "hashes": hashes, "recompute_s": recompute_s}


def batch_fields(ops: list[dict[str, Any]]) -> dict[str, Any]:
    """``Batch(ops=ops).model_dump()`` for op maps. Over MAX_BATCH_OPS it takes the reference path, which
    raises the ValidationError a built Batch raises: the fast path never sends what the client refused."""
    if len(ops) > MAX_BATCH_OPS:
        return op_fields(Batch(ops=ops))
    return {"type": "batch", "ops": ops}


def encode_reply(req_id: Optional[int], result: dict[str, Any]) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **result})


def encode_error(req_id: Optional[int], code: str, message: str) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": req_id, "ok": False,
                 "error": {"code": code, "message": message}})
