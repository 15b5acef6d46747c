"""A model directory with a real tokenizer and random weights, so a real model *size* can be served for timing.

    python -m specd.loader.random_weights --shape qwen3-8b --tokenizer-from Q.gguf --out models/qwen3-8b-random
    python -m specd --model models/qwen3-8b-random ...        # specd and bench take the directory like any model

Why: issue 7's TTFT goal (LMCache's ≥ 3× over a GPU-only prefix cache) is about models whose prefill is
expensive. On Qwen2.5-0.5B recomputing 18k tokens costs about what fetching them does (docs/results/kv.md),
so no cache tier can win 3×. An 8B model's weights (16 GB) cannot reach the device machine (64 MiB a call, no
hub), but prefill, decode and KV movement cost the same whatever the weight values are: only the shapes
matter. So the directory holds the architecture and a real vocabulary, and the loader draws the weights.

What it is not: a model. Its answers are noise. Use it only where answers have a fixed length
(``ignore_eos``) and only time is measured; every result made with it must say "random weights".

The directory:
  random_weights.json      {"shape": ..., "config": ModelConfig fields, "seed": ..., "std": ...}
  tokenizer.json, tokenizer_config.json, generation_config.json
                           the vocabulary, written from a GGUF (the files specd.loader.hf reads)

The marker file is what makes a directory random: a directory that lacks its safetensors is an error
(specd.loader.hf), never silently random.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from specd.loader.hf import load_hf_tokenizer
from specd.loader.weights import CheckpointError, fill_model
from specd.models.config import ModelConfig, fingerprint_of
from specd.models.decoder import DecoderModel, empty_model
from specd.tokenizer import Tokenizer

MARKER = "random_weights.json"

# Published architectures (their config.json values), in ModelConfig's terms.
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                     qk_norm=True, max_position_embeddings=40960),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         qkv_bias=True, max_position_embeddings=32768, tie_word_embeddings=True),
    # the qwen3 architecture at toy sizes: the CPU tests' stand-in for qwen3-8b
    "tiny-qwen3": dict(arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                       qk_norm=True, max_position_embeddings=4096),
}


def is_random_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def model_label(path: str | os.PathLike) -> str:
    """A model's name in reports; a random-weights directory says so, with its shape, wherever it is named."""
    path = Path(path)
    if not is_random_dir(path):
        return path.name
    shape = json.loads((path / MARKER).read_text(encoding="utf-8")).get("shape", "?")
    return f"{path.name} ({shape} shape, RANDOM WEIGHTS: timing only)"


# ---- writing the directory --------------------------------------------------------------------------

def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    """The three HF files that make specd.loader.hf.load_hf_tokenizer rebuild ``tokenizer`` exactly."""
    inner = tokenizer.inner
    inner.save(str(out / "tokenizer.json"))

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else inner.id_to_token(token_id)

    tcfg = {"bos_token": text(tokenizer.bos_id), "eos_token": text(tokenizer.eos_id),
            "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tokenizer.stop_ids)}),
                                                encoding="utf-8")


def write_random_dir(shape: str, tokenizer: Tokenizer, out: str | os.PathLike, seed: int = 0,
                     std: float = 0.02) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (have {', '.join(sorted(SHAPES))})")
    config = dict(SHAPES[shape])
    if tokenizer.vocab_size > config["vocab_size"]:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens; shape {shape} embeds {config['vocab_size']}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(tokenizer, out)
    meta = {"shape": shape, "config": config, "seed": seed, "std": std,
            "note": "RANDOM WEIGHTS: for timing only; answers are noise (specd/loader/random_weights.py)"}
    (out / MARKER).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return out


# ---- loading it ---------------------------------------------------------------------------------------

def _random_tensors(model: DecoderModel, seed: int, std: float, dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """Each parameter drawn where it will live, in its serving dtype (an 8B model built in fp32 and cast
    would need 48 GB at its peak). Norm weights are 1 and biases 0, as a trained model's roughly are, so
    activations keep a realistic scale."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, std, generator=gen)
        yield name, t


def load_random(root: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> tuple[DecoderModel, Tokenizer]:
    root = Path(root)
    try:
        meta = json.loads((root / MARKER).read_text(encoding="utf-8"))
        seed, std = int(meta["seed"]), float(meta["std"])
        config = ModelConfig(**meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{root / MARKER} is not a valid random-weights marker: {exc}") from exc
    content = json.dumps({"random": True, "seed": seed, "std": std}, sort_keys=True).encode()
    config = dataclasses.replace(config, fingerprint=fingerprint_of(config, [], content))
    device = torch.device(device)
    model = empty_model(config, device)
    fill_model(model, _random_tensors(model, seed, std, dtype, device))
    return model, load_hf_tokenizer(root)


# ---- command line -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specd.loader.random_weights",
        description="Write a model directory with a real tokenizer and random weights (drawn at load), to time "
                    "serving at a real model size whose weights are not at hand. Answers are noise.")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the architecture to build")
    p.add_argument("--tokenizer-from", required=True, type=Path,
                   help="a GGUF file or HF directory whose tokenizer (and chat template) the directory gets")
    p.add_argument("--out", required=True, type=Path, help="the directory to write (created)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (part of the KV namespace fingerprint)")
    p.add_argument("--std", type=float, default=0.02, help="standard deviation of the weight matrices")
    args = p.parse_args(argv)
    src = args.tokenizer_from
    if src.is_file() and src.suffix == ".gguf":
        from specd.loader.gguf import gguf_tokenizer
        from specd.loader.gguf_file import GGUFFile
        tokenizer = gguf_tokenizer(GGUFFile(src))
    elif src.is_dir():
        tokenizer = load_hf_tokenizer(src)
    else:
        p.error(f"--tokenizer-from {src}: not a .gguf file or a directory")
    out = write_random_dir(args.shape, tokenizer, args.out, args.seed, args.std)
    print(f"wrote {out} ({args.shape}, random weights, seed {args.seed}; tokenizer of {src.name}, "
          f"{tokenizer.vocab_size} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
