"""CUDA graphs for EAGLE-3's draft: γ sequential drafter steps, each with the LM head and its slot's sampling.

Why: EAGLE-3 drafts token by token, so its draft is γ passes of the drafter layer, the final norm, the
target's LM head and the sampler, each feeding the next. Run eagerly that is ~100 host launches a pass.
H100, session 41, run DN (docs/results/speedup.md): `bench speedup`'s schedule phase, where the draft
runs, took 13.5-17.7 ms a step at c = 1 and 35-43 ms at c = 32 for `eagle3`, against 0.9-1.2 ms at c = 1
and 2.6-4.4 ms at c = 32 for `dflash-g7`, whose round replays from graphs (coding, extraction); the
`eagle3` row ran at 0.13-0.18x plain decoding.
Replayed, the γ passes are one launch, plus the fill below.

What runs where, per draft of B requests:
- host: anchors, context lengths, top-k and row kinds packed into one pinned int64 buffer; temperature,
  top-p and the uniforms (drawn from each request's generator exactly as ``SlotSampler`` draws them) into
  one pinned fp32 buffer; two host-to-device copies;
- the kept-back features (``tails``, one [1, d] per request) into a static [Bmax, d] buffer, one copy;
- one ``_foreach_copy_`` (context_cache.copy_into_rows): every request's context K/V into row i of static
  padded buffers [Bp, S, Hkv, D];
- the graph (``Eagle3Drafter.padded_draft`` on the static buffers): γ steps, each the layer over
  [context K/V ; the row's own drafted keys], the LM head, and ``draft_graphs.sample_slot``; tokens
  [Bp, γ] and probs [Bp, γ, V] land in static outputs.

Exactness: the LM head sits inside the loop (each step's token feeds the next), so it runs padded, unlike
the block drafters' round (``DraftGraphs.load`` keeps theirs eager at the exact batch). What verification
needs is that the probabilities returned are exactly those each token was drawn from, and they are: both
come from the one captured computation. Against the eager reference (``Eagle3Drafter.draft_contexts``) a
real row can differ in rounding (padding rows and context positions, other BLAS kernels), never in kind;
the tests bound it.

A graph is captured per ``Eagle3GraphKey``: the batch bucket (draft_graphs.bucket), the context bucket
(block_graphs.context_buckets) and the sampling path (``SamplingPath``). Every batch bucket x ~8 context
buckets x 5 paths is too many keys to warm (a capture on the request path costs ~100 ms: the speculative
warm-up in docs/design/speculation.md), so the proposer's warm-up captures the common ones
(``warm_keys``: every batch bucket, contexts up to ``WARM_CONTEXT``, the greedy, top-p and mixed paths
that chat traffic and the benchmark workloads use, 81 keys at 256 sequences) and any other key is captured
at its first use, up to ``MAX_EAGLE3_GRAPHS``; later keys, batches past the engine's batch, contexts past
its limit or past the static capacity run the eager reference. The warm-up's cost is not measured yet
(the engine's log line says how long it took). Padding rows are inert: length 0, anchor 0, a zero tail,
greedy-coded; their outputs are never read. Outputs are views of buffers shared by every graph of the
instance, valid until the next draft (through this step's verification, ``Draft.origin``).

Memory: the static K/V hold ``capacity`` positions ([2, capacity, Hkv, D], one layer): 128 MiB at the
default 2^18 for Qwen2.5-0.5B's drafter shape (2 KV heads of 64, bf16); the probs output is
[Bmax, γ, V] fp32 as ``DraftGraphs``'s; graph intermediates live in the instance's graph pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.drafter.base import DraftOutput
from specd.drafter.context_cache import DraftContext, copy_into_rows
from specd.engine.block_graphs import MAX_CONTEXT_TOKENS, block_graph_key, context_buckets
from specd.engine.draft_graphs import BATCH_BUCKETS, float_settings, pack_floats
from specd.engine.keyed_graphs import KeyedGraphs
from specd.engine.sampler import GREEDY_ROW, SamplingPath, row_kind_codes
from specd.sampling_params import SamplingParams

MAX_EAGLE3_GRAPHS = 96     # keys holding a graph: the warm-up's (81 at 256 sequences) and some room
WARM_CONTEXT = 1024        # the longest context bucket warmed (the benchmark's first turns are < 1K tokens)
WARM_PATHS = (SamplingPath(greedy=True), SamplingPath(top_p=True), SamplingPath(greedy=True, top_p=True))


@dataclass(frozen=True)
class Eagle3GraphKey:
    batch: int                 # padded row count Bp
    context: int               # padded context length S
    path: SamplingPath         # which sampling transforms the graph computes


@dataclass
class SlotSettings:
    """Each row's sampling settings, [Bp] each (uniforms [Bp, γ]): what ``draft_graphs.sample_slot`` reads."""

    top_k: Tensor              # int64
    kind: Tensor               # int64 row kind codes (sampler.row_kind_codes)
    temperature: Tensor        # fp32, 1.0 on greedy and padding rows
    top_p: Tensor              # fp32
    uniforms: Tensor           # fp32, 0 on greedy and padding rows


