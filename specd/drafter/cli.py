"""``specd train-drafter``: regenerate the data with the target, train, calibrate, write the drafter.

    specd train-drafter --target models/stories260K.gguf --self-prompts 512 --method dspark \\
        --out models/drafters/stories260K-dspark --steps 1500 --layers 1
    specd train-drafter --target qwen.gguf --data coding.train.jsonl --method dspark --out runs/coding \\
        --init runs/generic --device cuda

Output directory: ``drafter.safetensors`` + ``drafter.json`` (specd.drafter.base.save_drafter),
``calibration.json`` (STS temperatures, dspark only), ``training.json`` (command, data hashes and
generator, loss curves, wall times, weight sha256, ECE before/after STS), and the run's working files
``data.jsonl`` (the target's answers, reused by ``--resume``), ``data.json`` (which generator wrote them),
``prompts.txt`` (self-sampled openings) and ``checkpoint.pt``; only the first four are meant to be committed.

``--answers``: which generator answers the prompts (specd.drafter.data.ANSWERS): ``engine`` (the serving
engine: continuous batching, CUDA graphs; the default on CUDA) or ``harness`` (eager padded-K/V
forwards; the default on the CPU, where it is the faster one).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.workloads.split import file_sha256
from specd.drafter import calibration, data
from specd.drafter.train import CHECKPOINT, TrainConfig, Trainer

WEIGHTS = "drafter.safetensors"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specd train-drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, type=Path, help="GGUF file or HF directory of the target")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="workload SESSIONS.jsonl; its train split is used")
    src.add_argument("--prompts", type=Path, help="plain prompts, one per line")
    src.add_argument("--self-prompts", type=int, help="N openings sampled from the target (BOS + tokens, T=1)")
    p.add_argument("--method", required=True, choices=["dspark", "dflash", "eagle3"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--init", type=Path, help="fine-tune from this drafter directory (workload tuning)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--layers", type=int, default=1, help="draft transformer layers (dspark/dflash)")
    p.add_argument("--markov-rank", type=int, default=None, help="dspark Markov rank (default: the config's)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="random anchors per sequence")
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt with OUT/data.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="answer length (default: the session turn's max_tokens; 128 for prompts)")
    p.add_argument("--data-temperature", type=float, default=0.8,
                   help="sampling temperature of the target's answers to --prompts/--self-prompts "
                        "(sessions carry their own sampling)")
    p.add_argument("--opening-tokens", type=int, default=8, help="tokens per self-sampled opening")
    p.add_argument("--max-len", type=int, default=512, help="prompt + answer tokens at most")
    p.add_argument("--answers", choices=data.ANSWERS, default=None,
                   help="answer generator: engine (serving engine, CUDA graphs) or harness (eager); "
                        "default: engine on CUDA, harness on the CPU")
    p.add_argument("--answers-dtype", default="auto", choices=data.SERVED_DTYPES,
                   help="dtype the target answers the training prompts in: auto = bfloat16 on CUDA (what specd "
                        "serves; 2.4x faster a step than fp32 on the H200; a copy of the target, 2 bytes per "
                        "parameter, while the answers are made), the target's dtype elsewhere; target = --dtype")
    p.add_argument("--features-dtype", default="auto", choices=data.SERVED_DTYPES,
                   help="dtype of the target pass that gives the drafter its training features: auto = bfloat16 on "
                        "CUDA (what specd serves; fp32 attention was a third of an H200 training step; a copy of "
                        "the target, 2 bytes per parameter), the target's dtype elsewhere; target = --dtype. "
                        "The LM heads and STS calibration use the target")
    p.add_argument("--holdout", type=float, default=0.1, help="fraction of sequences kept for STS calibration")
    p.add_argument("--sts-temperature", type=float, default=0.0,
                   help="sampling temperature at which STS observes survival (0 = greedy)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="float32", help="drafter training runs in fp32 by default")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    from specd.loader import load_model

    target, tokenizer = load_model(args.target, args.dtype, args.device)
    target.requires_grad_(False)
    args.answers = args.answers or data.default_answers(next(target.parameters()).device)
    t0 = time.perf_counter()
    seqs, source_sha, answers = training_data(args, target, tokenizer)
    data_s = time.perf_counter() - t0
    fit(args, target, seqs, {"source_sha256": source_sha, "answers_sha256": file_sha256(args.out / "data.jsonl"),
                             "data_s": data_s, "answers": answers}, "specd train-drafter " + shlex.join(argv))
    return 0


def fit(args: argparse.Namespace, target, seqs: list[data.TrainSequence], provenance: dict, command: str,
        deadline: float | None = None) -> dict:
    """Train (resuming from OUT/checkpoint.pt when --resume), calibrate, write the drafter and its
    training.json; returns that report. `provenance`: source_sha256, answers_sha256, data_s, answers
    (the generator that wrote the data, ``data.ANSWERS``).
    `deadline` (time.perf_counter() value) stops training early; the report says at which step."""
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train_seqs, held = data.split_holdout(seqs, args.holdout, args.seed)
    drafter = make_drafter(args, target)
    cfg = TrainConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, anchors=args.anchors,
                      log_every=args.log_every, ckpt_every=args.ckpt_every, seed=args.seed)
    features = data.served_copy(target, args.features_dtype)
    trainer = Trainer(target, drafter, train_seqs, cfg, args.out, features=features)
    if args.resume and (args.out / CHECKPOINT).exists():
        print(f"resuming at step {trainer.load_checkpoint()}", file=sys.stderr)
    print(drafter.describe(), file=sys.stderr)
    curves = trainer.train(deadline=deadline)
    sts = calibrate(args, target, drafter, held)
    from specd.drafter.base import save_drafter

    save_drafter(drafter, args.out / WEIGHTS, extra_meta={"target_fingerprint": target.config.fingerprint})
    report = {
        "command": command,
        "method": args.method, "target": str(args.target), "target_fingerprint": target.config.fingerprint,
        "init": str(args.init) if args.init else None,
        "drafter": drafter.describe(), "parameters": drafter.num_parameters(),
        "data": {"source": str(args.data or args.prompts or f"self-prompts:{args.self_prompts}"),
                 "source_sha256": provenance["source_sha256"], "answers_sha256": provenance["answers_sha256"],
                 "sequences": len(seqs), "train_sequences": len(train_seqs), "heldout_sequences": len(held),
                 "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in seqs),
                 "answers": provenance.get("answers"),
                 "data_temperature": None if args.data else args.data_temperature},
        "train": asdict(cfg), "features_dtype": str(features.embed_tokens.weight.dtype).removeprefix("torch."),
        "steps_done": trainer.step, "loss_curves": asdict(curves),
        "wall_s": {"data": provenance["data_s"], "train": trainer.train_s},
        "weights_sha256": file_sha256(args.out / WEIGHTS),
        "sts": sts,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"steps": trainer.step, "final_loss": curves.total[-1] if curves.total else None,
                      "ece_before": sts and sts["ece_before"], "ece_after": sts and sts["ece_after"],
                      "train_s": round(trainer.train_s, 1)}))
    return report


def training_data(args: argparse.Namespace, target, tokenizer) -> tuple[list[data.TrainSequence], str, str | None]:
    """(sequences, sha256 of the prompt source, the generator that wrote the answers). The target's
    answers are reused from OUT/data.jsonl on --resume, so a resumed run trains on exactly the same
    data (its generator read back from OUT/data.json; None when an older run did not write it)."""
    path, meta = args.out / "data.jsonl", args.out / "data.json"
    max_new = args.max_new_tokens or (None if args.data else 128)
    if args.self_prompts:
        prompt_file = args.out / "prompts.txt"
        if not (args.resume and prompt_file.exists()):
            openings = data.self_openings(target, tokenizer, args.self_prompts, args.opening_tokens, args.seed,
                                          answers=args.answers)
            data.write_text_prompts(prompt_file, tokenizer, openings)
        args.prompts = prompt_file
    source = args.data or args.prompts
    if args.resume and path.exists():
        written = json.loads(meta.read_text()).get("answers") if meta.exists() else None
        return data.load_sequences(path), file_sha256(source), written
    answerer = data.served_copy(target, args.answers_dtype)
    if args.data:
        seqs = data.session_sequences(answerer, tokenizer, args.data, "train", args.seed, args.max_len, max_new,
                                      answers=args.answers)
    else:
        prompts = data.text_prompts(args.prompts, tokenizer, args.data_temperature, max_new)
        seqs = data.prompt_sequences(answerer, prompts, args.seed, tokenizer.stop_ids, args.max_len,
                                     answers=args.answers)
    answered_in = str(answerer.embed_tokens.weight.dtype)
    del answerer
    data.save_sequences(path, seqs)
    meta.write_text(json.dumps({"answers": args.answers, "answers_dtype": answered_in}) + "\n")
    return seqs, file_sha256(source), args.answers


def make_drafter(args: argparse.Namespace, target):
    """A fresh drafter for the target, or (--init) a copy of a trained one to fine-tune."""
    from specd.drafter.base import build_drafter, load_drafter
    from specd.drafter.config import DrafterConfig

    device = next(target.parameters()).device
    if args.init:
        drafter = load_drafter(args.init / WEIGHTS, target, device=device)
        if drafter.config.method != args.method or drafter.config.gamma != args.gamma:
            raise SystemExit(f"--init {args.init} is {drafter.config.method} γ={drafter.config.gamma}, "
                             f"asked {args.method} γ={args.gamma}")
        return drafter
    overrides = {"gamma": args.gamma}
    if args.method != "eagle3":
        overrides["num_layers"] = args.layers
    if args.markov_rank is not None and args.method == "dspark":
        overrides["markov_rank"] = args.markov_rank
    cfg = DrafterConfig.for_target(target.config, args.method, **overrides)
    return build_drafter(cfg, target).to(device)


def calibrate(args: argparse.Namespace, target, drafter, held: list[data.TrainSequence]) -> dict | None:
    """STS on the held-out sequences (dspark only); writes OUT/calibration.json."""
    if args.method != "dspark" or not drafter.config.confidence or not held:
        return None
    conf, accepted = calibration.heldout_survival(target, drafter.eval(), held, args.sts_temperature, args.seed)
    fit = calibration.fit_sts(conf, accepted)
    result = {**asdict(fit), "blocks": int(conf.shape[0]), "sts_temperature": args.sts_temperature,
              "heldout_tau": float((accepted.float() + 1).mean())}
    (args.out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
