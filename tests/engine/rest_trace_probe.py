"""Every gate decision at c = 1 on one workload (Qwen 0.5B on the CPU), per request: are rests sticky?

Not a test (pytest does not collect it). Needs the Qwen GGUF, a trained dspark drafter and an eval
sessions file (bench drafter-pipeline --prepare). Prints the timed run's wall time, steps, rests and τ,
then one line per request: '.' a step it rested (or its prefill), 'D' a step it drafted. Session 9's
A/B ran it per tree, alternated (docs/design/speculation.md, "A resting request drifts back to its class"):

    PYTHONPATH=<tree> python tests/engine/rest_trace_probe.py --model Q.gguf --drafter DIR \
        --workload .carry/qwen-sessions500/extraction.eval.jsonl [--out trace.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target GGUF")
    p.add_argument("--drafter", required=True, help="a trained dspark drafter directory")
    p.add_argument("--workload", required=True, help="an eval sessions .jsonl")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write every step's record and the gate's reports")
    a = p.parse_args()

    import specd.engine.spec_gate as spec_gate
    spec_gate.TRACE_STEPS = 5000             # keep every report of the run, not the last 16
    from bench import speedup

    sp = argparse.ArgumentParser()
    speedup.add_arguments(sp)
    args = sp.parse_args(["--model", a.model, "--drafters", f"dspark={a.drafter}", "--rows", "dspark",
                          "--workloads", a.workload, "--concurrency", "1", "--requests", str(a.requests),
                          "--max-tokens", str(a.max_tokens), "--repeats", "1", "--threads", str(a.threads),
                          "--out", "/tmp/rest-trace"])
    import torch
    torch.set_num_threads(a.threads)
    engine = speedup._engine(args)
    _, _, cap = speedup._available_rows(engine, ["dspark"])
    fields = speedup.row_fields("dspark", cap)
    prompts = speedup.workload_prompts(Path(a.workload), engine.tokenizer, a.requests, a.max_tokens, False,
                                       engine.max_model_len, args.gamma, 0)
    short = [speedup.Prompt(x.ids, x.params.model_copy(update={"max_tokens": 8})) for x in prompts]
    speedup.run_closed_loop(engine, short, fields, 1, "warm")

    log = []                                 # per step: request, its outputs, drafts verified, tokens, record, gap
    observe = engine._observe_gate

    def logged(batch, emitted, seconds, timed=True):
        seq = batch[0].seq
        r = seq.gate_acceptance
        log.append((seq.request.id, len(seq.output_ids), batch[0].num_draft, emitted.get(id(seq)),
                    round(r.tokens / r.steps, 2) if r is not None and r.steps else None,
                    seq.draft_ctx.offset if seq.draft_ctx is not None else None))
        return observe(batch, emitted, seconds, timed)

    engine._observe_gate = logged
    t0 = time.perf_counter()
    res = speedup.run_closed_loop(engine, prompts, fields, 1, "timed")
    print(f"wall {time.perf_counter() - t0:.2f} s, {res.throughput_tok_s:.3f} tok/s, steps {res.steps}, "
          f"rested {res.gate_rested_steps}, drafted by {res.gate_drafted_by}, tau {res.tau}")
    marks = collections.defaultdict(list)
    for rid, _, drafts, *_ in log:
        marks[rid].append("D" if drafts else ".")
    for rid, m in marks.items():
        print(rid, "".join(m))
    if a.out is not None:
        a.out.write_text(json.dumps({"log": log, "trace": engine.spec_gate.trace(latest=True)}) + "\n")


if __name__ == "__main__":
    main()