class Eagle3Graphs(KeyedGraphs):
    """Static inputs, captured drafts and their shared outputs; one instance per EAGLE-3 drafter.

    ``replay_eagerly``: run ``padded_draft`` on the same static buffers without a CUDA graph (the CPU
    tests). ``blocks`` and ``absorbs`` are None: the proposer's warm-up and counters treat every round
    object alike (specd/engine/proposers.py)."""

    blocks = None
    absorbs = None

    def __init__(self, drafter, max_batch: int, max_len: int, device: torch.device, replay_eagerly: bool = False,
                 capacity: int = MAX_CONTEXT_TOKENS):
        c, cfg = drafter.config.backbone(), drafter.config
        self.max_batch, self.gamma, self.vocab = max_batch, cfg.gamma, cfg.vocab_size
        self.buckets = context_buckets(max_len)
        self.capacity = min(capacity, max_batch * self.buckets[-1])
        dtype = drafter.fc.weight.dtype
        b, g = max_batch, cfg.gamma
        self._kv = torch.zeros(2, self.capacity, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self._tails = torch.zeros(b, cfg.hidden_size, dtype=dtype, device=device)
        self._ints = torch.zeros(4 * b, dtype=torch.int64, device=device)      # anchors, lens, top_k, kind
        self._h_ints = torch.zeros(4 * b, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._floats, self._h_floats = float_settings(b, g, device)          # temperature, top_p, u
        self.tokens = torch.zeros(b, g, dtype=torch.int64, device=device)
        self.probs = torch.zeros(b, g, cfg.vocab_size, dtype=torch.float32, device=device)
        super().__init__(MAX_EAGLE3_GRAPHS, "eagle3 draft", replay_eagerly,
                         None if replay_eagerly else torch.cuda.graph_pool_handle())
        self.eager_drafts = 0         # drafts no key held (too many rows, too long a context, past the limit)

    @property
    def memory_bytes(self) -> int:
        """The static context K/V and the probs output (graph intermediates are in the pool, not counted)."""
        return sum(t.numel() * t.element_size() for t in (self._kv, self.probs))

    def key(self, contexts: Sequence[DraftContext], params: Sequence[SamplingParams]) -> Eagle3GraphKey | None:
        shape = block_graph_key([c.n for c in contexts], self.max_batch, self.buckets, self.capacity)
        if shape is None:
            return None
        return Eagle3GraphKey(shape.batch, shape.context, SamplingPath.of(params, self.vocab))

    def warm_keys(self) -> list[Eagle3GraphKey]:
        """Every batch bucket x the context buckets up to ``WARM_CONTEXT`` x ``WARM_PATHS``, within the static
        capacity, largest first (smaller graphs then reuse the pool's memory)."""
        batches = sorted({b for b in (*BATCH_BUCKETS, self.max_batch) if b <= self.max_batch}, reverse=True)
        contexts = [c for c in self.buckets if c <= WARM_CONTEXT] or self.buckets[:1]
        keys = [Eagle3GraphKey(b, c, p) for b in batches for c in contexts for p in WARM_PATHS
                if b * c <= self.capacity]
        return sorted(keys, key=lambda k: (k.batch * k.context, k.batch), reverse=True)

    def context(self, key: Eagle3GraphKey) -> tuple[Tensor, Tensor]:
        """(k, v) [Bp, S, Hkv, D]: views of the first Bp·S static positions."""
        n, shape = key.batch * key.context, (key.batch, key.context, *self._kv.shape[2:])
        return self._kv[0, :n].view(shape), self._kv[1, :n].view(shape)

    def settings(self, batch: int) -> SlotSettings:
        b, g, bm, i, f = batch, self.gamma, self.max_batch, self._ints, self._floats
        return SlotSettings(i[2 * bm:2 * bm + b], i[3 * bm:3 * bm + b], f[:b], f[bm:bm + b],
                            f[2 * bm:2 * bm + b * g].view(b, g))

    # -- inputs ----------------------------------------------------------------------------------------
    def load(self, contexts: Sequence[DraftContext], tails: Sequence[Tensor], last_tokens: Sequence[int],
             params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
             key: Eagle3GraphKey) -> None:
        """Anchors, lengths and settings packed on the host (padding rows inert), two copies; the tails in
        one copy; every context's K/V in one foreach copy."""
        n, bm, bp, hi = len(params), self.max_batch, key.batch, self._h_ints
        for at in (0, bm, 2 * bm):                                    # anchors, lengths, top-k: 0
            hi[at:at + bp] = 0
        hi[3 * bm:3 * bm + bp] = GREEDY_ROW
        hi[:n] = torch.tensor(list(last_tokens), dtype=torch.int64)
        hi[bm:bm + n] = torch.tensor([c.n for c in contexts], dtype=torch.int64)
        hi[2 * bm:2 * bm + n] = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        hi[3 * bm:3 * bm + n] = torch.tensor(row_kind_codes(params, self.vocab), dtype=torch.int64)
        self._ints.copy_(hi, non_blocking=True)
        pack_floats(self._h_floats, self._floats, params, generators, bm, bp, self.gamma)
        self._tails[:n].copy_(torch.cat(list(tails)))
        self._tails[n:bp].zero_()
        copy_into_rows(contexts, [(self._kv[0], self._kv[1])], key.context)

    def _inert(self, key: Eagle3GraphKey) -> None:
        """Every row padding: anchor 0, length 0, a zero tail, greedy-coded, temperature and top-p 1."""
        bm, bp = self.max_batch, key.batch
        self._ints.zero_()
        self._ints[3 * bm:3 * bm + bp] = GREEDY_ROW
        self._floats.zero_()
        self._floats[:bp] = 1.0
        self._floats[bm:bm + bp] = 1.0
        self._tails[:bp].zero_()

    # -- capture and replay ----------------------------------------------------------------------------
    def _body(self, drafter, key: Eagle3GraphKey) -> None:
        bp, bm = key.batch, self.max_batch
        tokens = drafter.padded_draft(self._tails[:bp], self._ints[:bp], self._ints[bm:bm + bp], self.context(key),
                                      self.settings(bp), key.path, self.probs[:bp])
        self.tokens[:bp].copy_(tokens)

    @torch.inference_mode()
    def run(self, drafter, contexts: Sequence[DraftContext], tails: Sequence[Tensor], last_tokens: Sequence[int],
            params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> DraftOutput:
        """The draft of these requests: tokens [B, γ] and probs [B, γ, V], views of the shared outputs valid
        until the next draft. Shapes no graph holds run the eager reference (``draft_contexts``)."""
        key = self.key(contexts, params)
        if not self.can_run(key):
            self.eager_drafts += 1
            return drafter.draft_contexts(contexts, tails, last_tokens, params, generators)
        self.load(contexts, tails, last_tokens, params, generators, key)
        self.replay(drafter, key)
        n = len(params)
        return DraftOutput(tokens=self.tokens[:n], probs=self.probs[:n], confidence=None)
