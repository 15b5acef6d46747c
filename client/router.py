"""Cache-aware routing across several specd workers (DESIGN.md §3 "Routing").

Each request goes to the worker with the lowest

    cost = new prefill blocks + w x running requests

where "new prefill blocks" is the prompt minus the longest prefix the worker is believed to hold.

Why an approximate index kept by the router, not a query to kvd: the router sees text (or messages),
and kvd keys blocks by token ids under each worker's namespace, so asking kvd needs the tokenizer of
every worker in the router, plus a round trip per worker per request. Instead the router remembers
what it sent where: it chain-hashes the canonical rendering of a request (``kvd.hashing.chain_hashes``
over its UTF-8 bytes, CHUNK_BYTES per link; at ~4 bytes per token a link is about one 16-token KV
block) and records the chain (the prompt, then the prompt plus the answer: the next turn's prefix)
under the worker that served it, in a bounded LRU. It can be wrong only by over-believing (the
worker's cache has since evicted a prefix), which costs a prefill, never a wrong output. Load is the
router's own count of its in-flight requests per worker (exact for traffic through this router).

A worker that does not answer (timeout, unavailable) before its first token is marked down for
``retry_after_s``, and the request is retried on the next best worker.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from client.specd_client import Delta, SpecdClient, SpecdTimeoutError, SpecdUnavailableError
from kvd.hashing import chain_hashes, namespace_root

CHUNK_BYTES = 64            # ~16 tokens of text: one link of the router's chain ~ one KV block
LOAD_WEIGHT = 8.0           # blocks of prefill one running request is worth (decode steps it slows)
MAX_INDEX = 200_000         # chain links remembered per worker (~40 bytes each)
ROOT = namespace_root("router", "utf-8", "", "text", CHUNK_BYTES)


class NoWorker(Exception):
    """Every worker is down (or failed this request)."""


def render(prompt: str | list[int] | None, messages: Sequence[dict] | None) -> bytes:
    """A canonical byte string whose prefixes follow the prompt's: messages as role/content records."""
    if messages is not None:
        return b"".join(f"{m['role']}\x1f{m['content']}\x1e".encode() for m in messages)
    if isinstance(prompt, list):
        return b"".join(t.to_bytes(4, "little") for t in prompt)
    return (prompt or "").encode()


def text_chain(data: bytes) -> list[bytes]:
    return chain_hashes(ROOT, list(data), CHUNK_BYTES)


@dataclass
class Worker:
    """One specd worker as the router sees it. Mutated under the router's lock only."""

    run_dir: Path
    index: OrderedDict[bytes, None] = field(default_factory=OrderedDict)   # chain links sent here (LRU)
    running: int = 0
    assigned: int = 0
    down_until: float = 0.0

    def matched(self, chain: list[bytes]) -> int:
        """Links of ``chain`` this worker holds as a contiguous prefix."""
        n = 0
        for h in chain:
            if h not in self.index:
                break
            n += 1
        return n

    def remember(self, chain: list[bytes]) -> None:
        for h in chain:
            self.index[h] = None
            self.index.move_to_end(h)
        while len(self.index) > MAX_INDEX:
            self.index.popitem(last=False)


class Router:
    """Route generate requests over ``run_dirs`` (each a specd's run directory). Thread-safe."""

    def __init__(self, run_dirs: Sequence[str | Path], *, load_weight: float = LOAD_WEIGHT,
                 timeout_s: float = 30.0, retry_after_s: float = 10.0) -> None:
        self.workers = [Worker(Path(d)) for d in run_dirs]
        self.load_weight = load_weight
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()

    # -- the decision (pure) ----------------------------------------------------------------
    def cost(self, w: Worker, chain: list[bytes]) -> float:
        return (len(chain) - w.matched(chain)) + self.load_weight * w.running

    def rank(self, chain: list[bytes], now: float) -> list[int]:
        """Live workers, cheapest first; ties go to the less loaded, then the less used."""
        live = [i for i, w in enumerate(self.workers) if w.down_until <= now]
        return sorted(live, key=lambda i: (self.cost(self.workers[i], chain), self.workers[i].running,
                                           self.workers[i].assigned, i))

    # -- serving ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               session: str | None = None, **params: Any) -> Iterator[tuple[int, Delta]]:
        """Yield ``(worker index, delta)``; fails over to the next worker if one is down."""
        chain = text_chain(render(prompt, messages))
        tried: set[int] = set()
        while True:
            i = self._pick(chain, tried)
            w = self.workers[i]
            got_any, text = False, []
            try:
                with SpecdClient(w.run_dir, timeout_s=self.timeout_s) as client:
                    for delta in client.stream(prompt, messages=messages, session=session, **params):
                        got_any = True
                        text.append(delta.text)
                        yield i, delta
                self._done(i, chain, prompt, messages, "".join(text))
                return
            except (SpecdTimeoutError, SpecdUnavailableError):
                self._failed(i, down=not got_any)
                if got_any:
                    raise
                tried.add(i)
            except BaseException:
                self._failed(i, down=False)
                raise

    def generate(self, prompt: str | list[int] | None = None, **kw: Any) -> tuple[int, list[Delta]]:
        """Run one request to the end: ``(worker index, deltas)``."""
        out = list(self.stream(prompt, **kw))
        return out[-1][0], [d for _, d in out]

    def _pick(self, chain: list[bytes], tried: set[int]) -> int:
        with self._lock:
            order = [i for i in self.rank(chain, time.monotonic()) if i not in tried]
            if not order:
                raise NoWorker("no specd worker is answering")
            w = self.workers[order[0]]
            w.running += 1
            w.assigned += 1
            w.remember(chain)   # the prefill happens there now: later requests may follow it
            return order[0]

    def _done(self, i: int, chain: list[bytes], prompt: Any, messages: list[dict] | None, answer: str) -> None:
        follow = None
        if messages is not None:
            follow = text_chain(render(None, [*messages, {"role": "assistant", "content": answer}]))
        with self._lock:
            w = self.workers[i]
            w.running -= 1
            if follow:
                w.remember(follow)

    def _failed(self, i: int, down: bool) -> None:
        with self._lock:
            w = self.workers[i]
            w.running -= 1
            if down:
                w.down_until = time.monotonic() + self.retry_after_s
