"""``python -m bench eviction-ablation``: the reuse policy minus one ingredient at a time, on workload sessions.

Why a replay and not ``bench serve``: the question is which blocks the policy keeps, so the replay
feeds kvd the block streams of many sessions (with their own arrival and think times, which decide
what a cache forgets) through an in-process ``KvdCore`` on a simulated clock: thousands of turns in
seconds, the same KvdCore code as the daemon, and the real hint builder of specd
(specd/engine/hints.py), so the hints are the ones the engine sends.

The stream of a session (the session format's history rule, docs/workloads.md):

    system | tool schemas | turn 1 messages | answer 1 | turn 2 messages | answer 2 | ...

Tokens come from a cheap stand-in tokenizer (``stand_in_tokens``: words and punctuation, each mapped
to an id by blake2b), about one token per 4-5 characters like a BPE vocabulary; the answers the
replay cannot generate are ``max_tokens`` seeded pseudo-random ids per turn. Each turn: at its
arrival, ``lookup`` the prompt's full blocks (the hit is what a real engine would not prefill),
``allocate`` + ``commit`` the rest of the prompt and the answer, hold both leases for the service
time (prefill of the missed tokens + decode of the answer, at the per-token costs below), then
release as the engine does: by-hash hints (kinds, session, expected return) as a release of lease 0,
then the leases. The next turn arrives a think time after the answer.

Each workload's arrivals are rescaled to one window (``--window``) so the three overlap; think times
are left alone (creative writers pause for minutes, tools for seconds). Token hit rate =
Σ hit tokens / Σ prompt tokens over all turns.

``--sessions-file`` replays a built session file instead (e.g. the GPU plans' ``agentic-coding.jsonl``),
the way ``bench serve`` plays it: think times × ``--time-scale``, and with ``--arrivals closed`` every
session opens at 0 (a closed loop whose concurrency covers all sessions); ``--half-life`` matches the
plan's kvd half-life. Why: a policy gap measured on a GPU plan should be reproducible here on the same
sessions, not only on the profile mix.

``--cleaner``: kvd runs here without a cleaner thread, so by default (``inline``) a request that finds
the GPU tier full drops the policy's victim (a pressure drop) instead of waiting for it to be demoted;
the order of victims then decides which chains survive. ``keeps-up`` makes such a request wait for a
cleaning pass (instant on the simulated clock): the daemon when its copies always keep up. The two
bound the H200, whose cleaner keeps up only part of the time (docs/design/eviction.md, session 5).
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import random
import re
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvd.admission import GATES
from kvd.config import KvdConfig
from kvd.core import KvdCore
from kvd.core_types import KvdError
from kvd.eviction.reuse import ReusePolicy, ReuseTerms
from kvd.hashing import chain_hashes, namespace_root
from kvd.types import BlockKind
from specd.engine.hints import ReturnTimeModel, SessionHints

BLOCK = 16
VOCAB = 151_936
WORD = re.compile(r"\w+|[^\w\s]|\n")


def stand_in_tokens(text: str) -> list[int]:
    """Words, punctuation and newlines, each a stable id: a tokenizer's block boundaries without a model."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") % VOCAB
            for w in WORD.findall(text)]


@dataclass(frozen=True)
class Variant:
    """One replay configuration: a policy, its terms and gate, and which hints the engine sends."""

    name: str
    policy: str = "reuse"
    terms: ReuseTerms = ReuseTerms()
    admission: str = "not-dead"
    kinds: bool = True              # send SYSTEM / TOOL_SCHEMA kinds
    expected_return: bool = True    # send the learned expected return time
    per_session: bool = True        # KvdConfig.frequency_per_session


