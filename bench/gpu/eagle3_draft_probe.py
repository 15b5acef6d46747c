"""EAGLE-3's draft on the GPU: the eager reference against the captured graphs, host-bound shapes.

    python bench/gpu/eagle3_draft_probe.py [--batches 1,8,32] [--repeats 50]

A random EAGLE-3 drafter on the bundled stories260K target (no upload needed), so the times are nearly all
host launches: what the graphs remove (specd/engine/eagle3_graphs.py). Per batch: p50 ms of one draft
(γ = 7, greedy and top-p 0.9 rows mixed), eager and replayed, and whether the tokens agree. Not a serving
figure: `bench speedup`'s `eagle3` and `eagle3-eager` rows are (docs/results/speedup.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specd.drafter import DrafterConfig, build_drafter
from specd.engine.eagle3_graphs import Eagle3Graphs
from specd.loader import load_model
from specd.sampling_params import SamplingParams

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--device", default="cuda", help="cpu: the graphs' static function run eagerly (a check)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model, _ = load_model(STORIES, dtype="float32", device=args.device)
    torch.manual_seed(0)
    d = build_drafter(DrafterConfig.for_target(model.config, "eagle3"), model).to(dev).eval()
    graphs = Eagle3Graphs(d, 32, 1024, dev, replay_eagerly=dev.type != "cuda")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    out = {"device": name, "gamma": d.config.gamma, "batches": {}}
    for b in (int(x) for x in args.batches.split(",")):
        g = torch.Generator().manual_seed(b)
        contexts, tails = [], []
        for _ in range(b):
            m = int(torch.randint(50, 400, (1,), generator=g))
            c = d.new_context()
            tails.append(d.absorb(c, torch.randn(m, d.config.hidden_size, generator=g).to(dev),
                                  torch.randint(0, d.config.vocab_size, (m,), generator=g).to(dev)))
            contexts.append(c)
        anchors = torch.randint(0, d.config.vocab_size, (b,), generator=g).tolist()
        params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9)
                  for i in range(b)]
        row = {}
        for name, rounds in (("eager", None), ("graph", graphs)):
            times, tokens = [], None
            for i in range(args.repeats + 3):
                gens = [torch.Generator().manual_seed(j) for j in range(b)]
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    o = d.draft_contexts(contexts, tails, anchors, params, gens, rounds=rounds)
                    tok = o.tokens.tolist()
                if i >= 3:                      # the first calls capture / warm up
                    times.append(1e3 * (time.perf_counter() - t0))
                tokens = tok
            row[name] = {"ms_p50": round(statistics.median(times), 3),
                         "ms_p90": round(sorted(times)[int(0.9 * len(times))], 3)}
            row[f"{name}_tokens"] = tokens
        row["tokens_equal"] = row.pop("eager_tokens") == row.pop("graph_tokens")
        row["speedup_p50"] = round(row["eager"]["ms_p50"] / row["graph"]["ms_p50"], 2)
        out["batches"][str(b)] = row
        print(b, json.dumps(row), flush=True)
    out["captures"], out["capture_failures"] = graphs.captures, graphs.capture_failures
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "batches"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
