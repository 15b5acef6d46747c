"""The serving demo: kvd and specd as real processes, a 3-turn conversation through the client.

    python -m bench demo

It starts kvd and specd on the bundled stories260K (CPU unless --device cuda) with its committed DSpark
drafter, then talks to specd over its IPC socket with ``client.SpecdClient``. Each turn carries the
whole conversation so far, so turns 2 and 3 find their prefix in kvd and prefill only the new tokens:
the printed "from cache" counts are specd's own ``usage.cached_tokens``, and τ (tokens per
verification) comes from ``usage.speculation``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.stack import Stack, StackOptions
from bench.stats import tau
from client.specd_client import SpecdClient
from specd.engine.config import DEFAULT_MODEL

DEFAULT_DRAFTER = DEFAULT_MODEL.parent / "drafters" / "stories260K-dspark"

TURNS = (
    "Tell me a story about a little girl named Lily and her red ball.",
    "What did Lily do next?",
    "How did the story end?",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF file or HF directory (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length per turn")
    p.add_argument("--seed", type=int, default=7, help="sampling seed, for a repeatable demo")
    p.add_argument("--speculation", default="dspark", help="none, ngram or dspark (default: %(default)s)")
    p.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER, help="trained drafter (default: %(default)s)")


def speculation_note(method: str, spec: dict) -> str:
    """What speculation did in one turn, from its ``usage.speculation`` counts: τ (tokens a verification
    keeps) where it drafted, and a plain statement where it did not. Why: a turn without a τ read as if
    speculation were off; on this CPU the gate often measures plain decoding faster (the drafter costs about
    what stories260K does) and rests for the turn, and `ngram` drafts nothing where the text has no match."""
    if method == "none":
        return ""
    if not spec.get("verifications"):
        return f" | {method}: no drafting step this turn (rested by the gate, or nothing to draft)"
    return f" | {method} tau {tau(spec['verifications'], spec['accepted_tokens']):.2f}"


def run(args: argparse.Namespace) -> int:
    print(f"starting kvd and specd on {args.model.name} ...", flush=True)
    extra = ("--speculation", args.speculation) + (("--drafter", str(args.drafter)) if args.speculation == "dspark" else ())
    with Stack("ours", StackOptions(model=args.model, device=args.device, specd_args=extra)) as stack:
        print(f"specd at {stack.run_dir}/specd.sock, HTTP gateway at {stack.base_url}\n", flush=True)
        messages: list[dict] = []
        with SpecdClient(stack.run_dir, timeout_s=120) as client:
            for turn, question in enumerate(TURNS, 1):
                messages.append({"role": "user", "content": question})
                t0 = time.perf_counter()
                ttft, text, usage = None, "", None
                for delta in client.stream(messages=messages, session="demo", max_tokens=args.max_tokens,
                                           temperature=0.8, top_p=0.95, seed=args.seed + turn):
                    if ttft is None and (delta.text or delta.token_ids):
                        ttft = time.perf_counter() - t0
                    text += delta.text
                    usage = delta.usage or usage
                messages.append({"role": "assistant", "content": text})
                print(f"--- turn {turn} ---\nuser: {question}\nassistant: {text.strip()}")
                spec = usage.speculation or {}
                print(f"TTFT {1e3 * (ttft or 0):.1f} ms | prompt tokens {usage.prompt_tokens} | "
                      f"from cache {usage.cached_tokens} | generated {usage.completion_tokens}"
                      + speculation_note(args.speculation, spec) + "\n", flush=True)
        stats = stack.stats()
    print(f"specd: {stats['prompt_tokens_total']} prompt tokens, {stats['cached_tokens_total']} served from kvd's cache")
    return 0
