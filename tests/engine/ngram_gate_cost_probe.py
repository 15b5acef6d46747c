"""Host time of ``_add_drafts`` per decode step, plain decoding against gated ngram with the gate resting.

Why: on the H100 (session 44, run DS) the gated ngram row on coding drafted 2-20 steps a run and still ran
0.91-0.93x plain decoding, its decode steps ~9% slower. A resting gated ngram request is looked up at every
step (the gate decides after the lookup, on the drafts found: ``GateSteps._gate_found``), so a resting step
pays the lookups, the limits and the gate's question for every request. This probe times that engine
method (no profiler; stories260K, 32 requests of repetitive prompts so lookups find drafts, greedy, 60
tokens each) behind a gate that always rests, against the same requests with speculation off. Not a test
(pytest does not collect it); run it per tree to compare:

    PYTHONPATH=<tree> python tests/engine/ngram_gate_cost_probe.py [--repeats 7]

Session 44, CPU machine: 8.1 µs a step for `none`, 230.6 µs for resting gated ngram (c = 32), with the gate
that always rests (now ``--gate always``). With a lookup lease (``GateSteps._cheap_unlooked``), three
invocations each: the taught gate (the default) 275-309 µs before, 35-39 after (`none` 9-11); ``--gate
always`` 225-236 before, 239-250 after (never sure: no measured cell). With a lease after an asked rest
(``GateSteps._lease_found``), three invocations each, 60fc98d against after: ``--gate asked`` (the taught
gate never sure beforehand, as at c = 32 on the H100) 241-279 µs before, 53-62 after, 364 of 413 decode
steps leased; ``--gate always`` 256-326 against 248-294 (no cell, no lease: unchanged but for noise); the
taught gate 36-40 against 30-33 (a path this does not change); `none` 7-10 throughout.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from resting_probe_engine import BASE, one_batch, resting_engine, taught_to_rest, time_methods   # this folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--gate", choices=("taught", "asked", "always"), default="taught",
                   help="taught: the real gate, taught that drafting loses at every bucket (it may then rest "
                        "without a lookup, GateSteps._cheap_unlooked); asked: the same gate never sure before "
                        "the lookup (may_rest_unlooked off, as at c = 32 on the H100, session 45), so every "
                        "lease comes from a rest asked with the drafts found (GateSteps._lease_found); always: "
                        "session 44's gate, whose every answer is a rest and which has no measured cell (so "
                        "no lease of either kind: every request is looked up)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from specd.engine.spec_gate import SpecGate

    class Resting(SpecGate):
        """Rests every gated step: the measured answer does not matter here, only what a rest costs."""

        def should_draft(self, *args, **kwargs) -> bool:
            return False

    engine = resting_engine(args.concurrency)
    if args.gate != "always":
        # a drafting step taught at ~30 plain CPU steps, so the engine's real plain samples (~35 ms at c = 32)
        # keep drafting the loser at every number of drafts found (``SpecGate.rests_unlooked``'s bound)
        engine.spec_gate = taught_to_rest(SpecGate(probe_every=100_000, probe_max=100_000), args.concurrency,
                                          key="ngram_gated", plain_s=0.03, draft_s=1.0)
        if args.gate == "asked":
            engine.spec_gate.may_rest_unlooked = lambda method, sequences: False
    else:
        engine.spec_gate = Resting(probe_every=100_000, probe_max=100_000)
    engine.spec_gate.explores = staticmethod(lambda record: False)
    spent = time_methods(engine, ("_add_drafts",))
    prompts = [(text + " ") * 6 for text in (BASE * (args.concurrency // len(BASE) + 1))[:args.concurrency]]

    def run(spec: str, rep: int) -> float:
        extra = {"spec_schedule": "gated", "num_speculative_tokens": 7} if spec == "ngram" else {}
        steps = one_batch(engine, spent, prompts, spec, f"{spec}-{rep}-", max_tokens=60, **extra)
        return spent.get("_add_drafts", 0.0) / steps * 1e6

    got: dict[str, list[float]] = {"none": [], "ngram": []}
    for rep in range(args.repeats):
        for spec in got:                  # alternated, so drift hits both alike
            got[spec].append(run(spec, rep))
    verified = engine.stats().get("spec_verifications_total", 0)
    print("| row | µs of _add_drafts a decode step (median of repeats) |")
    print("|---|---|")
    for spec, values in got.items():
        print(f"| {spec} | {statistics.median(values):.1f} |")
    print(f"\nverifications: {verified} (0: the gate rested every step)")
    stats = engine.stats()
    print(f"decode steps rested without a lookup: {stats.get('spec_rest_unlooked_steps_total', 0)} "
          f"(on a lease: {stats.get('spec_rest_leased_steps_total', 0)})")


if __name__ == "__main__":
    main()
