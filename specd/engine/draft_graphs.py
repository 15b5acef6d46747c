"""CUDA graphs for a block drafter's sampling round: Markov loop, per-slot sampling, confidence head.

Why: on the H200 an eager op costs ~7 us of host time whatever its size. The Markov loop of γ = 7
slots (Markov bias, the sampling transform, inverse CDF, one-hot) is 100-200 ops: it took 27-41% of a
round on a Qwen3-8B shape (docs/results/speedup.md), the paper's loop ≤ 1.3%. Replayed, it is one launch.

What runs where, per round of B requests:
- the drafter's block forward: replayed from its own graph per (batch, context-length) bucket
  (specd/engine/block_graphs.py, ``blocks``), writing the static hidden buffer in place; eager
  (``draft_hidden``) without block graphs or past their buckets;
- eager, at the exact batch: the LM head, written by ``torch.mm(out=)`` straight into the static logits
  buffer (cuBLAS and MKL pick kernels by the row count, so a padded LM head would round differently from
  the eager reference; one launch);
- host: the uniforms, drawn from each request's own generator exactly as ``SlotSampler`` draws them,
  and the per-row settings, packed into two host buffers and copied in two copies;
- the graph (``markov_round`` on the static buffers): for each slot the Markov bias of the token drawn
  at the slot before, then, where the path has only greedy and unfiltered rows, one fused call
  (kvspec_kernels/markov_slot.py: the bf16 base logits and bias read twice, the fp32 probabilities written
  once, the inverse-CDF draw), else the scaled logits (one launch) and ``sampler.static_probs`` (every
  transform the key's ``SamplingPath`` names, on every row, chosen per row by ``where``) and the inverse
  CDF; at the end the confidence head's logits;
- eager, at the exact batch: the confidence's sigmoid (one launch: CPU vector kernels round the tail of
  a tensor differently from its body, so a sigmoid over 16 padded rows changed the confidences of 12
  real ones in the last bit).

A graph is captured per ``DraftGraphKey``: the batch bucket (a power of two up to the engine's batch)
and the sampling path, which the host decides from the requests' settings (all greedy, top-k with its
largest k, plain softmax, top-p, or any mix of them). The common keys (``warm_keys``) are captured when
the proposer loads; other paths (another top-k, rarer mixes) are captured on first use. Padding rows are inert: greedy-coded, temperature
1, their outputs are never read. Outputs (tokens [B, γ], probs [B, γ, V], confidence [B, γ]) are views
of buffers shared by every graph of the instance: valid until the next round, i.e. through this step's
verification (``Draft.origin``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from kvspec_kernels.markov_slot import plain_slot, slot_logits
from specd.drafter.base import BlockOut, DraftOutput
from specd.engine.keyed_graphs import KeyedGraphs
from specd.engine.sampler import GREEDY_ROW, SamplingPath, draw_uniforms, inverse_cdf, row_kind_codes, static_probs
from specd.sampling_params import SamplingParams

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_DRAFT_GRAPHS = 48     # beyond this, odd paths run eagerly rather than pile up graph memory (warm-up: 5 paths
                          # x 6 buckets at 32 requests, x 9 at 256)
WARM_TOP_K = 20           # the top-k path warmed at load: the k of the repo's own sampled tests and profiles
# The paths warmed at load. The bench workloads sample with top-p (0.9, 0.95) or greedily (extraction,
# unique), so the mixed path served when greedy and sampled requests share a batch is greedy + top-p.
WARM_PATHS = (SamplingPath(greedy=True), SamplingPath(plain=True), SamplingPath(max_k=WARM_TOP_K),
              SamplingPath(top_p=True), SamplingPath(greedy=True, top_p=True))


@dataclass(frozen=True)
class DraftGraphKey:
    batch: int                 # padded row count
    path: SamplingPath         # which sampling transforms the graph computes


@dataclass
class RoundInputs:
    """The static inputs of one round, [Bp] rows each (views of the packed device buffers)."""

    logits: Tensor             # [Bp, γ, V] LM-head output in the model dtype (upcast inside)
    hidden: Tensor             # [Bp, γ, d] final-normed draft hidden states (confidence head)
    anchors: Tensor            # [Bp] int64: the last known token of each request
    top_k: Tensor              # [Bp] int64
    kind: Tensor               # [Bp] int64 row kind codes (sampler.row_kind_codes)
    temperature: Tensor        # [Bp] fp32, 1.0 on greedy and padding rows
    top_p: Tensor              # [Bp] fp32
    uniforms: Tensor           # [Bp, γ] fp32, 0 on greedy and padding rows


def bucket(batch: int, max_batch: int) -> int | None:
    """The smallest captured batch that holds ``batch`` rows, or None (run eagerly)."""
    return next((b for b in (*BATCH_BUCKETS, max_batch) if batch <= b <= max_batch), None)


def draft_graph_key(params: Sequence[SamplingParams], max_batch: int, vocab: int) -> DraftGraphKey | None:
    """The key of the round that drafts for these requests' rows, or None (more rows than any graph)."""
    b = bucket(len(params), max_batch)
    return None if b is None else DraftGraphKey(b, SamplingPath.of(params, vocab))


