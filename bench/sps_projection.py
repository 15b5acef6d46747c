"""``python -m bench sps-projection``: timing at real size (a Qwen3-8B-shaped model, random weights) and a
PROJECTED speed-up from acceptance measured on the real small model.

    python -m bench sps-projection --shape qwen3-8b --acceptance runs/acceptance/dspark-t0.json --out runs/sps-8b
    python -m bench sps-projection --shape tiny --batches 1,2,4 --out /tmp/sps      # CPU (tests)

Measured (timing does not depend on weight values, so random bf16 weights are honest here):
- verify cost: one engine step (ModelRunner.run: the CUDA graph when one covers the shape, else eager) of
  B requests × (k + 1) tokens after ``--context`` cached tokens each, k = 0..γ, every request on its own
  blocks (shared blocks would make attention read one context from L2); k = 0 is a plain decode step,
  so SPS(B) = B / t(B, 0) tokens/s;
- the Markov loop (specd.drafter.markov_head.sample_block with a rank-256 head and the engine's slot
  sampler over the full vocabulary) at the same B, and its share of a round = loop / (loop + verify at γ);
  the drafter's block forward is not in that round, so the true share is smaller (the paper: ≤ 1.3 % at
  B = 128).

Projected (labelled so in both outputs): from ``bench acceptance`` JSON on the real model (conditional
acceptance by position α_j, the draft cost as a fraction of a verify), the expected tokens per round with
k drafts E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i, and speed-up(B, k) = E(k)·t(B, 0) / (t(B, k)·(1 + f) + loop(B)),
where f is that draft cost fraction (assumed to carry over to the larger model). Shown for k = γ and for
the best k per B (k = 0 gives 1.0: a uniform-length stand-in for the confidence scheduler).

Several ``--acceptance`` files (one per workload) pool by their counts (``reached_by_position``,
``accepted_by_position``), and each gets its own projection beside the pooled one. ``--draft-fraction``
takes a list: the first is the headline, the rest a sensitivity table. ``--timings`` reuses a stored
``sps_projection.json`` (a GPU run's verify and Markov-loop times) instead of measuring, so a new drafter's
acceptance, measured anywhere, can be projected without a device:

    python -m bench sps-projection --timings docs/results/gpu/s4/runC/sps_projection.json \\
        --acceptance acc/coding-t0.json --acceptance acc/creative-t0.json --draft-fraction 0.5,0.25,0.1 --out OUT

``--scheduled`` also replays the confidence scheduler itself on the rounds the acceptance files recorded
(``bench acceptance --keep-rounds``), per request and step, against the best uniform k on the same draws
(bench/scheduled_projection.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.arg_types import non_negative_floats, positive_ints
from bench.gpu_profile import SHAPES

TINY = dict(SHAPES["qwen3-8b"], vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=4096)   # the same architecture, CPU-sized
MARKOV_RANK = 256
PROJECTION_LABEL = ("PROJECTION, not a measurement: speed-ups combine timings of a random-weight model with "
                    "acceptance measured on another (smaller, real) model")


def shape_config(shape: str) -> dict:
    return TINY if shape == "tiny" else SHAPES[shape]


def random_model(config: dict, device: torch.device, dtype: torch.dtype):
    from specd.models.config import ModelConfig
    from specd.models.decoder import DecoderModel

    with torch.device(device):
        model = DecoderModel(ModelConfig(**config)).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval()


# ---- timing ------------------------------------------------------------------------------------------

class StepTimer:
    """Builds verify-shaped engine batches on a private pool and times ModelRunner.run on them."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_batch: int, context: int, gamma: int):
        from specd.engine.kv_layout import KVLayout
        from specd.engine.model_runner import ModelRunner

        cfg = model.config
        self.block_size = 16
        self.context = context
        self.blocks_per_seq = -(-(context + gamma + 1) // self.block_size)
        layout = KVLayout(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        pool = torch.zeros(max_batch * self.blocks_per_seq, layout.block_bytes, dtype=torch.uint8, device=device)
        self.device = device
        self.runner = ModelRunner(model, layout, pool, device, max_batch=max_batch,
                                  max_model_len=context + gamma + 1, cuda_graphs=device.type == "cuda",
                                  max_num_batched_tokens=max_batch * (gamma + 1), num_speculative_tokens=gamma)

    def batch(self, b: int, k: int) -> list:
        """b decoding requests, each with ``context`` computed tokens and k drafts to verify."""
        from specd.engine.request import Request
        from specd.engine.scheduler import ScheduledSeq
        from specd.engine.sequence import Sequence
        from specd.engine.speculation import Draft
        from specd.sampling_params import SamplingParams

        out = []
        for i in range(b):
            seq = Sequence(Request(f"r{i}", [1] * (self.context + 1), SamplingParams()), None, None)
            seq.num_computed_tokens = self.context
            seq.block_table = list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq))
            out.append(ScheduledSeq(seq, 1, Draft([1] * k) if k else None))
        return out

    def time(self, b: int, k: int, repeats: int) -> float:
        batch = self.batch(b, k)
        return median_seconds(lambda: self.runner.run(batch), self.device, repeats)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` after untimed warm-ups (graph capture, Triton compiles, allocator)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_markov_loop(vocab: int, b: int, gamma: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The DSpark Markov sampling loop alone, eagerly (sample_block + SlotSampler: the CPU path and the
    reference), at T=1 (the sampling path, not the greedy shortcut)."""
    from specd.drafter.base import SlotSampler
    from specd.drafter.markov_head import MarkovHead, sample_block
    from specd.sampling_params import SamplingParams

    head = MarkovHead(vocab, MARKOV_RANK).to(device=device, dtype=dtype)
    base = torch.randn(b, gamma, vocab, device=device)             # [B, γ, V] fp32 block logits
    anchors = torch.zeros(b, dtype=torch.int64, device=device)
    params = [SamplingParams(temperature=1.0)] * b
    gens = [torch.Generator().manual_seed(i) for i in range(b)]

    @torch.inference_mode()
    def loop():
        sample_block(base, anchors, head, SlotSampler(params, gens, gamma, device))
    return median_seconds(loop, device, repeats)


class GraphRound:
    """The engine's sampling round as served: specd/engine/draft_graphs.py (Markov loop, per-slot sampling
    and confidence head replayed from a CUDA graph; the LM head eager at the exact batch), on a random
    1-layer dspark drafter of the model's shape. On the CPU the same static round runs without a graph."""

    def __init__(self, model, gamma: int, max_batch: int, device: torch.device, dtype: torch.dtype):
        from specd.drafter import DrafterConfig, build_drafter
        from specd.engine.draft_graphs import DraftGraphs

        cfg = DrafterConfig.for_target(model.config, "dspark", gamma=gamma, num_layers=1, markov_rank=MARKOV_RANK)
        self.drafter = build_drafter(cfg, model).to(device, dtype).eval()
        self.graphs = DraftGraphs(self.drafter, max_batch, device, replay_eagerly=device.type != "cuda")
        self.gamma, self.device, self.dtype = gamma, device, dtype

    def time(self, b: int, repeats: int) -> tuple[float, float]:
        """(seconds of the whole round: LM head + graph, seconds of the LM head alone) at T=1."""
        from specd.sampling_params import SamplingParams

        hidden = torch.randn(b, self.gamma, self.drafter.config.hidden_size, device=self.device, dtype=self.dtype)
        last = [0] * b
        params = [SamplingParams(temperature=1.0)] * b

        @torch.inference_mode()
        def round_():
            self.graphs.run(self.drafter, hidden, last, params, [torch.Generator().manual_seed(i) for i in range(b)])

        @torch.inference_mode()
        def head():
            self.drafter.heads.logits(hidden)
        return median_seconds(round_, self.device, repeats), median_seconds(head, self.device, repeats)


# ---- projection (pure) -------------------------------------------------------------------------------

def expected_tokens(alpha: list[float | None], k: int) -> float:
    """E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i; an unmeasured position (None) counts as never accepted."""
    total, survive = 1.0, 1.0
    for a in alpha[:k]:
        survive *= a or 0.0
        total += survive
    return total


def project(verify_s: dict[int, list[float]], markov_s: dict[int, float], alpha: list[float | None],
            draft_fraction: float) -> dict:
    """verify_s[B][k]: seconds of a step of B × (k + 1) tokens -> projected speed-up by B, at k = γ and at
    the best k (k = 0 is plain decoding: 1.0)."""
    gamma = len(alpha)
    out = {}
    for b, times in verify_s.items():
        plain = times[0]
        speed = [1.0] + [expected_tokens(alpha, k) * plain / (times[k] * (1 + draft_fraction) + markov_s[b])
                         for k in range(1, min(gamma, len(times) - 1) + 1)]
        best = max(range(len(speed)), key=speed.__getitem__)
        out[str(b)] = {"fixed_gamma": {"k": len(speed) - 1, "expected_tokens": expected_tokens(alpha, len(speed) - 1),
                                       "speedup": speed[-1]},
                       "best": {"k": best, "expected_tokens": expected_tokens(alpha, best), "speedup": speed[best]}}
    return out


# ---- command line ------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES) + ["tiny"])
    p.add_argument("--batches", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    p.add_argument("--gamma", type=int, default=7, help="largest k timed (drafts per request)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--acceptance", type=Path, action="append", default=None,
                   help="bench acceptance JSON of the real model (acceptance_by_position, draft_cost_fraction); "
                        "repeat it (one per workload) to pool them by their counts and project each too")
    p.add_argument("--draft-fraction", type=non_negative_floats, default=None,
                   help="draft cost as a fraction of a verify step, overriding the JSONs' (measured where "
                        "`bench acceptance` ran); a list such as 0.5,0.25,0.1 adds a sensitivity table")
    p.add_argument("--draft-round", type=Path, default=None,
                   help="draft_round-<shape>.json from `python -m bench.gpu_profile --draft-round --shape S` at this "
                        "shape: the headline then charges each B the measured round (block forward + Markov round + "
                        "context projection, from their graphs) instead of f × verify + Markov loop")
    p.add_argument("--draft-setting", default="greedy",
                   help="which of the draft-round JSON's sampling settings to charge (greedy, T1, T0.7-k20-p0.9)")
    p.add_argument("--scheduled", action="store_true",
                   help="also replay the confidence scheduler on the rounds the --acceptance files recorded "
                        "(`bench acceptance --keep-rounds`): per-request lengths against the best uniform k, "
                        "same draws and costs (bench/scheduled_projection.py)")
    p.add_argument("--scheduled-draws", type=int, default=4000,
                   help="recorded rounds drawn per batch and source: ceil(draws / B) replayed steps of B requests")
    p.add_argument("--timings", type=Path, default=None,
                   help="a stored sps_projection.json: project from its verify and Markov-loop times instead of "
                        "measuring (--shape, --batches, --context, --gamma, --repeats are then its own)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True, help="directory for sps_projection.json and .md")


def measure(args: argparse.Namespace, progress=print) -> dict:
    from specd.loader import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = shape_config(args.shape)
    model = random_model(config, device, dtype)
    timer = StepTimer(model, device, dtype, max(args.batches), args.context, args.gamma)
    rounds = GraphRound(model, args.gamma, max(args.batches), device, dtype)
    verify_s: dict[int, list[float]] = {}
    markov_s: dict[int, float] = {}      # the loop as the engine runs it: graph round minus its eager LM head
    eager_s: dict[int, float] = {}
    for b in args.batches:
        verify_s[b] = [timer.time(b, k, args.repeats) for k in range(args.gamma + 1)]
        eager_s[b] = time_markov_loop(config["vocab_size"], b, args.gamma, device, dtype, args.repeats)
        whole, head = rounds.time(b, args.repeats)
        markov_s[b] = max(whole - head, 0.0)
        progress(f"B={b}: decode {1e3 * verify_s[b][0]:.2f} ms, verify k={args.gamma} "
                 f"{1e3 * verify_s[b][-1]:.2f} ms, Markov loop {1e3 * markov_s[b]:.3f} ms (graph; eager "
                 f"{1e3 * eager_s[b]:.3f} ms; LM head {1e3 * head:.3f} ms)")
    return {"shape": args.shape, "model_config": config, "device": str(device), "dtype": str(dtype),
            "context": args.context, "gamma": args.gamma, "repeats": args.repeats,
            "graphs": timer.runner.graphs is not None, "eager_steps": timer.runner.eager_steps,
            "decode": {str(b): {"step_ms": 1e3 * t[0], "tokens_per_s": b / t[0], "steps_per_s": 1 / t[0]}
                       for b, t in verify_s.items()},
            "verify_ms": {str(b): [1e3 * x for x in t] for b, t in verify_s.items()},
            "markov": {str(b): {"loop_ms": 1e3 * markov_s[b],
                                "share_of_round": markov_s[b] / (markov_s[b] + verify_s[b][-1]),
                                "eager_loop_ms": 1e3 * eager_s[b],
                                "eager_share_of_round": eager_s[b] / (eager_s[b] + verify_s[b][-1])}
                       for b in verify_s},
            "markov_graphs": rounds.graphs.replays > 0 and not rounds.graphs.replay_eagerly,
            "_seconds": (verify_s, markov_s)}


def stored_timings(path: Path) -> dict:
    """A stored run's timings in ``measure``'s form (``_seconds`` rebuilt from its milliseconds), and where
    they came from."""
    try:
        stored = json.loads(path.read_text())
        verify_s = {int(b): [x / 1e3 for x in times] for b, times in stored["verify_ms"].items()}
        markov_s = {int(b): m["loop_ms"] / 1e3 for b, m in stored["markov"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--timings {path}: not a sps_projection.json ({e})") from None
    kept = {k: v for k, v in stored.items() if k not in ("command", "projection")}
    return {**kept, "timings_from": {"path": str(path), "command": stored.get("command")},
            "_seconds": (verify_s, markov_s)}


def pooled_acceptance(runs: list[dict]) -> tuple[list[float | None], float | None]:
    """Acceptance by position and τ over several ``bench acceptance`` runs: α_j = Σ accepted_j / Σ reached_j
    (the counts each run writes), τ weighted by rounds. One run is taken as it is."""
    if len(runs) == 1:
        return runs[0]["acceptance_by_position"], runs[0].get("tau")
    if any("reached_by_position" not in r for r in runs):
        raise SystemExit("pooling several --acceptance files needs their counts (reached_by_position, "
                         "accepted_by_position): rerun `bench acceptance`")
    gamma = min(len(r["reached_by_position"]) for r in runs)
    alpha = []
    for j in range(gamma):
        reached = sum(r["reached_by_position"][j] for r in runs)
        alpha.append(sum(r["accepted_by_position"][j] for r in runs) / reached if reached else None)
    rounds = sum(r["rounds"] for r in runs)
    tau = sum(r["tau"] * r["rounds"] for r in runs if r.get("tau") is not None) / rounds if rounds else None
    return alpha, tau


ROUND_PARTS = ("block_forward_graph", "markov_graph", "absorb_graph")   # a drafting step's drafter work, as served


def measured_rounds(path: Path, setting: str) -> dict[int, float]:
    """Seconds of the drafter's work in a drafting step by batch, from ``bench.gpu_profile --draft-round``:
    the block forward, the Markov round (LM head, loop, per-slot sampling, confidence head) and the context
    projection of γ + 1 new features a request, each from its CUDA graph (device time, p50)."""
    try:
        rows = json.loads(path.read_text())
        out = {}
        for key, row in rows.items():
            if key.startswith("b") and key.endswith("_" + setting):
                out[int(key[1:].split("_", 1)[0])] = sum(row[part]["total_ms_p50"] for part in ROUND_PARTS) / 1e3
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--draft-round {path}: not a bench.gpu_profile --draft-round JSON ({e})") from None
    if not out:
        raise SystemExit(f"--draft-round {path}: no rows for setting {setting!r}")
    return out


def replay_sources(runs: list[dict], names: list[str]) -> dict[str, list]:
    """Each acceptance run's recorded rounds, calibrated, by source name, and all of them pooled."""
    from bench.scheduled_projection import recorded_rounds

    missing = [n for n, r in zip(names, runs) if "round_records" not in r]
    if missing:
        raise SystemExit(f"--scheduled needs rounds recorded with `bench acceptance --keep-rounds`: {missing}")
    sources = {n: recorded_rounds(r["round_records"]) for n, r in zip(names, runs)}
    if len(sources) > 1:
        sources["pooled"] = [x for rs in list(sources.values()) for x in rs]
    return sources


def scheduled(sources: dict[str, list], verify_s: dict[int, list[float]], draft_s: dict[int, float],
              draws: int) -> dict:
    """``scheduled_projection.scheduled_against_uniform`` for each source of ``replay_sources``, at each batch
    ``draft_s`` prices."""
    from bench.scheduled_projection import scheduled_against_uniform

    return {"draft_ms": {str(b): 1e3 * t for b, t in draft_s.items()}, "draws": draws,
            "by_source": {n: {str(b): scheduled_against_uniform(rs, verify_s[b], b, draft_s[b], -(-draws // b))
                              for b in draft_s} for n, rs in sources.items()}}


def projection(result: dict, acceptance: list[Path] | None, draft_fraction: list[float] | None,
               rounds: dict[int, float] | None = None, rounds_source: str = "", replay_draws: int = 0
               ) -> dict | None:
    """The labelled projection. The drafter's cost is either f × the verify step + the Markov loop (f from
    the acceptance runs or ``draft_fraction``), or, with ``rounds``, the measured drafter work of a step at
    each batch (``measured_rounds``); then only the batches it measured are projected."""
    if not acceptance:
        return None
    paths = list(acceptance)
    runs = []
    for path in paths:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--acceptance {path}: {e}") from None
    alpha, tau = pooled_acceptance(runs)
    if draft_fraction is None:
        fractions = [sum(r.get("draft_cost_fraction", 0.0) * r.get("rounds", 1) for r in runs)
                     / sum(r.get("rounds", 1) for r in runs)]
    else:
        fractions = list(draft_fraction)
    verify_s, markov_s = result["_seconds"]
    headline = lambda a: project(verify_s, markov_s, a, fractions[0])   # noqa: E731
    cost = {"draft_cost_fraction": fractions[0]}
    measured = None if rounds is None else {b: rounds[b] for b in verify_s if b in rounds}   # the batches both timed
    if measured is not None:
        if not measured:
            raise SystemExit(f"--draft-round: none of its batches {sorted(rounds)} was timed here ({sorted(verify_s)})")
        headline = lambda a: project({b: verify_s[b] for b in measured}, measured, a, 0.0)   # noqa: E731
        cost = {"draft_cost_fraction": None, "draft_round_ms": {str(b): 1e3 * t for b, t in measured.items()},
                "draft_round_source": rounds_source}
    out = {"label": PROJECTION_LABEL, "source": ", ".join(str(p) for p in paths), "acceptance_by_position": alpha,
           "tau_measured": tau, **cost, "by_batch": headline(alpha)}
    if len(fractions) > 1 or rounds is not None and draft_fraction is not None:
        out["by_draft_fraction"] = {str(f): project(verify_s, markov_s, alpha, f) for f in fractions}
    names = [p.stem for p in paths]
    names = names if len(set(names)) == len(names) else [str(p) for p in paths]
    if replay_draws:
        # the draft a step pays before the scheduler decides: measured, else f × a full verify + the loop,
        # one table for each f given
        costs = [] if measured is None else [("the measured round", measured)]
        if rounds is None or draft_fraction is not None:
            costs += [(f"f = {f}", {b: f * t[-1] + markov_s[b] for b, t in verify_s.items()}) for f in fractions]
        sources = replay_sources(runs, names)      # calibrated once, replayed under each cost
        out["scheduled"] = [{"basis": basis, **scheduled(sources, verify_s, draft_s, replay_draws)}
                            for basis, draft_s in costs]
    if len(runs) > 1:
        out["by_source"] = {name: {"acceptance_by_position": r["acceptance_by_position"], "tau_measured": r.get("tau"),
                                        "by_batch": headline(r["acceptance_by_position"])}
                            for name, r in zip(names, runs)}
    return out


def render_markdown(result: dict) -> str:
    g = result["gamma"]
    lines = ["# Timing at real size", "", f"Command: `{result['command']}`", ""]
    if "timings_from" in result:
        src = result["timings_from"]
        lines += [f"Timings not measured by this command: read from `{src['path']}` (made by `{src['command']}`).", ""]
    lines += [f"Shape `{result['shape']}` with random {result['dtype']} weights on {result['device']}, "
              f"{result['context']} cached tokens per request, CUDA graphs: {result['graphs']} "
              f"(eager steps: {result['eager_steps']}). Median of {result['repeats']} runs.", "",
              "| B | decode ms | SPS tok/s | " + " | ".join(f"verify k={k} ms" for k in range(1, g + 1)) +
              " | Markov loop ms | loop share | eager loop ms | eager share |",
              "|---|---|---|" + "---|" * g + "---|---|---|---|"]
    for b, d in result["decode"].items():
        v, m = result["verify_ms"][b], result["markov"][b]
        lines.append(f"| {b} | {d['step_ms']:.2f} | {d['tokens_per_s']:.0f} | " +
                     " | ".join(f"{x:.2f}" for x in v[1:]) + f" | {m['loop_ms']:.3f} | {100 * m['share_of_round']:.2f}% | "
                     f"{m['eager_loop_ms']:.3f} | {100 * m['eager_share_of_round']:.2f}% |")
    lines += ["", "Loop share = Markov loop / (loop + verify at k = γ); the drafter's block forward is not counted, "
                  "so the share of a full round is smaller. Markov loop: the engine's round "
                  "(specd/engine/draft_graphs.py: loop, per-slot sampling and confidence head"
                  + (" replayed from a CUDA graph" if result.get("markov_graphs") else ", no graph on this device")
                  + ") minus its eager LM head, at T = 1; eager loop: sample_block + SlotSampler, the reference."]
    proj = result.get("projection")
    if proj is None:
        lines += ["", "No projection: pass --acceptance JSON from `python -m bench acceptance` on the real model."]
    else:
        tau = proj["tau_measured"]
        lines += ["", f"## {proj['label']}", "",
                  f"Acceptance by position from `{proj['source']}`: "
                  f"{[None if a is None else round(a, 3) for a in proj['acceptance_by_position']]}, measured τ "
                  f"{'-' if tau is None else round(tau, 3)}, " + (
                      f"draft cost fraction {proj['draft_cost_fraction']:.3f} (assumed to carry over)."
                      if proj.get("draft_round_ms") is None else
                      "the drafter's work of a step measured at this shape (`" + proj["draft_round_source"] + "`: "
                      + ", ".join(f"B = {b}: {ms:.2f} ms" for b, ms in proj["draft_round_ms"].items()) + ")."),
                  "", "| B | projected speed-up at k=γ | best k | projected speed-up at best k |", "|---|---|---|---|"]
        for b, p in proj["by_batch"].items():
            lines.append(f"| {b} | {p['fixed_gamma']['speedup']:.2f} | {p['best']['k']} | {p['best']['speedup']:.2f} |")
        if "by_draft_fraction" in proj:
            fs = list(proj["by_draft_fraction"])
            lines += ["", "Sensitivity to the draft cost fraction f (best k: projected speed-up):", "",
                      "| B | " + " | ".join(f"f = {f}" for f in fs) + " |", "|---|" + "---|" * len(fs)]
            for b in proj["by_batch"]:
                cells = [proj["by_draft_fraction"][f][b]["best"] for f in fs]
                lines.append(f"| {b} | " + " | ".join(f"k = {c['k']}: {c['speedup']:.2f}" for c in cells) + " |")
        if "by_source" in proj:
            bs = list(proj["by_batch"])
            basis = ("the measured round" if proj.get("draft_round_ms") is not None
                     else f"f = {proj['draft_cost_fraction']}")
            lines += ["", f"Each source alone ({basis}; best k: projected speed-up):", "",
                      "| source | τ | α_1 | " + " | ".join(f"B = {b}" for b in bs) + " |", "|---|---|---|" + "---|" * len(bs)]
            for name, src in proj["by_source"].items():
                a1, t = src["acceptance_by_position"][0], src["tau_measured"]
                lines.append(f"| {name} | {'-' if t is None else f'{t:.2f}'} | {'-' if a1 is None else round(a1, 3)} | " +
                             " | ".join(f"k = {src['by_batch'][b]['best']['k']}: {src['by_batch'][b]['best']['speedup']:.2f}"
                                        for b in bs) + " |")
        for sch in proj.get("scheduled", []):
            bs = list(sch["draft_ms"])
            lines += ["", f"The confidence scheduler replayed on the recorded rounds, draft cost {sch['basis']} "
                          f"(`bench/scheduled_projection.py`, {sch['draws']} rounds drawn a cell; draft " +
                          ", ".join(f"B = {b}: {ms:.2f} ms" for b, ms in sch["draft_ms"].items()) +
                      "). Each cell: scheduled speed-up (mean verified length) / best uniform k on the same draws. "
                      "The gate keeps a row at ≥ 1.00 by not drafting.", "",
                      "| source | " + " | ".join(f"B = {b}" for b in bs) + " |", "|---|" + "---|" * len(bs)]
            for name, cells in sch["by_source"].items():
                lines.append(f"| {name} | " + " | ".join(
                    f"{c['scheduled']['speedup']:.2f} ({c['scheduled']['mean_length']:.1f}) / k = "
                    f"{c['best_uniform']['k']}: {c['best_uniform']['speedup']:.2f}" for c in (cells[b] for b in bs)) + " |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    measured = stored_timings(args.timings) if args.timings is not None else measure(args)
    result = {"command": " ".join(["python -m bench sps-projection", *sys.argv[2:]]), **measured}
    rounds = None if args.draft_round is None else measured_rounds(args.draft_round, args.draft_setting)
    result["projection"] = projection(result, args.acceptance, args.draft_fraction, rounds,
                                      f"{args.draft_round} ({args.draft_setting})",
                                      args.scheduled_draws if args.scheduled else 0)
    del result["_seconds"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sps_projection.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    (args.out / "sps_projection.md").write_text(md)
    print(md)
    return 0
