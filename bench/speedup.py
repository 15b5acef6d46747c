"""``python -m bench speedup``: every speculation method against plain decoding, side by side in one engine.

    python -m bench speedup --model models/stories260K.gguf \\
        --drafters dspark=models/drafters/stories260K-dspark \\
        --workloads runs/sessions/support.jsonl --concurrency 1,4 --requests 8 --max-tokens 32 \\
        --repeats 3 --out runs/speedup-cpu

One in-process engine holds every drafter (EngineConfig.drafters) and each request picks its row's method,
schedule and γ (Request.speculation / spec_schedule / num_speculative_tokens), so the model loads once and
every row runs on the same weights, pool and process. For each workload (a session JSONL file: its eval
split) and each concurrency level, the same N requests (the FIRST TURN of the first N eval sessions, with the
session's sampling; N = max(--requests, --waves × concurrency)) run under each row, closed loop:
``concurrency`` requests are always in flight until the N are done. With one wave every request starts
together and the run ends with the slowest: the batch empties step by step, and a speculative row pays
for the request its drafter serves worst (H200, session 11, run AH: four waves instead of one lifted
fixed γ = 7 at c = 8 from 0.84× to 1.11× on support). Within a (workload, concurrency) cell the rows alternate
row by row inside each repeat, so they share the machine's noise, and ratios to ``none`` are taken per
repeat; each repeat starts one row later (``repeat_order``), so no row always runs last while the machine
drifts (session 13, run AO: `none` slowed 17% over one cell's four repeats on creative at c = 16).
Before the timed runs of a (workload, concurrency) cell, every row runs the same N prompts untimed with
--warmup-tokens answers, so CUDA-graph captures of those prompt and step shapes, Triton compiles and the
SPS profile are not timed; each run records the graphs it still captured and its eager steps. A gated row
repeats its warm-up (up to EXTRA_WARMUPS times) while the spec gate's cell at this load still explores, and
warms each lighter bucket its warm-ups made a cell of at that bucket's concurrency while it explores (every
run's drain passes through them): a once-per-cell cost (``finish_exploring``); the cell's JSON lists those
extra warm-ups by row and bucket (``gate_extra_warmups``).

Measured per run: output throughput (generated tokens of the batch / wall time), per-user tok/s (median
over requests of tokens / (finish − first token)), τ (tokens per verification), mean verified drafts per
verification, the scheduler's CPU time per engine step (batch admission, and the confidence scheduler),
and the histogram of the verify lengths the scheduler chose. Writes speedup.json and speedup.md under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import kvspec_kernels as kernels
from bench.arg_types import non_negative_int, positive_int, positive_ints
from bench.cpu_pin import cpu_set, pin
from bench.host_adjust import host_line
from bench.host_drift import host_drift_line
from bench.row_profiles import RowProfiles, TorchProfiles
from bench.stats import tau
from specd.engine.gating import gate_key_name
from kvd.gc_pauses import GENERATIONS, freeze_heap
from specd.engine.gate_records import prompt_class
from specd.engine.spec_gate import DRAFT_REASONS, load_bucket

ROWS: dict[str, dict] = {     # row -> the request fields it sets; gamma None = the engine's (scheduled)
    "none": {"method": "none", "schedule": None, "gamma": None},
    # plain decoding again, alternated like every row: its ratio to `none` is the run's A/A noise, the
    # band a "never slower" verdict has to be read against (H200, run L: the per-repeat ratios of
    # scheduled dspark runs that never drafted ranged 0.92-1.08×)
    "none-aa": {"method": "none", "schedule": None, "gamma": None},
    "dspark": {"method": "dspark", "schedule": "confidence", "gamma": None},
    "dspark-g7": {"method": "dspark", "schedule": "fixed", "gamma": 7},
    "dflash-g7": {"method": "dflash", "schedule": "fixed", "gamma": 7},
    "eagle3": {"method": "eagle3", "schedule": "fixed", "gamma": 7},
    "ngram": {"method": "ngram", "schedule": "fixed", "gamma": 7},
    "ngram-gated": {"method": "ngram", "schedule": "gated", "gamma": 7},
    "dspark-g7-gated": {"method": "dspark", "schedule": "gated", "gamma": 7},
    # each request runs dspark (scheduled) or ngram (gated, γ = 7), the one whose finished requests of its
    # prompt class decoded fastest at its load (specd/engine/method_choice.py), through a gate of its own so
    # that its dspark cells are not the dspark row's. Session 55 (H100, runs MA + MB): ngram 1.62 / 1.26x
    # `none` at c = 1 / 4 against the schedule's 1.28 / 1.18, ahead on creative and support, behind on
    # coding and knowledge; the better of the two per cell would have been 1.67 / 1.33 / 1.21 / 1.15 / 1.06
    "auto": {"method": "auto", "schedule": None, "gamma": None, "own": True},
    # method auto whose chooser alternates dspark and gated ngram request by request (bench/alternating_choice.py),
    # through a gate of its own: every batch half one method and half the other, so the row measures what a
    # mixed batch costs against the two rows' blend (``python -m bench.measuring_cost --row auto-alternate``).
    # Session 59 (H100, RA-RC) saw the auto row's mixed runs at 0.94x that blend at c >= 16, mostly on
    # knowledge. A diagnostic, not a default row
    "auto-alternate": {"method": "auto", "schedule": None, "gamma": None, "chooser": "alternate"},
    # method auto whose chooser hands out each cell's method in epochs at c > 1 and learns only from requests
    # that ran in batches of their own method (specd/engine/epoch_choice.py), through a gate of its own.
    # Why: at c >= 16 the auto row's chooser rated its cells' losing method at 0.82x that method's own row
    # (sessions 57-59, ``python -m bench.mix_rates``). A candidate for `auto`, not a default row
    "auto-epoch": {"method": "auto", "schedule": None, "gamma": None, "chooser": "epoch"},
    # auto-epoch whose winner keeps a cell unless a challenger is 10% faster (``EpochChoice.hold``): session 60
    # (H200, run SA) saw auto-epoch's close cells at c = 8 flip method epoch by epoch and its mixed runs run
    # 0.90x the two rows' blend. Not GPU-run yet
    "auto-epoch-hold": {"method": "auto", "schedule": None, "gamma": None, "chooser": "epoch-hold"},
    # scheduled dspark with the gate's drafts beside prompt chunks on (``SpecGate.beside_prompts``, off by
    # default: session 13, run AP measured it against the default in the same run), through a gate of
    # its own (``row_gate``); not a default row
    "dspark-beside-prompts": {"method": "dspark", "schedule": "confidence", "gamma": None, "beside_prompts": True},
    # scheduled dspark behind a gate that never drafts (bench/resting_gate.py): what a resting cell costs
    # against `none`, without the workloads that taught a real gate to rest; a diagnostic, not a default row
    "dspark-resting": {"method": "dspark", "schedule": "confidence", "gamma": None, "gate": "resting"},
    # greedy drafts verified by the rejection sampler instead of the argmax chain (``SpecEngine.greedy_chain``
    # off while the row runs; specd/engine/greedy_verify.py): what the chain saves, in the same run, through
    # a gate of its own; diagnostics, not default rows
    "dspark-rejection": {"method": "dspark", "schedule": "confidence", "gamma": None, "verify": "rejection"},
    "dspark-g7-rejection": {"method": "dspark", "schedule": "fixed", "gamma": 7, "verify": "rejection"},
    # scheduled dspark with the drafter's context projection eager instead of replayed from its CUDA graphs
    # (specd/engine/absorb_graphs.py, session 29), through a gate of its own: what the graphs save, in the
    # same run; a diagnostic, not a default row (on the CPU both rows run the eager projection)
    "dspark-absorb-eager": {"method": "dspark", "schedule": "confidence", "gamma": None, "absorb": "eager"},
    # scheduled dspark behind a gate that probes the losing arm at the budget that was the default until
    # session 31 (1% of a cell's throughput, waits up to 1,024 steps), through a gate of its own. Session 30
    # ran it the other way round (`dspark-probe-half`, 0.5% beside the 1% default; runs CQ and CR): where
    # the gate rested, exploration cost 0.55-0.75% of a run's wall at 1% against 0.23-0.47% at 0.5%
    # (``python -m bench.exploration_cost``), so 0.5% is the default now; this row keeps the old setting
    # measurable against it in the same run. A diagnostic, not a default row
    "dspark-probe-full": {"method": "dspark", "schedule": "confidence", "gamma": None, "probe_budget": 0.01,
                          "probe_max": 1024},
    # scheduled dspark behind a gate that probes at half the default budget (0.25% of a cell's throughput,
    # waits up to 4,096 steps), through a gate of its own: after session 32 the probes' share of the loss
    # where the gate rests at c = 32 (~0.45% of the wall at 0.5%, ``python -m bench.exploration_cost``) is
    # the same size as the host time left; this row measures what halving it saves, and what the slower
    # recovery costs, in the same run. A diagnostic, not a default row
    "dspark-probe-quarter": {"method": "dspark", "schedule": "confidence", "gamma": None, "probe_budget": 0.0025,
                             "probe_max": 4096},
    # scheduled dspark behind a gate whose probes of drafting always run their 3 steps (``probe_cut`` None),
    # through a gate of its own: the default ends a probe after its first sample where drafting loses even
    # at twice the predicted rate (``SpecGate._cuts``, session 34), which should save about two thirds of
    # a resting cell's probe steps at c >= 16; this row measures that against the default in the same run.
    # A diagnostic, not a default row
    "dspark-probe-uncut": {"method": "dspark", "schedule": "confidence", "gamma": None, "probe_cut": None},
    # scheduled dspark without rest spans (``SpecEngine.rest_spans`` off while the row runs, session 32:
    # whole-batch leases end at every admission and prompt step, as before), through a gate of its own:
    # what the spans save, in the same run. A diagnostic, not a default row
    "dspark-no-span": {"method": "dspark", "schedule": "confidence", "gamma": None, "spans": False},
    # scheduled dspark behind a gate that puts all the capture time held for drafting on its next sample, as
    # until session 39 (``SpecGate.charge``: now at most one plain step a sample), through a gate of its own:
    # in run DH that one sample cut a probe and set a 2,048-step wait; this row measures the cap against
    # the old rule in the same run. A diagnostic, not a default row
    "dspark-charge-whole": {"method": "dspark", "schedule": "confidence", "gamma": None, "charge_steps": None},
    # scheduled dspark behind a gate that takes every plain sample as measured, as until session 41
    # (``SpecGate.plain_clip``: now at most twice the cell's fastest recent plain step), through a gate of its
    # own: in run DN one stalled plain step made drafting the winner where it ran 0.62x `none`; this row
    # measures the clip against the old rule in the same run. A diagnostic, not a default row
    "dspark-clip-off": {"method": "dspark", "schedule": "confidence", "gamma": None, "plain_clip": None},
    # scheduled dspark behind a gate whose prompts capture their features at loads up to 8 whatever the cell
    # decides (``SpecGate.capture_prompts``), through a gate of its own: in session 46's runs a run whose
    # prompts all rested drafted little or nothing where fixed γ = 7 won 1.07-1.72x (the prompt-less loop,
    # ``SpecGate.captures_prompt``); this row measures breaking it against the default in the same run. A
    # diagnostic, not a default row
    "dspark-capture-prompts": {"method": "dspark", "schedule": "confidence", "gamma": None, "capture_prompts": 8},
    # the same at every load up to b32: session 55 (H100, runs MB, MD) found extraction at c = 32 rested with
    # all 128 requests a run prompt-less, where fixed γ = 7 ran 1.20x `none` and a run whose prompts were all
    # captured 1.27x; capturing every prompt at c = 32 cost 2-5% in session 12. This row measures both sides.
    # A diagnostic, not a default row
    "dspark-capture-prompts-32": {"method": "dspark", "schedule": "confidence", "gamma": None, "capture_prompts": 32},
    # scheduled dspark behind a gate whose resting requests keep capturing their features at loads up to 8
    # while the cell is near a tie (``SpecGate.keep_context``), through a gate of its own: a rested request
    # drafts from a gapped context for good, and in session 47's runs the cells where fixed γ = 7 won rested
    # on that low acceptance (``SpecGate.keeps_context``); this row measures keeping the contexts whole
    # against the default in the same run. A diagnostic, not a default row
    "dspark-keep-context": {"method": "dspark", "schedule": "confidence", "gamma": None, "keep_context": 8},
    # scheduled dspark with the captured features fused after the step's sync, as until session 48
    # (``SpecEngine.fuse_early`` off: ``_keep_features_late``), through a gate of its own: on the H100 a step
    # that captured features cost ~0.2 ms more than a plain one (run FA); this row measures what fusing them
    # in the forward's shadow saves, in the same run. A diagnostic, not a default row
    "dspark-fuse-late": {"method": "dspark", "schedule": "confidence", "gamma": None, "fuse": "late"},
    # the same for fixed γ = 7, which captures at every step: the saving per drafting step, no gate in the way
    "dspark-g7-fuse-late": {"method": "dspark", "schedule": "fixed", "gamma": 7, "fuse": "late"},
    # EAGLE-3 at γ = 7 with its draft eager instead of replayed from its CUDA graphs (specd/engine/
    # eagle3_graphs.py, session 41), through a gate of its own: what the graphs save, in the same run. Until
    # session 41 the `eagle3` row ran this way (0.13-0.18x `none` on the H100, run DN). A diagnostic, not a
    # default row
    "eagle3-eager": {"method": "eagle3", "schedule": "fixed", "gamma": 7, "graphs": "eager"},
    # scheduled dspark with each draft slot's logits, distribution and draw run by the torch references
    # instead of kvspec_kernels/markov_slot.py's fused kernels (``KVSPEC_MARKOV_SLOT=0`` while the row runs,
    # and draft-round graphs of its own captured that way, sharing the block and projection graphs), through
    # a gate of its own: what the fused slot saves in serving, in the same run (session 52). A diagnostic,
    # not a default row
    "dspark-markov-ref": {"method": "dspark", "schedule": "confidence", "gamma": None, "markov": "ref"},
    # scheduled dspark behind a gate whose cells scale their requests' predicted acceptance by what their
    # own drafting steps emitted against the predictions (``SpecGate.calibrate``: ``Cell.calibration``),
    # through a gate of its own: in session 52's runs the cells that drafted after rests emitted 0.66-0.80
    # of the tokens their records predicted, and support at c = 32 ran 0.96x `none`. Session 53 ran it as
    # the default against the records as they are (runs KA-KC, tree eb1d7f8, where this row was
    # `dspark-uncalibrated`): it lost at c = 4, so it is off. A diagnostic, not a default row
    "dspark-calibrated": {"method": "dspark", "schedule": "confidence", "gamma": None, "calibrate": True},
    # scheduled dspark behind a gate whose cells price their drafting arm as measured, a phase's opening steps
    # (a probe's) at their own time (``SpecGate(steady_price=False)``, the rule until session 54), through a
    # gate of its own. Session 54 ran the steady price as row `dspark-steady` against this rule as the
    # default (runs LA, LB, H200): 1.127x `none` over 25 cells against 1.111, so it became the default. A
    # diagnostic, not a default row
    "dspark-opening-priced": {"method": "dspark", "schedule": "confidence", "gamma": None, "steady_price": False},
    # scheduled dspark behind a gate whose prompt classes remember ~200 drafting steps instead of ~20
    # (``SpecGate.class_decay`` 0.995), through a gate of its own: session 55 (H100, support at c = 1) found
    # resting requests predicted at 1.53-1.55 tokens a sequence, the tail of the phase that had just ended,
    # where the class's drafting steps averaged 2.05-2.13 and fixed γ = 7 ran 1.55x `none` against the
    # schedule's 1.28-1.46. A diagnostic, not a default row; not GPU-run yet
    "dspark-class-long": {"method": "dspark", "schedule": "confidence", "gamma": None, "class_decay": 0.995},
}
DIAGNOSTIC_ROWS = ("dspark-beside-prompts", "dspark-resting", "dspark-rejection", "dspark-g7-rejection",
                   "dspark-absorb-eager", "dspark-probe-full", "dspark-probe-quarter", "dspark-probe-uncut",
                   "dspark-no-span", "dspark-charge-whole", "dspark-clip-off", "eagle3-eager",
                   "dspark-capture-prompts", "dspark-capture-prompts-32", "dspark-fuse-late", "dspark-g7-fuse-late", "dspark-keep-context",
                   "dspark-markov-ref", "dspark-calibrated", "dspark-opening-priced", "dspark-class-long",
                   "auto-alternate", "auto-epoch", "auto-epoch-hold")
DEFAULT_ROWS = [r for r in ROWS if r not in DIAGNOSTIC_ROWS]
BASELINE = "none"
SCHEDULED = "dspark"          # the row that must never be slower than the baseline
PROMPT_MODE = "first turn of each eval session (no history)"


class SpeedupError(RuntimeError):
    """The run cannot give an honest table (a request failed, no sessions, an unknown row)."""


# ---- prompts -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    params: object            # specd.sampling_params.SamplingParams


def workload_prompts(path: Path, tokenizer, n: int, max_tokens: int | None, ignore_eos: bool,
                     context: int, gamma: int, seed: int) -> list[Prompt]:
    """The first turns of the first ``n`` eval sessions, tokenized with the chat template; a prompt too
    long for the context keeps its tail. Seeds are fixed per request, so every row samples alike."""
    from bench.workloads.format import prompt_messages, read_sessions
    from specd.sampling_params import SamplingParams

    sessions = [s for s in read_sessions(path) if s.split == "eval"][:n]
    if not sessions:
        raise SpeedupError(f"{path}: no eval sessions")
    out = []
    for i in range(n):
        s = sessions[i % len(sessions)]                # fewer sessions than requests: reuse them in order
        budget = s.turns[0].max_tokens if max_tokens is None else max_tokens
        extra = {"tools": s.tools} if s.tools else {}
        ids = tokenizer.encode_chat(prompt_messages(s, 0, []), **extra)
        room = context - budget - gamma - 2
        if room < 1:
            raise SpeedupError(f"context {context} has no room for a {budget}-token answer")
        params = SamplingParams(max_tokens=budget, temperature=s.sampling.temperature, top_p=s.sampling.top_p,
                                top_k=s.sampling.top_k, seed=seed + i, ignore_eos=ignore_eos)
        out.append(Prompt(ids[-room:], params))
    return out


def reseeded(prompts: list[Prompt], rep: int) -> list[Prompt]:
    """``prompts`` for repeat ``rep`` under ``--seeds by-repeat``: every request's seed moved by ``rep`` times
    the cell's requests, so no two repeats share a seed and every row of one repeat gets the same seeds (the
    rows stay paired within it). Repeat 0 keeps the seeds as they are.
    Why: a seeded request samples one fixed answer per row, so with fixed seeds a row's repeats give the same
    answers and token count, and at each turn's own length (answers end at EOS) that count differs from
    `none`'s; repeats do not average it out. H100, session 45 (runs DV, DW): on knowledge at c = 1 `none`
    emitted 141 tokens in every repeat and `dspark-g7` 238, so the cell's ratio carried its row's answer
    lengths. Greedy requests (temperature 0) answer alike whatever the seed."""
    if rep == 0:
        return prompts
    step = rep * len(prompts)
    return [Prompt(p.ids, p.params.model_copy(update={"seed": p.params.seed + step})) for p in prompts]


# ---- one closed-loop run -----------------------------------------------------------------------------

@dataclass
class RunResult:
    wall_s: float
    tokens: int
    throughput_tok_s: float
    per_user_tok_s: float | None
    steps: int
    verifications: int
    drafted: int
    accepted: int
    tau: float | None
    mean_verified: float | None
    admission_ms_per_step: float
    scheduler_ms_per_step: float
    scheduled_lengths: dict[str, int] = field(default_factory=dict)
    graph_captures: int = 0      # CUDA graphs (target steps and draft rounds) captured during this timed run
    eager_steps: int = 0         # steps no CUDA graph covered
    triton_compiles: int = 0     # Triton kernels built during this timed run (specd/engine/compile_count.py)
    gate_rested_steps: int = 0   # steps the measured pre-draft gate kept the scheduled requests from drafting
    # measured steps the gate let draft, by why: a new cell's exploration, a probe, the winning arm, and
    # steps where a recurring prompt class explored while its cell rested (session 8: run U's 22% loss on
    # coding at c = 32 came from 7 drafting steps whose reasons the records did not say)
    gate_drafted_by: dict[str, int] = field(default_factory=dict)
    gate_rest_again_steps: int = 0   # rested steps decided without a pass over the requests (SpecGate.rests_again)
    gate_rest_leased_steps: int = 0  # of those, steps rested on a lease without asking the gate (SpecGate.rest_lease)
    gate_rest_whole_batch_steps: int = 0   # of those, leased steps of the whole batch, no walk over it (session 29)
    gate_rest_span_steps: int = 0    # rested steps inside a rest span, prompt steps included (session 32)
    gate_probes: int = 0             # probes the gate started (of either arm)
    gate_probes_cut: int = 0         # of those, probes of drafting ended after their first sample (session 34)
    # where a step's wall time went, ms per step: the engine's phases (schedule: admission, kvd, gate and
    # drafting; forward: the model, sampling and verification; output; commit), the rest of ``step`` (its
    # settle, the gate's report) and the closed loop's own work between steps. Session 9, run X: a resting
    # scheduled row ran 2-3% behind ``none`` at c >= 4 with no verification, and nothing said where.
    phase_ms_per_step: dict[str, float] = field(default_factory=dict)
    # the engine's steps by kind (``specd.engine.engine.STEP_KINDS``: prompt, prompt_draft, draft, capture,
    # plain): count, ms and emitted tokens each. The gate compares pure decode steps only; a speculative
    # row's loss that its decode steps do not show is in its prompt steps, or in how many of them it runs
    # (session 13); ``capture`` steps are no-draft decode steps that did drafter work (session 17)
    step_kinds: dict[str, dict[str, float]] = field(default_factory=dict)
    # the ``draft`` steps again, as a drafting phase's first step and the others, with their schedule (the
    # proposal) and forward (the verify pass) ms apart (``draft_phases``; session 42: a probe's steps cost
    # 10-27 ms at c = 32 on the H200 against 7-8 ms in a drafting phase, and nothing said where)
    draft_phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # requests whose prompt captured no drafter features (the gate rested their cell): rated by their class's
    # prompt-less drafting steps (``ClassRecord``, session 14)
    gate_promptless_requests: int = 0
    # prompts that captured their features only because the row's gate captures every prompt at its load
    # (``SpecGate.capture_prompts``: the dspark-capture-prompts row) or keeps its resting requests' contexts
    # (``SpecGate.keep_context``: the dspark-keep-context row); 0 elsewhere
    gate_prompts_captured_anyway: int = 0
    # decode steps whose resting requests kept capturing their features (``SpecGate.keep_context``: the
    # dspark-keep-context row; 0 elsewhere)
    gate_context_kept_steps: int = 0
    # how the run's requests finished: by reason ("length", "stop", ...), and how many finished in the same step
    # as how many others ({"4": 3}: three steps each finished four requests). Why: with every answer capped at
    # 48 tokens, `none` finishes cohorts of requests in one step and their successors share prompt steps;
    # drafting spreads the finishes, and the successors' prompts take steps of their own (session 43: the
    # c = 32 loss of session 42's drafted runs was all in prompt steps). These say whether a run was in lockstep
    finish_reasons: dict[str, int] = field(default_factory=dict)
    finish_cohorts: dict[str, int] = field(default_factory=dict)
    # the garbage collector's passes during the run, by generation: [passes, ms] (kvd/gc_pauses.py).
    # A full pass over the process's heap took 113-182 ms on the CPU machine, against 2-10 ms steps
    gc_pauses: dict[str, list[float]] = field(default_factory=dict)
    # the auto row's requests by the method they were given (specd/engine/method_choice.py), "probes": how
    # many of them re-measured a cell's losing method, and "measuring": how many were sent to measure their
    # method (exploring or probing: they draft at every step); empty for other rows
    auto_methods: dict[str, int] = field(default_factory=dict)
    # every request as [prompt index, tokens, seconds from its first token to its finish, method it ran], in
    # finish order: the per-user rates the p50 is taken over, kept so that a method chooser can be replayed
    # offline on the rows' own requests (bench/auto_replay.py), and so that an auto row's requests can be read
    # by the method they were given (bench/mix_rates.py; runs before session 60 kept three fields)
    requests: list[list] = field(default_factory=list)


PHASES = ("schedule_seconds_total", "forward_seconds_total", "output_seconds_total", "commit_seconds_total")
STAT_KEYS = ("steps_total", "spec_verifications_total", "spec_drafted_tokens_total", "spec_accepted_tokens_total",
             "admission_seconds_total", "spec_scheduler_seconds_total", "spec_paused_steps_total",
             "spec_class_explore_steps_total", "spec_measure_steps_total", "spec_rest_again_steps_total",
             "spec_rest_leased_steps_total", "spec_rest_whole_batch_steps_total", "spec_rest_span_steps_total",
             "spec_promptless_requests_total", "spec_prompts_captured_anyway_total", "spec_context_kept_steps_total",
             "spec_gate_probes_total",
             "spec_gate_probes_cut_total") + PHASES


def _delta(before: dict, after: dict) -> dict:
    keys = set(STAT_KEYS) | {k for k in after
                             if k.startswith(("spec_scheduled_len", "spec_gate_drafted_", "step_", "gc_gen",
                                              "spec_auto_"))}
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def row_fields(row: str, gamma_cap: dict[str, int]) -> dict:
    spec = ROWS[row]
    gamma = spec["gamma"] if spec["gamma"] is None else min(spec["gamma"], gamma_cap.get(spec["method"], spec["gamma"]))
    return {"speculation": spec["method"], "spec_schedule": spec["schedule"], "num_speculative_tokens": gamma}


def gc_line(timed: list[dict], mode: str | None) -> str:
    """One markdown line: the collector's passes over all timed runs, by generation."""
    parts = []
    for g in reversed(GENERATIONS):
        hit = [r["gc_pauses"][f"gen{g}"] for r in timed if f"gen{g}" in r.get("gc_pauses", {})]
        parts.append(f"generation {g}: {sum(p[0] for p in hit)} passes in {len(hit)} runs, "
                     f"{sum(p[1] for p in hit):.1f} ms")
    return f"Garbage-collector passes in timed runs (--gc {mode}): " + "; ".join(parts) + "."


