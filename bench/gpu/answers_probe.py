"""Time the drafter pipeline's data stage (``EngineAnswers``) without the GGUF: real prompt ids, a
random-weight model of the same shape, and a cProfile of the host.

Why: in session 8 the data stage answered 1,249 first turns in ~260 s on the H200 (4.8 answers/s) and
the second turns at ~1.2-2.4 answers/s, where session 3's engine (aae14a5) answered 4,994 in 207 s
(24 /s). The GGUF takes ~90 s of device time to upload; the speed of one step depends only on the
model's shape, the prompts' lengths and the sampling settings, so this probe needs neither the weights
nor the tokenizer on the device. It uses only APIs that aae14a5 also has, so the same file times both
commits in one call (``PYTHONPATH=<export> python bench/gpu/answers_probe.py ...``).

    # on the CPU machine, once: the real prompts' ids and sampling settings
    python -m bench.gpu.answers_probe --prepare --target q.gguf --sessions .carry/qwen-sessions500 \\
        --train-sessions 250 --out .carry/answers-prompts.json
    # on the device, per commit
    PYTHONPATH=$EXPORT python bench/gpu/answers_probe.py --prompts .carry/answers-prompts.json \\
        --limit 600 --out result.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

# Qwen2.5-Coder-0.5B-Instruct's shape (the GGUF's metadata)
QWEN05 = dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
              num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
              max_position_embeddings=32768, qkv_bias=True, tie_word_embeddings=True)


def random_model(shape: dict, device, dtype):
    """A model of ``shape`` (QWEN05's keys; those the running commit's ModelConfig lacks are dropped, so an
    older export builds it too) with seeded N(0, 0.02) weights: small, so its logits are not one-hot."""
    import dataclasses

    import torch

    from specd.models.config import ModelConfig
    from specd.models.decoder import DecoderModel

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    torch.manual_seed(0)
    model = DecoderModel(ModelConfig(**{k: v for k, v in shape.items() if k in names}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.to(device=device, dtype=dtype).eval()


def prepare(args: argparse.Namespace) -> None:
    """Turn 1 of the first ``train_sessions`` train sessions per workload, as the data stage builds them."""
    from bench.drafter_pipeline import WORKLOADS, read_workload_sessions
    from bench.workloads.format import prompt_messages
    from specd.loader import load_model

    _, tok = load_model(args.target, "float32", "cpu")
    per_w = read_workload_sessions(Path(args.sessions), "train", args.train_sessions)
    rows = []
    for w in WORKLOADS:
        for s in per_w[w]:
            extra = {"tools": s.tools} if s.tools else {}
            ids = tok.encode_chat(prompt_messages(s, 0, []), **extra)
            new = s.turns[0].max_tokens
            if len(ids) + new > args.max_len:
                continue
            rows.append({"workload": w, "ids": ids, "temperature": s.sampling.temperature,
                         "top_p": s.sampling.top_p, "top_k": s.sampling.top_k, "max_new_tokens": new})
    Path(args.out).write_text(json.dumps({"stop_ids": sorted(tok.stop_ids), "prompts": rows}))
    lens = sorted(len(r["ids"]) for r in rows)
    print(f"{len(rows)} prompts, prompt tokens p50 {lens[len(lens) // 2]} max {lens[-1]} -> {args.out}")


def run(args: argparse.Namespace) -> None:
    import torch

    import specd
    from specd.drafter.data import Prompt
    from specd.drafter.engine_answers import EngineAnswers

    spec = json.loads(Path(args.prompts).read_text())
    rows = spec["prompts"]
    if args.limit:
        step = max(1, len(rows) // args.limit)           # every workload, in the file's proportions
        rows = rows[::step][: args.limit]
    prompts = [Prompt(r["ids"], r["temperature"], r["top_p"], r["top_k"], args.max_tokens or r["max_new_tokens"])
               for r in rows]
    if args.max_block_m:                  # session 5 raised the prefill tile from 64 to 128 rows (a bf16 sweep)
        import functools
        import importlib

        pa = importlib.import_module("kvspec_kernels.paged_attention")   # kvspec_kernels/__init__ shadows the module name
        pa.paged_attention_triton = functools.partial(pa.paged_attention_triton, max_block_m=args.max_block_m)
    device = torch.device(args.device)
    model = random_model(QWEN05, device, getattr(torch, args.dtype))
    capacity = args.max_len               # as the pipeline sizes its pool (``answerer``)
    t0 = time.perf_counter()
    answers = EngineAnswers(model, capacity)
    build_s = time.perf_counter() - t0
    engine = answers.engine
    marks: list[tuple[float, int]] = []
    done = 0
    real_step = engine.step
    steps = 0

    def timed_step():                     # answers finished against time, without touching the engine
        nonlocal done, steps
        outs = real_step()
        steps += 1
        done += sum(1 for o in outs if o.finished)
        marks.append((time.perf_counter() - t0, done))
        return outs

    engine.step = timed_step
    if args.kernels:                      # eager steps under torch.profiler: which kernels take the time
        engine.runner.graphs = None
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
            answers(prompts, 0, frozenset(spec["stop_ids"]), progress=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
        table = kprof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        Path(args.out).with_suffix(".kernels.txt").write_text(table)
        print(table)
        return
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    gen = answers(prompts, 0, frozenset(spec["stop_ids"]), progress=False)
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(40)
    graph = engine.graph_stats() if hasattr(engine, "graph_stats") else {}
    counters = dict(getattr(engine, "_counters", {}))
    result = {
        "specd": str(Path(specd.__file__).parent), "dtype": args.dtype, "max_block_m": args.max_block_m,
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p.ids) for p in prompts), "answer_tokens": sum(len(a) for a in gen),
        "build_s": build_s, "wall_s": wall, "answers_per_s": len(prompts) / wall, "steps": steps,
        "ms_per_step": 1e3 * wall / max(steps, 1), "graph_stats": graph, "counters": counters,
        "progress": marks[:: max(1, len(marks) // 60)], "device": torch.cuda.get_device_name() if
        device.type == "cuda" else "cpu",
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".prof.txt").write_text(text.getvalue())
    print(json.dumps({k: v for k, v in result.items() if k != "progress"}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", action="store_true", help="write the prompts file (CPU machine, needs the GGUF)")
    p.add_argument("--target", help="--prepare: the GGUF whose tokenizer encodes the prompts")
    p.add_argument("--sessions", help="--prepare: the prepared sessions folder (drafter-pipeline --prepare)")
    p.add_argument("--train-sessions", type=int, default=250)
    p.add_argument("--max-len", type=int, default=3072, help="as the pipeline's --max-len")
    p.add_argument("--prompts", help="the prompts file written by --prepare")
    p.add_argument("--limit", type=int, default=0, help="answer this many prompts (spread over the file)")
    p.add_argument("--max-tokens", type=int, default=0, help="answer length (0: each turn's own)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32", help="the pipeline's target dtype (its --dtype default)")
    p.add_argument("--max-block-m", type=int, default=0, help="paged attention's prefill tile rows (0: default)")
    p.add_argument("--kernels", action="store_true", help="eager steps under torch.profiler (kernel times) instead")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
