"""Support chat: one long shared policy prompt, short customer turns, many concurrent sessions.

The system prompt is the ABCD agent guidelines (95 KB), byte-identical in every session: it is the prefix a
KV cache should hold once and serve to everyone. Customer turns are the user utterances of a real
Schema-Guided Dialogue, in order. Answers are short and pauses are seconds, so prefill dominates.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import BuildOptions, Timing, pick, session_arrivals, think_times

WORKLOAD = "support"
TIMING = Timing(rate=2.0, think_median_s=6.0, think_sigma=0.6)  # a customer types a short reply
DEFAULT_MAX_TOKENS = 96
SGD_FILES = tuple(f"support/sgd_dev_dialogues_{i:03d}.json" for i in range(1, 6))
GUIDELINES = "support/abcd_guidelines.json"
INTRO = ("You are a customer service agent. Help the customer with their request: restaurants, travel, "
         "banking, shopping orders and accounts. Be brief and polite, ask for missing details one at a time, "
         "and confirm before you act. Follow the agent guidelines below (JSON: flows, subflows, actions).\n\n")


def system_prompt(corpora_dir: Path, opts: BuildOptions) -> str:
    """The exact same text for every session (clipped only by the size preset, identically for all)."""
    return opts.clip(INTRO + (corpora_dir / GUIDELINES).read_text(encoding="utf-8"))


def load_dialogues(corpora_dir: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """Item id 'sgd/<dialogue_id>' -> the customer's utterances in order (dialogues without any are skipped)."""
    paths = [corpora_dir / name for name in SGD_FILES]
    dialogues: dict[str, list[str]] = {}
    for path in paths:
        for dialogue in json.loads(path.read_text(encoding="utf-8")):
            said = [t["utterance"] for t in dialogue["turns"] if t["speaker"] == "USER"]
            if said:
                dialogues[f"sgd/{dialogue['dialogue_id']}"] = said
    return paths + [corpora_dir / GUIDELINES], dialogues


def make_session(index: int, item_id: str, utterances: list[str], system: str, arrival_s: float,
                 opts: BuildOptions, rng: random.Random) -> Session:
    n_turns = min(opts.turn_count(len(utterances)), len(utterances))
    pauses = think_times(opts, rng, TIMING, n_turns)
    max_tokens = opts.answer_tokens(DEFAULT_MAX_TOKENS)
    turns = [Turn(messages=[Message(role="user", content=opts.clip(text))], max_tokens=max_tokens,
                  think_time_s=pause) for text, pause in zip(utterances, pauses)]
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=arrival_s,
        system=system, turns=turns, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=0),
        meta={"corpus": WORKLOAD, "source_items": [item_id]},
    )


def build(opts: BuildOptions) -> list[Session]:
    sources, dialogues = load_dialogues(opts.corpora_dir)
    split = opts.split_of(WORKLOAD, sources, list(dialogues))
    system = system_prompt(opts.corpora_dir, opts)
    rng = opts.rng(WORKLOAD)
    chosen = pick(rng, split.ids(opts.split), opts.sessions)
    starts = session_arrivals(opts, rng, TIMING)
    return [make_session(i, item, dialogues[item], system, t, opts, rng)
            for i, (item, t) in enumerate(zip(chosen, starts))]