def _graph_state(engine) -> tuple[int, int, int]:
    """(CUDA graphs captured so far, target step and draft round alike; eager steps so far; Triton kernels
    built so far) (zeros without graphs or compiles)."""
    g = engine.graph_stats()
    return g["graph_captures_total"], g["eager_steps_total"], g.get("triton_compiles_total", 0)


def run_closed_loop(engine, prompts: list[Prompt], fields: dict, concurrency: int, tag: str,
                    queued: int = 0) -> RunResult:
    """Keep ``concurrency`` requests in flight until every prompt is answered; with ``queued``, that many more
    wait in the engine's queue (the caller caps the engine's batch at ``concurrency``)."""
    from specd.engine.request import Request

    queue = deque(enumerate(prompts))
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    spans: list[tuple[int, int, float, str]] = []  # per finished request: prompt index, tokens, seconds, method
    sent: dict[str, Request] = {}      # by id: an auto request's method is set on it at its first step
    reasons: Counter = Counter()
    cohorts: Counter = Counter()
    inflight = 0
    before = dict(engine.stats())
    graphs0, eager0, compiles0 = _graph_state(engine)
    in_step = 0.0
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and inflight < concurrency + queued:
            i, p = queue.popleft()
            req = sent[f"{tag}-{i}"] = Request(f"{tag}-{i}", list(p.ids), p.params, **fields)
            engine.add_request(req)
            inflight += 1
        ts = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        in_step += now - ts
        finished = 0
        for out in outs:
            if out.error or out.finish_reason in ("error", "abort"):
                raise SpeedupError(f"request {out.id} failed: {out.error or out.finish_reason}")
            if out.token_ids:
                first.setdefault(out.id, now)
                count[out.id] = count.get(out.id, 0) + len(out.token_ids)
            if out.finished:
                inflight -= 1
                finished += 1
                reasons[str(out.finish_reason)] += 1
                spans.append((int(out.id.rsplit("-", 1)[1]), count.get(out.id, 0), now - first.get(out.id, now),
                              str(sent.pop(out.id).speculation)))
        if finished:
            cohorts[str(finished)] += 1
    wall = time.perf_counter() - t0
    graphs1, eager1, compiles1 = _graph_state(engine)
    d = _delta(before, engine.stats())
    tokens = sum(span[1] for span in spans)
    rates = [n / s for _, n, s, _ in spans if s > 0]
    steps, verif = max(1, d["steps_total"]), d["spec_verifications_total"]
    return RunResult(
        wall_s=wall, tokens=tokens, throughput_tok_s=tokens / wall,
        per_user_tok_s=statistics.median(rates) if rates else None, steps=d["steps_total"],
        verifications=verif, drafted=d["spec_drafted_tokens_total"], accepted=d["spec_accepted_tokens_total"],
        tau=tau(verif, d["spec_accepted_tokens_total"]),
        mean_verified=d["spec_drafted_tokens_total"] / verif if verif else None,
        admission_ms_per_step=1e3 * d["admission_seconds_total"] / steps,
        scheduler_ms_per_step=1e3 * d["spec_scheduler_seconds_total"] / steps,
        scheduled_lengths={k.removeprefix("spec_scheduled_len").removesuffix("_total"): int(v)
                           for k, v in sorted(d.items()) if k.startswith("spec_scheduled_len") and v},
        graph_captures=graphs1 - graphs0, eager_steps=eager1 - eager0, triton_compiles=compiles1 - compiles0,
        gate_rested_steps=int(d["spec_paused_steps_total"]),
        gate_drafted_by={**{r: int(d.get(f"spec_gate_drafted_{r}_steps_total", 0)) for r in DRAFT_REASONS},
                         "class": int(d["spec_class_explore_steps_total"]),
                         "measure": int(d.get("spec_measure_steps_total", 0))},
        gate_rest_again_steps=int(d["spec_rest_again_steps_total"]),
        gate_rest_leased_steps=int(d["spec_rest_leased_steps_total"]),
        gate_rest_whole_batch_steps=int(d.get("spec_rest_whole_batch_steps_total", 0)),
        gate_rest_span_steps=int(d["spec_rest_span_steps_total"]),
        gate_probes=int(d.get("spec_gate_probes_total", 0)), gate_probes_cut=int(d.get("spec_gate_probes_cut_total", 0)),
        gate_promptless_requests=int(d["spec_promptless_requests_total"]),
        gate_prompts_captured_anyway=int(d.get("spec_prompts_captured_anyway_total", 0)),
        gate_context_kept_steps=int(d.get("spec_context_kept_steps_total", 0)),
        phase_ms_per_step=phase_split(d, in_step, wall, steps), step_kinds=step_kinds(d), draft_phases=draft_phases(d),
        gc_pauses=gc_split(d), finish_reasons=dict(sorted(reasons.items())), auto_methods=auto_split(d),
        requests=[[i, n, round(sec, 6), method] for i, n, sec, method in spans],
        finish_cohorts=dict(sorted(cohorts.items(), key=lambda kv: int(kv[0]))))


