"""What every drafter shares: its output types, exact per-slot sampling, and the checkpoint format.

The one invariant that makes speculation lossless lives here: `DraftOutput.probs` is *exactly* the
distribution each drafted token was drawn from (DESIGN.md §5, Verification). `SlotSampler` therefore
draws the token and returns the probabilities from the same tensor, through the engine's own
`sampling_probs` / `inverse_cdf`, so the verifier can never see a different p_d.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from safetensors.torch import load_file, save_file
import torch.nn.functional as F
from torch import Tensor, nn

from kvspec_kernels.markov_slot import plain_slot
from specd.drafter.config import DrafterConfig
from specd.engine.sampler import RowKinds, draw_uniforms, inverse_cdf, sampling_probs
from specd.sampling_params import SamplingParams

CHECKPOINT_FORMAT = 1


class DrafterError(RuntimeError):
    """A drafter used in a way that cannot work (no target attached, bad anchors, wrong feature count)."""


@dataclass
class DraftOutput:
    tokens: Tensor                  # [B, gamma] int64, proposals left to right (slot k follows slot k-1)
    probs: Tensor                   # [B, gamma, V] fp32, exactly what each token was sampled from
    confidence: Tensor | None       # [B, gamma] fp32 raw sigmoid(conditional survival), before calibration
    lengths: Tensor | None = None   # [B] int64 valid slots per row; None means all gamma (n-gram may stop short)

    def __post_init__(self) -> None:
        if self.lengths is None:
            b, g = self.tokens.shape
            self.lengths = torch.full((b,), g, dtype=torch.int64, device=self.tokens.device)


@dataclass
class BlockOut:
    base_logits: Tensor             # [N, gamma, V] fp32, LM head on the draft hidden states (no Markov bias)
    hidden: Tensor                  # [N, gamma, d], final-normed draft hidden states


class Drafter(Protocol):
    config: DrafterConfig

    def draft(self, ctx_feats: list[Tensor], last_tokens: list[int], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], ctx_tokens: list[Tensor] | None = None) -> DraftOutput:
        ...


class BorrowsTargetHeads:
    """Mixin for drafters that share the target's embedding and LM head (set ``self._heads = None``)."""

    _heads: "TargetHeads | None"

    def attach_target(self, target: nn.Module):
        """Borrow the target's (a DecoderModel's) embedding and LM head; nothing is copied."""
        heads = TargetHeads(target.embed_tokens, target.lm_head)
        heads.check(self.config)
        self._heads = heads
        return self

    @property
    def heads(self) -> "TargetHeads":
        if self._heads is None:
            raise DrafterError("no target attached: call drafter.attach_target(target) first")
        return self._heads


class TargetHeads:
    """The target's token embedding and LM head, borrowed by a drafter (DESIGN.md §5: frozen copies).

    A plain object, not an nn.Module, so the weights stay out of the drafter's state dict, parameters
    and optimizer; `detach()` keeps them frozen even if the target's tensors require grad.
    """

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def embed(self, ids: Tensor) -> Tensor:
        """ids: [...] int64 -> [..., d] in the target's dtype."""
        return F.embedding(ids, self.embed_tokens.weight.detach())

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [..., d] -> [..., V] fp32 (matmul in the model dtype, then upcast, like the target)."""
        return F.linear(hidden, self.lm_head.weight.detach()).float()

    def check(self, config: DrafterConfig) -> None:
        want = (config.vocab_size, config.hidden_size)
        for name, w in (("embedding", self.embed_tokens.weight), ("LM head", self.lm_head.weight)):
            if tuple(w.shape) != want:
                raise DrafterError(f"target {name} is {tuple(w.shape)}, the drafter expects {want}")


class SlotSampler:
    """Samples one block slot for every request with that request's own settings.

    Built once per draft call: the sampled (non-greedy) rows and their temperature/top-k/top-p tensors,
    the path each row takes through `sampling_probs` (decided here, on the host, so the loop never syncs),
    and the uniforms (gamma per sampled request, drawn up front from its generator, so a batched call
    consumes each generator exactly as a single call would). Greedy rows draw no uniforms, like the engine
    sampler: their distribution is the one-hot at the argmax.

    A batch of greedy and unfiltered rows only (no top-k, no top-p) takes one fused call per slot
    (kvspec_kernels/markov_slot.plain_slot: softmax or one-hot, written once, and the draw), the call the
    draft graphs make for such a batch (specd/engine/draft_graphs.py), so both give the same bits. Any other
    batch: an argmax and one-hot for the greedy rows, `sampling_probs` and the inverse CDF for the sampled.
    """

    def __init__(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 gamma: int, device: torch.device):
        if len(params) != len(generators):
            raise DrafterError(f"{len(params)} sampling params for {len(generators)} generators")
        self.rows = [i for i, p in enumerate(params) if not p.greedy]      # sampled rows, on the host
        self.all_rows = bool(self.rows) and len(self.rows) == len(params)
        self.index = torch.tensor(self.rows, dtype=torch.int64, device=device)
        sampled = [params[i] for i in self.rows]
        self.temperature = torch.tensor([p.temperature for p in sampled], dtype=torch.float32, device=device)
        self.top_k = torch.tensor([p.top_k for p in sampled], dtype=torch.int64, device=device)
        self.top_p = torch.tensor([p.top_p for p in sampled], dtype=torch.float32, device=device)
        self.top_k_list, self.top_p_list = [p.top_k for p in sampled], [p.top_p for p in sampled]
        self.uniforms = draw_uniforms([generators[i] for i in self.rows], gamma).to(device)   # [S, gamma]
        self.greedy_rows = [p.greedy for p in params]
        self._plain: tuple[Tensor, Tensor, Tensor] | None = None     # built on the first fused slot

    def _plain_settings(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The whole batch's temperature [B], uniforms [B, gamma] (greedy rows: 1 and 0) and greedy mask [B]
        for the fused call, built once per draft call."""
        if self._plain is None:
            t = torch.ones(len(self.greedy_rows), dtype=torch.float32, device=device)
            u = torch.zeros(len(self.greedy_rows), self.uniforms.shape[1], dtype=torch.float32, device=device)
            if self.rows:
                t[self.index], u[self.index] = self.temperature, self.uniforms
            self._plain = t, u, torch.tensor(self.greedy_rows, dtype=torch.bool, device=device)
        return self._plain

    def __call__(self, logits: Tensor, slot: int) -> tuple[Tensor, Tensor]:
        """logits: [B, V] fp32 (Markov-corrected) -> (tokens [B] int64, probs [B, V] fp32)."""
        kinds = self._kinds(logits)
        if not (kinds.top_k or kinds.top_p):          # greedy and unfiltered rows only: the graphs' fused call
            t, u, greedy = self._plain_settings(logits.device)
            probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            tokens = plain_slot(logits, None, t, u[:, slot], greedy, probs, bool(self.rows), not self.all_rows)
            return tokens, probs
        if self.all_rows:
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p, kinds, draft=True)
            return inverse_cdf(probs, self.uniforms[:, slot]), probs
        argmax = logits.argmax(dim=1)
        probs = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, argmax[:, None], 1.0)
        sampled = sampling_probs(logits[self.index], self.temperature, self.top_k, self.top_p, kinds, draft=True)
        probs[self.index] = sampled
        return argmax.index_copy(0, self.index, inverse_cdf(sampled, self.uniforms[:, slot])), probs

    def _kinds(self, logits: Tensor) -> RowKinds:
        return RowKinds.of(self.top_k_list, self.top_p_list, logits.shape[1])


