"""Acceptance benchmark: τ of a drafter against the real target, by lossless chain verification.

    python -m bench acceptance --target models/stories260K.gguf --drafter models/drafters/stories260K-dspark \\
        --self-prompts 16 --prompt-seed 1 --temperature 0 --gamma 7 --out results.json
    python -m bench acceptance --target qwen.gguf --drafter ngram --workload coding --temperature 1 --out r.json

For every prompt, repeatedly: the drafter proposes γ tokens from the current context (DSpark/DFlash/EAGLE-3
read the target's captured layer outputs of the context, n-gram reads the tokens), the target runs once
over ``[last token, drafts]`` (its KV kept across rounds and cropped to the accepted prefix), and
``kernels.rejection_sample`` accepts a prefix and emits one more token from the target (residual or bonus),
so the output is distributed exactly as the target's. Reported:

- τ: mean tokens emitted per verification (accepted drafts + the bonus/replacement token);
- conditional acceptance by position j: P(draft j accepted | drafts < j accepted);
- ECE of the cumulative survival Πc_i vs the observed survival, with raw and STS-calibrated confidences
  (temperatures from ``DIR/calibration.json``, written by ``specd train-drafter``);
- draft cost: wall time of ``draft()`` as a fraction of the target's verify forward.

Greedy (T = 0) uses one-hot target and draft distributions: a draft survives iff it is the target's argmax.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import torch
from torch import Tensor

from kernels.rejection_sample import rejection_sample
from specd.models.contiguous import causal_attention
from specd.sampling_params import SamplingParams
from specd.engine.speculation import target_probs  # the one definition of "what the target samples from"

DEFAULT_MAX_NEW_TOKENS = 128
WEIGHTS_FILE = "drafter.safetensors"   # in a drafter directory, beside drafter.json and calibration.json


class ChainKV:
    """The target's KV of one sequence, with `crop`: a verify step writes 1 + γ positions and rejection
    keeps only the accepted prefix. Implements the AttentionBackend protocol (specd/models/layers.py)."""

    def __init__(self, num_layers: int):
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.length = 0       # positions cached (as of the last completed forward)

    def begin(self, n: int, device: torch.device) -> Tensor:
        """Positions [n] of the next n tokens."""
        return torch.arange(self.length, self.length + n, device=device)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q: [n, Hq, D]; k, v: [n, Hkv, D]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        if layer == len(self.k) - 1:
            self.length = self.k[layer].shape[0]
        return causal_attention(q, self.k[layer], self.v[layer])

    def crop(self, length: int) -> None:
        self.k = [None if t is None else t[:length] for t in self.k]
        self.v = [None if t is None else t[:length] for t in self.v]
        self.length = min(self.length, length)


class Proposer(Protocol):
    """What the harness needs from a drafter. `captured` holds the target's outputs of `capture_layers`
    for context positions 0..n−2 (every token but the last, which the target has not run yet)."""
    capture_layers: tuple[int, ...]

    def propose(self, tokens: list[int], captured: list[Tensor], params: SamplingParams,
                generator: torch.Generator) -> "object":  # a DraftOutput with batch 1
        ...


class DrafterProposer:
    """A trained DSpark/DFlash/EAGLE-3 drafter: fuse the captured features, then one batched draft call."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.capture_layers = tuple(drafter.config.target_layers)

    @torch.no_grad()
    def propose(self, tokens, captured, params, generator):
        ctx_tokens = torch.tensor(tokens[:-1], dtype=torch.int64)      # EAGLE-3 pairs feature t with token t+1
        return self.drafter.draft([self.drafter.fuse(captured)], [tokens[-1]], [params], [generator],
                                  ctx_tokens=[ctx_tokens])


class NgramProposer:
    """Prompt lookup over the token history (no target features)."""
    capture_layers: tuple[int, ...] = ()

    def __init__(self, ngram):
        self.ngram = ngram

    def propose(self, tokens, captured, params, generator):
        return self.ngram.draft([tokens], [params], [generator])