FULL = Variant("reuse (all)")
VARIANTS = [
    Variant("lru (GPU only)", policy="lru"),
    Variant("lru-offload", policy="lru-offload"),
    FULL,
    replace(FULL, name="- frequency/decay", terms=ReuseTerms(frequency=False)),
    replace(FULL, name="- per-session frequency (count every lookup)", per_session=False),
    replace(FULL, name="+ depth (off in service)", terms=ReuseTerms(depth=True)),
    replace(FULL, name="- sharing (children)", terms=ReuseTerms(children=False)),
    replace(FULL, name="- kind hints", kinds=False),
    replace(FULL, name="- expected return", expected_return=False),
    replace(FULL, name="- admission gate", admission="none"),
    replace(FULL, name="- dead-tail rule", terms=ReuseTerms(dead=False)),
]


@dataclass
class Stream:
    """One session as a token stream, with the turn boundaries the replay walks through."""

    id: str
    arrival_s: float
    prefix: list[int]                       # system + tools
    prefix_kinds: list[tuple[int, int]]
    turns: list[tuple[list[int], list[int], float]] = field(default_factory=list)  # (messages, answer, think)


def session_stream(s: Any, rng_salt: str, time_scale: float = 1.0) -> Stream:
    """A session as a token stream; think times × ``time_scale`` (bench serve's ``--time-scale``)."""
    system = stand_in_tokens(s.system or "")
    tools = stand_in_tokens(json.dumps(s.tools, sort_keys=True)) if s.tools else []
    kinds = [(len(system), int(BlockKind.SYSTEM))] if system else []
    kinds += [(len(tools), int(BlockKind.TOOL_SCHEMA))] if tools else []
    st = Stream(s.id, s.arrival_s, system + tools, kinds)
    rng = random.Random(f"{rng_salt}/{s.id}")
    for t in s.turns:
        msgs = [tok for m in t.messages for tok in stand_in_tokens(f"{m.role}: {m.content}\n")]
        answer = [rng.randrange(VOCAB) for _ in range(t.max_tokens)]
        st.turns.append((msgs, answer, t.think_time_s * time_scale))
    return st


def load_streams(workloads: list[str], sessions: int, window_s: float, seed: int,
                 max_chars: int | None) -> list[Stream]:
    from bench.workloads.build import build_sessions
    from bench.workloads.profile import BuildOptions

    out: list[Stream] = []
    for w in workloads:
        ss = build_sessions(w, BuildOptions(split="eval", sessions=sessions, seed=seed, max_chars=max_chars))
        span = max(s.arrival_s for s in ss) or 1.0
        out += [replace_arrival(session_stream(s, str(seed)), s.arrival_s * window_s / span) for s in ss]
    return out


def load_session_file(path: Path, sessions: int, time_scale: float, arrivals: str, seed: int) -> list[Stream]:
    """The first ``sessions`` sessions of a built file, as ``bench serve`` plays them: think times and
    recorded arrivals × ``time_scale``; ``closed`` opens every session at 0 (bench serve's closed loop,
    its concurrency at least the session count, as in the GPU plans). Texts are kept whole: the file's
    builder already cut them."""
    from bench.workloads.format import read_sessions

    out = []
    for s in read_sessions(path)[:sessions]:
        st = session_stream(s, str(seed), time_scale)
        out.append(replace_arrival(st, 0.0 if arrivals == "closed" else s.arrival_s * time_scale))
    return out


def replace_arrival(st: Stream, arrival_s: float) -> Stream:
    st.arrival_s = arrival_s
    return st


@dataclass(frozen=True)
class Costs:
    prefill_s_per_token: float = 0.0002   # ~5k tokens/s prefill
    decode_s_per_token: float = 0.02      # ~50 tokens/s per stream


