"""Online-distillation trainer: the target runs in every step, the drafter learns from it.

One step: pick `batch_size` sequences (prompt + the target's own answer, see data.py), run the target once
over all of them (a ragged batch, no grad) capturing the layers the drafter fuses and the logits at every
position, then draw `anchors` random anchors per sequence inside the answer and train on those blocks:

- dspark: ``0.1·CE + 0.9·L1 + 1.0·BCE(confidence)`` on the Markov-corrected logits (losses.py);
- dflash: position-weighted CE on the block logits;
- eagle3: training-time test, CE over γ unrolled steps.

Hidden states are never written to disk (DeepSpec's offline cache is 38 TB for Qwen3-4B): they are
recomputed each step, which on a small target costs less than reading them back. AdamW, linear warmup then
cosine decay, gradient clipping at 1.0. A checkpoint (weights, optimizer, schedule, RNG, loss curves) is
written every `ckpt_every` steps; `resume` continues from it bit-for-bit in the data order.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from specd.drafter.data import TrainSequence
from specd.drafter.losses import LossParts, dflash_loss, dspark_loss, eagle3_loss
from specd.models import DecoderModel
from specd.models.padded_prefill import PaddedPrefill

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    lr: float = 6e-4
    warmup_frac: float = 0.04      # DeepSpec: 4% linear warmup, then cosine to 0
    weight_decay: float = 0.0      # DeepSpec: wd 0
    grad_clip: float = 1.0
    batch_size: int = 8            # sequences per step
    anchors: int = 16              # random anchors per sequence
    log_every: int = 10            # loss-curve resolution (steps)
    ckpt_every: int = 200
    seed: int = 0


@dataclass
class LossCurves:
    """Means over each `log_every` window: what training.json reports."""
    step: list[int] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    l1: list[float] = field(default_factory=list)
    bce: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)


def lr_factor(step: int, total: int, warmup_frac: float) -> float:
    """Linear warmup over warmup_frac·total steps, then cosine from 1 to 0."""
    warmup = max(1, int(round(total * warmup_frac)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def target_states(target: DecoderModel, seqs: Sequence[list[int]], layers: Sequence[int]
                  ) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One ragged target forward over all sequences: per sequence its final-normed hidden states [T_i, d]
    and the captured outputs of `layers` ([T_i, d] each). Logits are left to the caller: on Qwen
    (V = 151,936) logits at every position of a batch would be gigabytes, and only dspark's L1 needs
    them, at its block positions only."""
    device = next(target.parameters()).device
    kv = PaddedPrefill.for_model(target.config)      # one attention call per layer (specd/models/padded_prefill.py)
    positions = kv.begin([(i, len(s)) for i, s in enumerate(seqs)], device=device,
                         num_heads=target.config.num_heads)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
    out = target(ids, positions, kv, capture_layers=list(layers))
    sizes = [len(s) for s in seqs]
    captured = [list(parts) for parts in zip(*(c.split(sizes) for c in out.captured))] if layers else [[] for _ in seqs]
    return list(out.hidden.split(sizes)), captured


def in_dtype(hidden: list[Tensor], captured: list[list[Tensor]], dtype: torch.dtype
             ) -> tuple[list[Tensor], list[list[Tensor]]]:
    """``target_states``' output cast to ``dtype`` (the drafter's and the borrowed LM head's): features
    from a bf16 pass feed an fp32 drafter. A no-op when the dtypes already match."""
    if not hidden or hidden[0].dtype == dtype:
        return hidden, captured
    return [h.to(dtype) for h in hidden], [[c.to(dtype) for c in cs] for cs in captured]


@torch.no_grad()
def target_pass(target: DecoderModel, seqs: Sequence[list[int]], layers: Sequence[int]
                ) -> tuple[list[Tensor], list[list[Tensor]]]:
    """`target_states` with the logits [T_i, V] fp32 at every position (calibration's short held-out pass)."""
    hidden, captured = target_states(target, seqs, layers)
    return [target.logits(h) for h in hidden], captured


def sample_anchors(prompt_len: int, length: int, n: int, gen: torch.Generator) -> Tensor:
    """[≤ n] distinct anchors a in [prompt_len − 1, length − 2]: slot 0 always predicts an answer token."""
    lo = max(prompt_len - 1, 0)
    span = length - 1 - lo
    if span <= 0:
        return torch.empty(0, dtype=torch.int64)
    return (lo + torch.randperm(span, generator=gen)[:n]).sort().values


def method_anchors(method: str, seq: TrainSequence, gamma: int, n: int, gen: torch.Generator) -> Tensor:
    """Anchors for one sequence. EAGLE-3's unroll needs its γ steps inside the sequence (a ≤ T − γ) and a
    context element before the anchor (a ≥ 1); block drafters accept anchors up to T − 2 (labels masked)."""
    if method == "eagle3":
        return sample_anchors(max(seq.prompt_len, 2), len(seq.tokens) - gamma + 2, n, gen)
    return sample_anchors(seq.prompt_len, len(seq.tokens), n, gen)


