"""Session 34's drain A/B on the modeled clock: `bench.gate_sim` with this tree's warm-ups (`new`) or with
session 33's `finish_exploring`, which warmed only the load's own bucket (`old`).

    python docs/results/cpu/gate_sim_s34/drain_ab.py old runs/drain-old runs/coding.eval.jsonl,runs/extraction.eval.jsonl
    python docs/results/cpu/gate_sim_s34/drain_ab.py new runs/drain-new runs/coding.eval.jsonl,runs/extraction.eval.jsonl

(the workloads: `python -m bench build-workloads --workload coding --split eval --sessions 16 --scale tiny
--out runs/coding.eval.jsonl`, and the same for extraction). A record of how those runs were made, not a tool.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))

import bench.speedup as sp  # noqa: E402
from bench.gate_sim import main  # noqa: E402
from specd.engine.spec_gate import load_bucket  # noqa: E402

mode, out, workloads = sys.argv[1:4]
if mode == "old":
    def finish_exploring(engine, row, level, warm):
        key, gate = sp.gate_key(row), getattr(engine, "spec_gate", None)
        runs = 0
        while key and gate is not None and runs < sp.EXTRA_WARMUPS and load_bucket(level) in gate.exploring(key):
            warm(f"x{runs}", level)
            runs += 1
        return {load_bucket(level): runs} if runs else {}

    sp.finish_exploring = finish_exploring
elif mode != "new":
    raise SystemExit("mode: old or new")
sys.argv = ["bench.gate_sim"]
main(["--model", str(REPO / "models/stories260K.gguf"),
      "--drafters", f"dspark={REPO / 'models/drafters/stories260K-dspark'}", "--workloads", workloads,
      "--concurrency", "32", "--rows", "none,dspark", "--requests", "32", "--waves", "4", "--max-tokens", "48",
      "--ignore-eos", "--repeats", "6", "--costs", str(Path(__file__).with_name("cheap-drafting-costs.json")),
      "--out", out])