AUTO_NOTES = ("probes", "measuring", "unclean")     # auto_methods keys that count requests, not methods given


def auto_split(d: dict) -> dict[str, int]:
    """The auto requests of a stats delta by method given, and the probes, measuring and unclean requests among
    them (empty: none). Unclean: finished requests that taught ``EpochChoice`` nothing (a mixed or draining
    batch), so a run shows how often the clean rule held."""
    out = {k.removeprefix("spec_auto_").removesuffix("_requests_total"): int(v) for k, v in sorted(d.items())
           if k.startswith("spec_auto_") and k.endswith("_requests_total") and v}
    for note in AUTO_NOTES:     # ``MethodChoice.stats``: spec_auto_probes_total, ...; ``EpochChoice``'s unclean
        if out and d.get(f"spec_auto_{note}_total"):
            out[note] = int(d[f"spec_auto_{note}_total"])
    return out


def auto_line(runs: list[dict]) -> str:
    """One cell's auto requests over its runs: "dspark 12, ngram 52 (probes 3, measuring 3, measuring steps
    40)"; "" without any. Measuring steps: steps drafted only because a measuring request drafts throughout
    (``gate_drafted_by["measure"]``), which every request of the batch pays for (session 58)."""
    total: Counter = Counter()
    for r in runs:
        total.update(r.get("auto_methods", {}))
    counts = {note: total.pop(note, 0) for note in AUTO_NOTES}
    if not total:
        return ""
    counts["measuring steps"] = sum(r.get("gate_drafted_by", {}).get("measure", 0) for r in runs)
    notes = [f"{note} {n}" for note, n in counts.items() if n]
    return ", ".join(f"{m} {n}" for m, n in sorted(total.items())) + (f" ({', '.join(notes)})" if notes else "")


