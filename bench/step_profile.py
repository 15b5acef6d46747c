"""Where a prompt step's time goes: a decode batch with and without prompt chunks, replayed from CUDA graphs.

    python -m bench.step_profile --out DIR                         # Qwen2.5-0.5B shape, random weights, GPU
    python -m bench.step_profile --tiny --out DIR                  # toy sizes, on the CPU (smoke test)

Why: in session 13's run AP (``none``, coding at c = 16) a step that carried prompt chunks took 8.9 ms
against 4.0 ms for a plain decode step of the same sequences, and the prompts were then estimated at ~110
tokens, far too few to cost that. Session 14 ran this: the steps cost what their prefill computes (the
prompts are ~700 tokens with the template; docs/results/speedup.md, session 14), not their graph shape.

Each case is B decoders at ``--context`` tokens plus P prompts of ``--prompt-len`` new tokens, as the
engine batches them. It is timed through ``StepGraphs.run`` (host inputs, two copies, one replay) under
the graph key the engine picks, and under alternative keys of the same step, so the cost of the key's
parts shows apart:
- ``engine``: the engine's key (a prefill-shaped step's query bound is its whole token bucket);
- ``tight_q``: the same token bucket with the query bound the smallest power of two that holds the
  longest query block;
- ``exact``: tokens padded only to a multiple of 8, with the tight query bound (what padding costs).
Then the engine-key step runs eagerly under ``torch.profiler`` and its CUDA kernel time is summed by
kernel name, so the kernels that grow with the prompt tokens are named.
Weights are random: timing does not depend on their values, so no upload is needed. The model's norms and
rotary embedding run as one-launch kernels (kvspec_kernels/rms_norm.py, kvspec_kernels/rotary.py) unless ``KVSPEC_FUSED=0``:
run it both ways to time them (``bash bench/gpu/session.sh step-profile`` does).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.gpu_profile import pool_for, random_model, rows_step
from kvspec_kernels import fused_elementwise
from specd.engine.cuda_graphs import GraphKey, HostStep, StepGraphs, decode_keys, prefill_keys
from specd.engine.model_runner import device_inputs
from specd.engine.paged_backend import PagedAttentionBackend


def mixed_step(decoders: int, context: int, prompts: int, prompt_len: int) -> HostStep:
    """B decode rows (one token after ``context`` cached) then P prompt chunks of ``prompt_len`` tokens
    from position 0, each sequence in blocks of its own."""
    return rows_step([(context, 1)] * decoders + [(0, prompt_len)] * prompts)


def blocks_needed(step: HostStep) -> int:
    return sum(len(t) for t in step.tables)


def alternative_keys(step: HostStep, engine: GraphKey | None) -> dict[str, GraphKey]:
    """The engine's key and the variants described in the module docstring (decode steps: the engine's only)."""
    if engine is None:
        return {}
    keys = {"engine": engine}
    if engine.q_bound > 1:
        tight = 1 << (step.max_q_len - 1).bit_length()
        keys["tight_q"] = GraphKey(engine.tokens, min(tight, engine.tokens), engine.capture)
        exact = -(-len(step.ids) // 8) * 8
        keys["exact"] = GraphKey(max(exact, len(step.seq_lens)), tight, engine.capture)
    return keys


def time_replays(graphs: StepGraphs, step: HostStep, key: GraphKey, dev: torch.device, repeats: int) -> dict:
    """Wall ms of ``graphs.run`` plus a sync, p50/p99 over ``repeats`` (after a capture and two replays)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(3):
            graphs.run(step, key)
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            graphs.run(step, key)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"ms_p50": statistics.median(times), "ms_p99": times[min(len(times) - 1, int(0.99 * len(times)))],
            "repeats": repeats}


def kernel_breakdown(model, backend: PagedAttentionBackend, step: HostStep, q_bound: int, dev: torch.device,
                     top: int = 14) -> dict:
    """CUDA kernel time of one eager forward of ``step`` (query bound ``q_bound``), summed by kernel name:
    the total, and the ``top`` largest with their call counts. Empty off CUDA."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    inputs = device_inputs(step, [], dev)
    inputs.meta.max_q_len = q_bound
    with torch.inference_mode():
        backend.set_step(inputs.meta)
        for _ in range(2):
            model(inputs.input_ids, inputs.positions, backend)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(inputs.input_ids, inputs.positions, backend)
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            entry = by_name.setdefault(ev.name, [0.0, 0])
            entry[0] += ev.device_time_total / 1e3
            entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"gpu_ms_total": sum(v[0] for v in by_name.values()), "kernels": sum(v[1] for v in by_name.values()),
            "top": [{"name": n[:90], "ms": round(v[0], 4), "calls": v[1]} for n, v in ranked[:top]]}


def warm_up(graphs: StepGraphs, max_seqs: int, dev: torch.device) -> dict:
    """The runner's start warm-up (``plain_keys``: decode buckets and, since session 14, prompt chunks):
    graphs captured and seconds, prompt chunks apart."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for name, keys in (("decode", decode_keys(max_seqs, ())), ("prompt_chunks", prefill_keys(graphs.max_tokens, ()))):
        sync()
        t0 = time.perf_counter()
        n = graphs.warm(keys)
        sync()
        out[name] = {"graphs": n, "seconds": round(time.perf_counter() - t0, 3)}
    return out


