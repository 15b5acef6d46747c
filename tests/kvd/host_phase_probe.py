"""Where a step's host time goes, per engine call, with and without kvd: the 0%-hit gap broken down below
the engine's phase timers.

    python -m tests.kvd.host_phase_probe --model DIR_OR_GGUF --device cuda --configs standard,lru,reuse \\
        --prompts 64 --prompt-tokens 1000 --concurrency 32 --max-tokens 64 --repeats 3 --out probe.json

Why: ``bench serve``'s phase timers (schedule, forward, output, commit; run BR) say the 0%-hit gap sits in
the plain decode steps' schedule and output phases, ~0.2 ms a step, but not in which call. This runs one
in-process engine per configuration (``standard``: no kvd; ``lru``/``reuse``: a kvd process with that policy
and a GPU tier of ``--gpu-blocks``), alternated per repeat, on unique random prompts (nothing can hit), and
times each wrapped engine call with ``perf_counter`` (~1 us per call of overhead, far below cProfile's). It
prints ms per step for each call and config, the difference to the first config, and writes them as JSON.
Timing only; the outputs are not checked (the engine tests do that).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

# (object path from the engine, method): the calls a step makes outside the forward, and the forward itself
WRAPPED = [
    ("", "_maybe_reconnect"), ("drafts", "settle"), ("scheduler", "schedule"), ("", "_add_drafts"),
    ("", "_rest_prompts"), ("", "_capture_layers"), ("blocks", "settle"), ("blocks", "refill_ahead"),
    ("blocks", "refresh_roots"), ("", "_plan_sampling"), ("runner", "run"), ("", "_commit_held"),
    ("", "_sample"), ("", "_emit"), ("drafts", "publish"), ("", "_observe_gate"), ("", "_keep_features"),
]


def wrap(engine: Any, acc: dict[str, float]) -> None:
    """Replace each wrapped bound method with a timed one (instance attributes: nothing global changes)."""
    for path, name in WRAPPED:
        owner = engine if not path else getattr(engine, path, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        key = f"{path + '.' if path else ''}{name}"

        def timed(*a, _fn: Callable = fn, _key: str = key, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_key] += time.perf_counter() - t0
        setattr(owner, name, timed)


def drive(engine: Any, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Closed loop: ``concurrency`` requests in flight until every prompt is answered; (steps, seconds)."""
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    nxt, steps = 0, 0

    def add() -> None:
        nonlocal nxt
        engine.add_request(Request(f"p{nxt}-{time.monotonic_ns()}", prompts[nxt],
                                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        nxt += 1

    for _ in range(min(concurrency, len(prompts))):
        add()
    t0 = time.perf_counter()
    while engine.has_work():
        steps += 1
        for out in engine.step():
            if out.finished and nxt < len(prompts):
                add()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return steps, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", required=True, help="GGUF file or model directory (random weights are fine)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="standard,lru,reuse",
                    help="comma list: standard (no kvd) or a kvd policy (lru, lru-offload, reuse); the first is the base")
    ap.add_argument("--prompts", type=int, default=64, help="requests per cell (all unique)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed cells per config, alternated (after one warm-up)")
    ap.add_argument("--gpu-blocks", type=int, default=4096, help="kvd's GPU tier and the standard engine's pool")
    ap.add_argument("--dram-blocks", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, help="write the per-call table as JSON here")
    args = ap.parse_args(argv)

    from bench.kvd_process import KvdProcess
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="host-phase-"))
    kvds, engines, accs = {}, {}, {}
    try:
        for c in configs:
            run_dir = None
            if c != "standard":
                kvds[c] = KvdProcess(tmp / c, policy=c, gpu_blocks=args.gpu_blocks, dram_blocks=args.dram_blocks,
                                     max_groups=1).start()
                run_dir = kvds[c].run_dir
            engines[c] = SpecEngine.from_config(EngineConfig(
                model=args.model, device=args.device, kvd_run_dir=run_dir, num_local_blocks=args.gpu_blocks,
                max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.prompt_tokens + args.max_tokens + 16))
        vocab = engines[configs[0]].model.config.vocab_size
        seed = iter(range(10**6))

        def prompts() -> list[list[int]]:
            g = torch.Generator().manual_seed(next(seed))
            return [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]

        for c in configs:                      # warm-up: graph captures, kernel builds, the kvd reserve
            drive(engines[c], prompts(), args.concurrency, args.max_tokens)
            accs[c] = defaultdict(float)
            wrap(engines[c], accs[c])
        cells: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
        for r in range(args.repeats):
            for c in configs:
                acc = accs[c]
                acc.clear()
                steps, seconds = drive(engines[c], prompts(), args.concurrency, args.max_tokens)
                cell = {k: 1e3 * v / steps for k, v in acc.items()}
                cell.update(steps=steps, wall_ms_per_step=1e3 * seconds / steps,
                            tok_s=args.prompts * args.max_tokens / seconds)
                cells[c].append(cell)
                print(f"repeat {r} {c}: {steps} steps, {cell['wall_ms_per_step']:.3f} ms/step, {cell['tok_s']:.0f} tok/s",
                      flush=True)
    finally:
        for k in kvds.values():
            k.stop()
    med = {c: {k: statistics.median(cell.get(k, 0.0) for cell in cells[c]) for k in cells[c][0]} for c in configs}
    base = configs[0]
    keys = sorted({k for c in configs for k in med[c]}, key=lambda k: -max(med[c].get(k, 0) for c in configs))
    print(f"\nms per step, median of {args.repeats} repeats (difference to {base})")
    print("| call | " + " | ".join(configs) + " |")
    print("|---|" + "---|" * len(configs))
    for k in keys:
        row = [f"{med[base].get(k, 0):.3f}"] + [f"{med[c].get(k, 0):.3f} ({med[c].get(k, 0) - med[base].get(k, 0):+.3f})"
                                                 for c in configs[1:]]
        print(f"| {k} | " + " | ".join(row) + " |")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cells": cells,
                                        "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