def gc_split(d: dict) -> dict[str, list[float]]:
    """The collector's passes in a stats delta, by generation: {"gen2": [passes, ms], ...}, passes only."""
    return {f"gen{g}": [int(d[f"gc_gen{g}_passes_total"]), round(1e3 * d[f"gc_gen{g}_seconds_total"], 3)]
            for g in GENERATIONS if d.get(f"gc_gen{g}_passes_total")}


# ROWS keys for the row's own gate (SpecGate settings, or its verify, draft or projection path), not request fields
GATE_SETTINGS = ("beside_prompts", "probe_budget", "probe_max", "probe_cut", "charge_steps", "plain_clip", "gate",
                 "verify", "graphs", "absorb", "spans", "capture_prompts", "fuse", "keep_context", "markov",
                 "calibrate", "steady_price", "class_decay", "own", "chooser")


@contextmanager
def row_gate(engine, row: str, own: dict):
    """Run ``row`` with a gate of its own when it sets gate settings (``GATE_SETTINGS``): one SpecGate
    per such row, kept in ``own`` across cells, swapped in while the row runs and the engine's restored
    after; other rows use the engine's. Why: rows with the same method and schedule share the gate's
    cells and prompt-class records, so an ablation row's steps fed the default row's decisions and back
    (H200, session 13, run AP: support at c = 4 ran 1.03x in both dspark rows, 1.30-1.36x in runs
    without the ablation)."""
    from specd.engine.spec_gate import TRACE_STEPS, SpecGate

    gate = getattr(engine, "spec_gate", None)
    settings = {k: v for k, v in ROWS[row].items() if k in GATE_SETTINGS}
    if gate is None or not settings:
        yield
        return
    settings.pop("own", None)                     # a gate of its own with the default settings
    chooser = settings.pop("chooser", None)       # its method chooser: "alternate" ``AlternatingChoice``, "epoch"
                                                  # ``EpochChoice``, "epoch-hold" one that holds at 10%
    rejection = settings.pop("verify", None) == "rejection"
    spans = settings.pop("spans", True)
    swaps = []        # (object, attribute, value while the row runs): each put back after it
    if settings.pop("graphs", None) == "eager":   # ``FeatureProposer``: the drafter's eager draft (``draft_contexts``)
        swaps.append((engine._proposer(ROWS[row]["method"]), "rounds", None))
    if settings.pop("fuse", None) == "late":      # features fused after the step's sync (``_keep_features_late``)
        swaps.append((engine, "fuse_early", False))
    if settings.pop("absorb", None) == "eager":   # no projection graphs: the eager ``absorb_many``
        rounds = getattr(engine._proposer(ROWS[row]["method"]), "rounds", None)
        if rounds is not None:
            swaps.append((rounds, "absorbs", None))
    env = {}          # environment variables set while the row runs, each put back after it
    if settings.pop("markov", None) == "ref":     # the slot's torch references (``markov_slot_kernels``)
        from kvspec_kernels.dispatch import MARKOV_SLOT_ENV

        env[MARKOV_SLOT_ENV] = "0"
        proposer = engine._proposer(ROWS[row]["method"])
        if getattr(proposer, "rounds", None) is not None:
            swaps.append((proposer, "rounds", reference_rounds(proposer)))
    if row not in own:
        # the records kept as the engine's gate keeps them (``--gate-trace-steps``)
        settings["trace_steps"] = getattr(gate, "trace_steps", TRACE_STEPS)
        if settings.pop("gate", None) == "resting":
            from bench.resting_gate import RestingGate

            own[row] = RestingGate(**settings)
        else:
            own[row] = SpecGate(**settings)
        if chooser == "alternate":
            from bench.alternating_choice import AlternatingChoice

            own[row].methods = AlternatingChoice()
        elif chooser in ("epoch", "epoch-hold"):
            from specd.engine.epoch_choice import EpochChoice

            own[row].methods = EpochChoice(hold=0.10) if chooser == "epoch-hold" else EpochChoice()
    engine.spec_gate = own[row]
    engine.greedy_chain = not rejection
    engine.rest_spans = spans
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in swaps]
    saved_env = {k: os.environ.get(k) for k in env}
    for obj, attr, value in swaps:
        setattr(obj, attr, value)
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        engine.spec_gate = gate
        engine.greedy_chain = True
        engine.rest_spans = True
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def reference_rounds(proposer):
    """A second DraftGraphs for ``proposer``'s drafter, sharing its block-forward and projection graphs:
    its rounds are captured on first use, so under ``KVSPEC_MARKOV_SLOT=0`` (the dspark-markov-ref row)
    they hold the slot's torch references where the engine's hold the fused kernels. Why a second set:
    a captured graph keeps the kernels it was captured with, so the variable alone would not reach the
    engine's rounds."""
    from specd.engine.draft_graphs import DraftGraphs

    if proposer not in _REFERENCE_ROUNDS:       # one set a proposer, kept across the row's cells
        rounds = proposer.rounds
        ref = DraftGraphs(proposer.drafter, rounds.max_batch, rounds.device, replay_eagerly=rounds.replay_eagerly)
        ref.blocks, ref.absorbs = rounds.blocks, rounds.absorbs
        _REFERENCE_ROUNDS[proposer] = ref
    return _REFERENCE_ROUNDS[proposer]


