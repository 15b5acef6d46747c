"""SpecEngine: continuous-batching generation over paged KV leased from kvd. Pure logic: the
server (specd/server.py) owns sockets and threads and calls ``add_request`` / ``step``.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import torch

from kvd import gc_pauses
from kvd.hashing import namespace_root
from specd.engine import compile_count, sampler
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import BlockSource, local_source
from specd.engine.config import SCHEDULES, EngineConfig
from specd.engine.cuda_graphs import speculative_keys
from specd.engine.detokenizer import Detokenizer
from specd.engine.draft_cache import DraftCache
from specd.engine.errors import EngineError
from specd.engine.hints import SessionHints
from specd.engine.kv_layout import KVLayout
from specd.engine.model_runner import ModelRunner
from specd.engine.request import Request, RequestOutput
from specd.engine.block_source import OutOfBlocks
from specd.engine.proposers import load_proposer
from specd.engine.scheduler import ScheduledSeq, Scheduler
from specd.engine.greedy_verify import GreedyVerify
from specd.engine.speculation import METHODS, Draft, MixedVerify, VerifyInputs, prepare_verify, verify_prepared
from specd.engine.gating import GateSteps, confidence_scheduled, gate_key_name
from specd.engine.spec_gate import SpecGate, load_bucket, prompt_class
from specd.engine.spec_scheduler import SpsProfile, calibrate, profile_points, schedule_verify
from specd.engine.sequence import Sequence, SeqStatus
from specd.loader import load_model, resolve_device, resolve_dtype

log = logging.getLogger("specd.engine")

RECONNECT_EVERY_S = 2.0
SPS_CONTEXT_TOKENS = 256     # cached tokens per row of the SPS profile's dummy verify batches
OVERHEAD_EMA = 0.2           # weight of the newest step in the step-overhead average (~5 steps of memory)
# Steps by kind, each with its count, wall time and emitted tokens (``step_<kind>_*_total``): with prompt
# chunks, and some request verifying a draft or none (``prompt_draft``, ``prompt``); pure decode, the same
# (``draft``, ``plain``), with ``capture`` for a no-draft decode step that did drafter work (``step_kind``).
# The gate measures pure decode steps only; these say where the rest of a
# speculative run's time goes (session 13, run AO: scheduled dspark at coding c = 16 lost 15% end to end
# while the gate measured its drafting decode steps 15% ahead).
# Each kind's schedule and forward phases apart too (``step_<kind>_schedule_seconds_total``, ``..._forward_...``):
# on the H100 (session 45, run DW) scheduled dspark's prompt steps on knowledge at c = 32 took 0.2-0.3 ms more
# than `none`'s while it rested throughout, and the whole-run phase averages could not say which phase of
# which kind held it.
STEP_KINDS = ("prompt", "prompt_draft", "draft", "capture", "plain")
# Drafting steps again, split: the first of a drafting phase (the step before drafted for nobody) and the
# others, each with its schedule phase (and, of it, the gate's questions and the proposals) and forward
# phase (the verify pass) apart. Counted beside STEP_KINDS, not in them. Why: at c = 32 on the H200 (session 40, runs DJ, DK, DM)
# the 1-3 drafting steps of a probe took 10-27 ms each against 7-8 ms for a drafting phase's steps, with
# no graph capture in those runs, and the records could not say which part of the step held the excess.
DRAFT_PHASES = ("draft_first", "draft_later")
# A step with at least this many prompt tokens runs ``forward_hook`` while the GPU computes it (the server
# reads requests that arrive meanwhile and warms their cached prefixes in kvd). Why only those: on the 8B
# agentic load (run BV) prompt steps took ~73 ms and decode steps ~7 ms; a request that arrives during a
# decode step waits little for the next one, and decode steps (issue 6's tables) stay exactly as they were.
FORWARD_HOOK_MIN_TOKENS = 256


def step_kind(decode_step: bool, batch: list[ScheduledSeq], drafter_work: bool = False) -> str:
    """The step's kind in ``STEP_KINDS`` (``decode_step``: no sequence has a prompt chunk).

    ``drafter_work``: the step drafted for nobody but did work for the drafter, capturing target features
    (a probe's announcement, resuming or exploring requests, requests that keep drafting while others
    rest) or absorbing features before a rest. Such a step is ``capture``, not ``plain``, so that a
    speculative row's ``plain`` steps compare like for like with ``none``'s. Why: on the H200 (session 17,
    run BD) scheduled dspark's no-draft steps at c = 1 on knowledge took 2.04-2.24 ms against `none`'s
    1.94-2.07 in the same repeats, and the records could not say whether those steps captured."""
    drafted = any(s.draft is not None for s in batch)
    if not decode_step:
        return "prompt_draft" if drafted else "prompt"
    if drafted:
        return "draft"
    return "capture" if drafter_work else "plain"


@dataclass
class SamplingSplit:
    """A step's sequences that sample: plainly (``plan``: their ``sampler.SamplePlan``, None without any)
    or by verifying a draft. Made before the step's forward (``SpecEngine._plan_sampling``)."""

    plain: list[ScheduledSeq]
    spec: list[ScheduledSeq]
    plan: sampler.SamplePlan | None
    verify: VerifyInputs | GreedyVerify | MixedVerify | None     # the verified ones' inputs (None without any)


