"""Eagle3Drafter: the EAGLE-3-style baseline, one autoregressive decoder layer over fused target features.

Element t of its sequence pairs a hidden state for position t with the embedding of token t+1, at
RoPE position t, and predicts token t+2. Context elements carry the fused target features
(`fc([low; mid; high])`); a drafted element carries the drafter's own previous output hidden state
(pre-norm), which is what training-time test (TTT) teaches it to consume. The layer input is
[input_layernorm(embed) ; hidden_norm(hidden)] (2d wide), so q/k/v project from 2d.

Anchor convention, shared with BlockDrafter: the anchor token sits at position a, features exist for
positions < a; step s feeds token a+s and predicts token a+1+s. Context elements 0..a-2 are keys;
the step-0 element (features a-1, anchor) and every drafted element are the query's own keys.

Parameter names are DeepSpec's Qwen3Eagle3Model (`fc`, `layers.0.{hidden_norm, input_layernorm,
self_attn.*, post_attention_layernorm, mlp.*}`, `norm`), minus the borrowed `embed_tokens`/`lm_head`.
Note `fuse` here is fc only: the RMSNorm sits inside the layer (`hidden_norm`), after the residual tap.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from specd.drafter.anchor_rows import anchor_rows
from specd.drafter.base import (BorrowsTargetHeads, DrafterError, DraftOutput, SlotSampler, TargetHeads,
                                count_parameters)
from specd.drafter.config import DrafterConfig
from specd.drafter.context_cache import DraftContext, append_many, padded_layer
from specd.models.config import ModelConfig
from specd.models.layers import MLP, RMSNorm, Rotary, apply_rotary
from specd.sampling_params import SamplingParams

KV = tuple[Tensor, Tensor]   # (k, v): [..., S, Hkv, D] context keys, or [N, Hkv, D] one drafted element


class Eagle3Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hq, self.hkv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        two_h = 2 * config.hidden_size
        self.q_proj = nn.Linear(two_h, self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(two_h, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(two_h, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, config.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """x: [..., 2d]; cos, sin: [..., 1, D] -> rotated k, v [..., Hkv, D]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.hkv, self.d)))
        return apply_rotary(k, cos, sin), self.v_proj(x).unflatten(-1, (self.hkv, self.d))

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [N, 2d] -> rotated q [N, Hq, D]."""
        return apply_rotary(self.q_norm(self.q_proj(x).unflatten(-1, (self.hq, self.d))), cos, sin)

    def attend(self, q: Tensor, ctx: KV, ctx_mask: Tensor, own: list[KV]) -> Tensor:
        """One query per row over context keys (shared [S, Hkv, D] or per row [N, S, Hkv, D], masked by
        ctx_mask [N, S]) plus the row's own drafted keys (all visible). q: [N, Hq, D] -> [N, d].

        Done by hand (two score blocks, one softmax) so TTT never materialises the shared context
        keys once per anchor.
        """
        rep = self.hq // self.hkv
        ck, cv = (t.repeat_interleave(rep, dim=-2) for t in ctx)
        ok = torch.stack([k for k, _ in own], dim=1).repeat_interleave(rep, dim=-2)   # [N, s, Hq, D]
        ov = torch.stack([v for _, v in own], dim=1).repeat_interleave(rep, dim=-2)
        shared = ck.dim() == 3
        score_eq, mix_eq = ("nhd,shd->nhs", "nhs,shd->nhd") if shared else ("nhd,nshd->nhs", "nhs,nshd->nhd")
        s_ctx = torch.einsum(score_eq, q, ck).float().masked_fill(~ctx_mask[:, None, :], float("-inf"))
        s_own = torch.einsum("nhd,nshd->nhs", q, ok).float()
        w = torch.softmax(torch.cat([s_ctx, s_own], dim=-1) * self.d ** -0.5, dim=-1).to(q.dtype)
        n_ctx = s_ctx.shape[-1]
        out = torch.einsum(mix_eq, w[..., :n_ctx], cv)
        out = out + torch.einsum("nhs,nshd->nhd", w[..., n_ctx:], ov)
        return self.o_proj(out.reshape(q.shape[0], self.hq * self.d))

    def attend_batched(self, q: Tensor, ctx: KV, ctx_mask: Tensor, own: list[KV]) -> Tensor:
        """``attend`` for B padded sequences at once (training's unroll): q [B, n, Hq, D] over each sequence's
        context keys [B, S, Hkv, D] (masked by ctx_mask [B, n, S]) plus the row's own drafted keys
        ([B, n, Hkv, D] each, all visible) -> [B, n, d]. Grouped heads index the shared keys instead of
        repeating them (``attend`` repeats them once per call, fine for a draft, not for B × γ steps)."""
        b, n = q.shape[:2]
        rep = self.hq // self.hkv
        qg = q.view(b, n, self.hkv, rep, self.d)
        ok = torch.stack([k for k, _ in own], dim=2)                      # [B, n, s, Hkv, D]
        ov = torch.stack([v for _, v in own], dim=2)
        s_ctx = torch.einsum("bnkrd,bskd->bkrns", qg, ctx[0]).float()
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None], float("-inf"))
        s_own = torch.einsum("bnkrd,bntkd->bkrnt", qg, ok).float()
        w = torch.softmax(torch.cat([s_ctx, s_own], dim=-1) * self.d ** -0.5, dim=-1).to(q.dtype)
        n_ctx = s_ctx.shape[-1]
        out = torch.einsum("bkrns,bskd->bnkrd", w[..., :n_ctx], ctx[1])
        out = out + torch.einsum("bkrnt,bntkd->bnkrd", w[..., n_ctx:], ov)
        return self.o_proj(out.reshape(b, n, self.hq * self.d))


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def inputs(self, emb: Tensor, hidden: Tensor) -> Tensor:
        """emb, hidden: [..., d] -> attention input [..., 2d]."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """Residual on the (un-normed) hidden stream, then the MLP block. [N, d] -> [N, d]."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(BorrowsTargetHeads, nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.method != "eagle3":
            raise DrafterError(f"Eagle3Drafter serves eagle3, not {config.method!r}")
        self.config = config
        backbone = config.backbone()
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layers) * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(backbone)])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = Rotary(backbone)
        self._heads: TargetHeads | None = None


    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def fuse(self, features: Sequence[Tensor]) -> Tensor:
        """Captured target layer outputs ([T, d] each, target_layers order) -> fc(concat) [T, d] (no norm)."""
        if len(features) != len(self.config.target_layers):
            raise DrafterError(f"got {len(features)} feature tensors for target_layers {self.config.target_layers}")
        return self.fc(torch.cat(list(features), dim=-1))

    def context_kv(self, feats: Tensor, next_tokens: Tensor, positions: Tensor) -> KV:
        """Keys of context elements (feature t, token t+1) at positions t: feats [..., S, d],
        next_tokens, positions [..., S] -> k, v [..., S, Hkv, D]. Cacheable per request."""
        x = self.layer.inputs(self.heads.embed(next_tokens).to(feats.dtype), feats)
        cos, sin = self._rope(positions, feats.dtype)
        return self.layer.self_attn.kv(x, cos, sin)

    def step(self, hidden: Tensor, tokens: Tensor, positions: Tensor, ctx: KV, ctx_mask: Tensor,
             own: list[KV], batched: bool = False) -> Tensor:
        """One autoregressive step for N rows: hidden [N, d], tokens/positions [N]; appends this
        element's k/v to `own`. Returns the new hidden [N, d] (pre-norm; logits via `logits`).
        ``batched``: rows of B padded sequences, hidden [B, n, d], over per-sequence contexts
        (``Eagle3Attention.attend_batched``, training's unroll)."""
        attn = self.layer.self_attn
        x = self.layer.inputs(self.heads.embed(tokens).to(hidden.dtype), hidden)
        cos, sin = self._rope(positions, hidden.dtype)
        own.append(attn.kv(x, cos, sin))
        q = attn.query(x, cos, sin)
        attend = attn.attend_batched if batched else attn.attend
        return self.layer.finish(hidden, attend(q, ctx, ctx_mask, own))

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., d] -> [..., V] fp32 through the final norm and the target's LM head."""
        return self.heads.logits(self.norm(hidden))

    def ttt_logits(self, feats: Tensor, tokens: Tensor, anchors: Tensor, steps: int) -> Tensor:
        """Training-time test: unroll `steps` steps from each anchor, feeding the drafter's own hidden
        states after step 1 and the teacher-forced tokens tokens[a+s].

        feats: [T, d] fused; tokens: [T]; anchors: [N] with 1 <= a and a + steps - 1 <= T - 1.
        Returns logits [N, steps, V] fp32; [n, s] predicts tokens[a+1+s] (the caller masks labels past T-1).
        """
        t = tokens.shape[0]
        if anchors.numel() and (int(anchors.min()) < 1 or int(anchors.max()) + steps - 1 > t - 1):
            raise DrafterError(f"TTT anchors need 1 <= a <= {t - steps} for T={t}, steps={steps}")
        dev = tokens.device
        ctx = self.context_kv(feats[:-1], tokens[1:], torch.arange(t - 1, device=dev))   # elements 0..T-2
        ctx_mask = torch.arange(t - 1, device=dev)[None, :] <= (anchors - 2)[:, None]    # [N, T-1]
        hidden, own, out = feats[anchors - 1], [], []
        for s in range(steps):
            hidden = self.step(hidden, tokens[anchors + s], anchors - 1 + s, ctx, ctx_mask, own)
            out.append(self.logits(hidden))
        return torch.stack(out, dim=1)

    def ttt_logits_batch(self, feats: Sequence[Tensor], tokens: Sequence[Tensor], anchors: Sequence[Tensor],
                         steps: int) -> Tensor:
        """``ttt_logits`` of several sequences in one unroll: feats [T_i, d] fused, tokens [T_i], anchors
        [N_i ≥ 1] (host or device; each as ``ttt_logits`` requires) -> logits [ΣN_i, steps, V] fp32, the
        sequences' rows in order, as ``torch.cat`` of ``ttt_logits`` per sequence gives them (only the
        padding changes the summation order; tests/drafter/test_train.py). Why: training unrolled every
        sequence of a batch on its own, B × γ sequential steps of small kernels (65k aten ops a step of 8
        sequences × 64 anchors against 11k here, CPU count, ``bench/gpu/train_probe.py``), and EAGLE-3
        trained at 2.2 steps a second against DFlash's 13 on the H100 (session 41). The contexts are
        padded to the longest and masked; anchors are checked and padded on the host (no device sync); the
        LM head runs on the real rows only."""
        b = len(feats)
        # padded rows: anchor 1, no context, dropped
        rows = anchor_rows(feats, tokens, anchors, lo=1, tail=steps - 1, pad=1, what="ttt_logits_batch")
        anc, dev, n_max = rows.anchor, tokens[0].device, rows.anchor.shape[1]
        flat = torch.cat([i * n_max + torch.arange(c) for i, c in enumerate(rows.counts)]).to(dev)   # real rows
        fused = pad_sequence(list(feats), batch_first=True)                 # [B, T_max, d]
        toks = pad_sequence(list(tokens), batch_first=True)
        pos = torch.arange(fused.shape[1] - 1, device=dev)
        ctx = self.context_kv(fused[:, :-1], toks[:, 1:], pos.expand(b, -1))   # elements 0..T_max-2
        ctx_mask = pos[None, None, :] <= (anc - 2)[:, :, None]                  # [B, n, T_max-1]
        hidden, own, out = fused.gather(1, (anc - 1)[..., None].expand(-1, -1, fused.shape[-1])), [], []
        for s in range(steps):
            hidden = self.step(hidden, toks.gather(1, anc + s), anc - 1 + s, ctx, ctx_mask, own, batched=True)
            out.append(self.logits(hidden.flatten(0, 1)[flat]))
        return torch.stack(out, dim=1)

    keeps_tail = True    # absorb() keeps the last feature back for the next draft

    def new_context(self) -> DraftContext:
        """An empty per-request context K/V cache (specd/drafter/context_cache.py)."""
        c = self.config.backbone()
        return DraftContext(1, c.num_kv_heads, c.head_dim, self.fc.weight.dtype, self.fc.weight.device)

    def absorb(self, context: DraftContext, feats: Tensor, next_tokens: Tensor) -> Tensor:
        """Turn features [m, d] of the next m positions, each with the token after it ([m]), into
        context elements, except the last one: that feature starts the next draft (the step-0 element
        is the query's own key, not context). Returns the features kept back ([1, d], or [0, d])."""
        if feats.shape[0] != next_tokens.shape[0]:
            raise DrafterError(f"{feats.shape[0]} features but {next_tokens.shape[0]} next tokens")
        return self.absorb_pairs([context], [feats], [next_tokens])[0]

    def absorb_pairs(self, contexts: Sequence[DraftContext], feats: Sequence[Tensor],
                     next_tokens: Sequence[Tensor]) -> list[Tensor]:
        """``absorb`` for a batch of requests in one projection: each element's key depends only on its own
        feature, token and position, so every request's new elements go through ``context_kv`` as one
        [Σm, d] batch, are split back and appended in one foreach copy (``context_cache.append_many``).
        Returns each request's kept-back features, as ``absorb`` does.

        Why: ``absorb`` per request is ~20 small kernels a request; at c = 32 that is ~640 launches a
        draft, several ms of host time on the GPU (session 41, run DN: `eagle3`'s schedule phase 35-43 ms a
        step at c = 32 against 13.5-17.7 at c = 1). The block drafters batch theirs the same way
        (``BlockDrafter.absorb_many``)."""
        if not len(contexts) == len(feats) == len(next_tokens):
            raise DrafterError(f"{len(contexts)} contexts for {len(feats)} feature tensors and "
                               f"{len(next_tokens)} token tensors")
        if any(f.shape[0] != t.shape[0] for f, t in zip(feats, next_tokens)):
            raise DrafterError("every request needs one next token per feature")
        live = [(c, f[:-1], t[:-1]) for c, f, t in zip(contexts, feats, next_tokens) if f.shape[0] > 1]
        if live:
            dev, dtype = self.fc.weight.device, self.fc.weight.dtype
            sizes = [f.shape[0] for _, f, _ in live]
            positions = torch.tensor([p for (c, _, _), m in zip(live, sizes) for p in range(c.n, c.n + m)], device=dev)
            k, v = self.context_kv(torch.cat([f for _, f, _ in live]).to(dev, dtype),
                                   torch.cat([t for _, _, t in live]).to(dev), positions)
            append_many([c for c, _, _ in live], [[kv] for kv in zip(k.split(sizes), v.split(sizes))])
        return [f[max(f.shape[0] - 1, 0):] for f in feats]

    @torch.no_grad()
    def draft_contexts(self, contexts: Sequence[DraftContext], tails: Sequence[Tensor], last_tokens: Sequence[int],
                       params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                       rounds=None) -> DraftOutput:
        """γ sequential steps batched over requests. contexts[i] holds elements 0..n_i-1; tails[i] [1, d]
        is the feature of position n_i, the anchor last_tokens[i] sits at n_i + 1. ``rounds``: a
        specd.engine.eagle3_graphs.Eagle3Graphs that replays the γ steps from CUDA graphs; None (or a
        shape it holds no graph for) runs this eager reference."""
        if len(tails) != len(contexts) or any(t.shape[0] != 1 for t in tails):
            raise DrafterError("eagle3 needs one kept-back feature per request (absorb's return value)")
        if rounds is not None:
            return rounds.run(self, contexts, tails, last_tokens, params, generators)
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        lens = torch.tensor([c.n for c in contexts], dtype=torch.int64, device=dev)
        ctx = padded_layer(contexts, 0)
        ctx_mask = torch.arange(ctx[0].shape[1], device=dev)[None, :] < lens[:, None]
        hidden = torch.cat([t.to(dev, dtype) for t in tails])
        tok = torch.tensor(list(last_tokens), dtype=torch.int64, device=dev)
        sampler = SlotSampler(params, generators, self.config.gamma, dev)
        own, tokens, probs = [], [], []
        for s in range(self.config.gamma):
            hidden = self.step(hidden, tok, lens + s, ctx, ctx_mask, own)
            tok, p = sampler(self.logits(hidden), s)
            tokens.append(tok)
            probs.append(p)
        return DraftOutput(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1), confidence=None)

    def padded_draft(self, tails: Tensor, anchors: Tensor, lens: Tensor, ctx: KV, settings, path,
                     probs_out: Tensor) -> Tensor:
        """``draft_contexts``'s γ steps on fixed shapes, no host reads: what a CUDA graph captures per
        (batch, S, sampling path) (specd/engine/eagle3_graphs.py).

        tails: [B, d] kept-back features; anchors, lens: [B] int64; ctx: (k, v) [B, S, Hkv, D], row i's
        positions >= lens[i] padding (masked; must be finite); settings: the rows' sampling settings
        (eagle3_graphs.SlotSettings), path: the transforms they need. Each step's probabilities go into
        probs_out [B, γ, V] fp32; returns the tokens [B, γ] int64."""
        from specd.engine.draft_graphs import sample_slot     # the engine imports this module's package
        from specd.engine.sampler import GREEDY_ROW

        s = ctx[0].shape[1]
        ctx_mask = torch.arange(s, device=lens.device)[None, :] < lens[:, None]
        hidden, tok, own, tokens = tails, anchors, [], []
        greedy = settings.kind == GREEDY_ROW          # once for the γ steps (sample_slot's ``greedy``)
        for k in range(self.config.gamma):
            hidden = self.step(hidden, tok, lens + k, ctx, ctx_mask, own)
            tok = sample_slot(self.logits(hidden), settings, path, k, probs_out, greedy=greedy)
            tokens.append(tok)
        return torch.stack(tokens, dim=1)

    @torch.no_grad()
    def draft(self, ctx_feats: Sequence[Tensor], last_tokens: Sequence[int], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], ctx_tokens: Sequence[Tensor] | None = None) -> DraftOutput:
        """The stateless form. ctx_feats[i]: [n_i, d] fused (n_i >= 1); ctx_tokens[i]: [n_i] the tokens
        at positions 0..n_i-1 (EAGLE-3 embeds token t+1 with feature t). Serving keeps DraftContexts."""
        if ctx_tokens is None or len(ctx_tokens) != len(ctx_feats):
            raise DrafterError("eagle3 needs ctx_tokens, one [n_i] tensor per request")
        if any(f.shape[0] < 1 or f.shape[0] != tk.shape[0] for f, tk in zip(ctx_feats, ctx_tokens)):
            raise DrafterError("eagle3 needs n_i >= 1 features and as many context tokens per request")
        contexts = [self.new_context() for _ in ctx_feats]
        tails = []
        for c, f, tk, last in zip(contexts, ctx_feats, ctx_tokens, last_tokens):
            nxt = torch.cat([tk[1:], torch.tensor([last], dtype=tk.dtype)])
            tails.append(self.absorb(c, f, nxt))
        return self.draft_contexts(contexts, tails, last_tokens, params, generators)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)

    def describe(self) -> str:
        c = self.config
        return (f"eagle3: 1 layer, γ={c.gamma} sequential steps, fuses target layers {list(c.target_layers)}, "
                f"{self.num_parameters() / 1e6:.3f} M own parameters")

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [...] -> cos, sin [..., 1, D]."""
        cos, sin = self.rotary(positions.reshape(-1), dtype)
        shape = (*positions.shape, 1, cos.shape[-1])
        return cos.view(shape), sin.view(shape)
