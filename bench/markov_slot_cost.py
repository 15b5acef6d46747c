"""What a draft round's Markov loop costs on the GPU: the fused slot kernels (kvspec_kernels/markov_slot.py,
session 51) against the torch passes they replaced, on the same inputs, eager and replayed from a CUDA graph,
with the kernels checked against their torch references on those inputs.

    python -m bench.markov_slot_cost --out markov_slot.json        # CUDA: V = 151,936, B = 1, 8, 32, 128
    python -m bench.markov_slot_cost --tiny --out /tmp/m.json      # CPU smoke test (V = 4,096; references)

Why: the loop was 9.4-10.9% of a round at the Qwen3-8B shape on the H100 (session 50), the DSpark paper's
≤ 1.3% at batch 128, and it is bound by memory traffic: each slot made several fp32 passes over [B, V].
Three forms of one round of γ slots, each slot with the bias of a rank-256 Markov head on the token drawn at
the slot before:
- ``fused``: ``draft_graphs.markov_round``, the engine's round (the fused kernels);
- ``refs``: the same with ``KVSPEC_MARKOV_SLOT=0`` (the kernels' torch references on CUDA too);
- ``former``: the round as the engine ran it until session 51 (``_former_round``: the block's logits upcast
  once, per slot the fp32 add, the temperature division, the transform, the inverse-CDF draw).
Settings: ``greedy`` (every row greedy), ``T1`` (every row sampled at temperature 1: the plain softmax),
``T0.7-p0.9`` (top-p rows: ``slot_logits`` then the nucleus kernels). Random bf16 inputs, no model.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.sampling_cost import _graphed, _time
from kvspec_kernels.dispatch import MARKOV_SLOT_ENV
from kvspec_kernels.markov_slot import slot_logits
from specd.drafter.markov_head import MarkovHead
from specd.engine.draft_graphs import RoundInputs, markov_round, sample_slot
from specd.engine.sampler import GREEDY_ROW, PLAIN_ROW, TOP_P_ROW, SamplingPath, inverse_cdf, static_probs

VOCAB = 151936
RANK = 256
SETTINGS = {"greedy": (SamplingPath(greedy=True), GREEDY_ROW, 1.0, 1.0),      # path, kind, temperature, top-p
            "T1": (SamplingPath(plain=True), PLAIN_ROW, 1.0, 1.0),
            "T0.7-p0.9": (SamplingPath(top_p=True), TOP_P_ROW, 0.7, 0.9)}


def _former_round(x: RoundInputs, path: SamplingPath, head: MarkovHead, probs_out: torch.Tensor) -> torch.Tensor:
    """The round's Markov loop as the engine ran it before the fused slots (commit 520c224): the baseline. The
    block's logits upcast once; per slot the fp32 add, then a greedy-only slot's argmax and one-hot written
    into the output, or the temperature division, ``static_probs`` and the inverse-CDF draw."""
    base = x.logits.float()
    prev, tokens = x.anchors, []
    for k in range(base.shape[1]):
        logits = head(base[:, k], prev)
        out = probs_out[:, k]
        if not (path.plain or path.max_k or path.top_p):
            prev = logits.argmax(dim=1)
            out.zero_().scatter_(1, prev[:, None], 1.0)
        else:
            probs, argmax = static_probs(logits / x.temperature.unsqueeze(1), x.top_k, x.top_p, x.kind, path, out=out)
            drawn = inverse_cdf(probs, x.uniforms[:, k])
            prev = torch.where(x.kind == GREEDY_ROW, argmax, drawn) if path.greedy else drawn
        tokens.append(prev)
    return torch.stack(tokens, dim=1)


def _inputs(b: int, gamma: int, vocab: int, setting: str, device: str, dtype: torch.dtype, seed: int) -> RoundInputs:
    path, kind, t, p = SETTINGS[setting]
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(b, gamma, vocab, generator=g, device=device) * 3).to(dtype)
    rows = lambda v, dt=torch.float32: torch.full((b,), v, dtype=dt, device=device)   # noqa: E731
    uniforms = torch.rand(b, gamma, generator=g, device=device) * (kind != GREEDY_ROW)
    return RoundInputs(logits, torch.zeros(b, gamma, 1, device=device), torch.arange(b, device=device) % vocab,
                       rows(0, torch.int64), rows(kind, torch.int64), rows(t), rows(p), uniforms)


def _forced_round(x: RoundInputs, path: SamplingPath, head: MarkovHead, prev_tokens: torch.Tensor,
                  probs_out: torch.Tensor) -> torch.Tensor:
    """``markov_round`` with slot k's Markov bias from ``prev_tokens[:, k - 1]`` (slot 0: the anchor) instead of
    the token this round drew at slot k - 1. Fed the references' tokens, each fused slot samples the very
    distribution its reference slot sampled, so the two compare slot by slot: left to itself the loop carries
    a draw that rounding sent to a neighbouring token into the bias of every later slot of the row."""
    prev = torch.cat([x.anchors[:, None], prev_tokens[:, :-1]], dim=1)
    return torch.stack([sample_slot(x.logits[:, k], x, path, k, probs_out, bias=head.bias(prev[:, k]))
                        for k in range(x.logits.shape[1])], dim=1)


def _draw_slack(probs: torch.Tensor, uniforms: torch.Tensor, tokens: torch.Tensor, sampled: torch.Tensor,
                want: torch.Tensor) -> float:
    """The largest distance from a draw's uniform to its token's CDF step, in the fp64 running sums of
    ``probs`` [B, γ, V] normalised (0 where u lies on the step). Why not the tokens' equality: at T = 1 the
    151,936 steps are mostly narrower than an fp32 CDF's rounding (mean width 6.6e-6, ulp 6e-8 below 1,
    running-sum errors above it), so two correct draws with other summation orders differ on ~1% of
    uniforms, at a neighbouring step; a wrong draw lands far from u. A greedy row (one-hot) must take
    ``want``'s token exactly: 1 where it does not."""
    worst = 0.0
    for k in range(probs.shape[1]):
        p = probs[:, k].double()
        cdf = p.cumsum(dim=1)
        total = cdf[:, -1]
        t = tokens[:, k, None]
        through = cdf.gather(1, t)[:, 0] / total
        before = through - p.gather(1, t)[:, 0] / total
        u = uniforms[:, k].double()
        slack = torch.maximum(torch.maximum(before - u, u - through), torch.zeros_like(u))
        slack = torch.where(sampled, slack, (tokens[:, k] != want[:, k]).double())
        worst = max(worst, slack.max().item())
    return worst


