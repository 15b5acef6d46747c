"""BlockDrafter: the DSpark block drafter (and, with its heads off, the DFlash-style baseline).

One forward turns the block [anchor, MASK×(γ-1)] at positions a..a+γ-1 into γ next-token predictions:
slot k predicts the token at a+1+k. Each draft layer attends, bidirectionally, to the block and to
*injected* context keys/values: the fused target features of positions < a, projected by that layer's
own k/v projections (+ k_norm + RoPE at their true positions). Parameter names are DeepSpec's
(`fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.*}`, `norm`, `markov_head.*`, `confidence_head.proj`), minus the frozen
`embed_tokens` / `lm_head`, which are borrowed from the target (see docs/design/drafter.md).

Context K/V depend only on the fused features and their positions, never on the block, so a serving
engine may cache them per request and layer (`context_kv`) and extend them with each step's accepted
positions; block K/V are never stored, which is DeepSpec's "crop the draft cache after each block".
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from specd.drafter.anchor_rows import anchor_rows
from specd.drafter.base import (BlockOut, BorrowsTargetHeads, DrafterError, DraftOutput, SlotSampler, TargetHeads,
                                count_parameters)
from specd.drafter.confidence_head import ConfidenceHead
from specd.drafter.context_cache import DraftContext, append_many, padded_layer
from specd.drafter.config import DrafterConfig
from specd.drafter.markov_head import MarkovHead, sample_block
from specd.models.config import ModelConfig
from specd.models.layers import MLP, RMSNorm, Rotary, apply_rotary
from specd.sampling_params import SamplingParams

KV = tuple[Tensor, Tensor]   # (k, v), each [B, S, Hkv, D], rotated


class InjectedAttention(nn.Module):
    """Queries from the block only; keys/values over [context features ; block], non-causal with a mask."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hq, self.hkv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, config.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """x: [B, S, d]; cos, sin: [B, S, 1, D] -> rotated k, v [B, S, Hkv, D]."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.hkv, self.d))
        return apply_rotary(k, cos, sin), self.v_proj(x).view(b, s, self.hkv, self.d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: KV, mask: Tensor) -> Tensor:
        """x: [B, Q, d] (normed block states); ctx: context K/V [B, S, ...]; mask: [B, Q, S+Q] bool."""
        b, q_len, _ = x.shape
        q = apply_rotary(self.q_norm(self.q_proj(x).view(b, q_len, self.hq, self.d)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx[0], k_blk], dim=1)
        v = torch.cat([ctx[1], v_blk], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask[:, None], scale=self.d ** -0.5, enable_gqa=True,
        )                                                                   # [B, Hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.hq * self.d))