class Replay:
    """Event-driven replay of the streams through one KvdCore (see the module docstring)."""

    def __init__(self, streams: list[Stream], variant: Variant, gpu_blocks: int, dram_blocks: int,
                 run_dir: Path, costs: Costs, half_life_s: float | None = None, cleaner: str = "inline") -> None:
        self.streams, self.variant, self.costs = streams, variant, costs
        self.now = 0.0
        extra = {} if half_life_s is None else {"half_life_s": half_life_s}   # None: the service default
        cfg = KvdConfig(run_dir=run_dir, policy=variant.policy, gpu_blocks=gpu_blocks, dram_blocks=dram_blocks,
                        max_groups=1, move_workers=0, lease_ttl_s=1e6, admission=variant.admission,
                        frequency_per_session=variant.per_session, **extra)
        self.core = KvdCore(cfg, clock=lambda: self.now)
        self.core.attach("replay", "full", 16)
        group = self.core.groups["full"]
        if variant.policy == "reuse":  # the ablated terms; swapped before any block exists
            group.policy = ReusePolicy(group.policy.tiers, cfg.half_life_s, GATES[variant.admission], variant.terms)
        if cleaner == "keeps-up":
            group.wait_for_room = self._clean_now
        self.hints = SessionHints(BLOCK, ReturnTimeModel())
        self.root = namespace_root("stand-in", "stand-in", "bf16", "ablation", BLOCK)
        self.prompt_tokens = self.hit_tokens = self.refused = 0

    def _clean_now(self, group: Any, tier: Any) -> None:
        """``--cleaner keeps-up``: a request that finds a tier full waits for a cleaning pass, as the
        daemon's requests wait (pressure_wait_ms) for its cleaner thread. Inline (the default) a full
        tier drops its victim at once, and the cleaner runs only at each lookup's wait_ready: requests
        of thousands of blocks then drop most of what the tier below would have kept. On the simulated
        clock the pass takes no time, so this is the bound where the copies always finish in time."""
        if group.ask_cleaning(tier):
            self.core.clean()

    def run(self) -> dict[str, Any]:
        events: list[tuple[float, int, str, int, int]] = []   # (time, seq, kind, stream, turn)
        seq = 0
        for i, st in enumerate(self.streams):
            events.append((st.arrival_s, seq, "start", i, 0))
            seq += 1
        heapq.heapify(events)
        pending: dict[tuple[int, int], tuple[list[int], int, int, float]] = {}
        while events:
            self.now, _, kind, i, k = heapq.heappop(events)
            if kind == "start":
                end, state = self._start(i, k)
                pending[(i, k)] = state
                heapq.heappush(events, (end, seq, "finish", i, k))
            else:
                self._finish(i, k, *pending.pop((i, k)))
                st = self.streams[i]
                if k + 1 < len(st.turns):
                    heapq.heappush(events, (self.now + st.turns[k + 1][2], seq, "start", i, k + 1))
            seq += 1
        stats = self.core.stats()
        self.core.close()
        return {"variant": self.variant.name, "token_hit_rate": self.hit_tokens / max(1, self.prompt_tokens),
                "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "refused_allocations": self.refused,
                "demotions": stats.get("demotions", 0), "promotions": stats.get("promotions", 0),
                "pressure_drops": stats.get("pressure_drops", 0)}

    def _tokens(self, i: int, k: int) -> tuple[list[int], list[int]]:
        st = self.streams[i]
        prompt = list(st.prefix)
        for msgs, answer, _ in st.turns[:k]:
            prompt += msgs + answer
        prompt += st.turns[k][0]
        return prompt, st.turns[k][1]

    def _start(self, i: int, k: int) -> tuple[float, tuple[list[int], int, int, float]]:
        client = self.streams[i].id
        prompt, answer = self._tokens(i, k)
        hashes = chain_hashes(self.root, prompt + answer, BLOCK)
        usable = (len(prompt) - 1) // BLOCK
        res = self.core.lookup(client, "full", hashes[:usable], session=client)
        self.core.wait_ready(res.lease)
        hits = len(res.hits)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += hits * BLOCK
        write = 0
        try:
            write, ids = self.core.allocate(client, "full", len(hashes) - hits)
            parents = [hashes[j - 1] if j else None for j in range(hits, len(hashes))]
            self.core.commit(client, write, list(zip(ids, hashes[hits:], parents)))
        except KvdError:
            self.refused += 1          # every GPU block leased: served, not cached
        service = (len(prompt) - hits * BLOCK) * self.costs.prefill_s_per_token \
            + len(answer) * self.costs.decode_s_per_token
        return self.now + service, (hashes, res.lease, write, self.now)

    def _finish(self, i: int, k: int, hashes: list, lookup_lease: int, write_lease: int, arrival: float) -> None:
        st, v = self.streams[i], self.variant
        hints = self.hints.release_hints(hashes, st.prefix_kinds if v.kinds else None, st.id, arrival, self.now)
        if not v.expected_return:
            hints.pop("expected_return_s")
        self.core.release(st.id, 0, hints)
        lease_hints = {key: val for key, val in hints.items() if key != "kinds"}
        for lease in (lookup_lease, write_lease):
            if lease:
                self.core.release(st.id, lease, lease_hints)