def _with_kernels(on: bool, fn):
    """fn() with KVSPEC_MARKOV_SLOT set to 1 (the kernels) or 0 (their torch references), restored after."""
    old = os.environ.get(MARKOV_SLOT_ENV)
    os.environ[MARKOV_SLOT_ENV] = "1" if on else "0"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(MARKOV_SLOT_ENV)
        else:
            os.environ[MARKOV_SLOT_ENV] = old


def measure(batches: list[int], vocab: int, gamma: int, device: str, repeats: int) -> list[dict]:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    head = MarkovHead(vocab, RANK).to(device, dtype)
    records = []
    for b in batches:
        for setting, (path, *_) in SETTINGS.items():
            x = _inputs(b, gamma, vocab, setting, device, dtype, seed=b)
            outs = {name: torch.empty(b, gamma, vocab, device=device) for name in ("fused", "refs", "former")}
            rounds = {"fused": lambda: _with_kernels(True, lambda: markov_round(x, path, head, None, outs["fused"])[0]),
                      "refs": lambda: _with_kernels(False, lambda: markov_round(x, path, head, None, outs["refs"])[0]),
                      "former": lambda: _former_round(x, path, head, outs["former"])}
            tokens = {name: fn() for name, fn in rounds.items()}
            rec = {"batch": b, "setting": setting,
                   "fused_tokens_equal_refs": (tokens["fused"] == tokens["refs"]).float().mean().item(),
                   "fused_max_abs_probs_diff_refs": (outs["fused"] - outs["refs"]).abs().max().item(),
                   "refs_tokens_equal_former": (tokens["refs"] == tokens["former"]).float().mean().item(),
                   "refs_max_abs_probs_diff_former": (outs["refs"] - outs["former"]).abs().max().item()}
            # slot by slot: the fused slots fed the references' tokens (see _forced_round, _draw_slack)
            forced = torch.empty_like(outs["fused"])
            forced_tokens = _with_kernels(True, lambda: _forced_round(x, path, head, tokens["refs"], forced))
            sampled = x.kind != GREEDY_ROW
            rec.update({"fused_slot_tokens_equal_refs": (forced_tokens == tokens["refs"]).float().mean().item(),
                        "fused_slot_max_abs_probs_diff_refs": (forced - outs["refs"]).abs().max().item(),
                        "fused_slot_draw_max_slack": _draw_slack(outs["refs"], x.uniforms, forced_tokens, sampled,
                                                                 tokens["refs"]),
                        "refs_draw_max_slack": _draw_slack(outs["refs"], x.uniforms, tokens["refs"], sampled,
                                                           tokens["refs"])})
            del forced
            if setting == "T0.7-p0.9":      # slot_logits against the torch formula, bit for bit
                bias = head.bias(x.anchors)
                want = (x.logits[:, 0].float() + bias.float()) / x.temperature[:, None]
                rec["slot_logits_bit_identical"] = bool(torch.equal(slot_logits(x.logits[:, 0], bias, x.temperature),
                                                                    want))
            for name, fn in rounds.items():
                rec[name] = _time(fn, repeats, cuda)
                if cuda:
                    rec[f"{name}_graph"] = _time(_graphed(fn), repeats, cuda)
            key = "_graph" if cuda else ""
            rec["fused_over_former"] = rec[f"fused{key}"]["ms_p50"] / rec[f"former{key}"]["ms_p50"]
            records.append(rec)
            print(f"B {b:4d} {setting:10s} former {rec['former' + key]['ms_p50']:.3f} ms  refs "
                  f"{rec['refs' + key]['ms_p50']:.3f}  fused {rec['fused' + key]['ms_p50']:.3f} "
                  f"({rec['fused_over_former']:.2f}x){' in a graph' if cuda else ''}  |  fused vs refs, slot by slot: "
                  f"probs within {rec['fused_slot_max_abs_probs_diff_refs']:.1e}, tokens "
                  f"{rec['fused_slot_tokens_equal_refs']:.3f} equal, draws within {rec['fused_slot_draw_max_slack']:.1e} "
                  f"of u (refs {rec['refs_draw_max_slack']:.1e}); whole rounds: tokens "
                  f"{rec['fused_tokens_equal_refs']:.3f} equal"
                  + (f"  |  slot_logits bit-identical {rec['slot_logits_bit_identical']}"
                     if "slot_logits_bit_identical" in rec else ""), flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--batches", default="1,8,32,128", help="batch sizes (comma-separated)")
    ap.add_argument("--gamma", type=int, default=7, help="slots a round")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="CPU, vocabulary 4,096, batches 1 and 3, 3 repeats (a smoke "
                                                        "test: the references only, no kernel timings)")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    vocab, batches = (4096, [1, 3]) if args.tiny else (VOCAB, [int(b) for b in args.batches.split(",")])
    with torch.inference_mode():
        records = measure(batches, vocab, args.gamma, device, 3 if args.tiny else args.repeats)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "vocab": vocab, "gamma": args.gamma, "markov_rank": RANK}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
