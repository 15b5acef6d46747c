"""Which prompts can hit at all: the first-block hashes kvd holds, mirrored in specd.

Why: a prefix hit starts at block 0, so a prompt whose first block kvd does not hold cannot hit, and its
lookup is a wasted blocking round trip at admission. At a 0% hit rate those round trips were most of the
waited kvd time on the H200 (run BO: 0.25 of 0.29 s, 1.8 ms each, in the prompt steps that admit).
The mirror only ever skips lookups that would have missed, or misses a hit for a moment:
- a root committed by another client (a second worker) is seen at the next refresh (``refresh_s``);
  until then that prompt recomputes, which is a lost hit, never a wrong block (no lookup, no block read);
- a root kvd has evicted stays in the mirror until the refresh: the lookup then goes and misses, as before.
With no answer yet, after an error, or for a group kvd cannot filter (a sliding-window group serves hits
without their first blocks), every prompt is looked up.

Pure logic: the source (specd/engine/kvd_source.py) posts the refresh and feeds the answers in.
"""
from __future__ import annotations

from typing import Any

REFRESH_S = 0.05    # how stale another worker's new prefixes may be; one small posted op per interval
RESYNC_S = 10.0     # the whole set again: drops our own roots that kvd refused or evicted before the ask


class RootFilter:
    def __init__(self, refresh_s: float = REFRESH_S, resync_s: float = RESYNC_S) -> None:
        self.refresh_s, self.resync_s = refresh_s, resync_s
        self._full_at = float("-inf")            # when the last whole-set answer was asked for
        self.roots: set[bytes] | None = None     # None: unknown, every prompt is looked up
        self.version: int | None = None
        self.enabled = True                      # False for good once kvd says the group cannot be filtered
        self._asked_at = float("-inf")
        self._in_flight = False
        self._added_since_ask: set[bytes] = set()   # our own roots committed after the ask: not in its answer
        self.skipped = 0                             # lookups not sent (stats)
        self.unreported = [0, 0]                     # [lookups, blocks] skipped since the last ask: kvd counts them

    def may_hit(self, hashes: list[bytes]) -> bool:
        """False only when the mirror is known and lacks ``hashes[0]``: a lookup would miss. The miss is
        counted, and the next ask reports it, so kvd's hit rate still counts every lookup."""
        if self.roots is None or not hashes or bytes(hashes[0]) in self.roots:
            return True
        self.skipped += 1
        self.unreported[0] += 1
        self.unreported[1] += len(hashes)
        return False

    def committed(self, first: bytes) -> None:
        """A root we commit ourselves is hittable at once (the next turn of a session follows its commit).
        kvd may refuse or later evict it: the lookup then goes and misses, as without the filter."""
        if self.roots is not None:
            self.roots.add(first)
        if self._in_flight:
            self._added_since_ask.add(first)

    def due(self, now: float, urgent: bool = False) -> bool:
        """Ask now? ``urgent``: the ask carries news kvd needs at once (the source's first block price)."""
        return (self.enabled or urgent) and not self._in_flight and (urgent or now - self._asked_at >= self.refresh_s)

    def asked(self, now: float) -> int | None:
        """Book an ask sent now (it carries ``unreported``, then zeroed); returns the ``known`` version to
        send (None: send the whole set)."""
        self._asked_at, self._in_flight = now, True
        self._added_since_ask.clear()
        self.unreported = [0, 0]
        if self.roots is None or now - self._full_at >= self.resync_s:
            self._full_at = now
            return None
        return self.version

    def answered(self, out: Any) -> None:
        """kvd's ``roots`` answer (a dict: the whole set, or the change since the version we sent), or the
        error it sent (anything else): forget the mirror, every prompt is looked up until the next answer."""
        self._in_flight = False
        if not isinstance(out, dict) or not out.get("filterable", False):
            if isinstance(out, dict):
                self.enabled = False        # kvd cannot filter this group; it will not start to
            self.roots = self.version = None
            return
        if out.get("roots") is not None:
            self.roots = {bytes(h) for h in out["roots"]} | self._added_since_ask
        elif self.roots is not None and out.get("since") == self.version:
            self.roots.difference_update(bytes(h) for h in out.get("removed", ()))
            self.roots.update(bytes(h) for h in out.get("added", ()))
            self.roots |= self._added_since_ask     # ours, committed after kvd answered (not in its change)
        else:                               # a change from a version we do not hold: ask again in full
            self.roots = self.version = None
            return
        self.version = out.get("version")
        self._added_since_ask.clear()