@dataclass
class ChainRecord:
    """Per verification round: drafts proposed and accepted, raw confidences, wall times."""
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidence: list[list[float]] = field(default_factory=list)   # rows of γ, rounds with a full block only
    conf_accepted: list[int] = field(default_factory=list)        # accepted drafts of those rounds
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)

    def extend(self, other: "ChainRecord") -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).extend(getattr(other, name))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_chain(target, proposer: Proposer, prompt: Sequence[int], params: SamplingParams, gamma: int,
              max_new_tokens: int, generator: torch.Generator, stop_ids: frozenset[int] = frozenset(),
              max_len: int | None = None) -> tuple[list[int], ChainRecord]:
    """Speculative generation of one prompt; returns (generated tokens, per-round record).

    The prompt minus its last token is prefilled first; every round then verifies [last, drafts]."""
    device = next(target.parameters()).device
    layers = proposer.capture_layers
    max_len = max_len or target.config.max_position_embeddings
    kv = ChainKV(target.config.num_layers)
    tokens = list(prompt)
    captured = _forward(target, kv, tokens[:-1], layers, device)[1]
    rec = ChainRecord()
    generated: list[int] = []
    while len(generated) < max_new_tokens and len(tokens) + gamma + 1 <= max_len:
        _sync(device)
        t0 = time.perf_counter()
        draft = proposer.propose(tokens, captured, params, generator)
        _sync(device)
        t1 = time.perf_counter()
        n_draft = int(draft.lengths[0]) if getattr(draft, "lengths", None) is not None else gamma
        drafts = draft.tokens[0, :n_draft].tolist()
        logits, new_feats = _forward(target, kv, [tokens[-1], *drafts], layers, device)
        _sync(device)
        rec.draft_s.append(t1 - t0)
        rec.verify_s.append(time.perf_counter() - t1)
        acc, emitted = _accept(logits, draft, n_draft, gamma, params, generator)
        kv.crop(len(tokens) + acc)                     # the cache holds tokens[:-1], last, accepted drafts
        captured = [torch.cat([c, f[:1 + acc]]) for c, f in zip(captured, new_feats)]
        rec.drafted.append(n_draft)
        rec.accepted.append(acc)
        if draft.confidence is not None and n_draft == gamma:
            rec.confidence.append(draft.confidence[0].float().tolist())
            rec.conf_accepted.append(acc)
        for tok in emitted:
            tokens.append(tok)
            generated.append(tok)
            if tok in stop_ids or len(generated) >= max_new_tokens:
                return generated, rec
    return generated, rec


def _forward(target, kv: ChainKV, ids: list[int], layers: tuple[int, ...], device) -> tuple[Tensor, list[Tensor]]:
    """Run the target over `ids` after the cached prefix: (logits [n, V] fp32, captured [n, d] per layer)."""
    if not ids:
        d = target.config.hidden_size
        empty = [torch.empty(0, d, device=device) for _ in layers]
        return torch.empty(0, target.config.vocab_size, device=device), empty
    positions = kv.begin(len(ids), device)
    out = target(torch.tensor(ids, dtype=torch.int64, device=device), positions, kv, capture_layers=list(layers))
    return target.logits(out.hidden), list(out.captured)


def _accept(logits: Tensor, draft, n_draft: int, gamma: int, params: SamplingParams,
            generator: torch.Generator) -> tuple[int, list[int]]:
    """Lossless rejection sampling of one round: (accepted drafts, emitted tokens incl. the last one)."""
    device = logits.device
    vocab = logits.shape[1]
    t_probs = torch.zeros(1, gamma + 1, vocab, device=device)
    t_probs[0, :n_draft + 1] = target_probs(logits, params)
    d_probs = torch.zeros(1, gamma, vocab, device=device)
    d_probs[0, :n_draft] = draft.probs[0, :n_draft].float().to(device)
    d_tokens = torch.zeros(1, gamma, dtype=torch.int64, device=device)
    d_tokens[0, :n_draft] = draft.tokens[0, :n_draft].to(device)
    uniforms = torch.rand(1, gamma, generator=generator).to(device)
    bonus = torch.rand(1, generator=generator).to(device)
    acc, out = rejection_sample(t_probs, d_probs, d_tokens, torch.tensor([n_draft], dtype=torch.int32, device=device),
                                uniforms, bonus)
    a = int(acc[0])
    return a, out[0, :a + 1].tolist()


