"""Result and hint types of the KvdCore API (docs/design/interfaces.md).

Why a file of its own: the wire layer (kvd/protocol.py, kvd/server.py) and the client import these
without importing the core's logic. Every type has ``to_dict`` returning plain ints, strs, bytes,
floats, lists and dicts, so msgpack can carry it as is. Admin results (stats, top, leases, sessions)
are plain dicts already.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvd.types import BlockHash, BlockId, BlockKind, LeaseId, Tier

ERROR_CODES = frozenset(
    {
        "bad_request",  # a malformed argument (wrong type, negative count, ...)
        "bad_hash",  # a hash that is not 16 bytes
        "bad_chain",  # a commit whose parent is neither None nor a known hash
        "bad_block",  # a block id that does not belong to the lease, or is already committed
        "unknown_group",  # a group never attached
        "group_mismatch",  # re-attach of a group with another block_bytes
        "no_capacity",  # attach when the capacity is already divided among max_groups groups
        "unknown_lease",  # lease id not live (released, reclaimed after its TTL, or never issued)
        "not_owner",  # lease held by another client
        "out_of_blocks",  # every GPU block is leased or pinned
        "timeout",  # wait_ready ran out of time
    }
)


class KvdError(Exception):
    """A typed error the server turns into ``{"ok": false, "error": {"code", "message"}}``.

    ``code`` is one of ERROR_CODES, so clients can branch on it without parsing messages."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class PoolInfo:
    """How a client maps one cache group's GPU pool: a byte tensor ``[gpu_blocks, block_bytes]``.

    kind "shm": ``path`` is a file (in /dev/shm) to map with ``torch.from_file(path, shared=True,
    size=gpu_blocks*block_bytes, dtype=torch.uint8)``. kind "cuda": ``ipc_handle`` holds the fields of
    ``storage._share_cuda_()`` (best effort; untested without a GPU) and ``device`` the CUDA index.
    ``dram_path`` is the DRAM tier's shared file (or None), for clients that read it directly."""

    group: str
    block_bytes: int
    gpu_blocks: int
    kind: Literal["shm", "cuda"]
    path: str | None = None
    ipc_handle: tuple[Any, ...] | None = None
    device: int | None = None
    dram_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ipc_handle"] = list(self.ipc_handle) if self.ipc_handle is not None else None
        return d


@dataclass(frozen=True)
class LookupResult:
    """The longest contiguous present prefix, leased atomically.

    ``hits[i]`` is the GPU slot of the i-th block of the prefix (valid once ready), ``tiers[i]`` the
    tier it was found in (not GPU -> a promotion is in flight), ``ready`` False until every promotion
    has landed (``KvdCore.wait_ready(lease)``). ``lease`` is 0 when nothing hit (nothing to release,
    although releasing 0 is accepted)."""

    lease: LeaseId
    hits: list[BlockId]
    tiers: list[Tier]
    ready: bool
    first: int = 0  # index in the prefix of hits[0]: > 0 for a tail group, whose older blocks are not needed
    # blocks of the prefix, past the hit, that a lower tier holds but no GPU slot could take (every GPU block
    # leased): the hit was cut for want of room, not for want of data. Recomputing them needs as many GPU
    # blocks, so a client whose own requests will release room soon does better to ask again then.
    room_cut: int = 0

    @property
    def num_hits(self) -> int:
        return len(self.hits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease": int(self.lease),
            "hits": [int(b) for b in self.hits],
            "tiers": [int(t) for t in self.tiers],
            "ready": self.ready,
            "first": self.first,
            "room_cut": self.room_cut,
        }


@dataclass(frozen=True)
class JointLookup:
    """A prefix hit across cache groups (``KvdCore.lookup_groups``): ``hit`` blocks, the same end in
    every group; ``results[group]`` leases what that group needs for it (kvd/hybrid_hits.py)."""

    hit: int
    results: dict[str, LookupResult]

    def to_dict(self) -> dict[str, Any]:
        return {"hit": self.hit, "results": {g: r.to_dict() for g, r in self.results.items()}}


@dataclass
class ReleaseHints:
    """What the client knows about the blocks it releases; feeds the reuse policy.

    ``kinds``: per-hash BlockKind (SYSTEM / TOOL_SCHEMA are shared, valued high). ``turn_end``: the
    lease covers a session's last turn so far, its tail will likely be extended. ``expected_return_s``:
    when the session is expected back (think time); the tail is protected until then."""

    session: str | None = None
    kinds: dict[BlockHash, BlockKind] = field(default_factory=dict)
    turn_end: bool = False
    expected_return_s: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ReleaseHints":
        """Build from wire fields; raises KvdError("bad_request") on a malformed value."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise KvdError("bad_request", "hints must be a map")
        try:
            kinds = {BlockHash(bytes(h)): BlockKind(int(k)) for h, k in (d.get("kinds") or {}).items()}
            ret = d.get("expected_return_s")
            session = d.get("session")
            if session is not None and not isinstance(session, str):
                raise TypeError("session must be a string")
            return cls(
                session=session,
                kinds=kinds,
                turn_end=bool(d.get("turn_end", False)),
                expected_return_s=None if ret is None else float(ret),
            )
        except (TypeError, ValueError) as e:
            raise KvdError("bad_request", f"bad hints: {e}") from e


@dataclass
class SessionHint:
    """What kvd remembers about a live session (``KvdCore.sessions()``): its tail block and when it is
    expected back. Only the core mutates it, on release with hints and on tick (expiry)."""

    session: str
    client: str
    tail: BlockHash | None
    blocks: int
    last_seen: float
    expected_return_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "client": self.client,
            "tail": self.tail.hex() if self.tail else None,
            "blocks": self.blocks,
            "last_seen": self.last_seen,
            "expected_return_at": self.expected_return_at,
        }