def warm_keys(max_batch: int, vocab: int) -> list[DraftGraphKey]:
    """Every batch bucket up to ``max_batch`` times the warmed sampling paths (a top-k at or above the
    vocabulary is no top-k: left out), largest first."""
    buckets = sorted({b for b in (*BATCH_BUCKETS, max_batch) if b <= max_batch}, reverse=True)
    return [DraftGraphKey(b, p) for b in buckets for p in WARM_PATHS if p.max_k < vocab]


def float_settings(max_batch: int, gamma: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The device buffer of the rows' float settings and its pinned host twin, laid out [temperature Bmax |
    top-p Bmax | uniforms Bmax·γ] (``pack_floats``)."""
    n = 2 * max_batch + max_batch * gamma
    return (torch.zeros(n, dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.float32, pin_memory=device.type == "cuda"))


def pack_floats(host: Tensor, device: Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], max_batch: int, batch: int, gamma: int) -> None:
    """Each row's temperature (1.0 on greedy and padding rows), top-p (1.0 on padding) and γ uniforms (0 on
    greedy and padding rows; the sampled rows' drawn from their own generators in the same order as
    ``SlotSampler`` draws them) into the host buffer, then one copy of the first ``batch`` rows' worth."""
    n, bm, bp, g = len(params), max_batch, batch, gamma
    host[:bp] = 1.0
    host[bm:bm + bp] = 1.0
    host[:n] = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
    host[bm:bm + n] = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    u = host[2 * bm:2 * bm + bp * g].view(bp, g)
    u.zero_()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        u[sampled] = draw_uniforms([generators[i] for i in sampled], g)
    device[: 2 * bm + bp * g].copy_(host[: 2 * bm + bp * g], non_blocking=True)


def sample_slot(logits: Tensor, x, path: SamplingPath, k: int, probs_out: Tensor, bias: Tensor | None = None,
                greedy: Tensor | None = None) -> Tensor:
    """Slot ``k`` of a static round: each row's sampling distribution from ``logits`` [Bp, V] (any float
    dtype; a DSpark slot's base logits, with its Markov ``bias`` [Bp, V] added in fp32) written into
    ``probs_out[:, k]``, and its token [Bp]: a greedy row the argmax, a sampled row the inverse CDF at its
    uniform for slot k. ``x``: the rows' settings (``RoundInputs``, or EAGLE-3's ``SlotSettings``: ``top_k``,
    ``kind``, ``temperature``, ``top_p``, ``uniforms``). Shared by the block drafters' Markov loop and EAGLE-3's
    sequential steps (specd/engine/eagle3_graphs.py).

    A path of greedy and unfiltered rows only is one fused call (kvspec_kernels/markov_slot.py: the inputs
    read twice, the probabilities written once), as ``SlotSampler`` samples them. Any other path scales the
    logits in one launch (``slot_logits``, bit for bit the torch formula) and runs ``static_probs``: every
    transform the path names on every row, chosen per row by ``where``. ``greedy``: ``x.kind == GREEDY_ROW``,
    when the caller computed it once for its γ slots (one comparison a round, not one a slot)."""
    out = probs_out[:, k]
    if greedy is None:
        greedy = x.kind == GREEDY_ROW
    if not (path.max_k or path.top_p):
        return plain_slot(logits, bias, x.temperature, x.uniforms[:, k], greedy, out, path.plain, path.greedy)
    probs, argmax = static_probs(slot_logits(logits, bias, x.temperature), x.top_k, x.top_p, x.kind, path, out=out)
    drawn = inverse_cdf(probs, x.uniforms[:, k])
    return torch.where(greedy, argmax, drawn) if path.greedy else drawn