_REFERENCE_ROUNDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # proposer -> reference_rounds


def repeat_order(rows: list[str], rep: int) -> list[str]:
    """The rows of repeat ``rep``: the list rotated by ``rep``. With as many repeats as rows each row
    runs once in each position."""
    k = rep % len(rows)
    return rows[k:] + rows[:k]


def step_kinds_line(runs: list[dict]) -> str:
    """A row's steps by kind, averaged over its runs: "prompt 38 (9.6 ms, 14.9 tok), draft 40 (...)";
    empty when the runs recorded none."""
    from specd.engine.engine import STEP_KINDS

    parts = []
    for kind in STEP_KINDS:
        seen = [r["step_kinds"][kind] for r in runs if kind in r.get("step_kinds", {})]
        steps = sum(k["steps"] for k in seen)
        if steps:
            parts.append(f"{kind} {steps / len(runs):.0f} ({sum(k['ms'] for k in seen) / steps:.1f} ms, "
                         f"{sum(k['tokens'] for k in seen) / steps:.1f} tok)")
    return ", ".join(parts)


def step_kinds(d: dict) -> dict[str, dict[str, float]]:
    """The run's steps by kind from the engine's counter deltas: {kind: {steps, ms, tokens, schedule_ms,
    forward_ms}}, kinds that ran only (the two phases since session 45: ``bench.step_split --phases``)."""
    from specd.engine.engine import STEP_KINDS

    out = {}
    for kind in STEP_KINDS:
        n = int(d.get(f"step_{kind}_steps_total", 0))
        if n:
            out[kind] = {"steps": n, "ms": round(1e3 * d[f"step_{kind}_seconds_total"], 3),
                         "tokens": int(d[f"step_{kind}_tokens_total"]),
                         **{f"{phase}_ms": round(1e3 * d.get(f"step_{kind}_{phase}_seconds_total", 0.0), 3)
                            for phase in ("schedule", "forward")}}
    return out


def draft_phases(d: dict) -> dict[str, dict[str, float]]:
    """The run's drafting steps again (``specd.engine.engine.DRAFT_PHASES``: the first step of a drafting
    phase, the others), {phase: {steps, ms, tokens, schedule_ms (of it gate_ms and propose_ms),
    forward_ms}}, phases that ran only. Kept
    apart from ``step_kinds``, whose kinds partition the run's steps."""
    from specd.engine.engine import DRAFT_PHASES

    out = {}
    for phase in DRAFT_PHASES:
        n = int(d.get(f"step_{phase}_steps_total", 0))
        if n:
            out[phase] = {"steps": n, "tokens": int(d[f"step_{phase}_tokens_total"]),
                          **{f"{what}ms": round(1e3 * d.get(f"step_{phase}_{what}seconds_total", 0.0), 3)
                             for what in ("", "schedule_", "gate_", "propose_", "forward_")}}
    return out


def phase_split(d: dict, in_step: float, wall: float, steps: int) -> dict[str, float]:
    """ms per step: the engine's four phase counters (``PHASES``), the rest of ``engine.step``, and the
    closed loop's time outside it."""
    phases = {k.removesuffix("_seconds_total"): 1e3 * d[k] / steps for k in PHASES}
    phases["rest_of_step"] = 1e3 * in_step / steps - sum(phases.values())
    phases["outside_step"] = 1e3 * (wall - in_step) / steps
    return {k: round(v, 4) for k, v in phases.items()}


# ---- summaries (pure) --------------------------------------------------------------------------------

