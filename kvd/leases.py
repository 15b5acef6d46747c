"""Leases: who holds which blocks, until when.

A lease pins blocks (read: a lookup's hits; write: allocated GPU slots and the blocks committed
from them). It lives until released, or until its client's TTL passes without a heartbeat; then the
core reclaims it: held blocks are unpinned, uncommitted slots go back to free and are never published.
Only the core mutates leases; the table only keeps ids, owners and deadlines.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvd.block_index import BlockRecord
from kvd.core_types import KvdError
from kvd.types import LeaseId


@dataclass(eq=False)
class Lease:
    id: LeaseId
    client: str
    group: str
    created: float
    held: list[BlockRecord] = field(default_factory=list)  # chain order; refs taken
    writes: set[int] = field(default_factory=set)  # allocated GPU slots not yet committed


class LeaseTable:
    """Live leases by id and by client, plus each client's deadline (renewed by heartbeat)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._leases: dict[LeaseId, Lease] = {}
        self._by_client: dict[str, set[LeaseId]] = {}
        self._deadline: dict[str, float] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases.values()))

    def open(self, client: str, group: str, now: float) -> Lease:
        lease = Lease(LeaseId(self._next), client, group, now)
        self._next += 1
        self._leases[lease.id] = lease
        self._by_client.setdefault(client, set()).add(lease.id)
        self._deadline[client] = now + self.ttl_s
        return lease

    def find(self, lease_id: int) -> Lease:
        """The live lease ``lease_id`` whoever holds it; KvdError("unknown_lease") otherwise."""
        lease = self._leases.get(LeaseId(lease_id)) if isinstance(lease_id, int) else None
        if lease is None:
            raise KvdError("unknown_lease", f"lease {lease_id!r} is not live")
        return lease

    def get(self, client: str, lease_id: int) -> Lease:
        """The live lease ``lease_id`` of ``client``; typed errors for unknown or foreign ids."""
        lease = self.find(lease_id)
        if lease.client != client:
            raise KvdError("not_owner", f"lease {lease_id} belongs to another client")
        return lease

    def close(self, lease: Lease) -> None:
        del self._leases[lease.id]
        ids = self._by_client[lease.client]
        ids.discard(lease.id)
        if not ids:
            del self._by_client[lease.client]

    def heartbeat(self, client: str, now: float) -> int:
        """Renew every lease of ``client``; returns how many it holds."""
        if client in self._by_client:
            self._deadline[client] = now + self.ttl_s
        return len(self._by_client.get(client, ()))

    def expired(self, now: float) -> list[Lease]:
        """Leases of clients whose deadline passed (the caller reclaims them)."""
        dead = [c for c, t in self._deadline.items() if t <= now]
        out: list[Lease] = []
        for c in dead:
            del self._deadline[c]
            out.extend(self._leases[i] for i in sorted(self._by_client.get(c, ())))
        return out

    def deadline(self, client: str) -> float | None:
        return self._deadline.get(client)
