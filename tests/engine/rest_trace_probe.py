"""Every gate decision at c = 1 on extraction (Qwen 0.5B on the CPU), per request: are rests sticky?

Not a test (pytest does not collect it). Needs the Qwen GGUF and session 9's drafter where session 9's
machine kept them (edit the paths), and .carry/qwen-sessions500 (bench drafter-pipeline --prepare).
Prints one line per request: '.' a step it rested (or its prefill), 'D' a step it drafted. Session 9's
A/B ran it per tree: PYTHONPATH=<tree> python tests/engine/rest_trace_probe.py (docs/design/speculation.md).
"""
import argparse, json, collections
import torch
import specd.engine.spec_gate as sg
sg.TRACE_STEPS = 5000
from bench import speedup as S
p = argparse.ArgumentParser(); S.add_arguments(p)
args = p.parse_args(["--model", "/work/models/qwen05/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "--drafters", "dspark=/work/models/dspark-s9/dsp", "--rows", "dspark", "--workloads",
    ".carry/qwen-sessions500/extraction.eval.jsonl", "--concurrency", "1", "--requests", "8", "--max-tokens", "48",
    "--repeats", "1", "--threads", "2", "--out", "/tmp/spx2"])
torch.set_num_threads(2)
engine = S._engine(args)
rows, skipped, cap = S._available_rows(engine, ["dspark"])
prompts = S.workload_prompts(S.Path(args.workloads), engine.tokenizer, 8, 48, False, engine.max_model_len, args.gamma, 0)
short = [S.Prompt(x.ids, x.params.model_copy(update={"max_tokens": 8})) for x in prompts]
S.run_closed_loop(engine, short, S.row_fields("dspark", cap), 1, "warm")
# per step: which request, its record, decision
log = []
orig = engine._observe_gate
def obs(batch, emitted, seconds, timed=True):
    seq = batch[0].seq
    r = seq.gate_acceptance
    log.append((seq.request.id, len(seq.output_ids), batch[0].num_draft, emitted.get(id(seq)),
                round(r.tokens / r.steps, 2) if r and r.steps else None,
                seq.draft_ctx.offset if seq.draft_ctx is not None else None))
    return orig(batch, emitted, seconds, timed)
engine._observe_gate = obs
import time as _t
_t0 = _t.perf_counter()
res = S.run_closed_loop(engine, prompts, S.row_fields("dspark", cap), 1, "timed")
print("WALL", round(_t.perf_counter() - _t0, 2), "TOK/S", round(res.throughput_tok_s, 3), "FILE", S.__file__)
print("steps", res.steps, "rested", res.gate_rested_steps, res.gate_drafted_by, "tau", res.tau)
tr = engine.spec_gate.trace(latest=True)["dspark_b1"]
by_req = collections.defaultdict(list)
for (rid, nout, ndraft, em, rec, off) in log:
    by_req[rid].append("D" if ndraft else ".")
for rid, marks in by_req.items():
    print(rid, "".join(marks))
json.dump({"log": log, "trace": tr}, open("/tmp/rest_trace.json", "w"))
