"""Acceptance benchmark: τ of a drafter against the real target, by lossless chain verification.

    python -m bench acceptance --target models/stories260K.gguf --drafter models/drafters/stories260K-dspark \\
        --self-prompts 16 --prompt-seed 1 --temperature 0 --gamma 7 --out results.json
    python -m bench acceptance --target qwen.gguf --drafter ngram --workload coding --temperature 1 --out r.json

For every prompt, repeatedly: the drafter proposes γ tokens from the current context (DSpark/DFlash/EAGLE-3
read the target's captured layer outputs of the context, n-gram reads the tokens), the target runs once
over ``[last token, drafts]`` (its KV kept across rounds and cropped to the accepted prefix), and
``kernels.rejection_sample`` accepts a prefix and emits one more token from the target (residual or bonus),
so the output is distributed exactly as the target's. Prompts run as a batch (`run_batch`): one draft
call, one ragged verify forward and one rejection-sampling call per round for all live chains, because an
eager forward of a 0.5B target costs ~20 ms of host time whatever its token count. Reported:

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
from typing import Hashable, Protocol, Sequence

import torch
from torch import Tensor

from bench.batch_kv import BatchKV, token_chunks
from kvspec_kernels.rejection_sample import rejection_sample
from specd.drafter.base import DraftOutput
from specd.sampling_params import SamplingParams
from specd.engine.speculation import target_probs  # the one definition of "what the target samples from"

DEFAULT_MAX_NEW_TOKENS = 128
WEIGHTS_FILE = "drafter.safetensors"   # in a drafter directory, beside drafter.json and calibration.json




class Proposer(Protocol):
    """What the harness needs from a drafter, batched over rows. `features` turns the target's captured
    layer outputs ([T, d] per layer, flat) into what the proposer keeps per position (fused features, or
    nothing); `propose` drafts γ tokens for every row from its context."""
    capture_layers: tuple[int, ...]

    def features(self, captured: list[Tensor]) -> Tensor:   # -> [T, f]
        ...

    def propose(self, rows: Sequence["Row"], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator]) -> "object":  # a DraftOutput with batch len(rows)
        ...


@dataclass
class Row:
    """One chain's context: `tokens` (prompt + emitted), `ids` the same as a CPU tensor (capacity-sized,
    valid up to len(tokens)), `feats` [len(tokens) − 1, f] the kept features of every token but the last
    (the target has not run on the last one yet)."""
    tokens: list[int]
    ids: Tensor
    feats: Tensor

    def context_ids(self) -> Tensor:
        """[n − 1] the tokens whose features are in `feats`."""
        return self.ids[:len(self.tokens) - 1]


class DrafterProposer:
    """A trained DSpark/DFlash/EAGLE-3 drafter: fused features kept per position, one batched draft call."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.capture_layers = tuple(drafter.config.target_layers)

    @torch.no_grad()
    def features(self, captured):
        return self.drafter.fuse(captured)

    @torch.no_grad()
    def propose(self, rows, params, generators):
        # EAGLE-3 pairs feature t with token t+1; the block drafters ignore ctx_tokens
        return self.drafter.draft([r.feats for r in rows], [r.tokens[-1] for r in rows], list(params),
                                  list(generators), ctx_tokens=[r.context_ids() for r in rows])


