"""KeyedGraphs: CUDA graphs of one static computation, captured per shape key, with the eager fallback.

Why one piece: the drafter's block forward (specd/engine/block_graphs.py) and its sampling round
(specd/engine/draft_graphs.py) keep graphs the same way: a bounded dict of keys, capture on first use or
at warm-up (largest first, inert inputs), a key whose capture failed (or every key, with
``replay_eagerly`` on the CPU) runs the same static computation without a graph, and counters for the
benchmarks. A subclass supplies the computation (``_body``) and the inert inputs a warm-up captures on
(``_inert``); loading real inputs and reading the outputs stay with it.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

log = logging.getLogger("specd.keyed_graphs")


def capture_graph(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """Two warm-up calls on a side stream (the allocator settles), then ``fn`` captured into ``pool``.
    Raises RuntimeError when an op cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


def capture_or_none(fn: Callable[[], None], pool, what: str) -> torch.cuda.CUDAGraph | None:
    """``capture_graph``, or None (logged) when an op cannot be captured here: the caller then serves that
    shape by running ``fn``'s static computation eagerly, so a capture problem never fails a step."""
    try:
        return capture_graph(fn, pool)
    except RuntimeError as exc:
        log.warning("%s: capture failed (%s); it runs eagerly", what, exc)
        torch.cuda.synchronize()
        return None


class KeyedGraphs:
    """``limit``: at most this many keys hold a graph; past it, new shapes run eagerly. ``what``: the
    name in logs ("block forward", "draft round")."""

    def __init__(self, limit: int, what: str, replay_eagerly: bool, pool) -> None:
        self.limit, self.what, self.replay_eagerly = limit, what, replay_eagerly
        self.pool = pool
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph | None] = {}
        self.replays = 0
        self.captures = 0             # keys captured so far (load-time warm-ups included)
        self.capture_failures = 0     # keys whose capture raised: they run the static computation eagerly

    def _body(self, drafter, key) -> None:
        """The static computation on the static buffers (what a graph captures)."""
        raise NotImplementedError

    def _inert(self, key) -> None:
        """Inputs a warm-up capture may run on: every value finite on every path."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, drafter, key) -> None:
        self.captures += 1
        if self.replay_eagerly:
            self.graphs[key] = None
            return
        self.graphs[key] = capture_or_none(lambda: self._body(drafter, key), self.pool, f"{self.what} {key}")
        self.capture_failures += self.graphs[key] is None

    @torch.inference_mode()
    def warm(self, drafter, keys: list) -> int:
        """Capture these keys now on inert inputs (largest first, so smaller graphs reuse their memory),
        up to ``limit``. Returns how many were new."""
        fresh = [k for k in dict.fromkeys(keys) if k not in self.graphs]
        room = max(0, self.limit - len(self.graphs))
        if len(fresh) > room:
            log.warning("%s warm-up: %d keys past the limit of %d run eagerly", self.what, len(fresh) - room,
                        self.limit)
            fresh = fresh[:room]
        for key in fresh:
            self._inert(key)
            self.capture(drafter, key)
        return len(fresh)

    def can_run(self, key) -> bool:
        return key is not None and (key in self.graphs or len(self.graphs) < self.limit)

    def replay(self, drafter, key) -> None:
        """Run ``key``'s computation on the loaded inputs: capture it first if new (its warm-up passes read
        those inputs), then replay the graph, or run the body eagerly where there is none."""
        if key not in self.graphs:
            self.capture(drafter, key)
        graph = self.graphs[key]
        if graph is None:
            self._body(drafter, key)
        else:
            graph.replay()
        self.replays += 1