def markov_round(x: RoundInputs, path: SamplingPath, markov_head, confidence: Callable | None,
                 probs_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The Markov loop, per-slot sampling and confidence head on fixed-shape inputs: what is captured.

    Row for row the same computation as ``BlockDrafter.sample_drafts`` (``sample_block`` with a
    ``SlotSampler``): slot k's logits get the bias of the token drawn at slot k-1 (slot 0: the anchor),
    a greedy row takes the argmax and a one-hot, a sampled row its own ``sampling_probs`` row and the
    inverse CDF at its uniform for slot k. The base logits stay in the model dtype: each slot's kernels
    read them and the bias and upcast inside (no fp32 copy of the block). ``confidence(hidden, prev)``
    returns pre-sigmoid logits. Returns tokens [Bp, γ] int64, probs [Bp, γ, V] fp32 (written into
    ``probs_out`` when given), pre-sigmoid confidence logits [Bp, γ] fp32 or None."""
    gamma = x.logits.shape[1]
    if probs_out is None:
        probs_out = torch.empty(x.logits.shape, dtype=torch.float32, device=x.logits.device)
    prev, tokens, greedy = x.anchors, [], x.kind == GREEDY_ROW
    for k in range(gamma):
        bias = None if markov_head is None else markov_head.bias(prev)
        prev = sample_slot(x.logits[:, k], x, path, k, probs_out, bias=bias, greedy=greedy)
        tokens.append(prev)
    tokens = torch.stack(tokens, dim=1)
    conf = None
    if confidence is not None:
        conf = confidence(x.hidden, torch.cat([x.anchors[:, None], tokens[:, :-1]], dim=1))
    return tokens, probs_out, conf


class DraftGraphs(KeyedGraphs):
    """Static buffers, captured rounds and their shared outputs; one instance per block drafter.

    ``replay_eagerly``: run ``markov_round`` on the same padded static buffers without a CUDA graph, so
    the CPU tests check the padding and the packing (CUDA graphs need a GPU). ``blocks``: a
    specd.engine.block_graphs.BlockGraphs writing into ``hidden`` (the block forward replayed too), or
    None (the block forward runs eagerly)."""

    def __init__(self, drafter, max_batch: int, device: torch.device, replay_eagerly: bool = False):
        cfg = drafter.config
        self.max_batch, self.gamma, self.vocab = max_batch, cfg.gamma, cfg.vocab_size
        self.device = device
        dtype = drafter.fc.weight.dtype
        b, g = max_batch, cfg.gamma
        self.logits = torch.zeros(b * g, cfg.vocab_size, dtype=dtype, device=device)     # [Bmax·γ, V]
        self.hidden = torch.zeros(b, g, cfg.hidden_size, dtype=dtype, device=device)
        self._ints = torch.zeros(3 * b, dtype=torch.int64, device=device)     # anchors, top_k, kind
        self._h_ints = torch.zeros(3 * b, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._floats, self._h_floats = float_settings(b, g, device)           # temperature, top_p, u
        self.tokens = torch.zeros(b, g, dtype=torch.int64, device=device)
        self.probs = torch.zeros(b, g, cfg.vocab_size, dtype=torch.float32, device=device)
        self.confidence = torch.zeros(b, g, dtype=torch.float32, device=device)     # pre-sigmoid
        super().__init__(MAX_DRAFT_GRAPHS, "draft round", replay_eagerly,
                         None if replay_eagerly else torch.cuda.graph_pool_handle())
        self.eager_rounds = 0
        self.blocks = None            # BlockGraphs, set by the proposer (specd/engine/proposers.py)
        self.absorbs = None           # AbsorbGraphs (the context projection), set by the proposer too

    def block_hidden(self, drafter, contexts: Sequence, last_tokens: Sequence[int]) -> Tensor:
        """The round's block forward -> hidden [B, γ, d]: from the block graphs when there are any (a view
        of ``self.hidden``), else the eager ``draft_hidden``."""
        if self.blocks is None:
            return drafter.draft_hidden(contexts, last_tokens)
        return self.blocks.run(drafter, contexts, last_tokens)

    def key(self, params: Sequence[SamplingParams]) -> DraftGraphKey | None:
        return draft_graph_key(params, self.max_batch, self.vocab)

    def warm_keys(self) -> list[DraftGraphKey]:
        """The keys captured when the proposer loads (``warm_keys``)."""
        return warm_keys(self.max_batch, self.vocab)

    def inputs(self, batch: int) -> RoundInputs:
        b, g, bm = batch, self.gamma, self.max_batch
        i, f = self._ints, self._floats
        return RoundInputs(self.logits[: b * g].view(b, g, -1), self.hidden[:b], i[:b], i[bm:bm + b],
                           i[2 * bm:2 * bm + b], f[:b], f[bm:bm + b], f[2 * bm:2 * bm + b * g].view(b, g))

    # -- inputs ----------------------------------------------------------------------------------------
    def load(self, drafter, hidden: Tensor, last_tokens: Sequence[int], params: Sequence[SamplingParams],
             generators: Sequence[torch.Generator | None], key: DraftGraphKey) -> None:
        """hidden: [B, γ, d]. The LM head at the exact batch into the logits buffer, the hidden states
        beside it, the settings and uniforms packed on the host and copied in two copies."""
        n, g, bm, bp = len(params), self.gamma, self.max_batch, key.batch
        torch.mm(hidden.reshape(n * g, -1), drafter.heads.lm_head.weight.detach().t(), out=self.logits[: n * g])
        if hidden.data_ptr() != self.hidden.data_ptr():       # the block graphs write it in place
            self.hidden[:n].copy_(hidden)
        hi = self._h_ints
        kinds = row_kind_codes(params, self.vocab)
        hi[:n] = torch.tensor(list(last_tokens), dtype=torch.int64)
        hi[bm:bm + n] = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        hi[2 * bm:2 * bm + n] = torch.tensor(kinds, dtype=torch.int64)
        hi[2 * bm + n:2 * bm + bp] = GREEDY_ROW                                 # padding rows: inert
        self._ints.copy_(hi, non_blocking=True)
        pack_floats(self._h_floats, self._floats, params, generators, bm, bp, g)

    # -- capture and replay ----------------------------------------------------------------------------
    def _body(self, drafter, key: DraftGraphKey) -> None:
        conf = drafter.confidence_logits if drafter.confidence_head is not None else None
        tokens, _, c = markov_round(self.inputs(key.batch), key.path, drafter.markov_head, conf,
                                    self.probs[: key.batch])
        self.tokens[: key.batch].copy_(tokens)
        if c is not None:
            self.confidence[: key.batch].copy_(c)

    def _inert(self, key: DraftGraphKey) -> None:
        """Greedy-coded rows, temperature and top-p 1, top-k 0, uniforms 0, zero logits: every transform
        of every path is finite on them."""
        batch = key.batch
        self.logits[: batch * self.gamma].zero_()
        self.hidden[:batch].zero_()
        i, f, bm = self._ints, self._floats, self.max_batch
        i[:batch].zero_()
        i[bm:bm + batch].zero_()
        i[2 * bm:2 * bm + batch] = GREEDY_ROW
        f[:batch] = 1.0
        f[bm:bm + batch] = 1.0
        f[2 * bm:2 * bm + batch * self.gamma].zero_()

    @torch.inference_mode()
    def run(self, drafter, hidden: Tensor, last_tokens: Sequence[int], params: Sequence[SamplingParams],
            generators: Sequence[torch.Generator | None]) -> DraftOutput:
        """hidden: [B, γ, d] from ``draft_hidden`` -> the round's DraftOutput (views of the shared
        output buffers, valid until the next round). Shapes no graph holds run the eager reference."""
        key = self.key(params)
        if not self.can_run(key):
            self.eager_rounds += 1
            return drafter.sample_drafts(BlockOut(drafter.heads.logits(hidden), hidden), last_tokens, params,
                                         generators)
        self.load(drafter, hidden, last_tokens, params, generators, key)
        self.replay(drafter, key)
        n = len(params)
        conf = torch.sigmoid(self.confidence[:n]) if drafter.confidence_head is not None else None
        return DraftOutput(tokens=self.tokens[:n], probs=self.probs[:n], confidence=conf)