class SpecEngine(GateSteps):
    def __init__(self, model, tokenizer, config: EngineConfig, source: BlockSource, layout: KVLayout,
                 device: torch.device, model_name: str):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = device
        self.layout = layout
        self.model_name = model_name
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings)
        self.root = namespace_root(
            model.config.fingerprint, tokenizer.name, str(layout.dtype), layout.describe(),
            layout.block_size, "", config.tenant_salt,
        )
        self._stop_ids = frozenset(tokenizer.stop_ids)   # EOS and end-of-turn tokens
        self._seqs: dict[str, Sequence] = {}
        self._pending_outputs: list[RequestOutput] = []
        # called repeatedly while the GPU runs a long prompt step (``_while_forward``); the server sets it to
        # read requests early. It must not touch the engine's state except through ``warm``.
        self.forward_hook: Callable[[], None] | None = None
        self._hook_this_step = False
        self._held_commit: list[Sequence] = []     # the last step's sequences, committed in the next forward
        self._counters = dict(requests_total=0, requests_finished=0, requests_aborted=0, prompt_tokens_total=0,
                              cached_tokens_total=0, tokens_generated_total=0, steps_total=0,
                              schedule_seconds_total=0.0, forward_seconds_total=0.0, output_seconds_total=0.0,
                              commit_seconds_total=0.0, spec_verifications_total=0,
                              spec_drafted_tokens_total=0, spec_accepted_tokens_total=0, spec_paused_steps_total=0,
                              spec_class_explore_steps_total=0, spec_measure_steps_total=0,
                              spec_scheduled_requests_total=0, spec_scheduled_tokens_total=0,
                              admission_seconds_total=0.0,
                              spec_scheduler_seconds_total=0.0, spec_rest_again_steps_total=0,
                              spec_rest_leased_steps_total=0, spec_rest_whole_batch_steps_total=0,
                              spec_rest_span_steps_total=0, spec_rest_unlooked_steps_total=0,
                              spec_promptless_requests_total=0, spec_prompts_captured_anyway_total=0,
                              spec_context_kept_steps_total=0,
                              forward_hook_steps_total=0, forward_hook_calls_total=0, warmed_requests_total=0,
                              **{f"step_{kind}_{what}_total": 0 for kind in STEP_KINDS
                                 for what in ("steps", "seconds", "tokens", "schedule_seconds", "forward_seconds")},
                              **{f"step_{kind}_{what}_total": 0 for kind in DRAFT_PHASES
                                 for what in ("steps", "seconds", "tokens", "schedule_seconds",
                                              "gate_seconds", "propose_seconds", "forward_seconds")})
        self._scheduled_lengths: collections.Counter[int] = collections.Counter()   # ℓ chosen per scheduled draft
        self._proposers: dict = {}
        self._admissions: dict = {}      # speculation settings -> (method, gate key, proposer): ``_admit_speculation``
        self._auto_pending: list[Sequence] = []   # admitted with method auto, its method not chosen yet (``_resolve_auto``)
        self._auto_candidates: tuple[str, ...] | None = None   # the auto methods this deployment serves
        self.sps: SpsProfile | None = None      # SPS(B) of verify steps, measured on first scheduled draft
        self._track_overhead = False            # True once the engine measured self.sps (an injected one is kept as is)
        self._scheduled_step = False            # this step's drafts went through the scheduler
        self.spec_gate: SpecGate | None = SpecGate()   # measured: do scheduled requests draft? None: always
        # greedy drafts verified as the argmax chain (specd/engine/greedy_verify.py); False: through the
        # rejection sampler like sampled ones (the bench's ``*-rejection`` rows measure what it saves)
        self.greedy_chain = True
        compile_count.install()                 # a step that built a Triton kernel is no timing sample
        self._gate_arms: dict[str, bool] = {}   # this step: method -> its scheduled requests drafted
        self._resting: set[int] = set()         # this step: id() of the sequences the gate rests (no features)
        self._resting_keys: set[str] = set()    # this step: gate keys whose every gated request rests
        self._gate_drafting: dict[str, list[Sequence]] = {}   # this step: gate key -> its sequences that draft
        self._gate_capturing: set[str] = set()  # this step: gate keys whose requests did drafter work, no draft
        self._profiled = False                  # this step measured self.sps: its time is no gate sample
        self._rest_absorbed = False             # a rest this step ran the drafter (absorb): no gate sample
        self._decode_step = False               # this step: every sequence decodes one token (set by step)
        self._drafted_last = False              # the last step drafted (``DRAFT_PHASES``)
        self._gate_s = self._propose_s = 0.0    # this step's gate questions and proposals, seconds
        self._rest_chain = None                 # the last step rested a whole gated group (gating.RestChain)
        self._lease_step = None                 # this step rests on that chain's lease (``GateSteps._fold``)
        self._lookup_chain = None               # a cheap proposer's gate key rests unlooked on a lease (gating.RestChain)
        self._lookup_step = None                # this step rests on that lease (``GateSteps._cheap_unlooked``)
        self._whole_rest = False                # this step: the lease rests the whole batch (``_rests_whole_batch``)
        self._span_step = None                  # this step rests in that span; bookkept after launch (``_span_books``)
        self._span_observe = None               # this step is that span's leased rest (``_observe_span``)
        self._span_sample = None                # a span step's plain sample, for its lease's samples (``_observe_span``)
        self.rest_spans = True                  # whole-batch leases may span prompt steps and admissions (``_span_rests``)
        self.fuse_early = True                  # captured features fused in the forward's shadow (``_fuse_features``)
        self._last_reconnect_s = 0.0
        self.hints = SessionHints(layout.block_size)
        self._attach(source)
        if self.runner.graphs is not None:
            sampler.warm(self.device, self.model.config.vocab_size)
        if self._warming():
            for method in dict.fromkeys([config.speculation, *config.drafters]):
                if method == "auto":
                    self.auto_candidates()
                elif method != "none":
                    self._proposer(method)
        self._gc = gc_pauses.pauses()       # the collector's passes, in stats(): the process owner may freeze

    def _attach(self, source: BlockSource) -> None:
        self.source = source
        self.drafts = DraftCache(source, self.layout.block_size, attrgetter("method"))   # drafter context K/V in kvd
        for method, proposer in self._proposers.items():
            self.drafts.offer(method, proposer)
        if self.layout.hybrid:       # sliding-window layers: a cache group per kind (specd/engine/group_backend.py)
            from specd.engine.group_backend import hybrid_engine_parts
            self.blocks, self.scheduler, self.runner = hybrid_engine_parts(self, source)
            return
        self.blocks = BlockManager(source, self.layout.block_size, self.root)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   prefill_order=self.config.prefill_order, starve_s=self.config.prefill_starve_s)
        self.runner = ModelRunner(self.model, self.layout, source.pool, self.device,
                                  max_batch=self.config.max_num_seqs, max_model_len=self.max_model_len,
                                  cuda_graphs=self.config.cuda_graphs,
                                  max_num_batched_tokens=self.config.max_num_batched_tokens,
                                  num_speculative_tokens=self.config.num_speculative_tokens)
        if self._warming() and self._proposers:       # a fresh runner (kvd reattached): its graphs are new
            self.runner.warm(self.speculative_graph_keys())

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> "SpecEngine":
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        model, tokenizer = load_model(config.model, dtype=dtype, device=device)
        mc = model.config
        layout = KVLayout(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, dtype, mc.layer_windows)
        source = cls._make_source(config, layout, device)
        return cls(model, tokenizer, config, source, layout, device, model_name=config.model.name)

    @staticmethod
    def _make_source(config: EngineConfig, layout: KVLayout, device: torch.device) -> BlockSource:
        if config.kvd_run_dir is not None:
            from specd.engine.kvd_source import KvdBlockSource, KvdUnavailable

            try:
                return KvdBlockSource.connect(config.kvd_run_dir, layout, device)
            except KvdUnavailable as exc:
                log.warning("kvd unavailable (%s): serving without the shared cache", exc)
        return local_source(config.num_local_blocks, layout, device)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise EngineError("empty_prompt", "the prompt has no tokens")
        if n >= self.max_model_len:
            raise EngineError("prompt_too_long",
                              f"prompt has {n} tokens; the context is {self.max_model_len} (one is needed to answer)")
        if request.id in self._seqs:
            raise EngineError("duplicate_id", f"request id {request.id!r} is already running")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_ids):
            raise EngineError("bad_request", f"token ids must be in [0, {vocab})")
        method, gate_key = self._admit_speculation(request)
        if not request.arrival_s:
            request.arrival_s = time.monotonic()
        gen = None
        if request.params.seed is not None:
            gen = torch.Generator().manual_seed(request.params.seed)
        seq = Sequence(request, Detokenizer(self.tokenizer.decode, request.params.stop), gen)
        self._seqs[request.id] = seq
        self.scheduler.add(seq)
        if method == "auto":
            self._auto_pending.append(seq)      # runs as `none` until its first step chooses (``_resolve_auto``)
        else:
            self._assign_method(seq, method, gate_key)
        self._counters["requests_total"] += 1
        self._counters["prompt_tokens_total"] += n

    def _assign_method(self, seq: Sequence, method: str, gate_key: str | None, measures: bool = False) -> None:
        """Fix a queued request's method and gate key for its whole life, with its gate record (``measures``:
        an auto request that drafts at every step to measure its method, ``Choice.drafts``, so it must be
        marked before a rest span weighs it)."""
        seq.method, seq.gate_key = method, gate_key
        if seq.gate_key is not None and self.spec_gate is not None:
            seq.gate_acceptance = self.spec_gate.record(seq.gate_key, seq.request.prompt_ids)
        seq.gate_acceptance.measures = measures
        if self._rest_chain is not None and self._rest_chain.span:
            self._join_span(seq)            # a rest span covers the requests that join its bound (gating.py)

    def auto_candidates(self) -> tuple[str, ...]:
        """The methods an auto request chooses among: the deployment's ``auto_methods`` that it can serve
        (a trained method without a drafter is left out), loaded. EngineError when none can be."""
        if self._auto_candidates is None:
            served = []
            for method in self.config.auto_methods.split(","):
                try:
                    self._proposer(method)
                except EngineError as exc:
                    log.info("auto speculation leaves out %s: %s", method, exc)
                    continue
                served.append(method)
            if not served:
                raise EngineError("bad_request", f"speculation 'auto' has no method it can serve among "
                                                 f"{self.config.auto_methods!r}")
            self._auto_candidates = tuple(served)
        return self._auto_candidates

    def auto_gate_keys(self) -> tuple[str, ...]:
        """The spec gate keys an auto request may run under: each candidate's with its auto schedule (a
        benchmark warms those cells before timing an auto row, ``bench.speedup.finish_exploring``)."""
        return tuple(gate_key_name(m, self._auto_schedule(m)) for m in self.auto_candidates())

    def _auto_schedule(self, method: str) -> str:
        """An auto request's schedule: the confidence schedule where the drafter has a confidence head, else
        gated (fixed γ where the measured gate finds drafting faster). Both rest where drafting loses."""
        return "confidence" if self._gated(self._proposer(method), "confidence") else "gated"

    def _resolve_auto(self) -> None:
        """Choose the method of each request admitted with method auto (``SpecGate.methods``), at the top of
        the step that first schedules it. Why not at admission: in a closed loop the requests that finished
        in one step are replaced one by one, and a burst of arrivals is added one at a time, so the load at
        admission understates the load the request runs at (c = 32's first wave would be spread over buckets
        1 to 16). Here every request admitted since the last step counts. The choice is the request's own
        settings from then on (its ``speculation`` and ``spec_schedule``), so every later step reads it as a
        request that asked for that method."""
        pending, self._auto_pending = self._auto_pending, []
        pending = [seq for seq in pending if seq.status is not SeqStatus.FINISHED]
        if not pending:
            return
        candidates = self.auto_candidates()
        bucket = load_bucket(len(self._seqs))
        chooser = self.spec_gate.methods if self.spec_gate is not None else None
        for seq in pending:
            req = seq.request
            cls = prompt_class(req.prompt_ids)
            choice = chooser.choose(cls, bucket, candidates) if chooser is not None else None
            method = candidates[0] if choice is None else choice.method
            req.speculation, req.spec_schedule = method, self._auto_schedule(method)
            # kept per settings there; a rest span let it in as a `none` request at admission, and weighs it
            # again here as what it now is (``_join_span``): a measuring request ends the span
            self._assign_method(seq, method, self._admit_speculation(req)[1],
                                measures=choice is not None and choice.drafts)
            seq.auto_choice = (chooser, cls, bucket, choice is not None and choice.measures)

    def warm(self, prompt_ids: list[int]) -> bool:
        """Prefetch on arrival: have kvd start promoting the prompt's cached prefix now, before the request
        is added (the server calls this from ``forward_hook`` for requests that arrive while a forward runs).
        Touches no request or scheduler state, so it is safe in the middle of a step; never raises (a bad
        prompt is refused later by ``add_request``). Returns whether kvd was asked."""
        try:
            asked = self.blocks.warm(prompt_ids)
        except Exception:       # advice only: the lookup at admission decides what is read
            log.debug("warm failed", exc_info=True)
            return False
        self._counters["warmed_requests_total"] += bool(asked)
        return asked

    def _admit_speculation(self, request: Request) -> tuple[str, str | None]:
        """The request's method and gate key (``_gate_key_for``) once its speculation settings pass
        ``_check_speculation``; EngineError where they do not. Both depend only on those settings, the
        deployment's config and the method's proposer, so the answer is kept per settings while the engine
        holds the same proposer (a test may swap one in). Why: asked in full, the two cost ~12 µs an
        admission for dspark against ~3 for `none` on the CPU probe at c = 32 (tests/engine/closed_loop_probe.py),
        where a request finishes and another is admitted every step or two."""
        gamma = request.num_speculative_tokens
        key = (request.speculation, request.spec_schedule, type(gamma), gamma)   # True == 1 == 1.0: the type too
        try:
            kept = self._admissions.get(key)
        except TypeError:            # an unhashable setting: the full check refuses it
            kept = key = None
        if kept is not None and self._proposers.get(kept[0]) is kept[2]:
            return kept[0], kept[1]
        self._check_speculation(request)
        method = request.speculation or self.config.speculation
        gate_key = None if method == "auto" else self._gate_key_for(method, request)
        if key is not None:
            self._admissions[key] = (method, gate_key, self._proposers.get(method))
        return method, gate_key

    def _check_speculation(self, request: Request) -> None:
        """Refuse a bad per-request speculation setting here, not mid-step: an unknown method, a missing
        drafter, a schedule or γ without speculation, γ past the drafter's block, or the confidence
        schedule on a drafter without a confidence head."""
        method = request.speculation or self.config.speculation
        schedule, gamma = request.spec_schedule, request.num_speculative_tokens
        if schedule is not None and schedule not in SCHEDULES:
            raise EngineError("bad_request", f"unknown speculation schedule {schedule!r} (have {', '.join(SCHEDULES)})")
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
            raise EngineError("bad_request", f"num_speculative_tokens must be a positive integer, got {gamma!r}")
        if method == "none":
            if schedule is not None or gamma is not None:
                raise EngineError("bad_request", "a speculation schedule or num_speculative_tokens needs a "
                                                 "speculation method other than 'none'")
            return
        if method == "auto":
            if schedule is not None or gamma is not None:
                raise EngineError("bad_request", "speculation 'auto' picks the method and its schedule: leave "
                                                 "the schedule and num_speculative_tokens unset")
            self.auto_candidates()
            return
        proposer = self._proposer(method)
        most = self.max_draft_tokens(method)
        if gamma is not None and gamma > most:
            raise EngineError("bad_request", f"num_speculative_tokens={gamma} exceeds what the {method} "
                                             f"drafter proposes per step ({most})")
        if schedule == "confidence" and not getattr(proposer, "has_confidence", True):
            raise EngineError("bad_request", f"the confidence schedule needs a drafter with a confidence head; "
                                             f"{method} has none")

    def max_draft_tokens(self, method: str) -> int:
        """The longest draft ``method`` proposes per step (its drafter's block; the engine's γ for a
        proposer that does not say). Loads the proposer; EngineError when the method cannot be served."""
        return getattr(self._proposer(method), "max_tokens", None) or self.config.num_speculative_tokens

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")
        self._counters["requests_aborted"] += 1

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    def release_idle(self) -> bool:
        """Give the block reserve back to kvd when no request is left (the server calls this once its
        idle poll times out). Not at the instant the last request finishes: in a closed loop the next
        requests come right after, and each admission step then allocated blocking again (session 10,
        tests/kvd/reserve_probe.py: 3 releases of 100-117 blocks for 24 requests, and the allocates they
        caused). Returns whether anything was held."""
        if self.scheduler.has_work():
            return False
        self._fold(self._rest_chain)     # idle: a rest span kept over its emptied batch (``_keeps_span``) ends
        self._end_lookup()
        return self.blocks.release_reserve()

    def only_parked(self) -> bool:
        """Nothing to run until a kvd promotion lands (the server then waits instead of spinning)."""
        return self.scheduler.only_parked() and not self._pending_outputs

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._maybe_reconnect()
        if self._auto_pending:
            self._resolve_auto()
        self.drafts.settle()
        cold = self._cold_events()
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self._counters["admission_seconds_total"] += time.perf_counter() - t0
        outputs, self._pending_outputs = self._pending_outputs, []
        if not batch:
            self._commit_held()
            self._fail_unschedulable(outputs)
            self._fold(self._rest_chain)     # idle: the gate takes a lease's last steps now, not at the next rest
            self._end_lookup()
            return outputs
        self._decode_step = self._pure_decode(batch)     # asked by the gate three times a step (gating.py)
        self._hook_this_step = self.forward_hook is not None and not self._decode_step and sum(
            s.num_tokens for s in batch if not s.decodes) >= FORWARD_HOOK_MIN_TOKENS
        self._add_drafts(batch)
        self._rest_prompts(batch)
        capture = self._capture_layers(batch)
        self.blocks.settle()         # answers that have come (commits: table switches) and any the forward needs (refills)
        self.blocks.refill_ahead(self.scheduler.expected_blocks())   # posted: kvd answers during the forward
        plan = self._plan_sampling(batch)        # uploaded before the forward: its launches queue behind it
        t1 = time.perf_counter()
        logits, captured = self.runner.run(batch, capture)
        fused = self._fuse_features(batch, capture, captured) if captured is not None and self.fuse_early else None
        self._span_books()           # a rest span's step: its bookkeeping, while the GPU runs the forward
        tc = time.perf_counter()
        self._commit_held()          # the last step's full blocks, while the GPU runs this forward
        self.blocks.drain_in_forward()   # and kvd's answers that have come (duplicates' slots: after it)
        committing = time.perf_counter() - tc
        emitted = self._sample(logits, plan)
        t2 = time.perf_counter()
        self.source.observe_prefill(sum(s.num_tokens for s in batch), t2 - t1 - committing)   # kvd's prefetch budget
        now = time.monotonic()
        for sched in batch:          # prompt chunks that do not sample yet (``samples`` reads the old count)
            if not sched.samples:
                sched.seq.num_computed_tokens += sched.num_tokens
        valid = {id(sched): sched.num_tokens for sched in batch}
        for sched, toks in emitted:
            # KV is valid for the scheduled tokens and the accepted drafts; the last emitted token is pending
            valid[id(sched)] += len(toks) - 1 if sched.draft else 0
            sched.seq.num_computed_tokens += valid[id(sched)]
        t3 = time.perf_counter()
        self._held_commit = [s.seq for s in batch]      # committed in the next step's forward (``_commit_held``)
        t4 = time.perf_counter()
        if fused:
            self._keep_features(batch, fused, valid)
        elif captured is not None and not self.fuse_early:
            self._keep_features_late(batch, capture, captured, valid)
        self._count_batch(batch, emitted)
        with self.blocks.posting():  # the finished sequences' releases: one frame
            self.blocks.after_forward()      # the forward is over: duplicates' slots drained in it go back
            for sched, toks in emitted:
                outputs.append(self._emit(sched.seq, toks, now))
        t5 = time.perf_counter()
        self.drafts.publish([s.seq for s in batch])
        t6 = time.perf_counter()
        c = self._counters
        c["steps_total"] += 1
        c["schedule_seconds_total"] += t1 - t0          # includes kvd lookups, allocations and drafting
        c["forward_seconds_total"] += t2 - t1 - committing    # model + sampling/verification, synchronised by .tolist()
        c["output_seconds_total"] += (t3 - t2) + (t5 - t4)      # detokenize, stop checks, finishing
        # publishing full blocks to kvd (target: the last step's, inside this forward; draft)
        c["commit_seconds_total"] += committing + (t4 - t3) + (t6 - t5)
        kind = step_kind(self._decode_step, batch, bool(capture) or self._rest_absorbed)
        c[f"step_{kind}_steps_total"] += 1
        c[f"step_{kind}_seconds_total"] += t6 - t0
        n_emitted = sum(len(toks) for _, toks in emitted)
        c[f"step_{kind}_tokens_total"] += n_emitted
        c[f"step_{kind}_schedule_seconds_total"] += t1 - t0       # the phases of each kind (``STEP_KINDS``)
        c[f"step_{kind}_forward_seconds_total"] += t2 - t1 - committing
        if kind == "draft":
            phase = "draft_later" if self._drafted_last else "draft_first"
            c[f"step_{phase}_steps_total"] += 1
            c[f"step_{phase}_seconds_total"] += t6 - t0
            c[f"step_{phase}_tokens_total"] += n_emitted
            c[f"step_{phase}_schedule_seconds_total"] += t1 - t0
            c[f"step_{phase}_gate_seconds_total"] += self._gate_s          # parts of the schedule phase
            c[f"step_{phase}_propose_seconds_total"] += self._propose_s
            c[f"step_{phase}_forward_seconds_total"] += t2 - t1 - committing
        self._drafted_last = kind in ("draft", "prompt_draft")
        # A step that captured a CUDA graph (target step, draft round or block forward) or built a Triton
        # kernel lasted ~100 ms-seconds once: no sample of what a step costs. Session 8, run U: dspark's
        # b = 1 drafting cell held 5 warm-up samples at 66 tok/s against 296 plain, so the gate rested it
        # (and probed every 1,024 steps) where fixed γ = 7 ran 1.54x on extraction.
        timed = self._cold_events() == cold
        if self._scheduled_step:
            self._update_overhead(batch, t6 - t0, timed)
        self._observe_gate(batch, {id(s.seq): len(toks) for s, toks in emitted}, t6 - t0, timed)
        if not self.scheduler.running:
            self._keeps_span()       # the batch is gone: the gate's stats hold every step of it
            self._end_lookup()
        return outputs

    def _count_batch(self, batch, emitted) -> None:
        """For each auto request that emitted this step: the step, the share of the batch on its own method and
        the batch's size. Why: its method chooser rates a method by its requests' decode rate, and a request
        in a batch mostly of the other method decodes at a step time the other method shaped (sessions 57-59,
        H100: at c >= 16 the chooser's rate of a cell's losing method was 0.82x that method's own row,
        ``python -m bench.mix_rates``); ``EpochChoice`` learns only from requests that ran in batches of
        their own method at the load they were chosen for."""
        autos = [sched.seq for sched, _ in emitted if sched.seq.auto_choice is not None]
        if not autos:
            return
        methods = collections.Counter(sched.seq.method for sched in batch)
        n = len(batch)
        for seq in autos:
            seq.batch_steps += 1
            seq.batch_own += methods[seq.method] / n
            seq.batch_size_sum += n

    def _cold_events(self) -> int:
        """One-off work so far that makes a step no timing sample: CUDA graph captures and Triton compiles."""
        return self._graph_captures() + compile_count.compiles()

    def _graph_captures(self) -> int:
        """CUDA graphs captured so far, target and drafters (0 without graphs: on the CPU)."""
        return self.runner.graph_captures + self._draft_captures()

    def _draft_captures(self) -> int:
        """Draft-round and block-forward graphs captured so far, over every proposer."""
        return sum(getattr(p, "round_captures", 0) for p in self._proposers.values())

    def _commit_held(self) -> None:
        """Publish the previous step's newly full, computed blocks, in one frame to kvd. Called between
        launching this step's forward and waiting for it (``_sample``), so on the GPU the commit's CPU work
        (hash extension, the frame) runs under the forward instead of after it. In the 0%-hit run BO the
        step-end commit took 0.31 s against standard's 0.10 s, ~0.7% of the run (docs/design/kvd.md,
        "Cost at a 0% hit rate").
        Exact: ``commit_step`` reads each sequence's state now, a full computed block is never written
        again, and this forward writes only positions past ``num_computed_tokens``, which is not advanced
        until ``_sample`` returns. A finished sequence committed on its way out (``_finish``, before its
        release); an empty step commits too. The cost: another request's lookup sees these blocks a step
        later, and a sequence preempted meanwhile leaves its last step's full block uncommitted (recomputed
        if it comes back)."""
        held, self._held_commit = self._held_commit, []
        with self.blocks.posting():
            self.blocks.refresh_roots()      # when due: in the same frame (a send of its own cost ~0.06 ms a step)
            if held:
                self.blocks.commit_step([seq for seq in held if seq.status is SeqStatus.RUNNING])

    def _update_overhead(self, batch: list[ScheduledSeq], seconds: float, timed: bool = True) -> None:
        """Fold this step's time outside the profiled target forward into the profile (moving average);
        not a step that captured a graph (``timed`` False).

        Lossless: it reads finished steps only, never this step's drafts."""
        self._scheduled_step = False
        if not self._track_overhead or not timed:
            return
        tokens = sum(s.num_tokens + s.num_draft for s in batch)
        sample = seconds - 1.0 / self.sps.forward_sps(tokens)
        self.sps = self.sps.with_overhead((1 - OVERHEAD_EMA) * self.sps.overhead_s + OVERHEAD_EMA * sample)

    # -- speculation -----------------------------------------------------------------------
    def _add_drafts(self, batch: list[ScheduledSeq]) -> None:
        """Attach a draft to every decoding sequence that speculates: one batched proposal per method.
        Within a method, the requests on the confidence schedule go through the scheduler together;
        the fixed ones keep their γ drafts. A rest lease over the whole batch returns before any walk
        over it (``_rests_whole_batch``)."""
        self._whole_rest = False     # set per step, here, so no step inherits it (``_feature_proposers``)
        self._span_step = self._span_observe = None   # nor a span's bookkeeping from a step that never launched
        self._lookup_step = None                       # nor a lookup lease's step (``_cheap_unlooked``)
        self._gate_s = self._propose_s = 0.0           # this step's gate questions and proposals (``DRAFT_PHASES``)
        if self._span_rests(batch) or self._decode_step and self._rests_whole_batch(batch):
            return
        by_method: dict[str, list[ScheduledSeq]] = {}
        # a pure decode step (``_decode_step``, asked once a step) needs no per-sequence ``decodes``: at c = 32
        # that walk and a second method lookup per sequence were half this method's ~11 µs a step for
        # `none` on the CPU machine (tests/engine/gate_cost_probe.py)
        for sched in batch if self._decode_step else [s for s in batch if s.decodes]:
            method = sched.seq.method
            if method != "none":
                by_method.setdefault(method, []).append(sched)
        for method, group in by_method.items():
            proposer = self._proposer(method)
            cheap = getattr(proposer, "proposes_cheaply", False)
            if cheap:
                group = (self._cheap_unlooked(batch, group) if self._decode_step
                         else self._cheap_beside_prompts(batch, group))
                if not group:
                    continue
            if not cheap:
                t0 = time.perf_counter()
                group = self._gate_group(batch, group)
                self._gate_s += time.perf_counter() - t0
                if not group:
                    continue
            limits = [self._draft_limit(s.seq) for s in group]
            if not cheap:
                self._drop_undrafted(proposer, group, limits)
            t0 = time.perf_counter()
            drafts = proposer.propose([s.seq for s in group], limits)
            self._propose_s += time.perf_counter() - t0
            if cheap:
                drafts = self._gate_found(batch, group, drafts)
            chosen = [i for i, (s, d) in enumerate(zip(group, drafts))
                      if d.confidence is not None and self._wants_confidence(s.seq)]
            if chosen:
                t0 = time.perf_counter()
                scheduled = self._schedule(batch, [group[i] for i in chosen], [drafts[i] for i in chosen],
                                           getattr(proposer, "temperatures", None))
                for i, draft in zip(chosen, scheduled):
                    drafts[i] = draft
                self._counters["spec_scheduler_seconds_total"] += time.perf_counter() - t0
            for sched, draft in zip(group, drafts):
                if draft.tokens and self._room_for(sched.seq, 1 + len(draft.tokens)):
                    sched.draft = draft

    def _schedule_of(self, request: Request) -> str | None:
        """The request's schedule, else the deployment's (None: unset)."""
        return request.spec_schedule or self.config.spec_schedule

    def _wants_confidence(self, seq: Sequence) -> bool:
        """Unset means confidence wherever the drafts carry confidences (the caller checks that)."""
        return confidence_scheduled(self._schedule_of(seq.request))

    def _schedule(self, batch: list[ScheduledSeq], group: list[ScheduledSeq], drafts: list[Draft],
                  temperatures: list[float] | None) -> list[Draft]:
        """Truncate each draft to the length the causal scheduler gives it (specd/engine/spec_scheduler.py);
        the rest of the step (prompt chunks, decoders of other methods) counts in B and τ as it is."""
        mine = {id(s) for s in group}
        others = [s for s in batch if id(s) not in mine]
        conf = [calibrate(d.confidence or [], temperatures) for d in drafts]
        fresh = self.sps is None                 # this step measures the profile: its time is no overhead sample
        lengths = schedule_verify(conf, self._sps(), other_tokens=sum(s.num_tokens for s in others),
                                  other_emitted=sum(s.samples for s in others))
        self._scheduled_step = not fresh
        self._counters["spec_scheduled_requests_total"] += len(drafts)
        self._counters["spec_scheduled_tokens_total"] += sum(lengths)
        self._scheduled_lengths.update(lengths)
        return [d.truncated(k) for d, k in zip(drafts, lengths)]

    def _sps(self) -> SpsProfile:
        """Measured once, on the first scheduled step, on dummy verify batches up to the largest step."""
        if self.sps is None:
            gamma = self.config.num_speculative_tokens
            most = self.config.max_num_batched_tokens + self.config.max_num_seqs * gamma
            forward = self.runner.dummy_verify_forward(
                gamma, context=min(SPS_CONTEXT_TOKENS, self.max_model_len - gamma - 1))
            sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
            self.sps = SpsProfile.measure(forward, profile_points(most), sync=sync)
            self._track_overhead = self._profiled = True
            log.info("verify steps/s by batch tokens: %s", {b: round(s, 1) for b, s in self.sps.to_table().items()})
        return self.sps

    def _feature_proposers(self, batch: list[ScheduledSeq]) -> dict:
        """The proposers that read target features, for the methods of this batch's sequences that do
        not rest this step."""
        if self._whole_rest:         # every sequence of the batch rests on the lease: nothing captures
            return {}
        found = {}
        # a sequence rests if marked one by one (``_rest``) or with its whole gate key (``_resting_keys``,
        # a steady rest); the test is spelled out here, in ``_fuse_features`` and in ``_keep_features``: a
        # helper call per sequence cost ~4 µs a resting step at c = 32 on the CPU machine, the kind of cost
        # the steady rest removes
        for sched in batch:
            method = sched.seq.method
            if (method not in ("none", "ngram") and method not in found and id(sched.seq) not in self._resting
                    and sched.seq.gate_key not in self._resting_keys):
                found[method] = self._proposer(method)
        return found

    def _capture_layers(self, batch: list[ScheduledSeq]) -> tuple[int, ...]:
        layers = {layer for p in self._feature_proposers(batch).values() for layer in p.capture_layers}
        return tuple(sorted(layers))

    def _fuse_features(self, batch, capture, captured) -> dict:
        """Launch each feature proposer's fuse over the step's captured rows, right after the forward's launch:
        method -> (fused [rows, d], first row). The rows span the first to the last row of the sequences
        that capture for it; ``_keep_features`` takes each one's accepted rows as views once the step's
        tokens are known. The fuse is row-wise (concatenation, projection, norm), so a row's value does not
        depend on which other rows are fused beside it, up to the projection's kernel choice by row count.

        Why before the step's sync, not after it (the reference below, ``_keep_features_late``): on the H100 (session
        47, run FA, coding c = 1) a step that captured features for no draft took 2.27 ms against a plain
        step's 2.04, ~0.18 ms of it after the forward: an index upload, three row selections, the fuse and a
        concatenation per sequence, each a launch the GPU waited for. Launched here, the host issues them
        while the GPU runs the forward; after the sync only views are taken. ``fuse_early`` off runs the
        reference instead."""
        proposers = self._feature_proposers(batch)
        spans: dict[str, list[int]] = {}
        row = 0
        for sched in batch:
            method = sched.seq.method
            end = row + sched.num_tokens + sched.num_draft
            if (method in proposers and id(sched.seq) not in self._resting
                    and sched.seq.gate_key not in self._resting_keys):
                span = spans.get(method)
                if span is None:
                    spans[method] = [row, end]
                else:
                    span[1] = end
            row = end
        return {method: (proposers[method].fuse([captured[capture.index(layer)][lo:hi]
                                                 for layer in proposers[method].capture_layers]), lo)
                for method, (lo, hi) in spans.items()}

    def _keep_features(self, batch, fused: dict, valid) -> None:
        """Append the fused features of each feature-drafting sequence's newly computed tokens: its valid
        rows of the step's fused features (``_fuse_features``), as a view. A sequence with no pending
        features (None, or none left after its drafter absorbed them) takes the view itself; one with
        pending features (a prompt in chunks, a rest that keeps capturing) gets them concatenated."""
        row = 0
        for sched in batch:
            seq = sched.seq
            got = fused.get(seq.method)
            if (got is not None and seq.status is not SeqStatus.FINISHED
                    and id(seq) not in self._resting and seq.gate_key not in self._resting_keys):
                rows, first = got
                feats = rows[row - first:row - first + valid[id(sched)]]
                old = seq.draft_feats
                if old is None and seq.draft_ctx is not None:       # the first features after a rest
                    self._stitch(seq, seq.num_computed_tokens - len(feats))
                seq.draft_feats = feats if old is None or not len(old) else torch.cat([old, feats])
            row += sched.num_tokens + sched.num_draft

    def _keep_features_late(self, batch, capture, captured, valid) -> None:
        """The reference for ``_fuse_features`` + ``_keep_features``, and the path until session 48: after the
        step's sync, each proposer's fuse of exactly its sequences' valid rows (an index upload and a row
        selection per layer), split per sequence and concatenated to its pending features. Runs where
        ``fuse_early`` is off (``bench speedup``'s dspark-fuse-late row; the tests compare the two)."""
        proposers = self._feature_proposers(batch)
        rows: dict[str, list[int]] = {}                      # method -> captured rows to fuse, batch order
        owners: dict[str, list[tuple[Sequence, int]]] = {}   # method -> (sequence, its row count)
        row = 0
        for sched in batch:
            method = sched.seq.method
            if (method in proposers and sched.seq.status is not SeqStatus.FINISHED
                    and id(sched.seq) not in self._resting and sched.seq.gate_key not in self._resting_keys):
                rows.setdefault(method, []).extend(range(row, row + valid[id(sched)]))
                owners.setdefault(method, []).append((sched.seq, valid[id(sched)]))
            row += sched.num_tokens + sched.num_draft
        for method, picked in rows.items():
            proposer = proposers[method]
            idx = torch.tensor(picked, dtype=torch.int64, device=captured[0].device)
            fused = proposer.fuse([captured[capture.index(layer)].index_select(0, idx)
                                   for layer in proposer.capture_layers])
            for seq, feats in zip((s for s, _ in owners[method]), fused.split([n for _, n in owners[method]])):
                old = seq.draft_feats
                if old is None and seq.draft_ctx is not None:       # the first features after a rest
                    self._stitch(seq, seq.num_computed_tokens - len(feats))
                seq.draft_feats = feats if old is None else torch.cat([old, feats])

    def _draft_limit(self, seq: Sequence) -> int:
        """Never draft past max_tokens or the context: every draft token may be emitted."""
        left = min(seq.request.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)
        gamma = seq.request.num_speculative_tokens or self.config.num_speculative_tokens
        return max(0, min(gamma, left - 1))

    def _room_for(self, seq: Sequence, tokens: int) -> bool:
        try:
            self.blocks.ensure_slots(seq, tokens)
            return True
        except OutOfBlocks:
            return False

    def _proposer(self, method: str):
        if method not in self._proposers:
            if method not in METHODS or method == "none":
                raise EngineError("bad_request", f"unknown speculation method {method!r} (have {', '.join(METHODS)})")
            self._proposers[method] = load_proposer(method, self.config, self.model)
            self.drafts.offer(method, self._proposers[method])
            if self._warming():
                self._warm(method)
        return self._proposers[method]

    # -- CUDA-graph warm-up ------------------------------------------------------------------
    def _warming(self) -> bool:
        return self.config.spec_warmup and self.runner.graphs is not None

    def _warm_gamma(self, proposer) -> int:
        """The longest draft a request on the deployment's γ verifies with this proposer."""
        return min(getattr(proposer, "max_tokens", None) or self.config.num_speculative_tokens,
                   self.config.num_speculative_tokens)

    def speculative_graph_keys(self) -> list:
        """The target step shapes the loaded proposers can produce beyond plain decoding
        (cuda_graphs.speculative_keys); computed with or without a GPU."""
        methods = [(tuple(getattr(p, "capture_layers", ())), self._warm_gamma(p)) for p in self._proposers.values()]
        return speculative_keys(self.runner.max_batch, self.runner.max_tokens, methods)

    def _warm(self, method: str) -> None:
        """Capture, when ``method`` loads, every step and draft-round shape it adds: a capture costs
        ~100 ms on the H200, longer than a timed run at low load, so none may happen on a request's path."""
        t0 = time.perf_counter()
        proposer = self._proposers[method]
        before = self.runner.graph_captures
        self.runner.warm(self.speculative_graph_keys())
        if getattr(proposer, "has_confidence", False) and self.sps is None:
            self._sps()     # the scheduler's SPS profile runs verify shapes of its own: measured (and captured) now
        rounds = getattr(proposer, "warm_rounds", lambda: 0)()
        log.info("speculation warm-up for %s: %d target step graphs and %d draft-round graphs captured in %.2f s",
                 method, self.runner.graph_captures - before, rounds, time.perf_counter() - t0)

    def graph_stats(self) -> dict[str, int]:
        """CUDA graphs captured and Triton kernels built so far (warm-ups included: a timed window reads the
        difference), and steps no graph covered."""
        return {"graph_captures_total": self._graph_captures(),
                "draft_graph_captures_total": self._draft_captures(),
                "triton_compiles_total": compile_count.compiles(),
                "eager_steps_total": self.runner.eager_steps}

    def _plan_sampling(self, batch: list[ScheduledSeq]) -> SamplingSplit:
        """The step's sampling split, known before its forward: the sequences that sample plainly (with
        their ``sampler.SamplePlan``, uploaded now) and those whose drafts are verified."""
        plain, spec, plain_rows, spec_rows, row = [], [], [], [], 0     # *_rows: each one's first logits row
        for sched in batch:
            if not sched.samples:
                continue
            if sched.draft:
                spec.append(sched)
                spec_rows.append(row)
            else:
                plain.append(sched)
                plain_rows.append(row)
            row += sched.num_draft + 1
        vocab = self.model.config.vocab_size
        # plain rows draw their uniforms first, then the verified ones: the order sampling after the
        # forward drew them in (it matters for requests without a seed, which share the global generator)
        plan = sampler.SamplePlan.of(plain_rows, [s.seq.request.params for s in plain],
                                     [s.seq.generator for s in plain], vocab, self.device) if plain else None
        inputs = prepare_verify(spec_rows, [s.draft for s in spec], [s.seq.request.params for s in spec],
                                [s.seq.generator for s in spec], vocab, self.device,
                                greedy_chain=self.greedy_chain) if spec else None
        return SamplingSplit(plain, spec, plan, inputs)

    def _sample(self, logits, split: SamplingSplit) -> list[tuple[ScheduledSeq, list[int]]]:
        """Split the logits rows: plain sampling for most, chain verification for drafted sequences."""
        plain, spec = split.plain, split.spec
        out: list[tuple[ScheduledSeq, list[int]]] = []
        if plain:
            sampled = sampler.sample_planned(logits, split.plan)
            self._while_forward()
            toks = sampled.tolist()
            out += [(s, [t]) for s, t in zip(plain, toks)]
        if spec:
            chains = verify_prepared(logits, split.verify)
            for s, toks in zip(spec, chains):
                s.seq.spec_verifications += 1
                s.seq.spec_drafted += s.num_draft
                s.seq.spec_accepted += len(toks) - 1
                self._counters["spec_verifications_total"] += 1
                self._counters["spec_drafted_tokens_total"] += s.num_draft
                self._counters["spec_accepted_tokens_total"] += len(toks) - 1
            out += list(zip(spec, chains))
        return out

    def _while_forward(self) -> None:
        """While the GPU runs this step's launched work, call ``forward_hook`` again and again (a long prompt
        step only: ``FORWARD_HOOK_MIN_TOKENS``), so requests that arrive meanwhile are read and warmed then
        rather than after the step. On the CPU the forward has already run: the hook is called once."""
        if not self._hook_this_step:
            return
        hook = self.forward_hook
        self._counters["forward_hook_steps_total"] += 1
        calls = 0
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            while not done.query():
                hook()
                calls += 1
        else:
            hook()
            calls = 1
        self._counters["forward_hook_calls_total"] += calls

    def _maybe_reconnect(self) -> None:
        """(Re-)attach to kvd after an outage or a start without it, at a moment when no sequence
        holds a block, so no block table ever spans two pools."""
        if self.config.kvd_run_dir is None or self.source.connected or self.scheduler.running:
            return
        now = time.monotonic()
        if now - self._last_reconnect_s < RECONNECT_EVERY_S:
            return
        self._last_reconnect_s = now
        from specd.engine.kvd_source import PROBE_TIMEOUT_S, KvdBlockSource, KvdUnavailable

        try:
            fresh = KvdBlockSource.connect(self.config.kvd_run_dir, self.layout, self.device, PROBE_TIMEOUT_S)
        except (KvdUnavailable, OSError):
            return
        self.blocks.release_reserve()
        waiting = self.scheduler.parked + list(self.scheduler.waiting)
        for seq in waiting:
            self.blocks.drop_hit(seq)
        if hasattr(self.source, "close"):
            self.source.close()
        counters = self.scheduler.counters
        self._attach(fresh)
        self.scheduler.counters = counters
        for seq in waiting:
            self.scheduler.add(seq)
        log.info("kvd attached: the shared prefix cache is on")

    def _emit(self, seq: Sequence, tokens: list[int], now: float) -> RequestOutput:
        """Append the step's tokens (one, or a verified chain) until one of them ends the request."""
        params = seq.request.params
        if seq.first_token_s is None:
            seq.first_token_s = now
            self._counters["cached_tokens_total"] += seq.num_cached_tokens
        out = RequestOutput(seq.id)
        reason = None
        for tok in tokens:
            self._counters["tokens_generated_total"] += 1
            seq.output_ids.append(tok)
            out.token_ids.append(tok)
            if (tok in self._stop_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                reason = "stop"
                break
            out.text += seq.detok.add(tok)
            if seq.detok.stopped:
                reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if reason is None:
            return out
        out.text += seq.detok.finish() if not seq.detok.stopped else ""
        self._finish(seq, reason)
        out.finished, out.finish_reason, out.usage = True, reason, seq.usage()
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Commit what is complete, release every lease, forget the sequence."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.blocks.commit_full(seq)
        self.scheduler.remove(seq)
        req = seq.request
        self.blocks.extend_hashes(seq)
        hints = self.hints.release_hints(seq.hashes, req.prefix_kinds, req.session, req.arrival_s,
                                         time.monotonic(), req.expected_return_s)
        self.blocks.free(seq, hints)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._seqs.pop(seq.id, None)
        if seq.auto_choice is not None and seq.auto_choice[0] is not None:   # its decode rate, for the next
            chooser, cls, bucket, measured = seq.auto_choice                  # auto requests of its class
            decoded = 0.0 if seq.first_token_s is None else max(0.0, time.monotonic() - seq.first_token_s)
            steps = max(1, seq.batch_steps)
            chooser.observe(cls, bucket, seq.method, max(0, len(seq.output_ids) - 1), decoded, measured=measured,
                            mix=seq.batch_own / steps if seq.batch_steps else 1.0, load=seq.batch_size_sum / steps)
        self._counters["requests_finished"] += 1

    def _fail_unschedulable(self, outputs: list[RequestOutput]) -> None:
        """Nothing ran although requests wait: the head one cannot fit in the whole pool."""
        if self.scheduler.running or self.scheduler.parked or not self.scheduler.waiting:
            return          # parked sequences hold blocks they will give back (or run with)
        seq = self.scheduler.waiting[0]
        self._finish(seq, "error")
        outputs.append(RequestOutput(seq.id, finished=True, finish_reason="error", usage=seq.usage(),
                                     error="the KV pool is too small for this prompt"))

    def stats(self) -> dict[str, float | int]:
        c = self._counters
        sps = {f"spec_sps_b{b}": s for b, s in self.sps.to_table().items()} if self.sps else {}
        if self.sps:
            sps["spec_step_overhead_seconds"] = self.sps.overhead_s
        lengths = {f"spec_scheduled_len{k}_total": n for k, n in sorted(self._scheduled_lengths.items())}
        return {
            **c,
            **sps,
            **lengths,
            **self.drafts.stats(),
            **self.graph_stats(),
            **self._gc.stats(),
            **self.source.stats(),
            **self.scheduler.stats(),
            **(self.spec_gate.stats() if self.spec_gate is not None else {}),
            "spec_scheduled_tokens_mean": c["spec_scheduled_tokens_total"] / max(1, c["spec_scheduled_requests_total"]),
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "preemptions_total": self.scheduler.num_preemptions,
            "kvd_connected": int(self.source.connected),
            "free_blocks": self.source.num_free(),
        }
