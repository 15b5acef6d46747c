"""First contact with a GPU machine: does the engine run on CUDA, with CUDA graphs, on a pool leased
from a kvd process over CUDA IPC? Uses only the bundled stories260K, so it needs no upload.

    python -m bench.gpu_smoke --out smoke.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.kvd_process import KvdProcess
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

REFERENCE = (" Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
             "One day, she saw a big, red ball. She wanted to play with it, but it was too high")


def generate(engine: SpecEngine, prompts: list[list[int]], max_tokens: int = 48) -> tuple[list[str], list]:
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    texts, usage = [""] * len(prompts), [None] * len(prompts)
    while engine.has_work():
        for out in engine.step():
            i = int(out.id[1:])
            texts[i] += out.text
            if out.finished:
                usage[i] = out.usage
    return texts, usage


def check(name: str, fn, results: dict) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as exc:  # a smoke test reports every failure, then goes on
        results[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps(results[name])[:400], flush=True)


def engine_alone(graphs: bool) -> dict:
    engine = SpecEngine.from_config(EngineConfig(device="cuda", cuda_graphs=graphs))
    texts, _ = generate(engine, [[1]] * 3 + [engine.tokenizer.encode("Tom had a dog")], max_tokens=60)
    return {"bos_text": texts[0], "matches_reference": texts[0] == REFERENCE, "batch_consistent": len(set(texts[:3])) == 1,
            "graphs": sorted(engine.runner.graphs.graphs) if engine.runner.graphs else []}


def with_kvd(tmp: Path) -> dict:
    with KvdProcess(tmp / "kvd", device="cuda", gpu_bytes=64 << 20, dram_bytes=64 << 20) as kvd:
        engine = SpecEngine.from_config(EngineConfig(device="cuda", kvd_run_dir=kvd.run_dir))
        local = SpecEngine.from_config(EngineConfig(device="cuda"))
        prompt = engine.tokenizer.encode(REFERENCE.strip())
        want, _ = generate(local, [prompt])
        first, u1 = generate(engine, [prompt])
        second, u2 = generate(engine, [prompt])
        return {"connected": engine.source.connected, "pool_device": str(engine.source.pool.device),
                "cached_second": u2[0].cached_tokens, "cached_first": u1[0].cached_tokens,
                "identical": first == second == want, "text": first[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
               "torch": torch.__version__}
    tmp = Path(tempfile.mkdtemp(prefix="smoke-"))
    check("engine_graphs", lambda: engine_alone(True), results)
    check("engine_eager", lambda: engine_alone(False), results)
    check("engine_kvd_cuda_ipc", lambda: with_kvd(tmp), results)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