def summarize(rec: ChainRecord, gamma: int, temperatures: Sequence[float] | None) -> dict:
    """τ, conditional acceptance by position, ECE raw / after STS, draft cost fraction."""
    from specd.drafter.calibration import ece_by_position

    drafted = torch.tensor(rec.drafted)
    accepted = torch.tensor(rec.accepted)
    by_pos = []
    for j in range(1, gamma + 1):
        reached = (accepted >= j - 1) & (drafted >= j)
        by_pos.append(float((accepted[reached] >= j).float().mean()) if reached.any() else None)
    out = {
        "rounds": len(rec.accepted),
        "tau": float((accepted + 1).float().mean()) if len(rec.accepted) else None,
        "mean_drafted": float(drafted.float().mean()) if len(rec.drafted) else None,
        "acceptance_by_position": by_pos,
        "draft_cost_fraction": sum(rec.draft_s) / max(sum(rec.verify_s), 1e-12),
        "draft_ms_mean": 1e3 * sum(rec.draft_s) / max(len(rec.draft_s), 1),
        "verify_ms_mean": 1e3 * sum(rec.verify_s) / max(len(rec.verify_s), 1),
        "ece_raw": None, "ece_sts": None, "ece_raw_by_position": None, "ece_sts_by_position": None,
    }
    if rec.confidence:
        logits = torch.logit(torch.tensor(rec.confidence, dtype=torch.float64).clamp(1e-7, 1 - 1e-7))
        acc = torch.tensor(rec.conf_accepted)
        out["ece_raw"], out["ece_raw_by_position"] = ece_by_position(logits, acc, torch.ones(gamma))
        if temperatures is not None:
            out["ece_sts"], out["ece_sts_by_position"] = ece_by_position(logits, acc, torch.tensor(temperatures))
    return out


# ---- prompts ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalPrompt:
    """A prompt to continue: token ids, or a session turn whose history is filled in as answers come."""
    ids: list[int] | None = None
    session: object | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS


def _sessions(args: argparse.Namespace) -> list:
    from bench.workloads.format import read_sessions

    if Path(args.workload).exists():
        sessions = [s for s in read_sessions(args.workload) if s.split == "eval"]
    else:
        from bench.workloads.build import build_sessions
        from bench.workloads.profile import SCALES, BuildOptions
        sessions = build_sessions(args.workload, BuildOptions(split="eval", sessions=args.sessions,
                                                              scale=SCALES[args.scale]))
    return sessions[:args.sessions]


