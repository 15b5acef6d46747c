"""Which prefix ends a set of cache groups can serve together (DESIGN.md §3, "Hybrid attention").

A group either needs every block of a prefix (``tail`` None: full attention) or only its last
``tail`` blocks (a sliding window W over blocks of ``bs`` tokens: ``tail = ceil((W - 1) / bs)``,
since the first query after a hit of h blocks, at position h*bs, sees keys > h*bs - W; a
linear-attention state snapshot: ``tail = 1``, the state stored under the prefix's last block).
A hit of h blocks is valid for a group when the blocks it needs are all present; a joint hit must
be valid for every group. Full-attention validity is downward closed (a prefix of a hit is a hit);
tail validity is not (blocks behind a window may be gone), which is why the joint hit is searched
over every end, not cut at the first gap.
"""
from __future__ import annotations

from typing import Sequence


def needed_from(h: int, tail: int | None) -> int:
    """Index of the first block a hit of ``h`` blocks needs in a group."""
    return 0 if tail is None else max(0, h - tail)


def valid_ends(present: Sequence[bool], tail: int | None) -> list[bool]:
    """``out[h]`` (0 <= h <= len(present)): can a hit of h blocks be served by this group."""
    out = [True]
    run = 0
    for h, p in enumerate(present, start=1):
        run = run + 1 if p else 0
        out.append(run >= h - needed_from(h, tail))
    return out


def tail_blocks(window: int, block_size: int) -> int:
    """Trailing blocks a sliding-window group needs behind a hit (see the module docstring)."""
    return max(1, -(-(window - 1) // block_size))
