"""CUDA graphs for every step shape: decode, verify, drafting decode and prefill chunks.

Why: on the H200 an eager forward of Qwen2.5-0.5B costs ~20 ms whatever its token count, all of it
host time (~950 kernel launches at ~7 us, Triton launches at 30-60 us; bench/gpu_profile.py), while
the GPU work of a decode or verify step is well under a millisecond. A graph replays the whole step
with one launch.

A graph is captured per ``GraphKey``: a token bucket (rows padded up to it), a query bound (the
longest per-sequence query block the attention kernel is compiled for: 1 for decode, a power of two
up to 16 for verify, the whole bucket for prefill) and the captured layers (drafter features).
Every graph has ``seqs = min(max_seqs, tokens)`` sequence slots. Padding is inert:
- padded *sequences* have an empty query block (their ``cu_q_lens`` entries repeat the real total),
  so the attention kernel returns before reading anything for them;
- padded *tokens* write no KV (slot -1), get no attention output (their rows are left as they are)
  and are never read back: every other layer is row-wise, and only real rows are sampled or kept.
Graphs are captured into one shared memory pool, largest first where known; their outputs are consumed
before the next replay. The runner warms every decode bucket at start; the engine warms every decode
and verify shape a loaded speculation method can produce (``speculative_keys``) when the method loads,
so no request meets a capture (~100 ms each on the H200, longer than a whole timed run at low load).
Since session 14 the runner also warms prompt chunks at start (``plain_keys``), and the speculative warm-up
their feature-capturing variants; shapes outside the warmed set (odd mixes: a prompt chunk of at most 16
tokens beside verifies) are still captured on first use.

All step metadata travels in two packed host buffers (int64: ids, positions, slots; int32: cu_q_lens,
seq_lens, block tables), so one step costs two host-to-device copies and one graph launch.
"""
from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

import torch

from specd.engine.paged_backend import PagedAttentionBackend, StepMetadata

log = logging.getLogger("specd.cuda_graphs")

DECODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
VERIFY_Q_BOUNDS = (2, 4, 8, 16)   # query bounds of verify-like steps; above 16 a step is a prefill
MAX_GRAPHS = 192                  # beyond this, odd shapes run eagerly rather than pile up graph memory; the
                                  # warm-ups need 84 (plain shapes, one drafter plus ngram, 32 seqs, γ 7,
                                  # prompt chunks included since session 14) to 134 (256 seqs); two feature
                                  # drafters plus ngram need 168 at 32 seqs (raised from 160 for them) and
                                  # 268 at 256, where the warm-up drops prompt shapes first (``warm``)
INT32_CODE = next(c for c in "ilh" if array(c).itemsize == 4)   # array's typecode of a C int32


def write_tables(dst: torch.Tensor, tables: list[list[int]]) -> None:
    """Write each block table into its row of the int32 ``dst`` (entries past a row's length keep their
    values: a step reads only its sequences' own blocks). Through ``array('i')`` and ``frombuffer``:
    ``torch.tensor`` of a Python list costs ~35 ns per entry, and at the agentic load's 22k-token
    contexts (32 × ~1,400 blocks) the per-step tables took 1.75 ms on the CPU machine; this takes 0.57."""
    for i, row in enumerate(tables):
        if row:
            dst[i, : len(row)] = torch.frombuffer(array(INT32_CODE, row), dtype=torch.int32)

@dataclass(frozen=True)
class GraphKey:
    tokens: int                    # padded row count T
    q_bound: int                   # longest query block of any sequence
    capture: tuple[int, ...]       # target layers whose outputs the step returns


