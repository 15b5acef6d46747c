"""How many aten ops one drafter training step issues, by batch size: a proxy for a step's host time on a
GPU, where each op is a launch (session 8: run T's H200 step took ~185 ms at batch 8).

    python tests/drafter/train_ops_probe.py --batches 8,16,32
    PYTHONPATH=<export of an older commit> python tests/drafter/train_ops_probe.py --batches 8,16,32

The target has Qwen2.5-0.5B's depth and heads (24 layers, 14 query / 2 KV heads) with small widths: the op
count depends on the structure, not the widths, and the CPU runs it in seconds. The drafter is dspark
(1 layer, γ = 7, Markov rank 64), the sequences 300 tokens with a 200-token prompt, 16 anchors each. The
CPU's math attention decomposes into several ops where CUDA launches one kernel, so the count
over-states the GPU's launches; compare commits with it, do not read it as a timing. Run as a script
(not ``-m``), so that ``PYTHONPATH`` decides which commit's ``specd`` it counts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def count_ops(batch: int, steps: int = 3) -> float:
    """Mean aten ops per training step at this batch size (after one unprofiled step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specd.drafter.base import build_drafter
    from specd.drafter.config import DrafterConfig
    from specd.drafter.data import TrainSequence
    from specd.drafter.train import Trainer, TrainConfig
    from specd.models.config import ModelConfig
    from specd.models.decoder import DecoderModel

    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=24,
                      num_heads=14, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                      qkv_bias=True)
    target = DecoderModel(cfg).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(torch.randint(3, 500, (300,), generator=gen).tolist(), 200) for _ in range(32)]
    drafter = build_drafter(DrafterConfig.for_target(cfg, "dspark", gamma=7, num_layers=1, markov_rank=64), target)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(target, drafter, seqs, TrainConfig(steps=steps + 1, batch_size=batch), Path(tmp))
        trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                trainer.train_step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,16,32", help="sequences per training step, comma-separated")
    args = p.parse_args(argv)
    import specd

    print(f"specd: {Path(specd.__file__).parent}")
    for batch in [int(b) for b in args.batches.split(",")]:
        print(f"batch {batch}: {count_ops(batch):,.0f} aten ops per step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
