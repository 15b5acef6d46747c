"""`bench speedup` on a modeled clock: the gate's decisions priced by a model of a GPU's step costs, not timed.

    python -m bench.gate_sim --model models/stories260K.gguf --drafters dspark=models/drafters/stories260K-dspark \\
        --workloads W.jsonl --concurrency 32 --rows none,dspark,dspark-probe-uncut --out runs/gate-sim

Why: where the measured gate rests (c >= 16 on the H200), what separates scheduled DSpark from `none` is
~1-2%, and a GPU run's repeats spread ±5% (session 32: the A/A row's runs at c = 32, sd 5.3%), so a change
to the gate's policy (how it probes, where it explores) cannot be sized there. Nor on the CPU: there the
drafter costs what the target does. Here the engine runs for real (the model, the drafter, the gate, the
scheduler, every decision), but its clock is a model. Each target forward advances it by what that step
would cost on the modeled GPU, each drafter pass and context projection by theirs, and host work by
nothing. So the gate measures modeled step times and decides on them, and the table prices its
decisions (probes, explorations, captures, the prompt steps drafting adds) without host time or noise.
The same `bench speedup` JSON and table come out, and every tool that reads them works on them
(``bench.run_kinds``, ``bench.exploration_cost``, ``bench.step_split``).

What it is not: a speed result. Host time costs nothing on this clock, and the real drafter's acceptance
on the real model is not stories260K's. Compare rows and commits run on it; read nothing absolute off it.

The default costs (``StepCosts``) are fitted to session 32's H200 runs of Qwen2.5-Coder-0.5B (bf16, CUDA
graphs), from ``step_kinds`` and ``bench.draft_step_cost``:
- a plain decode step of B sequences: 1.75 + 0.036·B ms (1.8 ms at c = 1, 2.9 at c = 32);
- a step with prompt chunks: +4 ms, +0.5 µs a prompt token (~6.8 ms at c = 32; session 28 measured ~3 plain
  steps at any number of prompts);
- a drafting step: the drafter's pass, 1.0 + 0.15·B ms, plus 15 µs per draft token verified (12 ms at
  c = 32 with γ = 7, 3 ms at c = 1);
- a step that captures target features: +30% of its forward (capture steps ran ~1.3 plain steps);
- a context projection: 0.3 ms + 2 µs a token.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of modeled GPU time for each kind of engine work (see the module's docstring)."""

    decode_base: float = 1.75
    decode_per_seq: float = 0.036
    prompt_step: float = 4.0
    prompt_per_token: float = 0.0005
    draft_base: float = 1.0
    draft_per_seq: float = 0.15
    verify_per_token: float = 0.015
    capture_frac: float = 0.3
    absorb_base: float = 0.3
    absorb_per_token: float = 0.002

    def forward_ms(self, batch, capture: bool) -> float:
        """A target forward over ``batch`` (``ScheduledSeq``s): decoders, prompt chunks and draft tokens."""
        prompt = sum(s.num_tokens for s in batch if not s.decodes)
        drafts = sum(s.num_draft for s in batch)
        ms = self.decode_base + self.decode_per_seq * len(batch) + self.verify_per_token * drafts
        if prompt:
            ms += self.prompt_step + self.prompt_per_token * prompt
        return ms * (1.0 + self.capture_frac) if capture else ms

    def verify_ms(self, tokens: int, gamma: int) -> float:
        """A verify-shaped pass of ``tokens`` tokens, ``gamma`` + 1 a sequence (the SPS profile's shape)."""
        sequences = max(1, tokens // (gamma + 1))
        return self.decode_base + self.decode_per_seq * sequences + self.verify_per_token * (tokens - sequences)

    def draft_ms(self, sequences: int) -> float:
        return self.draft_base + self.draft_per_seq * sequences if sequences else 0.0

    def absorb_ms(self, tokens: int) -> float:
        return self.absorb_base + self.absorb_per_token * tokens if tokens else 0.0


class ModeledClock:
    """``time`` for the engine, the SPS profile and the bench: ``perf_counter`` is the modeled time, which
    host work advances by ``host_s`` a call (so two readings are never equal) and modeled GPU work by its
    cost (``advance``); ``monotonic`` stays real (arrival times only)."""

    def __init__(self, host_s: float = 1e-7):
        import time

        self.now, self.host_s, self.monotonic = 0.0, host_s, time.monotonic

    def perf_counter(self) -> float:
        self.now += self.host_s
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


def price(engine, clock: ModeledClock, costs: StepCosts) -> None:
    """Wrap ``engine``'s target forward and every drafter it can load so that each call advances ``clock``
    by its modeled cost; the work itself still runs (the outputs are the real model's)."""
    runner_run = engine.runner.run

    def run(batch, capture_layers=()):
        clock.advance(costs.forward_ms(batch, bool(capture_layers)))
        return runner_run(batch, capture_layers)

    engine.runner.run = run
    dummy = engine.runner.dummy_verify_forward

    def dummy_verify_forward(gamma, **kw):      # the SPS profile's verify passes of b tokens (γ + 1 a sequence)
        forward = dummy(gamma, **kw)

        def priced(b):
            clock.advance(costs.verify_ms(b, gamma))
            return forward(b)

        return priced

    engine.runner.dummy_verify_forward = dummy_verify_forward
    load = engine._proposer

    def proposer(method):
        p = load(method)
        if getattr(p, "_priced", False):
            return p
        propose, absorb_all = p.propose, getattr(p, "_absorb_all", None)

        def priced_propose(seqs, limits):
            clock.advance(costs.draft_ms(len(seqs)))
            return propose(seqs, limits)

        p.propose = priced_propose
        if absorb_all is not None:
            def priced_absorb(seqs):
                clock.advance(costs.absorb_ms(sum(len(s.draft_feats) for s in seqs if s.draft_feats is not None)))
                return absorb_all(seqs)

            p._absorb_all = priced_absorb
        p._priced = True
        return p

    engine._proposer = proposer


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench import speedup

    speedup.add_arguments(p)
    p.add_argument("--costs", type=Path, default=None,
                   help="a JSON object of StepCosts fields (ms) to change from the defaults fitted to the H200")


def run(args: argparse.Namespace) -> int:
    from bench import speedup
    from specd.engine import engine as engine_module
    from specd.engine import spec_scheduler

    fields = json.loads(args.costs.read_text()) if args.costs is not None else {}
    try:
        costs = StepCosts(**fields)
    except TypeError as e:
        raise SystemExit(f"--costs {args.costs}: {e} (fields: {', '.join(asdict(StepCosts()))})") from e
    clock = ModeledClock()
    saved = (engine_module.time, spec_scheduler.time, speedup.time)
    engine_module.time = spec_scheduler.time = speedup.time = clock
    try:
        return speedup.run(args, prepare=lambda engine: price(engine, clock, costs),
                           note={"command": " ".join(["python -m bench.gate_sim", *sys.argv[1:]]),
                                 "modeled_costs_ms": asdict(costs)})
    finally:
        engine_module.time, spec_scheduler.time, speedup.time = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gate_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