class DraftLayer(nn.Module):
    """Pre-norm block over the block states; the injected context enters only through attention."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = InjectedAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx: KV, mask: Tensor) -> Tensor:  # h: [B, Q, d]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockDrafter(BorrowsTargetHeads, nn.Module):
    """DSpark (Markov + confidence heads) or DFlash (`markov_rank=0, confidence=False`): one class, flags."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.method not in ("dspark", "dflash"):
            raise DrafterError(f"BlockDrafter serves dspark/dflash, not {config.method!r}")
        self.config = config
        backbone = config.backbone()
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(backbone) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = Rotary(backbone)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank) if config.markov_rank else None
        self.confidence_head = ConfidenceHead(d, config.markov_rank) if config.confidence else None
        self._heads: TargetHeads | None = None

    # --- pieces shared by training and inference ----------------------------------------------
    def fuse(self, features: Sequence[Tensor]) -> Tensor:
        """Captured target layer outputs ([T, d] each, in target_layers order) -> fused [T, d]."""
        if len(features) != len(self.config.target_layers):
            raise DrafterError(f"got {len(features)} feature tensors for target_layers {self.config.target_layers}")
        return self.hidden_norm(self.fc(torch.cat(list(features), dim=-1)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[KV]:
        """ctx: [B, S, d] fused features; positions: [B, S] int64 -> per layer (k, v) [B, S, Hkv, D].

        The cacheable part of a draft: it depends on nothing the block contains.
        """
        cos, sin = self._rope(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, block_ids: Tensor, positions: Tensor, ctx_kv: list[KV], mask: Tensor) -> Tensor:
        """block_ids, positions: [B, Q] int64; mask: [B, Q, S+Q] bool -> final-normed hidden [B, Q, d]."""
        h = self.heads.embed(block_ids).to(self.fc.weight.dtype)
        cos, sin = self._rope(positions, h.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    def markov_logits(self, base_logits: Tensor, prev_tokens: Tensor) -> Tensor:
        """base_logits: [N, γ, V] fp32; prev_tokens: [N, γ] (col 0 = anchor) -> U_k + W2·W1[x_{k-1}]."""
        return base_logits if self.markov_head is None else self.markov_head(base_logits, prev_tokens)

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """hidden: [N, γ, d]; prev_tokens: [N, γ] -> pre-sigmoid conditional survival logits [N, γ] fp32."""
        if self.confidence_head is None or self.markov_head is None:
            raise DrafterError(f"{self.config.method} drafter has no confidence head")
        return self.confidence_head(hidden, self.markov_head.prev_embedding(prev_tokens))

    # --- training -----------------------------------------------------------------------------
    def block_logits(self, ctx: Tensor, tokens: Tensor, anchors: Tensor) -> BlockOut:
        """Teacher-forced blocks at many anchors of one sequence, in one forward.

        ctx: [T, d] fused features; tokens: [T] int64; anchors: [N] int64 in [0, T-1]. Block n is
        [tokens[a], MASK×(γ-1)] at positions a..a+γ-1; slot k's label is tokens[a+1+k]. Anchors with
        a+γ > T-1 are accepted: the caller must mask the labels past the end.
        """
        t, g = tokens.shape[0], self.config.gamma
        if ctx.shape[0] != t:
            raise DrafterError(f"ctx has {ctx.shape[0]} positions, tokens {t}")
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) > t - 1):
            raise DrafterError(f"anchors must lie in [0, {t - 1}]")
        n, dev = anchors.numel(), tokens.device
        ids = torch.full((n, g), self.config.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = tokens[anchors]
        positions = anchors[:, None] + torch.arange(g, device=dev)                 # [N, γ]
        ctx_kv = self.context_kv(ctx[None], torch.arange(t, device=dev)[None])
        mask = training_mask(anchors, t, g)
        hidden = self.block_hidden(ids.view(1, n * g), positions.view(1, n * g), ctx_kv, mask)
        hidden = hidden.view(n, g, -1)
        return BlockOut(base_logits=self.heads.logits(hidden), hidden=hidden)

    def block_logits_batch(self, ctxs: Sequence[Tensor], tokens: Sequence[Tensor],
                           anchors: Sequence[Tensor]) -> BlockOut:
        """``block_logits`` of several sequences in one forward: rows of every sequence's anchors, in order.

        ctxs[i]: [T_i, d] fused features; tokens[i]: [T_i]; anchors[i]: [N_i] (N_i ≥ 1). The contexts are
        right-padded to [B, T_max] and the blocks to [B, N_max·γ]. A block sees context positions below its
        anchor (< T_i, so never a padded one) and its own block; padded blocks (anchor 0) see only
        themselves and are dropped. Why: training called ``block_logits`` once per sequence, ~1.4k aten
        ops each with the backward (CPU count), and the H200 step is host-bound (docs/results/acceptance.md,
        session 8). ``block_logits`` per sequence stays the reference (tests/drafter/test_train.py)."""
        b, g = len(ctxs), self.config.gamma
        rows = anchor_rows(ctxs, tokens, anchors, lo=0, tail=0, pad=0, what="block_logits_batch")
        anchor, real = rows.anchor, rows.real
        dev, t_max, n_max = tokens[0].device, max(t.shape[0] for t in tokens), anchor.shape[1]
        ctx = pad_sequence(list(ctxs), batch_first=True)                                 # [B, T_max, d]
        tok = pad_sequence(list(tokens), batch_first=True)
        first = tok.gather(1, anchor)                                                    # [B, N_max]
        ids = torch.full((b, n_max, g), self.config.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, :, 0] = first
        positions = anchor[..., None] + torch.arange(g, device=dev)                     # [B, N_max, γ]
        ctx_kv = self.context_kv(ctx, torch.arange(t_max, device=dev).expand(b, t_max))
        mask = training_mask(anchor, t_max, g)                                           # [B, N_max·γ, T_max + N_max·γ]
        hidden = self.block_hidden(ids.view(b, n_max * g), positions.view(b, n_max * g), ctx_kv, mask)
        hidden = hidden.view(b, n_max, g, -1)[real]                                      # [ΣN, γ, d]
        return BlockOut(base_logits=self.heads.logits(hidden), hidden=hidden)

    # --- inference ----------------------------------------------------------------------------
    keeps_tail = False    # absorb() keeps the last feature back for the next draft

    def new_context(self) -> DraftContext:
        """An empty per-request context K/V cache (specd/drafter/context_cache.py)."""
        c = self.config.backbone()
        return DraftContext(len(self.layers), c.num_kv_heads, c.head_dim, self.fc.weight.dtype, self.fc.weight.device)

    def absorb(self, context: DraftContext, feats: Tensor, next_tokens: Tensor | None = None) -> Tensor:
        """Project fused features [m, d] of the next m context positions into ``context``; returns the
        features still needed later (none: a block drafter reads its context only through K/V).
        ``next_tokens`` is unused (EAGLE-3 pairs each feature with the following token)."""
        del next_tokens
        if feats.shape[0]:
            pos = torch.arange(context.n, context.n + feats.shape[0], device=self.fc.weight.device)
            kvs = self.context_kv(feats.to(self.fc.weight.device, self.fc.weight.dtype)[None], pos[None])
            context.append([(k[0], v[0]) for k, v in kvs])
        return feats[:0]

    def absorb_many(self, contexts: Sequence[DraftContext], feats: Sequence[Tensor], graphs=None) -> list[Tensor]:
        """``absorb`` for a batch of requests in one projection: the positions are independent (norm,
        linear, RoPE per position), so the requests' new features go through ``context_kv`` as one
        [1, Σm, d] row and the K/V are split back, then appended in one foreach copy
        (``context_cache.append_many``). Why: absorbing per request cost ~25 small kernels per request per
        round; at 32 requests that was a third of a drafting step's host time on the H200 (``bench speedup
        --profile``; docs/results/speedup.md, session 4). ``graphs``: a specd.engine.absorb_graphs.AbsorbGraphs
        replaying that projection from a CUDA graph (None, or a batch too large for it: this reference)."""
        if len(contexts) != len(feats):
            raise DrafterError(f"{len(contexts)} contexts for {len(feats)} feature tensors")
        live = [(c, f) for c, f in zip(contexts, feats) if f.shape[0]]
        if live:
            dev, dtype = self.fc.weight.device, self.fc.weight.dtype
            sizes = [f.shape[0] for _, f in live]
            positions = [p for (c, _), m in zip(live, sizes) for p in range(c.n, c.n + m)]
            projected = None if graphs is None else graphs.run(self, [f for _, f in live], positions)
            if projected is None:
                x = torch.cat([f for _, f in live]).to(dev, dtype)
                projected = self.context_kv(x[None], torch.tensor(positions, device=dev)[None])
            kvs = [(k[0].split(sizes), v[0].split(sizes)) for k, v in projected]
            append_many([c for c, _ in live], [[(ks[i], vs[i]) for ks, vs in kvs] for i in range(len(live))])
        return [f[:0] for f in feats]

    def draft_hidden(self, contexts: Sequence[DraftContext], last_tokens: Sequence[int]) -> Tensor:
        """One padded, batched block forward for B requests -> final-normed hidden [B, γ, d] (no LM head).

        contexts[i] holds the context K/V of positions 0..n_i-1; last_tokens[i] sits at n_i. The eager
        reference of the captured block forward (specd/engine/block_graphs.py)."""
        if len(contexts) != len(last_tokens):
            raise DrafterError(f"{len(contexts)} contexts for {len(last_tokens)} anchors")
        dev = self.fc.weight.device
        lens = torch.tensor([c.n for c in contexts], dtype=torch.int64, device=dev)
        anchors = torch.tensor(list(last_tokens), dtype=torch.int64, device=dev)
        return self.padded_block_hidden(anchors, lens, [padded_layer(contexts, i) for i in range(len(self.layers))])

    def padded_block_hidden(self, anchors: Tensor, lens: Tensor, ctx_kv: list[KV]) -> Tensor:
        """anchors, lens: [B] int64; ctx_kv: per layer (k, v) [B, S, Hkv, D], row i's positions >= lens[i]
        padding (masked; must be finite) -> final-normed hidden [B, γ, d].

        Fixed shapes in, no host reads: what a CUDA graph captures per (batch, S) bucket."""
        g, dev = self.config.gamma, anchors.device
        b, s = ctx_kv[0][0].shape[:2]
        ids = torch.full((b, g), self.config.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = anchors
        positions = lens[:, None] + torch.arange(g, device=dev)
        valid = (torch.arange(s, device=dev)[None, :] < lens[:, None])[:, None, :].expand(b, g, s)
        mask = torch.cat([valid, torch.ones(b, g, g, dtype=torch.bool, device=dev)], dim=2)
        return self.block_hidden(ids, positions, ctx_kv, mask)

    def draft_block(self, contexts: Sequence[DraftContext], last_tokens: Sequence[int]) -> BlockOut:
        """``draft_hidden`` and the LM head on it (no Markov bias, no sampling)."""
        hidden = self.draft_hidden(contexts, last_tokens)
        return BlockOut(base_logits=self.heads.logits(hidden), hidden=hidden)

    @torch.no_grad()
    def draft_contexts(self, contexts: Sequence[DraftContext], tails: Sequence[Tensor], last_tokens: Sequence[int],
                       params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                       rounds=None) -> DraftOutput:
        """γ proposals per request from cached contexts: one batched block forward, then the Markov
        loop with each request's own sampling. ``tails`` (what ``absorb`` left over) is empty here.
        ``rounds``: a specd.engine.draft_graphs.DraftGraphs that replays the block forward (when it has
        block graphs), the LM head's consumers, the Markov loop, the sampling and the confidence head from
        CUDA graphs; None runs them eagerly."""
        del tails
        if rounds is not None:
            hidden = rounds.block_hidden(self, contexts, last_tokens)
            return rounds.run(self, hidden, last_tokens, params, generators)
        hidden = self.draft_hidden(contexts, last_tokens)
        return self.sample_drafts(BlockOut(self.heads.logits(hidden), hidden), last_tokens, params, generators)

    def sample_drafts(self, out: BlockOut, last_tokens: Sequence[int], params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None]) -> DraftOutput:
        """The eager Markov loop, sampling and confidence head: the reference the graphs must match."""
        anchors = torch.tensor(list(last_tokens), dtype=torch.int64, device=out.hidden.device)
        sampler = SlotSampler(params, generators, self.config.gamma, out.hidden.device)
        tokens, probs = sample_block(out.base_logits, anchors, self.markov_head, sampler)
        confidence = None
        if self.confidence_head is not None:
            prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
            confidence = torch.sigmoid(self.confidence_logits(out.hidden, prev))
        return DraftOutput(tokens=tokens, probs=probs, confidence=confidence)

    @torch.no_grad()
    def draft(self, ctx_feats: Sequence[Tensor], last_tokens: Sequence[int], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], ctx_tokens: Sequence[Tensor] | None = None) -> DraftOutput:
        """The stateless form: ctx_feats[i] [n_i, d] are the fused features of positions 0..n_i-1
        (projected afresh; serving keeps DraftContexts instead). ``ctx_tokens`` is unused."""
        del ctx_tokens
        return self.draft_contexts(self.contexts_of(ctx_feats), [], last_tokens, params, generators)

    def contexts_of(self, ctx_feats: Sequence[Tensor]) -> list[DraftContext]:
        """Fresh contexts holding the K/V of these features ([n_i, d] each, positions 0..n_i-1)."""
        contexts = [self.new_context() for _ in ctx_feats]
        for c, f in zip(contexts, ctx_feats):
            self.absorb(c, f)
        return contexts

    # --- reporting ----------------------------------------------------------------------------
    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)

    def describe(self) -> str:
        c = self.config
        return (f"{c.method}: {c.num_layers} layer(s), γ={c.gamma}, fuses target layers {list(c.target_layers)}, "
                f"markov rank {c.markov_rank}, confidence {'on' if c.confidence else 'off'}, "
                f"mask id {c.mask_token_id}, {self.num_parameters() / 1e6:.3f} M own parameters")

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [B, S] -> cos, sin [B, S, 1, D]."""
        cos, sin = self.rotary(positions.reshape(-1), dtype)
        shape = (*positions.shape, 1, cos.shape[-1])
        return cos.view(shape), sin.view(shape)


def training_mask(anchors: Tensor, seq_len: int, gamma: int) -> Tensor:
    """anchors: [N], or [B, N] for B padded sequences -> mask [1 or B, N·γ, T + N·γ] bool: block n sees
    context positions < anchors[n] and every slot of its own block (bidirectional), nothing of other
    blocks."""
    rows = anchors.reshape(-1, anchors.shape[-1])                                     # [B, N]
    n, dev = rows.shape[1], anchors.device
    q_block = torch.arange(n * gamma, device=dev) // gamma                          # [Nγ]
    sees_ctx = torch.arange(seq_len, device=dev)[None, None, :] < rows[:, q_block][..., None]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(rows.shape[0], -1, -1)
    return torch.cat([sees_ctx, sees_block], dim=2)