@dataclass
class HostStep:
    """One step's inputs on the host, unpadded (built by ModelRunner.prepare)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_q_lens: list[int]           # [B+1]
    seq_lens: list[int]            # [B]
    tables: list[list[int]]        # [B][blocks]
    max_q_len: int


def graph_key(num_tokens: int, num_seqs: int, max_q_len: int, max_seqs: int, max_tokens: int,
              capture: tuple[int, ...]) -> GraphKey | None:
    """The smallest captured shape that holds this step, or None (run it eagerly)."""
    if max_q_len == 1:
        t = next((b for b in decode_buckets(max_seqs) if b >= num_tokens), None)
        return GraphKey(t, 1, capture) if t is not None else None
    q = next((b for b in VERIFY_Q_BOUNDS if b >= max_q_len), None)
    for t in TOKEN_BUCKETS:
        if t > max_tokens:
            return None
        if t >= num_tokens and min(max_seqs, t) >= num_seqs:
            return GraphKey(t, q if q is not None else t, capture)
    return None


def decode_buckets(max_seqs: int) -> list[int]:
    """The decode batch buckets up to ``max_seqs``, and ``max_seqs`` itself (a batch of 20 when the
    engine holds 20 sequences is its fullest decode step, not an eager one)."""
    return sorted({b for b in DECODE_BUCKETS if b <= max_seqs} | {max_seqs})


def decode_keys(max_seqs: int, capture: tuple[int, ...]) -> list[GraphKey]:
    """Every key ``graph_key`` gives a decode step (one query token per sequence) of at most
    ``max_seqs`` sequences."""
    return [GraphKey(b, 1, capture) for b in decode_buckets(max_seqs)]


def verify_keys(max_seqs: int, max_tokens: int, gamma: int, capture: tuple[int, ...]) -> list[GraphKey]:
    """Every key ``graph_key`` gives a verify step: at most ``max_seqs`` sequences of 1 to ``gamma + 1``
    query tokens, at least one of them longer than 1 (else it is a decode step).

    A step whose longest query block is m in (lo, q] (q the query bound, lo the bound below) has
    between m and max_seqs·m tokens, so its token bucket runs from the first bucket > lo to the first
    bucket ≥ max_seqs·min(q, γ + 1), within the step budget. A γ + 1 above 16 makes such steps
    prefill-shaped (query bound = token bucket): those are not enumerated."""
    keys, lo = [], 1
    for q in VERIFY_Q_BOUNDS:
        if lo >= gamma + 1:
            break
        most = max_seqs * min(q, gamma + 1)
        for t in TOKEN_BUCKETS:
            if t > max_tokens:
                break
            if t > lo:
                keys.append(GraphKey(t, q, capture))
            if t >= most:
                break
        lo = q
    return keys


def prefill_keys(max_tokens: int, capture: tuple[int, ...]) -> list[GraphKey]:
    """Every key ``graph_key`` gives a prefill-shaped step (a query block longer than the largest verify
    bound: a prompt chunk, alone or beside decoding and verifying sequences) of at most ``max_tokens``
    tokens: each token bucket above that bound, its query bound the bucket itself.

    Why warmed (session 14): until then prompt shapes were captured on first use, and `bench speedup`'s
    untimed warm-up runs did not meet them all. On the H200 (run AR) 7 of 300 timed runs captured a graph,
    ~100 ms each in runs of ~1 s; coding at c = 8 captured in two of scheduled dspark's three runs, which
    ran 0.82x and 0.86x plain decoding (the third, without, 0.93x)."""
    top = VERIFY_Q_BOUNDS[-1]
    return [GraphKey(t, t, capture) for t in TOKEN_BUCKETS if top < t <= max_tokens]


def speculative_keys(max_seqs: int, max_tokens: int, methods: list[tuple[tuple[int, ...], int]]) -> list[GraphKey]:
    """The target step shapes the loaded speculation methods can produce, beyond plain decoding.

    ``methods``: (capture layers, γ) per loaded method; () for a method that reads no target features
    (ngram). A step captures the union of the layers of the feature methods that draft in it, and its
    longest verify block is 1 + the largest γ among the methods in it, so every non-empty subset of
    methods counts: decode steps with the subset's layers (the feature drafter's first step, or all its
    drafts scheduled to 0; decode steps capturing nothing are the runner's plain ones), verify steps
    with them, and prompt chunks with them (a prompt that captures its features, or capturing decoders
    beside a prompt; prompt chunks capturing nothing are the runner's). Sorted largest first, the order
    they are captured in."""
    keys: set[GraphKey] = set()
    for mask in range(1, 2 ** len(methods)):
        chosen = [m for i, m in enumerate(methods) if mask >> i & 1]
        capture = tuple(sorted({layer for layers, _ in chosen for layer in layers}))
        if capture:
            keys.update(decode_keys(max_seqs, capture))
            keys.update(prefill_keys(max(max_tokens, max_seqs), capture))
        keys.update(verify_keys(max_seqs, max_tokens, max(g for _, g in chosen), capture))
    return sorted(keys, key=lambda k: (k.tokens, k.q_bound, k.capture), reverse=True)


def plain_keys(max_seqs: int, max_tokens: int) -> list[GraphKey]:
    """The shapes of steps that capture nothing and verify nothing: decode at every bucket and prompt
    chunks (``prefill_keys``), warmed by the runner at start."""
    return decode_keys(max_seqs, ()) + prefill_keys(max(max_tokens, max_seqs), ())


class StepGraphs:
    """Static input buffers, the captured graphs and their outputs; one instance per ModelRunner."""

    def __init__(self, model, backend: PagedAttentionBackend, max_seqs: int, max_tokens: int, max_blocks: int,
                 device: torch.device, replay_eagerly: bool = False):
        self.model = model
        # replay_eagerly: run the padded step through the same static buffers without a CUDA graph, so
        # the CPU tests can check the padding rules (CUDA graphs need a GPU).
        self.replay_eagerly = replay_eagerly
        self.backend = backend
        self.max_seqs = max_seqs
        self.max_tokens = max(max_tokens, max_seqs)
        self.max_blocks = max_blocks
        self.device = device
        t, s = self.max_tokens, max_seqs
        self._i64 = torch.zeros(3 * t, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(2 * s + 1 + s * max_blocks, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._h64 = torch.zeros(3 * t, dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(2 * s + 1 + s * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.ids, self.positions, self.slots = self._i64[:t], self._i64[t:2 * t], self._i64[2 * t:]
        self.cu_q_lens = self._i32[: s + 1]
        self.seq_lens = self._i32[s + 1: 2 * s + 1]
        self.block_tables = self._i32[2 * s + 1:].view(s, max_blocks)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph | None, torch.Tensor, list[torch.Tensor]]] = {}
        self.pool = None if replay_eagerly else torch.cuda.graph_pool_handle()
        self.replays = 0
        self.captures = 0          # graphs captured so far (start-up warm-ups included)

    def key(self, step: HostStep, capture: tuple[int, ...]) -> GraphKey | None:
        if max((len(t) for t in step.tables), default=0) > self.max_blocks:
            return None
        return graph_key(len(step.ids), len(step.seq_lens), step.max_q_len, self.max_seqs, self.max_tokens, capture)

    # -- inputs ----------------------------------------------------------------------------------------
    def _load(self, step: HostStep, key: GraphKey) -> None:
        """Write the padded step into the host buffers, then copy both to the device (two copies)."""
        t, n, s = self.max_tokens, len(step.ids), min(self.max_seqs, key.tokens)
        h64, h32 = self._h64, self._h32
        h64[:n] = torch.tensor(step.ids, dtype=torch.int64)
        h64[t:t + n] = torch.tensor(step.positions, dtype=torch.int64)
        h64[2 * t:2 * t + n] = torch.tensor(step.slots, dtype=torch.int64)
        h64[2 * t + n:2 * t + key.tokens] = -1                     # padded tokens write no KV
        b = len(step.seq_lens)
        ms = self.max_seqs
        h32[: b + 1] = torch.tensor(step.cu_q_lens, dtype=torch.int32)
        h32[b + 1: s + 1] = step.cu_q_lens[-1]                      # padded sequences: empty query blocks
        h32[ms + 1: ms + 1 + b] = torch.tensor(step.seq_lens, dtype=torch.int32)
        write_tables(h32[2 * ms + 1:].view(ms, self.max_blocks), step.tables)
        # ids/positions of padded rows keep whatever valid values they last held; slots are -1.
        self._i64[:2 * t + key.tokens].copy_(h64[:2 * t + key.tokens], non_blocking=True)
        self._i32[: 2 * ms + 1 + b * self.max_blocks].copy_(h32[: 2 * ms + 1 + b * self.max_blocks], non_blocking=True)

    def _meta(self, key: GraphKey) -> StepMetadata:
        s = min(self.max_seqs, key.tokens)
        return StepMetadata(self.slots[: key.tokens], self.block_tables[:s], self.cu_q_lens[: s + 1],
                            self.seq_lens[:s], key.q_bound)

    # -- capture and replay ----------------------------------------------------------------------------
    def _forward(self, key: GraphKey) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.backend.set_step(self._meta(key))
        out = self.model(self.ids[: key.tokens], self.positions[: key.tokens], self.backend,
                         capture_layers=list(key.capture))
        return out.hidden, out.captured

    @torch.inference_mode()
    def capture(self, key: GraphKey) -> None:
        if self.replay_eagerly:
            self._store(key, (None, *self._forward(key)))
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                     # warm up: Triton compiles, allocator settles
                self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, captured = self._forward(key)
        self._store(key, (graph, hidden, captured))

    def _store(self, key: GraphKey, entry) -> None:
        self.graphs[key] = entry
        self.captures += 1

    def warm(self, keys: list[GraphKey]) -> int:
        """Capture these shapes now, largest first, so smaller graphs reuse the larger ones' memory.
        Shapes past MAX_GRAPHS are left to run eagerly (logged): decode and verify shapes are kept before
        prompt chunks (a decode shape runs every step; a prompt shape once per prompt), the larger first
        within each. Returns how many were new."""
        fresh = [k for k in dict.fromkeys(keys) if k not in self.graphs]
        fresh = sorted(fresh, key=lambda k: (k.tokens, k.q_bound, k.capture), reverse=True)
        room = max(0, MAX_GRAPHS - len(self.graphs))
        if len(fresh) > room:
            log.warning("graph warm-up: %d shapes past MAX_GRAPHS=%d run eagerly (prompt chunks first, then "
                        "the smallest)", len(fresh) - room, MAX_GRAPHS)
            top = VERIFY_Q_BOUNDS[-1]
            kept = set(sorted(fresh, key=lambda k: (k.q_bound <= top, k.tokens), reverse=True)[:room])
            fresh = [k for k in fresh if k in kept]
        for key in fresh:
            self._inert(key)
            self.capture(key)
        return len(fresh)

    def _inert(self, key: GraphKey) -> None:
        """Warm-up inputs: every row padding (slot -1: no KV written; every query block empty: nothing
        attended), so a warm-up while requests run touches no sequence's cache."""
        s = min(self.max_seqs, key.tokens)
        self.ids[: key.tokens].zero_()
        self.positions[: key.tokens].zero_()
        self.slots[: key.tokens].fill_(-1)
        self.cu_q_lens[: s + 1].zero_()
        self.seq_lens[:s].zero_()

    def can_run(self, key: GraphKey | None) -> bool:
        return key is not None and (key in self.graphs or len(self.graphs) < MAX_GRAPHS)

    @torch.inference_mode()
    def run(self, step: HostStep, key: GraphKey) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay (capturing first if new). Returns views of the graph's outputs for the real rows:
        hidden [T, d] and one [T, d] per captured layer; valid until the next replay."""
        if key not in self.graphs:
            self._load(step, key)                  # warm-up passes read the real inputs (writes: real slots)
            self.capture(key)
        self._load(step, key)
        graph, hidden, captured = self.graphs[key]
        if graph is None:
            hidden, captured = self._forward(key)
        else:
            graph.replay()
        self.replays += 1
        n = len(step.ids)
        return hidden[:n], [c[:n] for c in captured]