def spread(values: list[float]) -> dict:
    return {"per_repeat": values, "p50": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_cell(runs: dict[str, list[RunResult]], tolerance: float = 0.0) -> dict:
    """runs[row][repeat] -> per row: the runs, the ratios to the baseline of the same repeat, and the
    "never slower" verdict of the scheduled row (p50 ratios of both throughputs ≥ 1 − tolerance)."""
    base = runs[BASELINE]
    rows = {}
    for row, rs in runs.items():
        thr = [r.throughput_tok_s / b.throughput_tok_s for r, b in zip(rs, base)]
        users = [r.per_user_tok_s / b.per_user_tok_s for r, b in zip(rs, base) if r.per_user_tok_s and b.per_user_tok_s]
        per_user = [r.per_user_tok_s for r in rs if r.per_user_tok_s]
        taus = [r.tau for r in rs if r.tau is not None]
        verified = [r.mean_verified for r in rs if r.mean_verified is not None]
        rows[row] = {"runs": [asdict(r) for r in rs],
                     "throughput_tok_s_p50": statistics.median(r.throughput_tok_s for r in rs),
                     "per_user_tok_s_p50": statistics.median(per_user) if per_user else None,
                     "throughput_ratio": spread(thr), "per_user_ratio": spread(users) if users else None,
                     "tau": statistics.mean(taus) if taus else None,
                     "mean_verified": statistics.mean(verified) if verified else None,
                     "scheduler_ms_per_step": statistics.median(r.scheduler_ms_per_step for r in rs),
                     "admission_ms_per_step": statistics.median(r.admission_ms_per_step for r in rs)}
    cell: dict = {"rows": rows}
    if SCHEDULED in rows:
        s = rows[SCHEDULED]
        ok = s["throughput_ratio"]["p50"] >= 1 - tolerance
        if s["per_user_ratio"] is not None:
            ok = ok and s["per_user_ratio"]["p50"] >= 1 - tolerance
        cell["never_slower"] = bool(ok)
        hist: dict[str, int] = {}
        for r in runs[SCHEDULED]:
            for k, v in r.scheduled_lengths.items():
                hist[k] = hist.get(k, 0) + v
        cell["scheduled_length_histogram"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    return cell


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary_across(workloads: dict) -> dict:
    """row -> concurrency -> geometric mean over workloads of the p50 throughput (and per-user) ratio."""
    out: dict = {}
    for cells in workloads.values():
        for level, cell in cells.items():
            for row, r in cell["rows"].items():
                slot = out.setdefault(row, {}).setdefault(level, {"throughput": [], "per_user": []})
                slot["throughput"].append(r["throughput_ratio"]["p50"])
                if r["per_user_ratio"] is not None:
                    slot["per_user"].append(r["per_user_ratio"]["p50"])
    return {row: {level: {k: geomean(v) if v else None for k, v in slot.items()} for level, slot in levels.items()}
            for row, levels in out.items()}


# ---- markdown ----------------------------------------------------------------------------------------

def _ratio(r: dict | None) -> str:
    return "–" if r is None else f"{r['p50']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def run_device(device) -> str:
    """The name of the card a run timed (``torch.cuda.get_device_name``), or the device type off CUDA."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def render_markdown(result: dict) -> str:
    lines = ["# Speculative decoding speed-up", "", f"Command: `{result['command']}`", ""]
    if "modeled_costs_ms" in result:
        lines += ["**MODELED CLOCK** (`bench.gate_sim`): every time below is a model of a GPU's step costs, "
                  f"host work costs nothing; compare rows, read nothing absolute. Costs (ms): "
                  f"{result['modeled_costs_ms']}.", ""]
    lines += [f"Model `{result['model']}`" + (f" on {result['device']}" if result.get("device") else "")
              + ("; norms and rotary as one-launch kernels" if result.get("fused_elementwise")
                 else "; torch norms and rotary (KVSPEC_FUSED=0, or older than session 15)"
                 if "fused_elementwise" in result else "")
              + f"; prompts: {result['prompt_mode']}; {result['repeats']} repeat(s)"
              + (", seeds moved each repeat (--seeds by-repeat)" if result.get("seeds") == "by-repeat" else "")
              + ", rows alternated inside each (each repeat starts one row later); ratios are to `none` in "
              "the same repeat: p50 [min, max]. "
              "Per-user tok/s: median over requests of tokens / (finish − first token).", ""]
    if result["skipped_rows"]:
        lines += [f"Rows skipped (no drafter given): {', '.join(result['skipped_rows'])}.", ""]
    if result.get("cut"):
        lines += [f"Cells not run (past --budget-s): {', '.join(result['cut'])}.", ""]
    for wl, cells in result["workloads"].items():
        lines += [f"## {wl}", "", "| conc. | row | tok/s | ratio | per-user tok/s | ratio | τ | verified/step | "
                  "sched. ms/step | admit ms/step |", "|---|---|---|---|---|---|---|---|---|---|"]
        for level, cell in cells.items():
            for row, r in cell["rows"].items():
                lines.append(f"| {level} | {row} | {r['throughput_tok_s_p50']:.1f} | {_ratio(r['throughput_ratio'])} | "
                             f"{_num(r['per_user_tok_s_p50'], '.1f')} | {_ratio(r['per_user_ratio'])} | {_num(r['tau'])} | "
                             f"{_num(r['mean_verified'])} | {r['scheduler_ms_per_step']:.3f} | {r['admission_ms_per_step']:.3f} |")
        lines.append("")
        for level, cell in cells.items():
            if "never_slower" in cell:
                lines.append(f"- never slower than none at concurrency {level}: "
                             f"**{'yes' if cell['never_slower'] else 'NO'}**; scheduled verify lengths "
                             f"{cell['scheduled_length_histogram']}")
                kinds = {row: step_kinds_line(cell["rows"][row]["runs"]) for row in (BASELINE, SCHEDULED)
                         if row in cell["rows"]}
                if all(kinds.values()):
                    lines.append("  - steps per run by kind, count (ms each, tokens each): "
                                 + "; ".join(f"{row}: {line}" for row, line in kinds.items()))
            for row in (r for r in cell["rows"] if ROWS.get(r, {}).get("method") == "auto"):
                given = auto_line(cell["rows"][row]["runs"])
                if given:
                    lines.append(f"- {row} at concurrency {level}, requests by method over the timed runs: {given}")
        lines.append("")
    lines += ["## Summary across workloads (geometric mean of p50 throughput ratios; per-user in brackets)", "",
              "| row | " + " | ".join(f"c={c}" for c in result["concurrency"]) + " |",
              "|---|" + "---|" * len(result["concurrency"])]
    for row, levels in result["summary"].items():
        cells = [levels.get(str(c)) for c in result["concurrency"]]
        lines.append(f"| {row} | " + " | ".join("–" if s is None else f"{_num(s['throughput'])} ({_num(s['per_user'])})"
                                               for s in cells) + " |")
    timed = [r for cells in result["workloads"].values() for c in cells.values() for row in c["rows"].values()
             for r in row["runs"]]
    capturing = sum(1 for r in timed if r["graph_captures"])
    compiling = sum(1 for r in timed if r.get("triton_compiles"))
    lines += ["", f"Timed runs that captured CUDA graphs: {capturing} of {len(timed)}; that built Triton kernels: "
                  f"{compiling}; eager steps in timed runs: "
                  f"{sum(r['eager_steps'] for r in timed)} of {sum(r['steps'] for r in timed)}.",
              "", gc_line(timed, result.get("gc")), "", host_drift_line(result["workloads"])]
    verdicts = [c.get("never_slower") for cells in result["workloads"].values() for c in cells.values()]
    if any(v is not None for v in verdicts):
        lines += ["", f"Scheduled dspark never slower than none in every cell: "
                      f"**{'yes' if all(v for v in verdicts if v is not None) else 'NO'}**"]
        floor = noise_floor(result, SCHEDULED, result.get("tolerance", 0.0))
        aa = noise_floor(result, "none-aa", result.get("tolerance", 0.0))
        if floor and aa:
            lines += ["", f"The same rule, cell by cell (p50 throughput and per-user ratios ≥ 1 − tolerance): "
                          f"scheduled dspark fails it in {floor['failed']} of {floor['cells']} cells, worst "
                          f"{floor['worst']:.3f}; the A/A row (`none` against itself) in {aa['failed']} of "
                          f"{aa['cells']}, worst {aa['worst']:.3f}: the rule's noise floor at this run length."]
            band = max(NOISE_BAND, result.get("tolerance", 0.0))
            floor, aa = noise_floor(result, SCHEDULED, band), noise_floor(result, "none-aa", band)
            lines += ["", f"Within a {band:.0%} band (ratios ≥ {1 - band:.2f}): scheduled dspark fails in "
                          f"{floor['failed']} of {floor['cells']} cells, the A/A row in {aa['failed']}."]
        adjusted = host_line(result, SCHEDULED)
        if adjusted:
            lines += ["", adjusted]
    return "\n".join(lines) + "\n"


NOISE_BAND = 0.03   # the per-cell rule again with this tolerance: on the H200 the A/A row fails the strict rule in
                    # about half the cells (runs AF-AM) and within 3% in 2-3 of 25, so a row failing it in many
                    # more cells is slower beyond the noise (session 12: AI+AJ 7 cells, AL+AM 12)


def requests_for(concurrency: int, requests: int, waves: int = 1) -> int:
    """Requests a (workload, concurrency) cell runs: ``requests``, at least ``waves`` per slot."""
    return max(requests, waves * concurrency)


def noise_floor(result: dict, row: str, tolerance: float = 0.0) -> dict | None:
    """How often ``row`` fails the never-slower rule over the cells, and its worst cell (the lower of its
    p50 throughput and per-user ratios). For the A/A row, the rule's noise floor. Session 10 (runs AA and
    AC, 3 repeats of ~0.4-1.3 s): the A/A row failed it in 9 and 16 of 25 cells, worst 0.96-0.97, so a
    per-cell verdict at this run length cannot tell a 1% loss from noise; the count beside the scheduled
    row's says how far apart they are. None when the row was not run."""
    worst, failed, cells = None, 0, 0
    for levels in result["workloads"].values():
        for cell in levels.values():
            r = cell["rows"].get(row)
            if r is None:
                continue
            ratios = [r["throughput_ratio"]["p50"]] + ([r["per_user_ratio"]["p50"]] if r["per_user_ratio"] else [])
            cells += 1
            failed += min(ratios) < 1 - tolerance
            worst = min(ratios) if worst is None else min(worst, min(ratios))
    return {"cells": cells, "failed": failed, "worst": worst} if cells else None


# ---- command line ------------------------------------------------------------------------------------

def _rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    return [BASELINE] + [r for r in dict.fromkeys(rows) if r != BASELINE]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="GGUF file or HF directory of the target")
    p.add_argument("--drafters", default="", help="method=DIR,... (dspark, dflash, eagle3); rows whose "
                                                  "drafter is missing are skipped and listed")
    p.add_argument("--workloads", required=True, help="comma list of session JSONL files (their eval split)")
    p.add_argument("--concurrency", type=positive_ints, default=[1, 4, 8, 16, 32])
    p.add_argument("--rows", type=_rows, default=DEFAULT_ROWS,
                   help=f"comma list of {', '.join(ROWS)} (default: all but the diagnostic rows "
                        f"{', '.join(DIAGNOSTIC_ROWS)})")
    p.add_argument("--requests", type=int, default=16, help="N requests per run (at least --waves × the concurrency)")
    p.add_argument("--queued", type=non_negative_int, default=0,
                   help="keep N more requests waiting in the engine's queue beyond the concurrency, which the "
                        "engine then runs at most at once: arrivals that outpace the batch, which a closed loop "
                        "never produces (session 33: a queued request had kept rest spans from forming)")
    p.add_argument("--waves", type=positive_int, default=1,
                   help="at least this many requests per slot of the concurrency (more waves: less of the "
                        "run is the tail where the batch empties)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer length (default: the turn's max_tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to its max tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-tokens", type=int, default=8, help="answer length of the untimed warm-up runs")
    p.add_argument("--auto-warmups", type=non_negative_int, default=AUTO_WARMUPS,
                   help="whole-answer untimed runs the auto row gets, at most, per cell while its method chooser "
                        "still explores the cell's prompt classes at that load (on the workload's next eval "
                        "sessions, other seeds); 0: none, so the chooser explores in the timed runs (session 56)")
    p.add_argument("--gamma", type=int, default=7, help="the engine's γ (the scheduled row's draft length)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="'never slower' holds when the scheduled row's p50 ratios are ≥ 1 − tolerance")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--cpus", type=cpu_set, default=None,
                   help="pin the process, every thread, to these CPUs (e.g. 2 or 2-5) before the model loads; "
                        "default: unpinned (bench/cpu_pin.py says why one would)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", choices=("fixed", "by-repeat"), default="fixed",
                   help="fixed: each request keeps its seed (--seed + its index) in every repeat, so a sampled "
                        "row's repeats give the same answers; by-repeat: repeat r moves every seed by r x the "
                        "cell's requests, the same for every row of that repeat, so repeats average the rows' "
                        "sampled answer lengths (which differ from `none`'s where answers end at EOS, session "
                        "45); greedy workloads answer alike either way")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget: no (workload, concurrency) cell starts after it (the cells left are "
                        "listed under 'cut'), so a device call with a hard limit still writes its results")
    p.add_argument("--gc", choices=("freeze", "default"), default="freeze",
                   help="freeze: collect and freeze the heap after each cell's warm-ups, as specd does after "
                   "start-up, so no full collector pass walks the model's and engine's objects inside a timed "
                   "run; default: Python's collector untouched (what runs before session 18 timed). Every run "
                   "records its collector passes either way (gc_pauses)")
    p.add_argument("--out", type=Path, required=True, help="directory for speedup.json and speedup.md")
    p.add_argument("--profile", type=Path, default=None,
                   help="also run cProfile over the timed runs and write DIR/profile-<row>-c<N>.txt (host hot "
                   "spots by own and cumulative time, all workloads and repeats of a cell summed; the GPU's "
                   "share shows as time in the step's one synchronising copy). Slows every row alike.")
    p.add_argument("--gate-trace-steps", type=positive_int, default=None,
                   help="reports each spec gate cell keeps for the JSON (its first ones in gate_trace, its latest "
                   "after each cell in gate_recent), for every row's gate; default: the gate's 16. A diagnosis "
                   "of a cell's whole history (bench.gate_trace) needs more; the JSON grows with it")
    p.add_argument("--torch-profile", type=Path, default=None,
                   help="also run torch.profiler over the timed runs and write DIR/torch-profile-c<N>.md: each "
                   "row's ops and kernels side by side, self device and CPU time (profiled runs are slower: "
                   "a diagnostic, not a speed result)")