def unique_blocks(streams: list[Stream]) -> int:
    root = namespace_root("stand-in", "stand-in", "bf16", "ablation", BLOCK)
    seen: set[bytes] = set()
    for st in streams:
        tokens = list(st.prefix)
        for msgs, answer, _ in st.turns:
            tokens += msgs + answer
        seen.update(chain_hashes(root, tokens, BLOCK))
    return len(seen)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="creative,support,coding", help="comma-separated profiles (eval split)")
    p.add_argument("--sessions", type=int, default=40, help="sessions per profile")
    p.add_argument("--window", type=float, default=600.0, help="seconds every profile's arrivals are spread over")
    p.add_argument("--gpu", type=float, default=0.05, help="GPU tier as a fraction of the unique blocks")
    p.add_argument("--dram", type=float, default=0.10, help="DRAM tier as a fraction of the unique blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=6000,
                   help="truncate every long text (system prompt, file): keeps one request within the GPU tier")
    p.add_argument("--sessions-file", type=Path,
                   help="replay this session file (docs/workloads.md) instead of --workloads; --sessions caps it")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--sessions-file: think times (and recorded arrivals) x this, as bench serve --time-scale")
    p.add_argument("--arrivals", choices=["closed", "recorded"], default="closed",
                   help="--sessions-file: every session at 0 (bench serve's closed loop) or at its arrival_s")
    p.add_argument("--cleaner", choices=["inline", "keeps-up"], default="inline",
                   help="inline: a full tier drops (no cleaner thread); keeps-up: requests wait for a cleaning pass")
    p.add_argument("--half-life", type=float, default=None, help="kvd half_life_s (default: KvdConfig's)")
    p.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.sessions_file:
        streams = load_session_file(args.sessions_file, args.sessions, args.time_scale, args.arrivals, args.seed)
    else:
        streams = load_streams(args.workloads.split(","), args.sessions, args.window, args.seed, args.max_chars)
    unique = unique_blocks(streams)
    gpu, dram = max(1, int(args.gpu * unique)), int(args.dram * unique)
    print(f"{len(streams)} sessions, {sum(len(s.turns) for s in streams)} turns, {unique} unique blocks; "
          f"GPU {gpu} blocks, DRAM {dram} blocks")
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants.split(",")]
    rows = []
    print("| variant | token hit rate | demotions | promotions | pressure drops | refused allocations |\n"
          "|---|---|---|---|---|---|")
    for v in chosen:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kvd-abl-") as d:
            row = Replay(streams, v, gpu, 0 if v.policy == "lru" else dram, Path(d), Costs(), args.half_life,
                         args.cleaner).run()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"| {v.name} | {100 * row['token_hit_rate']:.2f}% | {row['demotions']} | {row['promotions']} "
              f"| {row['pressure_drops']} | {row['refused_allocations']} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"unique_blocks": unique, "gpu_blocks": gpu, "dram_blocks": dram,
                                        "args": {k: str(v) for k, v in vars(args).items() if k != "run"},
                                        "rows": rows}, indent=1))
    return 0