@dataclass
class Blocks:
    """Teacher-forced block targets of N anchors of one sequence."""
    labels: Tensor        # [N, γ] int64, tokens[a+1+k] (clamped where invalid)
    valid: Tensor         # [N, γ] bool, a+1+k < T
    prev: Tensor          # [N, γ] int64, tokens[a+k]: the anchor, then the teacher-forced previous token
    target_logits: Tensor | None  # [N, γ, V] the target's logits at a+k (they predict tokens[a+1+k])


def make_blocks(tokens: Tensor, states: Tensor | None, anchors: Tensor, gamma: int,
                to_logits: Callable[[Tensor], Tensor] | None = None) -> Blocks:
    """tokens: [T] int64; anchors: [N]; states: [T, V] target logits, or [T, d] hidden states turned into
    logits by `to_logits` at the block positions only, or None (no target logits: CE-only methods)."""
    t = tokens.shape[0]
    pos = anchors[:, None] + torch.arange(gamma, device=tokens.device)[None]    # [N, γ] = a+k
    valid = pos + 1 < t
    safe = pos.clamp(max=t - 1)
    picked = None if states is None else states[safe]
    if picked is not None and to_logits is not None:
        picked = to_logits(picked)
    return Blocks(labels=tokens[(pos + 1).clamp(max=t - 1)], valid=valid, prev=tokens[safe], target_logits=picked)


def block_loss(drafter, method: str, feats: list[list[Tensor]], seqs: list[Tensor], hidden: list[Tensor],
               anchors: list[Tensor], to_logits: Callable[[Tensor], Tensor]) -> LossParts:
    """``block_loss_reference`` in one batched drafter forward: the features of all sequences fused in one
    projection, every block in ``block_logits_batch`` (EAGLE-3: every unroll in ``ttt_logits_batch``), the
    target's LM head once over every block position. The rows reach the loss in the reference's order, so only the
    attention's padding changes the summation order (tests/drafter/test_train.py). Why: the reference
    runs the drafter once per sequence, and the H200 step is host-bound (docs/results/acceptance.md,
    session 8). ``anchors`` may live on the host: they are moved to the device in one copy."""
    keep = [i for i, an in enumerate(anchors) if an.numel()]
    if not keep:
        raise ValueError("no sequence of the batch has an anchor")
    gamma, device = drafter.config.gamma, seqs[keep[0]].device
    toks = [seqs[i] for i in keep]
    host = [anchors[i].to("cpu") for i in keep]
    on_device = torch.cat(host).to(device).split([a.numel() for a in host])
    sizes = [t.shape[0] for t in toks]
    layers = len(feats[keep[0]])
    fused = drafter.fuse([torch.cat([feats[i][j] for i in keep]) for j in range(layers)]).split(sizes)
    if method == "eagle3":                  # the unroll of every sequence at once (``ttt_logits_batch``)
        blocks = [make_blocks(t, None, a, gamma) for t, a in zip(toks, on_device)]
        pred = drafter.ttt_logits_batch(fused, toks, host, gamma)
        return eagle3_loss(pred, torch.cat([b.labels for b in blocks]), torch.cat([b.valid for b in blocks]))
    out = drafter.block_logits_batch(fused, toks, host)
    dspark = method == "dspark"
    blocks = [make_blocks(t, hidden[i] if dspark else None, a, gamma) for i, t, a in zip(keep, toks, on_device)]
    prev = torch.cat([b.prev for b in blocks])
    labels = torch.cat([b.labels for b in blocks])
    valid = torch.cat([b.valid for b in blocks])
    pred = drafter.markov_logits(out.base_logits, prev)
    if not dspark:
        return dflash_loss(pred, labels, valid)
    picked = torch.cat([b.target_logits for b in blocks])                  # target hidden states [ΣN, γ, d]
    t_logits = to_logits(picked.view(-1, picked.shape[-1])).view(*picked.shape[:2], -1)
    conf = drafter.confidence_logits(out.hidden, prev) if drafter.config.confidence else None
    return dspark_loss(pred, t_logits, labels, valid, conf)


def block_loss_reference(drafter, method: str, feats: list[list[Tensor]], seqs: list[Tensor], hidden: list[Tensor],
                         anchors: list[Tensor], to_logits: Callable[[Tensor], Tensor]) -> LossParts:
    """The method's loss over all anchors of the batch (blocks of every sequence concatenated), one
    drafter forward per sequence: the readable reference of ``block_loss`` (EAGLE-3's path until session 42).
    hidden: the target's final hidden states per sequence; `to_logits` (the target's LM head) runs on the
    dspark block positions only."""
    gamma = drafter.config.gamma
    outs, confs, blocks = [], [], []
    for f, tok, h, an in zip(feats, seqs, hidden, anchors):
        if an.numel() == 0:
            continue
        an = an.to(tok.device)
        b = make_blocks(tok, h if method == "dspark" else None, an, gamma, to_logits)
        ctx = drafter.fuse(f)
        if method == "eagle3":
            outs.append(drafter.ttt_logits(ctx, tok, an, gamma))
        else:
            out = drafter.block_logits(ctx, tok, an)
            outs.append(drafter.markov_logits(out.base_logits, b.prev))
            if method == "dspark" and drafter.config.confidence:
                confs.append(drafter.confidence_logits(out.hidden, b.prev))
        blocks.append(b)
    pred = torch.cat(outs)
    labels = torch.cat([b.labels for b in blocks])
    valid = torch.cat([b.valid for b in blocks])
    if method == "dspark":
        t_logits = torch.cat([b.target_logits for b in blocks])
        return dspark_loss(pred, t_logits, labels, valid, torch.cat(confs) if confs else None)
    if method == "dflash":
        return dflash_loss(pred, labels, valid)
    return eagle3_loss(pred, labels, valid)


