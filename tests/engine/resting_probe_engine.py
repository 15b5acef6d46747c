"""The engine the gate's host-cost probes time (gate_cost_probe.py, prompt_gate_probe.py): stories260K with its
committed dspark drafter, behind a gate taught that drafting loses at every load bucket up to the
concurrency (so it rests and never probes), with some of its methods wrapped to add their wall time into a
dict. Not a test module (no ``test_`` prefix): a helper the probes import."""
from __future__ import annotations

import collections
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
        "The sun was hot and", "A little bird sat on", "Max liked to play with", "The cat saw a", "Sue and her mom"]
TIMED = ("_add_drafts", "_observe_gate", "_rest_prompts", "_capture_layers")


def resting_engine(concurrency: int, num_local_blocks: int = 2048):
    """A dspark engine whose gate rests at every bucket up to ``concurrency``, with no class exploration
    (the probes' prompts recur)."""
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine
    from specd.engine.spec_gate import SpecGate

    engine = SpecEngine.from_config(EngineConfig(max_num_seqs=concurrency, num_local_blocks=num_local_blocks,
                                                 drafter=ROOT / "models" / "drafters" / "stories260K-dspark",
                                                 speculation="dspark"))
    engine.spec_gate = taught_to_rest(SpecGate(probe_every=100_000, probe_max=100_000), concurrency)
    return engine


def taught_to_rest(gate, concurrency: int, key: str = "dspark", plain_s: float = 0.01, draft_s: float = 0.08):
    """``gate`` (a SpecGate) after 12 steps of gate key ``key`` at each load bucket up to ``concurrency``,
    drafting at a quarter of plain decoding's rate (so every cell rests; a plain step of ``plain_s``, a
    drafting one of ``draft_s``), with class exploration off; returned."""
    from specd.engine.spec_gate import Drafters

    b = 1
    while b <= concurrency:
        for _ in range(12):
            d = gate.should_draft(key, b)
            gate.observe(key, b, d, b * (2 if d else 1), draft_s if d else plain_s,
                         Drafters(b, 2 * b, 7 * b) if d else None)
        b *= 2
    gate.explores = staticmethod(lambda record: False)
    return gate


def probe_arguments(doc: str, concurrency: int, rounds: int, max_tokens: int, rounds_help: str,
                    stagger: tuple[int, str] | None = None, queued: tuple[int, str] | None = None):
    """The probes' shared command line (--concurrency, --rounds, --max-tokens, and --stagger and --queued when
    given as (default, help); from the script's docstring), parsed, with torch held to one thread as the
    probes time it."""
    import argparse

    import torch

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=concurrency)
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    if stagger is not None:
        p.add_argument("--stagger", type=int, default=stagger[0], help=stagger[1])
    if queued is not None:
        p.add_argument("--queued", type=int, default=queued[0], help=queued[1])
    args = p.parse_args()
    torch.set_num_threads(1)
    return args


def time_methods(engine, names=TIMED, kind=None) -> dict:
    """Wrap ``engine``'s methods ``names``; returns the dict each call adds its seconds to (clear it to
    start a measurement), keyed by name, or by (name, ``kind()`` at the call) when ``kind`` is given."""
    spent: dict = {}
    for name in names:
        inner = getattr(engine, name)

        def timed(*a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            out = _inner(*a, **k)
            key = _name if kind is None else (_name, kind())
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
            return out
        setattr(engine, name, timed)
    return spent


def one_batch(engine, spent: dict, prompts: list[str], spec: str, tag: str, max_tokens: int, **fields) -> int:
    """Serve ``prompts`` as one batch (greedy, EOS ignored, method ``spec``, more ``Request`` fields in
    ``fields``), clearing ``spent`` (``time_methods``) after admission and prefill (two steps), so it holds
    the decode steps' time only; returns how many decode steps there were. Shared by gate_cost_probe.py and
    ngram_gate_cost_probe.py."""
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, text in enumerate(prompts):
        engine.add_request(Request(f"{tag}{i}", engine.tokenizer.encode(text), params, speculation=spec, **fields))
    for _ in range(2):                # admission and prefill
        engine.step()
    spent.clear()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return steps


def closed_loop(engine, prompts: list[list[int]], lengths: list[int], concurrency: int, spec: str, tag: str,
                queued: int = 0, admitted: dict | None = None):
    """Serve every prompt (greedy, ``lengths[i]`` tokens, EOS ignored) with method ``spec``, keeping
    ``concurrency`` requests in flight plus ``queued`` waiting, as ``bench speedup``'s closed loop does; yields
    each ``engine.step()``'s outputs, so a probe reads the engine between steps. ``admitted["s"]`` collects
    the seconds ``add_request`` took. Shared by closed_loop_probe.py and span_gap_probe.py."""
    from specd.engine.request import Request
    from specd.sampling_params import SamplingParams

    queue, inflight = collections.deque(range(len(prompts))), 0
    while queue or inflight:
        while queue and inflight < concurrency + queued:
            i = queue.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
            t0 = time.perf_counter()
            engine.add_request(Request(f"{tag}-{i}", list(prompts[i]), params, speculation=spec))
            if admitted is not None:
                admitted["s"] = admitted.get("s", 0.0) + time.perf_counter() - t0
            inflight += 1
        outputs = engine.step()
        inflight -= sum(out.finished for out in outputs)
        yield outputs
