"""Where a drafter training step's time goes, and how it scales with the batch: a random-weight Qwen-0.5B
target and a fresh dspark drafter on sequences of the real prompts' lengths (no GGUF upload).

Why: run T (session 8) trained at 5.4 steps/s of 8 sequences × 16 anchors, so 2,300 steps took 425 s,
most of a session's training budget, and the drafter (τ 1.3-2.9) is what limits issue 6. A CPU count
said the step was host-bound: ~35k aten ops at 42933dd, growing linearly with the batch. Session 8 then
batched the target pass and the drafter forward (docs/design/drafter.md, "One forward per training
step": 8.8k ops at batch 8, 11.5k at 32). This probe measures what that did on the device, and whether a
larger batch is now nearly free, before any default changes. It uses only APIs 42933dd also has, so one
call can time both commits (``PYTHONPATH=<old export>``). Anchors per sequence are the other lever:
DeepSpec trains with 512 per sequence against our 16, and on a host-bound step more anchors cost GPU
time only (``BxA`` shapes below).

    python bench/gpu/train_probe.py --prompts .carry/answers-prompts.json --batches 8,16,32 --out probe.json
    # (PYTHONPATH = the export's root; --profile-batch 8 adds a torch.profiler kernel table)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from answers_probe import QWEN05, random_model  # noqa: E402  (this folder is not a package on the device's path)


def _shape(text: str, default_anchors: int) -> tuple[int, int] | None:
    """"B" or "BxA" -> (B, A); empty -> None."""
    if not text:
        return None
    batch, _, anchors = text.partition("x")
    return int(batch), int(anchors or default_anchors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True, help="answers_probe --prepare's file (real prompt ids)")
    p.add_argument("--answer-tokens", type=int, default=82, help="answer length appended (run T: 82 mean)")
    p.add_argument("--batches", default="8,16,32,8x64,32x64",
                   help="shapes to time: B (sequences per step, --anchors each) or BxA (A anchors per sequence)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per batch size (after 3 warm-ups)")
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--profile-batch", default="", help="also profile 3 steps of this shape (as in --batches)")
    p.add_argument("--features-dtype", default="target", choices=("target", "bfloat16"),
                   help="the target pass's dtype (Trainer.features): target = fp32, as before session 9; "
                        "bfloat16 = the pipeline's CUDA default since session 9 (--features-dtype auto)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--method", default="dspark", choices=("dspark", "dflash", "eagle3"),
                   help="the drafter trained (session 42: eagle3, whose loss ran one sequence at a time until then)")
    p.add_argument("--reference", action="store_true",
                   help="time the per-sequence loss (train.block_loss_reference) instead of the batched one")
    p.add_argument("--tiny", action="store_true", help="a 4-layer, 64-wide target (CPU smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from specd.drafter.base import build_drafter
    from specd.drafter.config import DrafterConfig
    from specd.drafter.data import TrainSequence
    from specd.drafter import train
    from specd.drafter.train import Trainer, TrainConfig

    if args.reference:
        train.block_loss = train.block_loss_reference       # the Trainer looks it up at each step

    device = torch.device(args.device)
    shape = dict(QWEN05)
    if args.tiny:
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    target = random_model(shape, device, torch.float32).requires_grad_(False)    # fp32, as the pipeline trains
    config = target.config
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True                  # the pipeline's default (--no-tf32 off)
    rows = json.loads(Path(args.prompts).read_text())["prompts"]
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for r in rows[:: max(1, len(rows) // 512)]:
        ids = [t % config.vocab_size for t in r["ids"]][: (64 if args.tiny else None)]
        answer = torch.randint(3, config.vocab_size, (args.answer_tokens,), generator=gen).tolist()
        seqs.append(TrainSequence(ids + answer, len(ids)))
    extra = {"markov_rank": 64} if args.method == "dspark" else {}
    dcfg = DrafterConfig.for_target(config, args.method, gamma=7, num_layers=1, **extra)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "method": args.method, "loss": "reference" if args.reference else "batched",
                    "features_dtype": args.features_dtype, "sequences": len(seqs), "mean_tokens": sum(len(s.tokens) for s in seqs) / len(seqs),
                    "anchors": args.anchors, "batches": {}}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    features = None          # the bf16 copy of --features-dtype bfloat16, made once
    with tempfile.TemporaryDirectory() as tmp:
        for shape in [b.strip() for b in args.batches.split(",") if b.strip()]:
            batch, anchors = _shape(shape, args.anchors)
            drafter = build_drafter(dcfg, target).to(device)
            trainer = Trainer(target, drafter, seqs, TrainConfig(steps=args.steps + 3, batch_size=batch,
                                                                 anchors=anchors), Path(tmp))
            if args.features_dtype != "target":
                if not hasattr(trainer, "features"):       # an older tree: it would time fp32 under this name
                    raise SystemExit(f"this tree's Trainer has no features model (--features-dtype {args.features_dtype})")
                if features is None:
                    from specd.drafter.data import served_copy
                    features = served_copy(target, args.features_dtype)
                trainer.features = features
            times = []
            try:
                for i in range(3 + args.steps):
                    t0 = time.perf_counter()
                    trainer.train_step()
                    sync()
                    if i >= 3:                    # the first three are warm-ups (allocator, compiles)
                        times.append(time.perf_counter() - t0)
            except torch.OutOfMemoryError as e:   # a shape too large for this GPU: say so, time the others
                result["batches"][shape] = {"sequences": batch, "anchors": anchors,
                                            "error": f"out of memory: {e}"[:300]}
                print(f"{batch} sequences x {anchors} anchors: out of memory", flush=True)
                del trainer, drafter
                torch.cuda.empty_cache()
                continue
            if device.type == "cuda":
                result.setdefault("peak_gib", {})[shape] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            times.sort()
            med = times[len(times) // 2]
            result["batches"][shape] = {"sequences": batch, "anchors": anchors, "step_s_p50": med,
                                        "step_s_min": times[0], "step_s_max": times[-1], "steps_per_s": 1 / med,
                                        "sequences_per_s": batch / med, "anchor_blocks_per_s": batch * anchors / med}
            print(f"{batch} sequences x {anchors} anchors: {1e3 * med:.1f} ms a step (p50 of {args.steps}), "
                  f"{batch / med:.1f} sequences/s, {batch * anchors / med:.0f} anchor blocks/s", flush=True)
            if (batch, anchors) == _shape(args.profile_batch, args.anchors):
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    for _ in range(3):
                        trainer.train_step()
                    sync()
                key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
                table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
                Path(args.out).with_suffix(".kernels.txt").write_text(table)
                ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / 3
                result["batches"][shape]["aten_ops_per_step"] = ops
            del trainer, drafter
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