class NgramProposer:
    """Prompt lookup over the token history (no target features). The one-hot probabilities are built on
    `device`: on Qwen a batch's [b, γ, V] one-hot block is ~0.7 GB, too big to build on the host and copy
    every round."""
    capture_layers: tuple[int, ...] = ()

    def __init__(self, ngram, device: str | torch.device = "cpu"):
        self.ngram = ngram
        self.device = torch.device(device)

    def features(self, captured):
        return torch.empty(0, 0)

    def propose(self, rows, params, generators):
        g, b = self.ngram.config.gamma, len(rows)
        proposals = [self.ngram.propose(r.tokens) for r in rows]
        tokens = torch.zeros(b, g, dtype=torch.int64)
        for i, p in enumerate(proposals):
            tokens[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
        tokens = tokens.to(self.device)
        probs = torch.zeros(b, g, self.ngram.config.vocab_size, device=self.device).scatter_(2, tokens[..., None], 1.0)
        lengths = torch.tensor([len(p) for p in proposals], dtype=torch.int64)
        return DraftOutput(tokens=tokens, probs=probs, confidence=None, lengths=lengths)


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
    """Speculative generation of one prompt: `run_batch` with one row."""
    outs, recs = run_batch(target, proposer, [list(prompt)], [params], gamma, [max_new_tokens], [generator],
                           stop_ids, max_len=max_len)
    return outs[0], recs.get(None, ChainRecord())


@torch.no_grad()
def run_batch(target, proposer: Proposer, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
              gamma: int, max_new_tokens: Sequence[int], generators: Sequence[torch.Generator],
              stop_ids: frozenset[int] = frozenset(), keys: Sequence[Hashable] | None = None,
              max_len: int | None = None) -> tuple[list[list[int]], dict[Hashable, ChainRecord]]:
    """Speculative generation of many prompts at once; returns (generated tokens per prompt, one
    ChainRecord per key, rounds of the rows with that key).

    Every prompt minus its last token is prefilled; then each round drafts for all live rows in one
    call, verifies ``[last, drafts]`` of all of them in one ragged target forward, and accepts with one
    `rejection_sample` call whose row i uses row i's own distributions and generator (so a row's output
    does not depend on the batch it ran in). Host reads: one per round for the draft lengths, one for the
    accepted counts and emitted tokens."""
    device = next(target.parameters()).device
    keys = list(keys) if keys is not None else [None] * len(prompts)
    max_len = max_len or target.config.max_position_embeddings
    capacity = min(max_len, max(len(p) + m + gamma + 1 for p, m in zip(prompts, max_new_tokens)))
    dtype = next(target.parameters()).dtype
    kv = BatchKV.for_model(target.config, len(prompts), capacity, dtype, device)
    rows = _prefill(target, proposer, kv, prompts, capacity)
    outs: list[list[int]] = [[] for _ in prompts]
    recs: dict[Hashable, ChainRecord] = {k: ChainRecord() for k in keys}
    live = [i for i, p in enumerate(prompts) if max_new_tokens[i] > 0 and len(p) + gamma + 1 <= max_len]
    while live:
        _sync(device)
        t0 = time.perf_counter()
        draft = proposer.propose([rows[i] for i in live], [params[i] for i in live], [generators[i] for i in live])
        n_draft = draft.lengths.tolist()
        _sync(device)
        t1 = time.perf_counter()
        acc, emitted, feats = _verify(target, proposer, kv, rows, live, draft, n_draft,
                                      [params[i] for i in live], [generators[i] for i in live], gamma)
        _sync(device)
        t2 = time.perf_counter()
        conf = draft.confidence.float().cpu().tolist() if draft.confidence is not None else None
        still = []
        for j, i in enumerate(live):
            a, row, rec = acc[j], rows[i], recs[keys[i]]
            kv.crop(i, len(row.tokens) + a)            # the cache holds tokens[:-1], last, accepted drafts
            row.feats = torch.cat([row.feats, feats[j, :1 + a]]) if feats is not None else row.feats
            rec.drafted.append(n_draft[j])
            rec.accepted.append(a)
            rec.draft_s.append(t1 - t0)
            rec.verify_s.append(t2 - t1)
            if conf is not None and n_draft[j] == gamma:
                rec.confidence.append(conf[j])
                rec.conf_accepted.append(a)
            if _emit(row, outs[i], emitted[j][:a + 1], stop_ids, max_new_tokens[i]) \
                    and len(row.tokens) + gamma + 1 <= max_len:
                still.append(i)
            else:
                kv.free(i)
        live = still
    return outs, recs


def _prefill(target, proposer: Proposer, kv: BatchKV, prompts: Sequence[list[int]], capacity: int) -> list[Row]:
    """Run every prompt minus its last token through the target (in chunks of batch_kv.PREFILL_TOKENS) and keep
    the proposer's features of those positions."""
    device = next(target.parameters()).device
    layers = list(proposer.capture_layers)
    rows = []
    for p in prompts:
        ids = torch.zeros(capacity, dtype=torch.int64)
        ids[:len(p)] = torch.tensor(p, dtype=torch.int64)
        rows.append(Row(list(p), ids, torch.empty(0, 0, device=device)))
    sizes = [len(p) - 1 for p in prompts]
    for chunk in token_chunks(sizes):
        chunk = [i for i in chunk if sizes[i] > 0]
        if not chunk:
            continue
        positions = kv.begin([(i, sizes[i]) for i in chunk])
        flat = torch.tensor([t for i in chunk for t in prompts[i][:-1]], dtype=torch.int64, device=device)
        out = target(flat, positions, kv, capture_layers=layers)
        feats = proposer.features(list(out.captured)) if layers else None
        if feats is not None:
            for i, f in zip(chunk, feats.split([sizes[i] for i in chunk])):
                rows[i].feats = f
    if layers:
        width = next((r.feats.shape[1] for r in rows if r.feats.shape[0]), None)
        for r in rows:
            if r.feats.shape[0] == 0 and width is not None:
                r.feats = torch.empty(0, width, device=device)
    return rows


def _verify(target, proposer: Proposer, kv: BatchKV, rows: list[Row], live: list[int], draft, n_draft: list[int],
            params: list[SamplingParams], generators: list[torch.Generator], gamma: int
            ) -> tuple[list[int], list[list[int]], Tensor | None]:
    """One ragged target forward over [last, drafts] of every live row, then lossless rejection sampling.
    Returns (accepted per row, emitted tokens per row [γ+1], kept features [b, γ+1, f] or None)."""
    device = next(target.parameters()).device
    b = len(live)
    lengths = torch.tensor(n_draft, dtype=torch.int64, device=device)
    last = torch.tensor([rows[i].tokens[-1] for i in live], dtype=torch.int64, device=device)
    d_tokens = draft.tokens.to(device)
    keep = torch.arange(gamma + 1, device=device)[None] <= lengths[:, None]            # [b, γ+1]
    positions = kv.begin([(i, 1 + n) for i, n in zip(live, n_draft)])
    layers = list(proposer.capture_layers)
    out = target(torch.cat([last[:, None], d_tokens], 1)[keep], positions, kv, capture_layers=layers)
    logits = target.logits(out.hidden)                                                # [T, V]
    t_logits = logits.new_zeros(b, gamma + 1, logits.shape[1])
    t_logits[keep] = logits
    uniforms = torch.stack([torch.rand(gamma, generator=g) for g in generators]).to(device)
    bonus = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)
    acc, emitted = rejection_sample(batch_target_probs(t_logits, params), draft.probs.to(device).float(), d_tokens,
                                    lengths.int(), uniforms, bonus)
    feats = None
    if layers:
        f = proposer.features(list(out.captured))
        feats = f.new_zeros(b, gamma + 1, f.shape[1])
        feats[keep] = f
    return acc.tolist(), emitted.tolist(), feats


