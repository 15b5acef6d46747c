"""Time ``encode_chat`` over agent sessions' turns, with the segment cache (specd/segment_cache.py) and
with the plain encode, and check both give the same ids.

    python -m tests.models.chat_encode_probe --model Q.gguf --sessions .carry/sessions/agentic-coding.jsonl

Each session's turns are rendered in order with stand-in answers, as the agentic replay sends them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.workloads.format import Session, prompt_messages
from specd.loader.gguf import gguf_tokenizer
from specd.loader.gguf_file import GGUFFile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.models.chat_encode_probe", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF with a byte-level BPE vocabulary (Qwen2.5)")
    p.add_argument("--sessions", required=True, help="a session JSONL (bench build-workloads)")
    p.add_argument("--limit", type=int, default=12, help="sessions to replay")
    args = p.parse_args(argv)
    tok = gguf_tokenizer(GGUFFile(args.model))
    if tok.segments is None:
        raise SystemExit("this tokenizer is not one the segment cache is enabled for")
    with open(args.sessions) as f:
        sessions = [Session(**json.loads(line)) for line in f][: args.limit]
    cached, plain, last = [], [], []
    for s in sessions:
        answers: list[str] = []
        for turn in range(len(s.turns)):
            msgs = [{"role": m["role"], "content": m["content"]} for m in prompt_messages(s, turn, answers)]
            text = tok.apply_chat_template(msgs)
            t0 = time.perf_counter()
            ids = tok.encode(text, add_bos=False)
            t1 = time.perf_counter()
            ref = tok.inner.encode(text, add_special_tokens=False).ids
            t2 = time.perf_counter()
            if ids != ref:
                raise SystemExit(f"session {s.id} turn {turn}: the cached encode differs")
            cached.append(t1 - t0)
            plain.append(t2 - t1)
            if turn == len(s.turns) - 1:
                last.append((len(ids), t1 - t0, t2 - t1))
            answers.append(f"def f():\n    return {turn}\n" * 5)
    print(f"{len(cached)} chats, identical ids; median encode {1e3 * statistics.median(cached):.1f} ms cached, "
          f"{1e3 * statistics.median(plain):.1f} ms plain")
    print("last turns (tokens: cached / plain ms): " + ", ".join(
        f"{n}: {1e3 * a:.1f} / {1e3 * b:.1f}" for n, a, b in last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