def load_deepspec_state_dict(drafter: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a DeepSpec checkpoint's state dict strictly into our drafter of the same method.

    DeepSpec stores frozen copies of the target's `embed_tokens` / `lm_head`; we borrow the target's
    own, so those two keys are dropped here (after checking their shapes) and everything else must
    match key for key and shape for shape.
    """
    config: DrafterConfig = drafter.config
    want = (config.vocab_size, config.hidden_size)
    state = dict(state)
    for key in ("embed_tokens.weight", "lm_head.weight"):
        w = state.pop(key, None)
        if w is not None and tuple(w.shape) != want:
            raise DrafterError(f"checkpoint {key} is {tuple(w.shape)}, the target's is {want}")
    drafter.load_state_dict(state, strict=True)


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Parameters owned by the drafter; the shared (target) embedding and LM head are never counted."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def build_drafter(config: DrafterConfig, target: nn.Module | None = None) -> Any:
    """A fresh drafter of `config.method`, attached to `target` (a DecoderModel) when given."""
    # imported here: the drafter modules import this file for DraftOutput
    from specd.drafter.dspark import BlockDrafter
    from specd.drafter.eagle3 import Eagle3Drafter
    from specd.drafter.ngram import NgramDrafter

    if config.method == "ngram":
        return NgramDrafter(config)
    drafter = (Eagle3Drafter if config.method == "eagle3" else BlockDrafter)(config)
    if target is not None:
        drafter.attach_target(target)
    return drafter


def config_path(path: str | os.PathLike) -> Path:
    """The JSON beside a drafter's safetensors file: drafter.safetensors -> drafter.json."""
    return Path(path).with_suffix(".json")


def save_drafter(drafter: Any, path: str | os.PathLike, extra_meta: dict[str, Any] | None = None) -> None:
    """Weights to `path` (safetensors, drafter-owned tensors only) and {format, config, meta} beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = drafter.state_dict() if isinstance(drafter, nn.Module) else {}
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path))
    doc = {"format": CHECKPOINT_FORMAT, "config": drafter.config.to_dict(), "meta": extra_meta or {}}
    config_path(path).write_text(json.dumps(doc, indent=2, sort_keys=True))


def load_drafter(path: str | os.PathLike, target: nn.Module | None = None,
                 device: str | torch.device | None = None) -> Any:
    """Rebuild a drafter saved by `save_drafter`; weights load strictly. `drafter.meta` holds extra_meta.

    `target` (the DecoderModel it drafts for) supplies the frozen embedding and LM head; without it,
    call `drafter.attach_target(target)` before any forward.
    """
    doc = json.loads(config_path(path).read_text())
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise DrafterError(f"{path}: checkpoint format {doc.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    drafter = build_drafter(DrafterConfig.from_dict(doc["config"]), target)
    if isinstance(drafter, nn.Module):
        drafter.load_state_dict(load_file(str(path)), strict=True)
        if device is not None:
            drafter.to(device)
    drafter.meta = doc["meta"]
    return drafter
