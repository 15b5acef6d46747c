"""specd's runtime on a real model and GPU, against transformers on the same GPU in the same run.

    python -m bench.gpu_runtime --model qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --out DIR

Measures (issue: specd runtime):
1. logits of our model code vs transformers holding the same bf16 weights, on a chat prompt;
2. a greedy chat answer: first divergence between our engine and ``transformers.generate``;
3. decode tokens/s at batch 1, 8, 32 (128 new tokens each), ours vs ``generate``, alternated, repeated;
4. the batch-1 decode step time against the HBM bound (bytes of weights read per step / 4.3 TB/s);
5. TTFT for a 4k-token prompt, cold and with the prefix cached in a kvd process (CUDA IPC pool).
Writes ``runtime.json`` and prints a markdown summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.hf_reference import to_transformers
from bench.kvd_process import KvdProcess
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.models.contiguous import ContiguousKV
from specd.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.3e12
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, with a docstring."}]


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Generate for all prompts at once; returns token ids, TTFTs and per-step times of pure decode steps."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}-{t0}", p, params, arrival_s=time.monotonic()))
    ids: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    decode_steps: list[float] = []
    while engine.has_work():
        decoding = all(s.num_pending == 1 for s in engine.scheduler.running) and not engine.scheduler.waiting
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        if decoding and engine.scheduler.running:
            decode_steps.append(dt)
        for o in outs:
            ids.setdefault(o.id, []).extend(o.token_ids)
            if o.finished:
                ttft[o.id] = o.usage.ttft_s
    sync()
    wall = time.perf_counter() - t0
    order = sorted(ids, key=lambda k: int(k[1:].split("-")[0]))
    return {"ids": [ids[k] for k in order], "ttft": [ttft[k] for k in order], "wall_s": wall, "decode_steps": decode_steps}


def check_logits(engine: SpecEngine, ref, prompt: list[int]) -> dict:
    model = engine.model
    ids = torch.tensor(prompt, device=DEVICE)
    kv = ContiguousKV(model.config.num_layers)
    with torch.inference_mode():
        ours = model.logits(model(ids, kv.begin([("s", len(ids))]).to(DEVICE), kv).hidden)
        theirs = ref(ids[None]).logits[0].float()
    diff = (ours - theirs).abs()
    return {"tokens": len(prompt), "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "rel_l2": ((ours - theirs).norm() / theirs.norm()).item(),
            "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
            "max_abs_logit": theirs.abs().max().item()}


def hf_generate(ref, tok, prompts: list[list[int]], new_tokens: int, greedy_stop: bool = False) -> tuple[list[list[int]], float]:
    """Left-padded batch generate; returns new token ids per prompt and the wall time."""
    width = max(len(p) for p in prompts)
    pad = tok.eos_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    if not greedy_stop:
        kw["min_new_tokens"] = new_tokens
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = ref.generate(input_ids=input_ids, attention_mask=mask, **kw)
    sync()
    return [row[width:].tolist() for row in out], time.perf_counter() - t0


def decode_throughput(engine, ref, tok, prompt, batches, new_tokens, repeats) -> list[dict]:
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for b in batches:
        prompts = [prompt] * b
        ours, theirs, steps = [], [], []
        run_engine(engine, prompts, params)                       # warm-up (graphs, allocator)
        hf_generate(ref, tok, prompts, 8)
        for _ in range(repeats):                                  # alternate A B A B
            r = run_engine(engine, prompts, params)
            ours.append(b * new_tokens / r["wall_s"])
            steps += r["decode_steps"]
            _, t = hf_generate(ref, tok, prompts, new_tokens)
            theirs.append(b * new_tokens / t)
        ratios = sorted(o / t for o, t in zip(ours, theirs))
        rows.append({"batch": b, "ours_tok_s": ours, "hf_tok_s": theirs, "ours_median": statistics.median(ours),
                     "hf_median": statistics.median(theirs), "ratio_median": statistics.median(ratios),
                     "ratio_min": ratios[0], "ratio_max": ratios[-1],
                     "decode_step_ms_p50": 1e3 * statistics.median(steps),
                     "decode_step_ms_p99": 1e3 * sorted(steps)[int(0.99 * (len(steps) - 1))]})
        print(f"batch {b}: ours {rows[-1]['ours_median']:.0f} tok/s, transformers {rows[-1]['hf_median']:.0f} tok/s, "
              f"x{rows[-1]['ratio_median']:.1f}; step p50 {rows[-1]['decode_step_ms_p50']:.2f} ms", flush=True)
    return rows


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once (tied embeddings once, as the LM head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def long_prompt(tok, n: int, salt: int) -> list[int]:
    """n tokens of real Python source (the stdlib), distinct per salt so cold runs never hit."""
    import inspect
    import json as _json
    import typing

    text = "".join(inspect.getsource(m) for m in (typing, _json.decoder, _json.encoder, inspect))
    ids = tok.encode(f"# file {salt}\n" + text)
    return ids[:n]


def ttft_4k(model_path: Path, tmp: Path, n_tokens: int, repeats: int) -> dict:
    with KvdProcess(tmp / "kvd", device=DEVICE, gpu_bytes=4 << 30 if DEVICE == "cuda" else 64 << 20, dram_bytes=0) as kvd:
        engine = SpecEngine.from_config(EngineConfig(model=model_path, device=DEVICE, kvd_run_dir=kvd.run_dir,
                                                     max_num_batched_tokens=8192))
        params = SamplingParams(temperature=0.0, max_tokens=1)
        run_engine(engine, [long_prompt(engine.tokenizer, n_tokens, 999)], params)     # warm-up
        cold, warm, cached, phases = [], [], [], []
        keys = ("schedule_seconds_total", "forward_seconds_total", "output_seconds_total", "commit_seconds_total")

        def timed(prompt):
            before = engine.stats()
            r = run_engine(engine, [prompt], params)
            after = engine.stats()
            phases.append({k.split("_")[0] + "_ms": 1e3 * (after[k] - before[k]) for k in keys})
            return r["ttft"][0]

        for i in range(repeats):
            p = long_prompt(engine.tokenizer, n_tokens, i)
            cold.append(timed(p))
            q = p + engine.tokenizer.encode("\n# What does this code do?", add_bos=False)
            warm.append(timed(q))
            cached.append(engine.stats()["cached_tokens_total"])
        return {"prompt_tokens": n_tokens, "cold_ttft_ms": [1e3 * x for x in cold],
                "cached_ttft_ms": [1e3 * x for x in warm],
                "cold_median_ms": 1e3 * statistics.median(cold), "cached_median_ms": 1e3 * statistics.median(warm),
                "speedup_median": statistics.median(c / w for c, w in zip(cold, warm)),
                "cached_tokens_total": cached[-1], "kvd_connected": engine.source.connected,
                "phases_cold_cached_alternating": phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to check this script on a tiny model")
    ap.add_argument("--ttft-tokens", type=int, default=4096)
    ap.add_argument("--parts", default="logits,decode,ttft", help="which measurements: logits (with the greedy "
                    "answer), decode (with the HBM bound), ttft")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "model": args.model.name}
    parts = set(args.parts.split(","))
    if parts & {"logits", "decode"}:
        t0 = time.perf_counter()
        engine = SpecEngine.from_config(EngineConfig(model=args.model, device=DEVICE, num_local_blocks=8192,
                                                     max_num_seqs=32))
        res["load_s"] = time.perf_counter() - t0
        tok = engine.tokenizer
        ref = to_transformers(engine.model)
        prompt = tok.encode_chat(CHAT)
        if "logits" in parts:
            res["logits"] = check_logits(engine, ref, prompt)
            print("logits", res["logits"], flush=True)
            ours = run_engine(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=64))["ids"][0]
            theirs = hf_generate(ref, tok, [prompt], 64, greedy_stop=True)[0][0]
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            res["greedy"] = {"identical_prefix_tokens": same, "ours": tok.decode(ours), "transformers": tok.decode(theirs)}
            print("greedy", res["greedy"], flush=True)
        if "decode" in parts:
            batches = [int(b) for b in args.batches.split(",")]
            res["decode"] = decode_throughput(engine, ref, tok, prompt, batches, args.new_tokens, args.repeats)
            wb = weight_bytes(engine.model)
            bound_ms = 1e3 * wb / HBM_BYTES_PER_S
            step = res["decode"][0]["decode_step_ms_p50"]
            res["hbm"] = {"weight_bytes": wb, "bound_ms": bound_ms, "batch1_step_ms": step,
                          "fraction_of_bound": bound_ms / step}
            print("hbm", res["hbm"], flush=True)
        del ref, engine
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if "ttft" in parts:
        res["ttft_4k"] = ttft_4k(args.model, Path(tempfile.mkdtemp()), args.ttft_tokens, args.repeats)
        print("ttft", res["ttft_4k"], flush=True)
    res["gpu_seconds"] = time.perf_counter() - t_all
    (args.out / "runtime.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