def batch_target_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """logits: [b, K, V] -> fp32 [b, K, V]: row i is what the target samples from under params[i]
    (speculation.target_probs, applied once per group of rows with equal settings)."""
    probs = torch.empty_like(logits, dtype=torch.float32)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.greedy, p.temperature, p.top_k, p.top_p), []).append(i)
    for idx in groups.values():
        sel = torch.tensor(idx, device=logits.device)
        probs[sel] = target_probs(logits[sel].flatten(0, 1), params[idx[0]]).view(len(idx), *logits.shape[1:])
    return probs


def _emit(row: Row, out: list[int], tokens: list[int], stop_ids: frozenset[int], max_new: int) -> bool:
    """Append a round's emitted tokens; False once the chain is done (stop token or max_new reached)."""
    for tok in tokens:
        row.ids[len(row.tokens)] = tok
        row.tokens.append(tok)
        out.append(tok)
        if tok in stop_ids or len(out) >= max_new:
            return False
    return True


def summarize(rec: ChainRecord, gamma: int, temperatures: Sequence[float] | None) -> dict:
    """τ, conditional acceptance by position, ECE raw / after STS, draft cost fraction."""
    from specd.drafter.calibration import ece_by_position

    drafted = torch.tensor(rec.drafted)
    accepted = torch.tensor(rec.accepted)
    by_pos, reached_n, accepted_n = [], [], []
    for j in range(1, gamma + 1):
        reached = (accepted >= j - 1) & (drafted >= j)
        survived = accepted[reached] >= j
        by_pos.append(float(survived.float().mean()) if reached.any() else None)
        reached_n.append(int(reached.sum()))          # the counts behind by_pos: runs pool exactly
        accepted_n.append(int(survived.sum()))
    out = {
        "rounds": len(rec.accepted),
        "tau": float((accepted + 1).float().mean()) if len(rec.accepted) else None,
        "mean_drafted": float(drafted.float().mean()) if len(rec.drafted) else None,
        "acceptance_by_position": by_pos,
        "reached_by_position": reached_n,
        "accepted_by_position": accepted_n,
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
    """A prompt to continue: token ids, or a session turn whose history is filled in as answers come.
    `params` overrides the run's sampling; records are summed per `key` (e.g. (workload, temperature))."""
    ids: list[int] | None = None
    session: object | None = None
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    params: SamplingParams | None = None
    key: Hashable = None


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
                gamma: int, seed: int, batch_size: int = 256, progress: bool = True) -> dict[Hashable, ChainRecord]:
    """Every prompt (and every turn of a session, with the chain's own answers as history), batched:
    turn k of all sessions runs as batches of `batch_size` chains. Prompt i samples with its own
    generator (seed + i), kept across its turns. Returns one ChainRecord per prompt key."""
    from bench.workloads.format import prompt_messages

    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    answers: list[list[str]] = [[] for _ in prompts]
    records: dict[Hashable, ChainRecord] = {}
    max_pos = target.config.max_position_embeddings
    for turn in range(max((len(p.session.turns) if p.session else 1) for p in prompts) if prompts else 0):
        todo: list[tuple[int, list[int], int]] = []
        for i, p in enumerate(prompts):
            if p.ids is not None:
                if turn == 0:
                    todo.append((i, p.ids, p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS))
                continue
            if turn >= len(p.session.turns) or len(answers[i]) < turn:
                continue
            extra = {"tools": p.session.tools} if p.session.tools else {}
            ids = tokenizer.encode_chat(prompt_messages(p.session, turn, answers[i]), **extra)
            budget = p.max_new_tokens or p.session.turns[turn].max_tokens
            if len(ids) + budget + gamma + 1 <= max_pos:      # a session stops at the turn that outgrows the context
                todo.append((i, ids, budget))
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            t0 = time.perf_counter()
            outs, recs = run_batch(target, proposer, [ids for _, ids, _ in chunk],
                                   [prompts[i].params or params for i, _, _ in chunk], gamma,
                                   [n for _, _, n in chunk], [gens[i] for i, _, _ in chunk], tokenizer.stop_ids,
                                   keys=[prompts[i].key for i, _, _ in chunk])
            for (i, _, _), out in zip(chunk, outs):
                answers[i].append(tokenizer.decode(out))
            for k, rec in recs.items():
                records.setdefault(k, ChainRecord()).extend(rec)
            if progress:
                print(f"acceptance: turn {turn}, {len(chunk)} chains, {sum(len(r.accepted) for r in recs.values())} "
                      f"row-rounds, {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return records


def round_records(rec: ChainRecord, temperatures: Sequence[float] | None) -> dict:
    """The rounds behind the summary that a scheduler can replay: each full-block round's raw conditional
    confidences (4 decimals) and how many of its drafts were accepted, with the STS temperatures that
    calibrate them (None: the drafter has none)."""
    return {"confidence": [[round(float(c), 4) for c in row] for row in rec.confidence],
            "accepted": [int(a) for a in rec.conf_accepted],
            "sts_temperatures": None if temperatures is None else [float(t) for t in temperatures]}


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
    parser.add_argument("--batch-size", type=int, default=256, help="chains verified together per round")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="float32",
                        help="target dtype; the drafters are fp32 and do not accept bf16 target features yet")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: a tiny target is latency-bound; more threads only contend)")
    parser.add_argument("--keep-rounds", action="store_true",
                        help="also write each full-block round's raw confidences and accepted drafts, with the "
                             "drafter's STS temperatures (`bench sps-projection --scheduled` replays them)")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")


def load_proposer(spec: str, target, gamma: int):
    """(proposer, STS temperatures or None) for `--drafter DIR|ngram`."""
    from specd.drafter.config import DrafterConfig
    from specd.drafter.ngram import NgramDrafter

    if spec == "ngram":
        ngram = NgramDrafter(DrafterConfig.for_target(target.config, "ngram", gamma=gamma))
        return NgramProposer(ngram, next(target.parameters()).device), None
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
    rec = run_prompts(target, tokenizer, proposer, prompts, params, args.gamma, args.seed,
                      args.batch_size).get(None, ChainRecord())
    result = {"command": " ".join(["python -m bench acceptance", *sys.argv[2:]]), "drafter": args.drafter,
              "target": str(args.target), "temperature": args.temperature, "gamma": args.gamma,
              "prompts": len(prompts), "wall_s": time.perf_counter() - t0, **summarize(rec, args.gamma, temps)}
    if args.keep_rounds:
        result["round_records"] = round_records(rec, temps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tau", "acceptance_by_position", "ece_raw", "ece_sts",
                                             "draft_cost_fraction", "rounds")}))
    return 0