class Trainer:
    """Owns the optimizer, schedule, data RNG and loss curves of one run; `train` may be resumed."""

    def __init__(self, target: DecoderModel, drafter, seqs: Sequence[TrainSequence], cfg: TrainConfig, out_dir: Path,
                 features: DecoderModel | None = None):
        """``features``: the model whose pass gives the drafter its features and the target's hidden
        states (default ``target``): a bf16 copy on CUDA (``data.served_copy``), what specd serves. The
        LM head of the target logits stays ``target``'s, as does the drafter's borrowed head."""
        self.target, self.drafter, self.seqs, self.cfg, self.out_dir = target, drafter, list(seqs), cfg, Path(out_dir)
        self.features = target if features is None else features
        self.method = drafter.config.method
        self.device = next(target.parameters()).device
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.optim, lambda s: lr_factor(s, cfg.steps, cfg.warmup_frac))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.curves = LossCurves()
        self.train_s = 0.0
        self._window: list[LossParts] = []

    def train_step(self) -> LossParts:
        idx = torch.randint(len(self.seqs), (self.cfg.batch_size,), generator=self.gen).tolist()
        batch = [self.seqs[i] for i in idx]
        hidden, feats = in_dtype(*target_states(self.features, [s.tokens for s in batch],
                                                self.drafter.config.target_layers), self.target.lm_head.weight.dtype)
        toks = [torch.tensor(s.tokens, dtype=torch.int64, device=self.device) for s in batch]
        anchors = [method_anchors(self.method, s, self.drafter.config.gamma, self.cfg.anchors, self.gen)
                   for s in batch]           # on the host: block_loss moves them in one copy
        self.drafter.train()
        loss = block_loss(self.drafter, self.method, feats, toks, hidden, anchors, self.target.logits)
        self.optim.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optim.step()
        self.sched.step()
        return loss

    def train(self, progress: bool = True, deadline: float | None = None) -> LossCurves:
        """Run to cfg.steps, or stop (checkpointed) once time.perf_counter() passes `deadline`: a GPU
        budget is enforced by cutting the run short, and `step` says where it stopped."""
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.method}", disable=not progress)
        while self.step < self.cfg.steps:
            if deadline is not None and time.perf_counter() > deadline:
                self.save_checkpoint()
                break
            t0 = time.perf_counter()
            loss = self.train_step()
            self.train_s += time.perf_counter() - t0
            self.step += 1
            self._record(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.total.item():.3f}", ce=f"{loss.ce:.3f}")
            if self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
        bar.close()
        self.drafter.eval()
        return self.curves

    def _record(self, loss: LossParts) -> None:
        self._window.append(loss)
        if self.step % self.cfg.log_every and self.step != self.cfg.steps:
            return
        n = len(self._window)
        c = self.curves
        c.step.append(self.step)
        c.total.append(sum(x.total.item() for x in self._window) / n)
        c.ce.append(sum(x.ce for x in self._window) / n)
        c.l1.append(sum(x.l1 for x in self._window) / n)
        c.bce.append(sum(x.bce for x in self._window) / n)
        c.lr.append(self.sched.get_last_lr()[0])
        self._window = []

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        path = self.out_dir / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save({"step": self.step, "drafter": self.drafter.state_dict(), "optim": self.optim.state_dict(),
                    "sched": self.sched.state_dict(), "gen": self.gen.get_state(), "curves": asdict(self.curves),
                    "train_s": self.train_s, "window": [(x.total.item(), x.ce, x.l1, x.bce) for x in self._window],
                    "config": asdict(self.cfg)}, tmp)
        tmp.replace(path)     # atomic: a kill mid-write leaves the previous checkpoint intact
        return path

    def load_checkpoint(self) -> int:
        """Continue a run from out_dir/checkpoint.pt; returns the step it resumes at."""
        state = torch.load(self.out_dir / CHECKPOINT, map_location=self.device, weights_only=False)
        if state["config"]["steps"] != self.cfg.steps:
            raise ValueError(f"checkpoint was for {state['config']['steps']} steps, this run asks {self.cfg.steps}")
        self.drafter.load_state_dict(state["drafter"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.gen.set_state(state["gen"].cpu())   # map_location moved it to the device; a CPU generator needs it back
        self.curves = LossCurves(**state["curves"])
        self.train_s = state["train_s"]
        self._window = [LossParts(torch.tensor(t), ce, l1, bce) for t, ce, l1, bce in state["window"]]
        self.step = state["step"]
        return self.step