def _engine(args: argparse.Namespace):
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    peak = max(args.concurrency)
    return SpecEngine.from_config(EngineConfig(
        model=args.model, drafters=args.drafters, speculation="none", device=args.device, dtype=args.dtype,
        max_num_seqs=peak, num_speculative_tokens=args.gamma, num_local_blocks=4096 + 64 * peak))


def _available_rows(engine, rows: list[str]) -> tuple[list[str], list[str], dict[str, int]]:
    """Rows whose method can be served, the skipped ones, and each method's largest γ (its drafter's block)."""
    from specd.engine.errors import EngineError

    keep, skipped, cap = [], [], {}
    for row in rows:
        method = ROWS[row]["method"]
        if method == "none":
            keep.append(row)
            continue
        try:
            if method == "auto":
                engine.auto_candidates()          # servable when one of the deployment's auto_methods is
                keep.append(row)
                continue
            cap[method] = engine.max_draft_tokens(method)
        except EngineError:
            skipped.append(row)
            continue
        keep.append(row)
    return keep, skipped, cap


EXTRA_WARMUPS = 3   # more warm-up runs a gated row gets, at most, while its gate cell still explores


def gate_keys(row: str, engine=None) -> tuple[str, ...]:
    """Every gate key a row's requests may run under: for the auto row its candidates' (the engine's
    ``auto_gate_keys``; none without an engine), else ``gate_key``'s."""
    if ROWS[row]["method"] == "auto":
        return () if engine is None else tuple(engine.auto_gate_keys())
    key = gate_key(row)
    return () if key is None else (key,)


def gate_key(row: str) -> str | None:
    """The spec gate's key for a row's requests, None if the gate does not decide for them (fixed γ and
    plain decoding; the confidence schedule and the gated one are gated; the auto row: ``gate_keys``)."""
    spec = ROWS[row]
    if spec["schedule"] not in ("confidence", "gated"):
        return None
    return gate_key_name(spec["method"], spec["schedule"])


def finish_exploring(engine, row: str, level: int, warm) -> dict[int, int]:
    """Run ``warm(tag, concurrency)`` (one more untimed warm-up) while the row's gate cell at this load, or at
    a lighter load bucket, still explores, at most EXTRA_WARMUPS times a bucket: the load's own bucket at
    this concurrency first, then each lighter one (its concurrency is the bucket) that the warm-ups have
    made a cell of. Returns the extra warm-ups run, by bucket (buckets that needed none left out).

    Why the load's own bucket: a new (method, load) cell measures 5 drafting and 5 resting steps once in a
    server's life, and steps that captured a graph do not count; with 8-token warm-ups at c = 32 that
    exploration spilled into the first timed runs of the first workload at each load (run U, session 8:
    coding c = 32 drafted 7 of 58 steps). Why the lighter ones (session 34): every closed-loop run ends in
    a drain through the lighter buckets, one or two steps in each. A request that rested has no features
    to draft from at its first step there (it captures them, ``GateSteps._drop_undrafted``), so such a
    step is no drafting sample, and a cell that only ever sees drains may never finish exploring. In
    session 32's runs of c = 16 and 32 alone (CT, CU, CW), the b1 cell had no sample of either arm after
    8 repeats of coding and creative, and their timed runs took an exploring decision at nearly every
    drain (a capture step or a drafting step); in CW (c = 32 alone, 4 repeats) the b2-b8 cells explored
    too, 5-19 such decisions a run on coding. A server that has seen these loads once has explored them.
    The timed runs measure the steady state, probes included; the JSON lists the extra warm-ups per cell
    and bucket (``gate_extra_warmups``)."""
    keys, gate = gate_keys(row, engine), getattr(engine, "spec_gate", None)
    if not keys or gate is None:
        return {}
    top = load_bucket(level)
    extra: dict[int, int] = {}
    for bucket in [top] + [1 << i for i in range(top.bit_length() - 2, -1, -1)]:     # then top/2, ..., 1
        runs = 0
        while runs < EXTRA_WARMUPS and any(bucket in gate.exploring(key) for key in keys):
            warm(f"x{bucket}-{runs}", level if bucket == top else bucket)
            runs += 1
        if runs:
            extra[bucket] = runs
    return extra


AUTO_WARMUPS = 3    # full-length warm-up runs the auto row gets, at most, while its chooser's cells still explore


