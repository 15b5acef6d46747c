"""Creative writing: story and dialogue continuation, high temperature, long answers, long pauses.

Seeds are real text: passages of tinyshakespeare (a scene opening to continue, with the user writing some of
the next real speeches in later turns) and the vicuna_bench writing/roleplay prompts. What stresses the
system: long outputs at T=0.8-1.0 (speculation is hardest there) and minutes-long pauses, so a session's
KV must survive in a lower tier until the writer comes back.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench.workloads.format import Message, Sampling, Session, Turn
from bench.workloads.profile import BuildOptions, Timing, pick, session_arrivals, think_times

WORKLOAD = "creative"
TIMING = Timing(rate=1 / 30, think_median_s=180.0, think_sigma=0.75)  # a writer pauses for minutes
DEFAULT_TURNS = 4
DEFAULT_MAX_TOKENS = 1024
PASSAGE_SPEECHES = 12  # speeches per passage; part of the item ids, so fixed
OPENING_SPEECHES = 6  # the scene opening shown in turn 1; the rest are the user's later lines
SYSTEM = ("You are a creative writing partner. Continue the user's story or scene in the same voice and style, "
          "with vivid detail and natural dialogue. Write long, complete passages.")
FOLLOW_UPS = (
    "Continue the story from where you stopped.",
    "Now add a new character who disagrees with the others, and continue.",
    "Rewrite the last part from another character's point of view.",
    "Continue, and build the tension toward a turning point.",
    "Write the next scene, set a day later.",
    "Continue with more dialogue and less description.",
)


@dataclass(frozen=True)
class Seed:
    """One source item: either a Shakespeare passage (speeches) or a vicuna prompt."""

    item_id: str
    speeches: tuple[str, ...] = ()
    prompt: str = ""


def load_seeds(corpora_dir: Path) -> tuple[list[Path], dict[str, Seed]]:
    """Read both sources; item ids are 'shakespeare/<passage index>' and 'vicuna/<question_id>'."""
    shakespeare = corpora_dir / "creative/tinyshakespeare.txt"
    vicuna = corpora_dir / "creative/vicuna_bench_questions.jsonl"
    seeds: dict[str, Seed] = {}
    speeches = [s.strip() for s in shakespeare.read_text(encoding="utf-8").split("\n\n") if s.strip()]
    for start in range(0, len(speeches) - PASSAGE_SPEECHES + 1, PASSAGE_SPEECHES):
        item_id = f"shakespeare/{start // PASSAGE_SPEECHES:05d}"
        seeds[item_id] = Seed(item_id, speeches=tuple(speeches[start:start + PASSAGE_SPEECHES]))
    for line in vicuna.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        if q["category"] in ("writing", "roleplay"):
            item_id = f"vicuna/{q['question_id']}"
            seeds[item_id] = Seed(item_id, prompt=q["turns"][0])
    return [shakespeare, vicuna], seeds


def turn_texts(seed: Seed, n_turns: int, opts: BuildOptions) -> list[str]:
    """The user's message of each turn: a scene opening then real next lines, or a prompt then follow-ups."""
    if seed.speeches:
        opening = opts.clip("\n\n".join(seed.speeches[:OPENING_SPEECHES]))
        texts = [f"Here is the opening of a scene:\n\n{opening}\n\nContinue the scene in the same style."]
        for line in seed.speeches[OPENING_SPEECHES:OPENING_SPEECHES + n_turns - 1]:
            texts.append(f"I'll write the next lines myself:\n\n{opts.clip(line)}\n\nNow continue from there.")
    else:
        texts = [seed.prompt]
    while len(texts) < n_turns:
        texts.append(FOLLOW_UPS[(len(texts) - 1) % len(FOLLOW_UPS)])
    return texts


def make_session(index: int, seed: Seed, arrival_s: float, opts: BuildOptions, rng: random.Random) -> Session:
    n_turns = opts.turn_count(DEFAULT_TURNS)
    pauses = think_times(opts, rng, TIMING, n_turns)
    max_tokens = opts.answer_tokens(DEFAULT_MAX_TOKENS)
    turns = [Turn(messages=[Message(role="user", content=text)], max_tokens=max_tokens, think_time_s=pause)
             for text, pause in zip(turn_texts(seed, n_turns, opts), pauses)]
    return Session(
        id=f"{WORKLOAD}-{opts.split}-{index:05d}", workload=WORKLOAD, split=opts.split, arrival_s=arrival_s,
        system=opts.clip(SYSTEM), turns=turns,
        sampling=Sampling(temperature=round(rng.uniform(0.8, 1.0), 2), top_p=0.95, top_k=0),
        meta={"corpus": WORKLOAD, "source_items": [seed.item_id]},
    )


def build(opts: BuildOptions) -> list[Session]:
    sources, seeds = load_seeds(opts.corpora_dir)
    split = opts.split_of(WORKLOAD, sources, list(seeds))
    rng = opts.rng(WORKLOAD)
    chosen = pick(rng, split.ids(opts.split), opts.sessions)
    starts = session_arrivals(opts, rng, TIMING)
    return [make_session(i, seeds[item], t, opts, rng) for i, (item, t) in enumerate(zip(chosen, starts))]