def run(shape: str, decoders: list[int], prompts: list[int], prompt_len: int, context: int, repeats: int,
        out: Path, max_seqs: int = 32) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(shape, str(dev), dtype)
    cfg = model.config
    steps = {(b, p): mixed_step(b, context, p, prompt_len) for b in decoders for p in prompts if b + p <= max_seqs}
    blocks = max(blocks_needed(s) for s in steps.values()) + 1
    pool = pool_for(cfg, blocks, str(dev), dtype)
    backend = PagedAttentionBackend(pool, cfg.attn_scale)
    max_tokens = 2048 + max_seqs * 7
    graphs = StepGraphs(model, backend, max_seqs, max_tokens, blocks, dev, replay_eagerly=dev.type != "cuda")
    res: dict = {"shape": shape, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "context": context, "prompt_len": prompt_len, "max_seqs": max_seqs,
                 "fused_elementwise": fused_elementwise(dev),
                 "start_warm_up": warm_up(graphs, max_seqs, dev), "cases": []}
    for (b, p), step in steps.items():
        engine_key = graphs.key(step, ())
        case = {"decoders": b, "prompts": p, "tokens": len(step.ids), "max_q_len": step.max_q_len, "keys": {}}
        for name, key in alternative_keys(step, engine_key).items():
            timing = time_replays(graphs, step, key, dev, repeats)
            case["keys"][name] = {"key": asdict(key), **timing}
        if engine_key is not None:
            case["engine_kernels"] = kernel_breakdown(model, backend, step, engine_key.q_bound, dev)
            if engine_key.q_bound > 1:
                tight = case["keys"]["tight_q"]["key"]["q_bound"]
                case["tight_q_kernels"] = kernel_breakdown(model, backend, step, tight, dev)
        res["cases"].append(case)
        print(b, p, len(step.ids), {n: (k["key"]["tokens"], k["key"]["q_bound"], round(k["ms_p50"], 3))
                                    for n, k in case["keys"].items()},
              round(case.get("engine_kernels", {}).get("gpu_ms_total", 0.0), 3), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_profile-{shape}.json").write_text(json.dumps(res, indent=1))
    (out / f"step_profile-{shape}.md").write_text(markdown(res))
    return res


def markdown(res: dict) -> str:
    warm = res["start_warm_up"]
    fused = "one-launch norms and rotary" if res.get("fused_elementwise") else "torch norms and rotary (KVSPEC_FUSED=0)"
    lines = [f"# Prompt steps against decode steps ({res['shape']}, {res['device']}, {fused})", "",
             "Start warm-up: " + ", ".join(f"{k} {v['graphs']} graphs in {v['seconds']:.2f} s" for k, v in warm.items())
             + ".", "",
             f"Decoders at context {res['context']}, prompts of {res['prompt_len']} new tokens; ms p50 of a "
             "graph replay with its inputs; GPU ms: the eager forward's summed kernel time under the same "
             "query bound.", "",
             "| decoders | prompts | tokens | engine key (T, q) | engine ms | tight q ms | exact ms | "
             "GPU ms (engine q) | GPU ms (tight q) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        k = c["keys"]
        if not k:
            continue
        e = k["engine"]
        cell = lambda name: f"{k[name]['ms_p50']:.3f}" if name in k else "-"   # noqa: E731
        gpu = lambda name: f"{c[name]['gpu_ms_total']:.3f}" if c.get(name) else "-"   # noqa: E731
        lines.append(f"| {c['decoders']} | {c['prompts']} | {c['tokens']} | ({e['key']['tokens']}, "
                     f"{e['key']['q_bound']}) | {e['ms_p50']:.3f} | {cell('tight_q')} | {cell('exact')} | "
                     f"{gpu('engine_kernels')} | {gpu('tight_q_kernels')} |")
    for c in res["cases"]:
        for name in ("engine_kernels", "tight_q_kernels"):
            if c.get(name):
                lines += ["", f"## {c['decoders']} decoders + {c['prompts']} prompts, {name}: "
                              f"{c[name]['gpu_ms_total']:.3f} GPU ms in {c[name]['kernels']} kernels", "",
                          "| kernel | ms | calls |", "|---|---|---|"]
                lines += [f"| `{t['name']}` | {t['ms']:.3f} | {t['calls']} |" for t in c[name]["top"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for step_profile-<shape>.json and .md")
    ap.add_argument("--tiny", action="store_true", help="toy model and shapes (runs on the CPU)")
    ap.add_argument("--decoders", default="16", help="decode batch sizes, comma-separated (default 16)")
    ap.add_argument("--prompts", default="0,1,2,3", help="prompt chunks beside them, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=400,
                    help="new tokens per prompt chunk (eval prompts, median: creative 287, extraction 422, "
                         "coding 696, support 741, knowledge 1,150)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens of each decoder")
    ap.add_argument("--repeats", type=int, default=50, help="timed replays per key")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    if args.tiny:
        run("tiny", [2], [0, 2], 20, 12, 3, args.out, max_seqs=4)
    else:
        run("qwen2.5-0.5b", ints(args.decoders), ints(args.prompts), args.prompt_len, args.context,
            args.repeats, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
