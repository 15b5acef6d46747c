"""Release hints specd sends kvd: what each block holds and when its session is expected back.

kvd's ``reuse`` policy (kvd/eviction/reuse.py) values a block by how likely it is to be read again.
Two things only the engine knows sharpen that guess:

- **Block kinds.** Blocks fully inside the system prompt are SYSTEM, blocks inside the tool schemas
  (or straddling the system/tools boundary: still inside the prefix every session of the application
  shares) are TOOL_SCHEMA, the rest CONVERSATION. The spans come with the request
  (``Request.prefix_kinds``; specd/server.py derives them from the chat template).
- **Expected return time.** A finished turn's blocks are the prefix of the session's next turn, which
  comes back after the user's (or the tool's) think time. kvd protects them until then. The time is
  learned from observed gaps (next turn's arrival minus the previous turn's end): per session (an EWMA,
  the session's own rhythm) and per session class (the median of recent gaps of every session sharing
  the same system prompt + tools prefix: one application, one think-time distribution), falling back to
  a per-deployment default for the first turn of a class never seen. A request may also carry
  ``expected_return_s`` (the client knows best), which wins.

Pure logic, owned by the engine thread; ``SessionHints`` forgets the oldest sessions beyond a bound so
a long-running server does not grow without limit.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kvd.types import BlockHash, BlockKind
from specd.chat_template import ChatTemplateError

DEFAULT_RETURN_S = 30.0      # first turn of an unseen class: a typical chat think time
MAX_RETURN_S = 3600.0        # kvd's protocol bound on expected_return_s (kvd/protocol.py Seconds)
SESSION_ALPHA = 0.5          # EWMA weight of the newest gap: think times drift within a session
CLASS_WINDOW = 64            # gaps kept per class for the median
MAX_SESSIONS = 65536         # sessions remembered (LRU); ~100 bytes each
DEFAULT_CLASS = "*"          # requests without a shared prefix: the deployment-wide class

SHARED_KINDS = (BlockKind.SYSTEM, BlockKind.TOOL_SCHEMA)


def block_kinds(hashes: Sequence[BlockHash], prefix_kinds: Sequence[tuple[int, int]] | None,
                block_size: int) -> dict[BlockHash, BlockKind]:
    """Kind of every full block ``hashes[i]`` (tokens ``[i*bs, (i+1)*bs)``).

    ``prefix_kinds`` lists consecutive ``(token_count, BlockKind)`` spans from token 0. A block is
    SYSTEM if it ends inside the SYSTEM spans, TOOL_SCHEMA if it ends inside the shared prefix (SYSTEM
    and TOOL_SCHEMA spans together) but not inside SYSTEM alone, CONVERSATION otherwise."""
    system_end, shared_end, pos = 0, 0, 0
    for count, kind in prefix_kinds or ():
        pos += count
        if kind == BlockKind.SYSTEM and system_end == pos - count:
            system_end = pos
        if kind in SHARED_KINDS and shared_end == pos - count:
            shared_end = pos
    out: dict[BlockHash, BlockKind] = {}
    for i, h in enumerate(hashes):
        end = (i + 1) * block_size
        if end <= system_end:
            out[h] = BlockKind.SYSTEM
        elif end <= shared_end:
            out[h] = BlockKind.TOOL_SCHEMA
        else:
            out[h] = BlockKind.CONVERSATION
    return out


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


EncodeChat = Callable[..., list[int]]  # Tokenizer.encode_chat(messages, add_generation_prompt, tools=...)


def chat_prefix_kinds(encode_chat: EncodeChat, messages: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int],
                      tools: list[dict] | None = None) -> list[tuple[int, int]] | None:
    """The SYSTEM and TOOL_SCHEMA spans of a chat prompt, in tokens.

    How the boundary is found without knowing the template: render only the leading system messages
    (and, for the tools span, the same plus the tool schemas), encode, and take the longest common
    token prefix with the real prompt. Whatever a template puts around the system text (Qwen's
    ``<|im_start|>system``, the tools block it appends inside the system turn), the common prefix is
    exactly the part every request with the same system prompt (and tools) shares; a BPE merge across
    the boundary only makes the span a token shorter. A template that refuses a system-only chat gives
    no spans (all blocks stay CONVERSATION), never an error."""
    system = []
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            break
        system.append(dict(m))
    try:
        system_len = common_prefix_len(prompt_ids, encode_chat(system, add_generation_prompt=False)) if system else 0
        shared_len = system_len
        if tools:
            head = system or [{"role": "user", "content": ""}]
            shared_len = common_prefix_len(prompt_ids, encode_chat(head, add_generation_prompt=False, tools=tools))
    except ChatTemplateError:
        return None
    spans = [(system_len, int(BlockKind.SYSTEM)), (max(0, shared_len - system_len), int(BlockKind.TOOL_SCHEMA))]
    return [s for s in spans if s[0] > 0] or None


def session_class(kinds: dict[BlockHash, BlockKind], hashes: Sequence[BlockHash]) -> str:
    """The class of a session: its last shared-prefix block (one application = one system prompt and
    tool set), or the deployment-wide class when the prompt has no full shared block."""
    shared = [h for h in hashes if kinds.get(h) in SHARED_KINDS]
    return shared[-1].hex() if shared else DEFAULT_CLASS


@dataclass
class _SessionState:
    klass: str
    ended_at: float              # when the session's last turn finished (engine clock)
    ewma_s: float | None = None  # the session's own gap estimate, once one gap was seen


class ReturnTimeModel:
    """Learns how long sessions stay away between turns; see the module docstring."""

    def __init__(self, default_s: float = DEFAULT_RETURN_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.default_s = default_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()
        self._class_gaps: dict[str, deque[float]] = {}

    def turn_finished(self, session: str, klass: str, arrival_s: float, now: float) -> float:
        """Record a finished turn that arrived at ``arrival_s``; returns the expected think time
        before the session's next turn."""
        state = self._sessions.pop(session, None)
        if state is not None and arrival_s >= state.ended_at:
            self._observe(state, arrival_s - state.ended_at)
        if state is None:
            state = _SessionState(klass, now)
        state.klass, state.ended_at = klass, now
        self._sessions[session] = state
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return self.expected(session)

    def _observe(self, state: _SessionState, gap: float) -> None:
        state.ewma_s = gap if state.ewma_s is None else SESSION_ALPHA * gap + (1 - SESSION_ALPHA) * state.ewma_s
        self._class_gaps.setdefault(state.klass, deque(maxlen=CLASS_WINDOW)).append(gap)

    def expected(self, session: str) -> float:
        """The session's own EWMA, else its class median, else the deployment default."""
        state = self._sessions.get(session)
        if state is None:
            return self.default_s
        if state.ewma_s is not None:
            return state.ewma_s
        gaps = self._class_gaps.get(state.klass)
        return statistics.median(gaps) if gaps else self.default_s


class SessionHints:
    """Builds the ``hints`` dict of kvd's release (kvd/core_types.py ReleaseHints) for a finished
    sequence. Owned by the engine; called from ``SpecEngine._finish`` only."""

    def __init__(self, block_size: int, model: ReturnTimeModel | None = None) -> None:
        self.block_size = block_size
        self.returns = model or ReturnTimeModel()

    def release_hints(self, hashes: Sequence[BlockHash], prefix_kinds: Sequence[tuple[int, int]] | None,
                      session: str | None, arrival_s: float, now: float,
                      expected_return_s: float | None = None) -> dict | None:
        """Hints for the leases of a finished turn; None when there is nothing to say."""
        kinds = block_kinds(hashes, prefix_kinds, self.block_size)
        hints: dict = {}
        if kinds:
            hints["kinds"] = {bytes(h): int(k) for h, k in kinds.items()}
        if session is not None:
            learned = self.returns.turn_finished(session, session_class(kinds, hashes), arrival_s, now)
            expect = learned if expected_return_s is None else expected_return_s
            hints.update(session=session, turn_end=True, expected_return_s=float(min(max(expect, 0.0), MAX_RETURN_S)))
        return hints or None