def explore_auto(engine, classes, level: int, warm, most: int = AUTO_WARMUPS) -> int:
    """Run ``warm(tag)`` (one untimed closed-loop run of whole answers at this load) while the auto row's
    method chooser (``SpecGate.methods``) still explores a cell of ``classes`` at this load, at most ``most``
    times. Returns the runs made.

    Why: the chooser rates a method by its finished requests' decode rate, and a cell explores each candidate
    until it has finished ``EXPLORE`` requests and decoded ``EXPLORE_TOKENS`` tokens. The 8-token warm-ups
    never get there, so in session 56's runs every cell explored in its timed runs, 8-32 requests a run
    (H100, run ND: knowledge c = 1 explored through all 16 of its timed requests). ``finish_exploring`` does
    the same for the spec gate's cells: the timed runs measure a server that has served this traffic before.
    The warm-up prompts are the workload's next eval sessions after the timed ones, with other seeds, so the
    chooser does not learn on the very answers it is then timed on. Where the workload has fewer sessions
    than twice a cell's requests (the qs1000 stage has 16 eval sessions a workload: c ≥ 4), they are the same
    sessions again with other seeds; a greedy workload (extraction) then answers alike, as the spec gate's
    warm-ups also run the timed prompts."""
    chooser = getattr(getattr(engine, "spec_gate", None), "methods", None)
    if chooser is None:
        return 0
    bucket, runs = load_bucket(level), 0
    while runs < most and chooser.young(classes, bucket):
        warm(f"auto-{runs}")
        runs += 1
    return runs


def measure(engine, args: argparse.Namespace, progress=print) -> dict:
    rows, skipped, cap = _available_rows(engine, args.rows)
    workloads: dict = {}
    cut: list[str] = []
    deadline = None if getattr(args, "budget_s", None) is None else time.perf_counter() + args.budget_s
    profiles = RowProfiles(getattr(args, "profile", None))
    torch_profiles = TorchProfiles(getattr(args, "torch_profile", None))
    own_gates: dict = {}          # row -> its own SpecGate (``row_gate``)
    trace_steps = getattr(args, "gate_trace_steps", None)      # a positive integer (argparse) or None
    if trace_steps is not None and getattr(engine, "spec_gate", None) is not None:
        engine.spec_gate.keep_trace(trace_steps)           # the rows' own gates copy it (``row_gate``)
    queued = getattr(args, "queued", 0)
    auto_warmups = getattr(args, "auto_warmups", AUTO_WARMUPS)
    most = engine.scheduler.max_num_seqs         # with ``queued``, each load caps the batch (restored after)
    try:
        for wl_path in [Path(w.strip()) for w in args.workloads.split(",") if w.strip()]:
            name = wl_path.stem
            workloads[name] = {}
            for level in args.concurrency:
                if deadline is not None and time.perf_counter() > deadline:
                    cut.append(f"{name} c={level}")
                    continue
                if queued:
                    engine.scheduler.max_num_seqs = level
                n = requests_for(level, args.requests, args.waves)
                prompts = workload_prompts(wl_path, engine.tokenizer, n, args.max_tokens, args.ignore_eos,
                                           engine.max_model_len, args.gamma, args.seed)
                runs: dict[str, list[RunResult]] = {row: [] for row in rows}
                short = [Prompt(p.ids, p.params.model_copy(update={"max_tokens": args.warmup_tokens})) for p in prompts]
                extra, auto_extra, explore = {}, {}, None
                for row in rows:          # the same prompts and batch shapes, short answers: captures and compiles
                    with row_gate(engine, row, own_gates):
                        run_closed_loop(engine, short, row_fields(row, cap), level, f"warm-{name}-{level}-{row}",
                                        queued)
                        # a lighter bucket's warm-up: its own concurrency, as many prompts as a cell of it runs
                        extra[row] = finish_exploring(engine, row, level, lambda tag, c: run_closed_loop(
                            engine, short if c == level else short[:requests_for(c, args.requests, args.waves)],
                            row_fields(row, cap), c, f"warm-{name}-{level}-{row}-{tag}", queued if c == level else 0))
                        if ROWS[row]["method"] == "auto" and auto_warmups:
                            if explore is None:       # the next eval sessions, other seeds (``explore_auto``)
                                explore = workload_prompts(wl_path, engine.tokenizer, 2 * n, args.max_tokens,
                                                           args.ignore_eos, engine.max_model_len, args.gamma,
                                                           args.seed)[n:]
                            auto_extra[row] = explore_auto(
                                engine, [prompt_class(p.ids) for p in prompts], level,
                                lambda tag: run_closed_loop(engine, explore, row_fields(row, cap), level,
                                                            f"warm-{name}-{level}-{row}-{tag}", queued),
                                auto_warmups)
                if args.gc == "freeze":              # untimed: the warm-ups' objects too
                    freeze_heap(f"the warm-ups of {name} c={level}")
                for rep in range(args.repeats):
                    timed = reseeded(prompts, rep) if getattr(args, "seeds", "fixed") == "by-repeat" else prompts
                    for row in repeat_order(rows, rep):
                        # torch.profiler outside cProfile: its post-processing (key_averages, at its exit)
                        # filled session 35's cProfile tables (run DA) when cProfile was the outer one
                        with torch_profiles.timed(row, level), profiles.timed(row, level), \
                                row_gate(engine, row, own_gates):
                            r = run_closed_loop(engine, timed, row_fields(row, cap), level,
                                                f"{name}-{level}-{row}-{rep}", queued)
                        runs[row].append(r)
                        progress(f"{name} c={level} {row} rep {rep}: {r.throughput_tok_s:.1f} tok/s, tau {_num(r.tau)}")
                workloads[name][str(level)] = summarize_cell(runs, args.tolerance)
                workloads[name][str(level)]["gate_extra_warmups"] = {r: n for r, n in extra.items() if n}
                if auto_extra:            # whole-answer warm-ups the auto row ran while its chooser explored
                    workloads[name][str(level)]["auto_extra_warmups"] = auto_extra
                # the spec gate's cells after this cell (measured rates per arm, samples, drafting or resting):
                # why a gated row drafted or rested, readable from the JSON of any run
                workloads[name][str(level)]["gate"] = {k: v for k, v in engine.stats().items()
                                                       if k.startswith("spec_gate_")}
                if getattr(engine, "spec_gate", None) is not None:   # each gate cell's latest reports, with why
                    workloads[name][str(level)]["gate_recent"] = engine.spec_gate.trace(latest=True)
                for row, gate in own_gates.items():                  # the same for the rows' own gates
                    workloads[name][str(level)].setdefault("gate_recent_by_row", {})[row] = gate.trace(latest=True)
                    methods = getattr(gate, "methods", None)         # the auto row's chooser, every cell so far
                    if methods is not None and methods.cells:
                        workloads[name][str(level)].setdefault("auto_choice_by_row", {})[row] = methods.snapshot()
    finally:
        engine.scheduler.max_num_seqs = most
    profiles.write()
    torch_profiles.write()
    return {"rows": rows, "skipped_rows": skipped, "cut": cut,
            "gate_trace_by_row": {row: gate.trace() for row, gate in own_gates.items()},
            "row_settings": {row: row_fields(row, cap) for row in rows}, "workloads": workloads,
            "summary": summary_across(workloads)}


def run(args: argparse.Namespace, prepare=None, note: dict | None = None) -> int:
    """``prepare``: called with the engine before anything runs (``bench.gate_sim`` prices its work on a
    modeled clock); ``note``: fields the result records beside its own, over them where they share a name
    (``bench.gate_sim``: its command and the modeled costs)."""
    import torch

    if args.cpus is not None:
        pin(args.cpus)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    engine = _engine(args)
    if prepare is not None:
        prepare(engine)
    t0 = time.perf_counter()
    result = {"command": " ".join(["python -m bench speedup", *sys.argv[2:]]), "model": str(args.model),
              **(note or {}),
              "drafters": args.drafters, "concurrency": args.concurrency, "requests": args.requests, "waves": args.waves,
              "queued": args.queued,
              "repeats": args.repeats, "seeds": getattr(args, "seeds", "fixed"), "max_tokens": args.max_tokens,
              "ignore_eos": args.ignore_eos,
              "prompt_mode": PROMPT_MODE, "tolerance": args.tolerance, "gc": args.gc,
              "cpus": None if args.cpus is None else sorted(os.sched_getaffinity(0)),
              # the card: a run that asks for one kind may get another (session 37: an H100 where the runs
              # before were on the H200), and runs of different cards do not pool (bench.speedup_pool)
              "device": run_device(engine.device),
              # the one-launch norms and rotary (the default since session 15): which model path the run timed
              "fused_elementwise": kernels.fused_elementwise(engine.device), **measure(engine, args)}
    # the drafter's context projection from CUDA graphs (session 29; KVSPEC_ABSORB_GRAPHS=0 keeps it eager)
    result["absorb_graphs"] = any(getattr(getattr(p, "rounds", None), "absorbs", None) is not None
                                  for p in engine._proposers.values())
    result["wall_s"] = time.perf_counter() - t0
    if engine.sps is not None:
        result["sps_profile"] = {str(b): s for b, s in engine.sps.to_table().items()}
    if getattr(engine, "spec_gate", None) is not None:
        # each gate cell's first reports (SpecGate.trace): what its exploration and first probes measured
        result["gate_trace"] = engine.spec_gate.trace()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speedup.json").write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    (args.out / "speedup.md").write_text(md)
    print(md)
    return 0