def eval_prompts(args: argparse.Namespace, target, tokenizer) -> list[EvalPrompt]:
    from specd.drafter.data import self_openings

    if args.prompts:
        lines = [ln.strip() for ln in Path(args.prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
        return [EvalPrompt(ids=tokenizer.encode(ln), max_new_tokens=args.max_new_tokens)
                for ln in lines[:args.sessions]]
    if args.self_prompts:
        ids = self_openings(target, tokenizer, args.self_prompts, args.opening_tokens, seed=args.prompt_seed)
        return [EvalPrompt(ids=p, max_new_tokens=args.max_new_tokens) for p in ids]
    return [EvalPrompt(session=s, max_new_tokens=args.max_new_tokens) for s in _sessions(args)]


def run_prompts(target, tokenizer, proposer: Proposer, prompts: Sequence[EvalPrompt], params: SamplingParams,
                gamma: int, seed: int, progress: bool = True) -> ChainRecord:
    """Every prompt (and every turn of a session, with the chain's own answers as history)."""
    from tqdm import tqdm

    from bench.workloads.format import prompt_messages

    total = ChainRecord()
    for i, p in enumerate(tqdm(prompts, desc="acceptance", disable=not progress)):
        gen = torch.Generator().manual_seed(seed + i)
        if p.ids is not None:
            rec = run_chain(target, proposer, p.ids, params, gamma, p.max_new_tokens, gen, tokenizer.stop_ids)[1]
            total.extend(rec)
            continue
        answers: list[str] = []
        for turn in range(len(p.session.turns)):
            extra = {"tools": p.session.tools} if p.session.tools else {}
            ids = tokenizer.encode_chat(prompt_messages(p.session, turn, answers), **extra)
            budget = p.max_new_tokens or p.session.turns[turn].max_tokens
            if len(ids) + budget + gamma + 1 > target.config.max_position_embeddings:
                break
            out, rec = run_chain(target, proposer, ids, params, gamma, budget, gen, tokenizer.stop_ids)
            total.extend(rec)
            answers.append(tokenizer.decode(out))
    return total


# ---- command line -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="GGUF file or HF directory")
    parser.add_argument("--drafter", required=True, help="a drafter directory (specd train-drafter --out), or 'ngram'")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload",
                     help="a workload name (eval split built on the fly) or a SESSIONS.jsonl (its eval split)")
    src.add_argument("--prompts", type=Path, help="plain prompts, one per line")
    src.add_argument("--self-prompts", type=int, help="N openings sampled from the target (BOS + tokens at T=1)")
    parser.add_argument("--prompt-seed", type=int, default=1, help="seed of --self-prompts (training uses 0)")
    parser.add_argument("--opening-tokens", type=int, default=8, help="tokens per self-sampled opening")
    parser.add_argument("--scale", default="full",
                        help="workload scale when --workload is a name (see build-workloads; tiny fits stories260K)")
    parser.add_argument("--temperature", type=float, required=True, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--gamma", type=int, default=7)
    parser.add_argument("--sessions", type=int, default=16, help="prompts or sessions evaluated")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="answer length (default: the session turn's max_tokens; "
                             f"{DEFAULT_MAX_NEW_TOKENS} for prompts)")
    parser.add_argument("--seed", type=int, default=0, help="rejection-sampling / draft RNG seed")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="float32",
                        help="target dtype; the drafters are fp32 and do not accept bf16 target features yet")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: a tiny target is latency-bound; more threads only contend)")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")


def load_proposer(spec: str, target, gamma: int):
    """(proposer, STS temperatures or None) for `--drafter DIR|ngram`."""
    from specd.drafter.config import DrafterConfig
    from specd.drafter.ngram import NgramDrafter

    if spec == "ngram":
        return NgramProposer(NgramDrafter(DrafterConfig.for_target(target.config, "ngram", gamma=gamma))), None
    from specd.drafter.base import load_drafter

    drafter = load_drafter(Path(spec) / WEIGHTS_FILE, target, device=next(target.parameters()).device).eval()
    if drafter.config.gamma != gamma:
        raise SystemExit(f"drafter {spec} was trained with gamma={drafter.config.gamma}, asked for {gamma}")
    cal = Path(spec) / "calibration.json"
    temps = json.loads(cal.read_text())["temperatures"] if cal.exists() else None
    return DrafterProposer(drafter), temps


def run(args: argparse.Namespace) -> int:
    from specd.loader import load_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.target, args.dtype, args.device)
    proposer, temps = load_proposer(args.drafter, target, args.gamma)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.max_new_tokens is None and (args.prompts or args.self_prompts):
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    prompts = eval_prompts(args, target, tokenizer)
    t0 = time.perf_counter()
    rec = run_prompts(target, tokenizer, proposer, prompts, params, args.gamma, args.seed)
    result = {"command": " ".join(["python -m bench acceptance", *sys.argv[2:]]), "drafter": args.drafter,
              "target": str(args.target), "temperature": args.temperature, "gamma": args.gamma,
              "prompts": len(prompts), "wall_s": time.perf_counter() - t0, **summarize(rec, args.gamma, temps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tau", "acceptance_by_position", "ece_raw", "ece_sts",
                                             "draft_cost_fraction", "rounds")}))
    return 0
