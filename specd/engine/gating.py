"""The engine's side of the measured pre-draft gate (specd/engine/spec_gate.py): which gated requests
draft this step, which rest, what a finished step reports.

Why a file of its own: the gate decides per (method, load) cell from measured steps, and the engine's
part of it (asking before or after a proposer runs, resting prompts and decoders, recording each
request's acceptance, reporting the step) had grown to a third of engine.py. ``GateSteps`` is mixed into
``SpecEngine``; it reads the engine's ``spec_gate``, ``sps``/``_track_overhead``, ``_counters`` and the
per-step state initialised in ``SpecEngine.__init__`` (``_gate_arms``, ``_resting``, ``_resting_keys``,
``_gate_drafting``, ``_profiled``, and ``_rest_chain`` across steps), and calls its ``_proposer`` and ``_schedule_of``.
docs/design/speculation.md ("Measured pre-draft gate") says what each rule is for and what it measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.engine.scheduler import ScheduledSeq
from specd.engine.sequence import Sequence
from specd.engine.spec_gate import RESTING_DECAY, SPAN_STEPS, Acceptance, Drafters, load_bucket
from specd.engine.speculation import Draft

RESUME_EVERY = 4   # resting steps between asks whether aged records would draft again (``_resumes``)
KEEP_ABSORB = 32   # pending feature rows a kept request holds before its rest absorbs them (``_keep_context``)


@dataclass(slots=True)
class RestChain:
    """The latest step of a steady rest of a whole gated group (``GateSteps._rests_again``): its gate key,
    load bucket, batch and group sizes, the engine step, the group's acceptance records, whether the group
    is still exactly the one the gate's bound was taken for (False once requests left), and the resting
    steps whose aging the records still owe (``settle``). Updated in place, step by step: on the H200
    host, as on the CPU machine, a step's Python runs with cold caches after the forward, and building a
    new object a step cost ~8 µs there (the whole shortcut ~40 µs at c = 32 before these changes)."""

    key: str
    bucket: int
    size: int
    count: int
    step: int
    records: list
    exact: bool = True
    owed: int = 0
    lease: int = 0           # steps the gate granted without asking (``SpecGate.rest_lease``), still to take
    leased: int = 0          # steps taken in the lease, not yet folded into the gate (``GateSteps._fold``)
    admitted: int = 0        # the gate's admission count when the lease was granted: a new request ends it
    gate: object = None      # the gate that granted it, which takes the fold (a test may swap the engine's)
    pending: list = field(default_factory=list)   # the leased steps' plain samples (sequences, tokens, seconds)
    span: bool = False       # the lease is a rest span: it covers prompt steps and admissions (``_span_rests``)
    preemptions: int = 0     # the scheduler's preemption count when the span was granted: a preemption ends it
    joined: list = field(default_factory=list)    # a span's joiners: (record, ``owed`` when it joined)
    broken: bool = False     # a request the span could not cover was admitted (``_join_span``): it ends the chain
    classes: dict = field(default_factory=dict)   # id -> prompt class record of the new requests that joined it
    emptied: bool = False    # a span whose batch emptied (``_keeps_span``) and no request of its key joined since

    def settle(self) -> None:
        """Age the records by the resting steps they owe, in one pass: decay^n once, where the full path
        multiplies by decay at each step (equal up to rounding). Nothing reads a record while it owes:
        the chain's steps decide on the gate's bound, and the chain settles before it ends. A span's
        joiners owe only the steps since they joined."""
        for record, at in self.joined:
            if self.owed > at and record.steps:    # a record that never drafted has nothing to age
                Acceptance.rest_all([record], RESTING_DECAY ** (self.owed - at))
        if self.owed:
            Acceptance.rest_all(self.records, RESTING_DECAY ** self.owed)
            self.owed = 0
        if self.joined:
            self.records.extend(record for record, _ in self.joined)
            self.joined = []


def confidence_scheduled(schedule: str | None) -> bool:
    """Does a request on ``schedule`` (its own, else the deployment's; None: unset) go through the confidence
    scheduler? Unset means confidence wherever the drafts carry confidences (the caller checks that)."""
    return schedule in (None, "confidence")


def by_gate_key(scheds: list[ScheduledSeq]) -> dict[str, list[ScheduledSeq]]:
    """The gated requests of ``scheds`` grouped by gate key, in order (ungated ones, key None, left out)."""
    keyed: dict[str, list[ScheduledSeq]] = {}
    for sched in scheds:
        key = sched.seq.gate_key
        if key is not None:
            keyed.setdefault(key, []).append(sched)
    return keyed


def gate_key_name(method: str, schedule: str | None) -> str:
    """The gate cell family of a request: its method, with ``_gated`` for the fixed-γ gated schedule
    (an underscore: the key ends up in Prometheus metric names)."""
    return f"{method}_gated" if schedule == "gated" else method


class GateSteps:
    def _observe_gate(self, batch: list[ScheduledSeq], emitted: dict[int, int], seconds: float,
                      timed: bool = True) -> None:
        """Report a finished pure decode step to the gate, under each gated method's arm. A step with
        prompt chunks, one that measured the SPS profile, one that captured a CUDA graph (``timed``
        False), or one where a rest began by absorbing features (``_rest``: a drafter pass in a resting
        step) says nothing about either arm's cost; the requests' acceptance is still recorded. A pure
        decode step that drafted for nobody but captured or absorbed features for a gate key
        (``_gate_capturing``) is charged to that key's next drafting sample (``SpecGate.charge``).
        A rest span's decode step (``_span_books`` names its chain) takes a shorter way, ``_observe_span``."""
        if self._span_observe is not None:
            self._observe_span(len(batch), emitted, seconds, timed)
            return
        arms, self._gate_arms = self._gate_arms, {}
        leased, self._lease_step = self._lease_step, None
        unlooked, self._lookup_step = self._lookup_step, None
        self._resting = set()
        self._resting_keys = set()
        drafting, self._gate_drafting = self._gate_drafting, {}
        for seqs in drafting.values():   # each gated request's own acceptance: tokens this drafting step emitted
            for seq in seqs:
                seq.gate_acceptance.add(emitted.get(id(seq), 1), pool=self._pools(seq))
                seq.prompt_forced = False     # its forced prompt went into this draft: later absorbs are drafting's
        profiled, self._profiled = self._profiled, False
        absorbed, self._rest_absorbed = self._rest_absorbed, False
        capturing, self._gate_capturing = self._gate_capturing, set()
        if self.spec_gate is None or profiled or not timed or not self._decode_step:
            return
        if capturing and not any(arms.values()):      # a ``capture`` step: drafting's cost, not a sample
            for key in capturing:
                self.spec_gate.charge(key, len(batch), seconds)
        if absorbed:
            return
        tokens = sum(emitted.values())
        drafts = {id(s.seq): s.num_draft for s in batch} if any(arms.values()) else {}
        for method, drafted in arms.items():
            chain = (leased if leased is not None and method == leased.key
                     else unlooked if unlooked is not None and method == unlooked.key else None)
            if chain is not None:                             # a leased rest: its sample waits for the fold
                chain.pending.append((len(batch), tokens, seconds))
                if not chain.lease:                           # the lease's last step: fold it now
                    self._fold(chain)
                continue
            seqs = drafting.get(method, [])
            drafters = Drafters(len(seqs), sum(emitted.get(id(s), 1) for s in seqs),
                                sum(drafts.get(id(s), 0) for s in seqs)) if drafted else None
            self.spec_gate.observe(method, len(batch), drafted, tokens, seconds, drafters)

    def _observe_span(self, size: int, emitted: dict[int, int], seconds: float, timed: bool) -> None:
        """A rest span's decode step, reported as ``_observe_gate``'s leased arm would report it, without its
        per-step state: the step rested the whole batch before any of that state was set (nothing drafted,
        captured, absorbed or profiled), so there is nothing to reset. A timed step's plain sample is kept for
        the lease's fold; at the lease's last step it is folded now, as before. Otherwise the sample waits in
        ``_span_sample`` and goes into the lease's samples in the next step's forward shadow
        (``_span_books``), or first thing at any fold (``_fold``): the gate reads a lease's samples only at
        its fold, so it takes the same samples, in the same order.
        Why: this runs after the step's forward has been waited for, on the step's critical path. On the
        H200 (session 35, run CZ, c = 1) the resting row's runs spent +9 µs a step over `none` there, where
        ``_observe_gate`` costs ~2 µs more than `none`'s on the CPU probe: cold caches after the forward."""
        chain, self._span_observe = self._span_observe, None
        if not timed:                # a step that captured a graph or built a kernel: no sample
            return
        self._span_sample = (chain, size, emitted, seconds)
        if not chain.lease:
            self._fold(chain)        # the lease's last step: the fold takes the held sample first

    def _take_span_sample(self) -> None:
        """The last rest-span step's plain sample (``_observe_span``) into its lease's samples."""
        held, self._span_sample = self._span_sample, None
        if held is not None:
            chain, size, emitted, seconds = held
            chain.pending.append((size, sum(emitted.values()), seconds))

    @staticmethod
    def _pools(seq: Sequence) -> bool:
        """Does this request's drafting step count for its prompt class? Not when its drafter context
        misses part of its history (``DraftContext.offset`` > 0: it rested before its first capture and
        a probe drafted from a stitched context, or a prefix hit came without the drafter's KV). Such a
        step underrates what the class's requests draft from a whole context, and a class rated low
        rests its next requests from their first step, which keeps their contexts gapped."""
        ctx = seq.draft_ctx
        return ctx is None or not ctx.offset

    def _gate_on(self) -> bool:
        """The gate decides, unless it is off or a profile was injected into ``self.sps`` (tests pinning
        the scheduler's decisions: it keeps the overhead average off too)."""
        return self.spec_gate is not None and (self.sps is None or self._track_overhead)

    @staticmethod
    def _pure_decode(batch: list[ScheduledSeq]) -> bool:
        """Every sequence of the batch decodes one token (no prompt chunk). ``step`` asks once, before
        drafting, and keeps the answer in ``_decode_step`` for the gate's three questions of the step: at
        c = 32 each asking walked 32 sequences' properties (~10 µs on the CPU machine). The answer holds
        after the forward too: computed and known tokens advance together."""
        return all(s.decodes for s in batch)

    def _gate_group(self, batch: list[ScheduledSeq], group: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """``group`` minus the requests the measured gate rests this step. Gate cells are per method and
        schedule (``_gate_key``): a confidence-scheduled step and a fixed-γ one cost differently."""
        chain, self._rest_chain = self._rest_chain, None
        if self._rests_again(batch, group, chain) or self._carries(batch, group, chain):
            return []
        if chain is not None:
            self._fold(chain)    # the gate sees the leased steps before it is asked
            chain.settle()       # before anything reads the records again
        resting: set[int] = set()
        rests = self._gate_rests(batch, group)
        for key, members in rests:
            records = [s.seq.gate_acceptance for s in members]
            resumes = self._resumes(batch, key, records)      # ages their records whatever comes next
            if not self._decode_step:
                # a step with prompt chunks drafts for nobody but changes nobody's capture: a request
                # that captures keeps its unabsorbed features and captures this step's too (``_keeps``)
                self._rest([s.seq for s in members if not self._keeps(s.seq)])
            elif self.spec_gate.keeps_context(key, len(batch)):
                self._keep_context(members)
            elif not (self.spec_gate.probe_next(key, len(batch)) or resumes):
                self._rest([s.seq for s in members])
                if len(members) == len(group) and self._gate_arms.get(key) is False:
                    # the whole group rests on the gate's answer: the next step may ask ``rests_again``
                    self._rest_chain = RestChain(key, load_bucket(len(batch)), len(batch), len(group),
                                                 self._counters["steps_total"], records)
            else:                # capture this step's features: the probe (or the resuming requests)
                self._gate_arms.pop(key, None)      # draft from a fresh context; the capture's time is no
                self._gate_capturing.add(key)       # resting sample, it is charged to the next drafting one
            resting.update(id(s) for s in members)
        return [s for s in group if id(s) not in resting] if resting else group

    def _keep_context(self, members: list[ScheduledSeq]) -> None:
        """Requests the gate rests this step but whose contexts the cell keeps whole
        (``SpecGate.keeps_context``): not rested (``_rest``), so they capture this step's features, and no
        rest chain, lease or span starts (those capture nothing). The step is a plain sample with the
        capture's cost in it: where the setting holds, both arms pay it. Their pending features go into their
        contexts at their next draft, or here, in one batched projection, once any of them holds
        ``KEEP_ABSORB`` rows: a long rest's rows would otherwise land in one drafting step (past the largest
        projection graph, and in that step's sample)."""
        self._counters["spec_context_kept_steps_total"] += 1
        if any(s.seq.draft_feats is not None and len(s.seq.draft_feats) >= KEEP_ABSORB for s in members):
            # as a rest's absorb (``_absorb_pending``): no sample, its time charged to drafting. H100, session
            # 50, run GA: while such steps counted as plain samples, the kept row's b8 cell sampled plain steps
            # of 8 at 4.4-5.9 ms (~2.2 ms elsewhere; the absorbs are the likely cause, not isolated), rated
            # plain decoding at 1,764-1,952 tok/s, drafted as the winner, and ran knowledge at 0.77x `none`
            # (the default row 0.99x)
            self._absorb_pending(members[0].seq.method, [s.seq for s in members])

    def _rests_whole_batch(self, batch: list[ScheduledSeq]) -> bool:
        """The leased steady rest of a chain whose group was the whole batch, taken before any walk over the
        batch: ``SpecEngine._add_drafts`` then skips grouping the batch by method and ``_feature_proposers``
        its pass (nothing captures). The proof that the batch is the chain's group: the chain's size and
        count are equal only when its gated group was every request of the batch (``_gate_group`` creates
        it so; ``_rests_again`` updates both from one full ask; ``_carries`` and ``_rest_prompts`` change
        one or both but end the lease), and on consecutive pure decode steps with no admission in between
        (the lease's own condition) a batch of the same size holds the same requests. The lease is asked
        as ``_rests_again`` asks it (``_lease_covers``), so that call takes its leased branch, which always
        rests. Why: at
        c = 32 those two walks were the resting row's largest host cost left over `none`'s (session 29,
        cProfile of the H200 runs and the CPU probe, tests/engine/rest_host_probe.py)."""
        chain = self._rest_chain
        size = len(batch)
        if (chain is None or chain.count != chain.size or chain.gate is not self.spec_gate or not self._gate_on()
                or chain.step + 1 != self._counters["steps_total"] or not self._lease_covers(chain, size, size)):
            return False
        self._rest_chain = None
        self._whole_rest = self._rests_again(batch, batch, chain)
        self._counters["spec_rest_whole_batch_steps_total"] += self._whole_rest
        return self._whole_rest

    def _rests_again(self, batch: list[ScheduledSeq], group: list[ScheduledSeq], chain: "RestChain | None") -> bool:
        """The steady rest, without a pass over the group: when the previous step rested this whole group
        on the gate's answer (``chain``), this is the next pure decode step in the same load bucket (or a
        smaller one, as the batch drains: ``SpecGate.carries_rest``), and the gate is sure it rests again
        (``SpecGate.rests_again``), the group rests: records aged, features
        not captured (``_resting_keys``), the step reported under the resting arm, as ``_gate_group``'s full
        path would. On consecutive pure decode steps the group can only lose requests: one leaves by
        finishing or by preemption and joins with a prompt chunk (no pure decode step). The same batch
        and group sizes mean the same requests; smaller ones, some of them (the gate then takes its bound
        for any subset). A due probe announcement is honoured (features captured, no sample), and the
        chain ends there. H200, session 10, run AA: with only the same-size rule, 40% of the rested steps
        at c = 32 asked in full, the batch shrinking as requests finished."""
        if chain is None or not self._decode_step or not self._gate_on():
            return False
        size, count = len(batch), len(group)
        counters = self._counters
        if chain.step + 1 != counters["steps_total"]:
            return False
        # a lease granted at an earlier step of this chain covers this one: the same requests rest, no
        # question asked (``SpecGate.rest_lease``); else the gate is asked (``rests_again``) after the fold.
        # Asked first: a leased step has the chain's sizes, so its bucket and sizes need no check
        leased = self._lease_covers(chain, size, count)
        if not leased:
            bucket = load_bucket(size)
            if bucket > chain.bucket or size > chain.size or count > chain.count:
                return False
            self._fold(chain)
            if bucket != chain.bucket:       # the batch drained into a smaller bucket (``SpecGate.carries_rest``)
                if self.spec_gate.keeps_context(chain.key, size):
                    return False             # where contexts are kept, no chain rests them (``_keep_context``)
                if not self.spec_gate.carries_rest(chain.key, chain.bucket, size):
                    return False
                chain.bucket, exact = bucket, False
            else:
                exact = chain.exact and size == chain.size and count == chain.count
                if not self.spec_gate.rests_again(chain.key, size, subset=not exact):
                    return False
        counters["spec_paused_steps_total"] += 1
        counters["spec_rest_again_steps_total"] += 1
        chain.owed += 1          # this step's aging (those that left since owe it too: nobody reads them)
        if leased:
            chain.lease -= 1
            chain.leased += 1
            counters["spec_rest_leased_steps_total"] += 1
            self._lease_step = chain           # ``_observe_gate`` keeps its sample for the fold
        elif self.spec_gate.probe_next(chain.key, size):
            chain.settle()       # the probe's features are captured this step: no resting sample (``_gate_arms``)
            self._gate_capturing.add(chain.key)
            return True
        self._gate_arms[chain.key] = False
        self._resting_keys.add(chain.key)
        chain.step += 1
        if not leased:           # a fresh answer: the chain takes this step's shape and the lease it grants
            chain.size, chain.count, chain.exact = size, count, exact
            chain.lease, chain.admitted = self.spec_gate.rest_lease(chain.key, size), self.spec_gate.admitted
            chain.gate = self.spec_gate
            if chain.lease and self.rest_spans and count == size and self._may_span(chain):
                chain.span, chain.lease = True, self.spec_gate.rest_lease(chain.key, size, SPAN_STEPS)
                chain.preemptions = self.scheduler.num_preemptions
        self._rest_chain = chain
        return True

    def _may_span(self, chain: RestChain) -> bool:
        """May ``chain``'s whole-batch lease become a rest span? Only where every request the engine holds
        is `none` or rests under its key with nothing captured: the running ones decode or prefill without
        capturing (``prompt_captures`` False). A request waiting or parked is vetted as an admission into the
        span is (``_join_span``): those of the key whose prompts have not been decided to capture join the
        rest's bound together (one ``SpecGate.join_rest``) and then capture nothing; one of another method
        or schedule, one whose prompt captures, or a refused join (an exploring class) leaves the lease a
        plain one. A span skips the walks that would notice any of these, so each later request is vetted as
        it is admitted. One pass over the requests, once per span; the join weighs one fresh record per prompt
        class (their tops and their exploration are their class's), and a queue of more than
        ``2 × max_num_seqs`` gated requests is not vetted (the lease stays plain).

        Why the queue is vetted instead of refused (session 33): under arrivals that keep a queue, which a
        closed loop never does, nearly every lease found a request waiting and stayed plain. CPU, c = 32, a
        scratch open loop at ~0.8 arrivals a step: 95 of 101 leases stayed plain, 76 span steps of 597 rested
        steps (536 now); ``tests/engine/closed_loop_probe.py --concurrency 32 --queued 4``: the resting row's
        gate methods and admissions ~32 µs a step over `none` before, ~11 after (prompt steps +48 → -7 µs).
        What it gives up, as for an admission: a queued request is weighed when the span starts, at the
        span's bucket, not at its first chunk, and its prompt rests even if the gate would draft by then."""
        key, sched = chain.key, self.scheduler
        for seq in sched.running:
            if seq.method != "none" and (seq.gate_key != key or seq.draft_feats is not None or (
                    seq.prompt_captures is not False and seq.num_computed_tokens < len(seq.request.prompt_ids))):
                return False
        queued = [seq for queue in (sched.waiting, sched.parked) for seq in queue if seq.method != "none"]
        if not queued:
            return True
        if len(queued) > 2 * sched.max_num_seqs:
            return False          # a queue this deep is vetted no more: a pass per span try would cost more
        if self.spec_gate.captures_prompt(chain.bucket):
            return False          # their prompts will capture (``SpecGate.capture_prompts``): none may join
        records, classes = [], set()
        for seq in queued:
            if seq.gate_key != key or seq.draft_feats is not None or seq.prompt_captures:
                return False
            record = seq.gate_acceptance
            if record.fresh:          # its class's start and its class's exploration: one per class is enough
                if id(record.group) in classes:
                    continue
                classes.add(id(record.group))
            records.append(record)
        if not self._join_bound(key, chain.bucket, records):
            return False
        for seq in queued:
            self._joined_span(chain, seq)
        return True

    def _span_rests(self, batch: list[ScheduledSeq]) -> bool:
        """A step inside a rest span, taken before any walk over the batch; False (and the span ended) when
        the span no longer covers it. A span is a whole-batch lease (``_rests_whole_batch``) that goes on
        through steps with prompt chunks, through requests finishing and through admissions: its decode
        steps are leased steps (aged records, a plain sample kept for the fold, no capture), its prompt
        steps rest the batch as a carried rest does (``_carries``) without walking it, and each request
        admitted meanwhile joins the rest's bound at admission (``_join_span``) or ends the span. It ends
        after ``SPAN_STEPS`` decode steps (sooner where a probe is near: ``SpecGate.rest_lease``) and at a
        step in another load bucket, where the chain goes on as a carried rest (``_rests_again`` asks for
        any subset of its requests), as it does after an idle step (``step`` folds the lease); at a
        preemption (its prompt is run again, undecided) and at an admission it could not cover, where the
        chain ends and the gate is asked in full.

        Why: at c = 32 under a closed loop a request finishes every step or two, so a lease (same requests,
        no admission) rarely lasts, and the resting row paid the gate's walks at nearly every step. H200,
        session 32 (runs CS and CT): runs that rested throughout took 1.5% more wall time than `none` at
        c = 32 (the A/A row 0.2%), the schedule phase +41 µs a step, the step's end +7 µs, admissions +8
        µs a step; on the CPU probe (tests/engine/closed_loop_probe.py) prompt steps cost +59 µs
        (``_add_drafts`` and ``_rest_prompts``), decode steps +26 µs.
        What it gives up: a joiner is weighed against the rest's bound at its admission, not at its first
        chunk (the same bound ``_rest_prompts`` folds joiners into), and the newest plain samples reach
        the gate up to ``SPAN_STEPS`` steps late."""
        chain = self._rest_chain
        if chain is None or not chain.span:
            return False
        counters = self._counters
        lost = (chain.broken or chain.gate is not self.spec_gate or not self._gate_on()   # the chain ends
                or chain.step + 1 != counters["steps_total"] or self.scheduler.num_preemptions != chain.preemptions)
        if lost or not chain.lease or load_bucket(len(batch)) != chain.bucket:
            self._fold(chain)
            chain.settle()
            if lost:
                self._rest_chain = None
                return False
            # its lease ran out, or the batch left the bucket: a plain chain from here (``_rests_again``,
            # ``_carries``), for this batch or part of it. Every request it now holds rested under the
            # span or joined its bound (``_join_span``), so the bound for a subset covers them. Why: a
            # span that ended dropped its chain, and at c = 32 on long prompts (knowledge, three
            # prompt steps in four) the full path then ran until a decode step made a new one (H200,
            # session 32, run CU: 61 of 111 rested steps took a shortcut against 77 without spans)
            chain.span, chain.exact = False, False
            # the members now, as ``_carries`` takes them: a span never walks its batch, so its records had
            # kept every request that joined it since the chain began, finished or not (a chain renewed span
            # after span at c = 32 held 128 records after 128 requests, and each settle aged them all). A
            # joiner still waiting for its prompt is left out: admitted in the span, it never drafted, so
            # its record has nothing to age, and its prompt joins the chain again (``_rest_prompts``)
            chain.records = [s.seq.gate_acceptance for s in batch if s.seq.gate_key == chain.key]
            chain.size, chain.count = len(batch), len(chain.records)
            return self._renews_span(batch, chain)
        self._whole_rest = True
        self._span_step = chain      # its bookkeeping waits for the forward's launch (``_span_books``)
        return True

    def _span_books(self) -> None:
        """The bookkeeping of a step that ``_span_rests`` took, run once the step's forward is launched
        (``SpecEngine.step``), so that on the GPU it runs while the forward does instead of before it: the
        step counts, the chain's step, and at a decode step the lease taken and the step reported as a leased
        rest (``_observe_gate``). Nothing between ``_add_drafts`` and the launch reads any of it: the whole
        rest (``_whole_rest``, set at once) already keeps ``_rest_prompts`` and the capture from the batch.
        Why: at c = 1 on the H200 (session 35, run CZ) the resting row's runs spent +16 µs a step scheduling
        over `none` where the CPU probe shows ~4 µs: the step's Python runs there with caches gone cold
        during the forward, and all of it before the launch is on the step's critical path."""
        if self._span_sample is not None:
            self._take_span_sample()     # the last span step's sample, here in the shadow too
        chain, self._span_step = self._span_step, None
        if chain is None:
            return
        counters = self._counters
        counters["spec_paused_steps_total"] += 1
        counters["spec_rest_again_steps_total"] += 1
        counters["spec_rest_span_steps_total"] += 1
        chain.step += 1
        if self._decode_step:
            chain.owed += 1
            chain.lease -= 1
            chain.leased += 1
            counters["spec_rest_leased_steps_total"] += 1
            counters["spec_rest_whole_batch_steps_total"] += 1
            self._span_observe = chain   # reported as a leased rest (``_observe_span``)

    def _renews_span(self, batch: list[ScheduledSeq], chain: RestChain) -> bool:
        """A span whose lease ran out at a pure decode step, in its bucket or a smaller one (the batch drains:
        ``SpecGate.carries_rest``), with every request of the batch
        under its key (``chain`` just made a plain chain of it, by ``_span_rests``): asked here as the full path
        would ask it (``_rests_again``: the gate's ``rests_again`` for a subset, then a new lease, and a new span
        where ``_may_span`` allows), before any walk over the batch. True: the step is taken (a whole-batch
        rest, or a probe's capture); False: the full path asks, with the chain. Why: at the end of each
        ``SPAN_STEPS`` lease the step first grouped the batch by method, then asked the same question. A
        small saving: on the CPU probe at c = 32 (stories260K, a closed loop), a renewal step's
        ``_add_drafts`` took ~68 µs (median of 24) against ~78 through the full path, once every 32 decode
        steps; most of what is left is ``RestChain.settle`` and ``_may_span``."""
        size = len(batch)
        if not self._decode_step or chain.count != size or load_bucket(size) > chain.bucket:
            return False
        self._rest_chain = None
        if not self._rests_again(batch, batch, chain):
            self._rest_chain = chain
            return False
        self._whole_rest = self._rest_chain is chain        # else a probe's capture: features are taken
        self._counters["spec_rest_whole_batch_steps_total"] += self._whole_rest
        return True

    def _join_span(self, seq: Sequence) -> None:
        """A request admitted during a rest span (``add_request``, once it is queued): `none` passes (but ends a
        span whose batch emptied, ``_keeps_span``: it would rest no request of its key); a request
        of the span's key joins when the most its record can reach folds into the rest's bound at the span's
        bucket (``SpecGate.join_rest``: not when its class explores), and its
        prompt then captures nothing, as ``_rest_prompts`` would decide; anything else ends the span at
        the next step (the full path then asks about it)."""
        chain = self._rest_chain
        if chain is None or not chain.span or not chain.lease:
            return
        if seq.method == "none" and not chain.emptied:
            return
        # weighed at the span's bucket, not at the queue's size now: in a closed loop the requests that
        # finished in one step are replaced one by one, so the first replacements see a smaller load
        # (stories260K, c = 8: 7 of 8, bucket 4, ended three spans of one loop); a batch that does leave
        # the bucket ends the span at its first step (``_span_rests``)
        record, gate = seq.gate_acceptance, self.spec_gate
        group = record.group
        # a swapped gate ends the span at its next step anyway; a `none` request into an emptied span would
        # leave it over no request of its key, with nothing to rest
        if chain.gate is not gate or seq.gate_key != chain.key:
            joins = False
        elif gate.captures_prompt(chain.bucket):      # its prompt captures whatever the cell decides: it cannot
            joins = False                             # rest under the span (``SpecGate.capture_prompts``)
        elif record.fresh and chain.classes.get(id(group)) is group and not gate.explores(record):
            joins = gate.rejoin_rest(chain.key, chain.bucket)   # its class's top is in the bound already
        else:
            joins = self._join_bound(chain.key, chain.bucket, [record])
        if not joins:
            chain.lease, chain.broken = 0, True
            return
        chain.emptied = False
        self._joined_span(chain, seq)

    def _join_bound(self, key: str, bucket: int, records: list[Acceptance]) -> bool:
        """``SpecGate.join_rest`` for requests whose prompts will capture nothing, weighed as such: their
        estimates then start from their class's prompt-less record (``lacks_prompt``), as ``_rest_prompts``
        weighs its joiners after resting them, so a span's bound is the one the carried rest would take.
        The records are left as they were; the caller marks the ones that join (``_joined_span``)."""
        was = [record.lacks_prompt for record in records]
        for record in records:
            record.lacks_prompt = True
        try:
            return self.spec_gate.join_rest(key, bucket, records)
        finally:
            for record, lacked in zip(records, was):
                record.lacks_prompt = lacked

    def _joined_span(self, chain: RestChain, seq: Sequence) -> None:
        """``seq`` joined ``chain``'s span (its top is in the rest's bound): its prompt captures nothing, as
        ``_rest_prompts`` would decide, it ages from now (``RestChain.joined``), and a fresh record's class
        is noted, so the class's later requests skip ``join_rest`` (``_join_span``)."""
        record = seq.gate_acceptance
        if record.fresh:
            chain.classes[id(record.group)] = record.group
        seq.prompt_captures = False
        chain.joined.append((record, chain.owed))
        if not record.lacks_prompt:
            record.lacks_prompt = True
            self._counters["spec_promptless_requests_total"] += 1

    def _lease_covers(self, chain: RestChain, size: int, count: int) -> bool:
        """Does a lease granted at an earlier step of ``chain`` cover this step (the same batch and group
        sizes, no admission since it was granted)? Asked by ``_rests_again`` and, before any walk over the
        batch, by ``_rests_whole_batch``."""
        return bool(chain.lease) and size == chain.size and count == chain.count \
            and self.spec_gate.admitted == chain.admitted

    def _fold(self, chain: RestChain | None, keep_lease: bool = False) -> None:
        """End ``chain``'s rest lease: the gate that granted it takes its steps (clock) and their plain
        samples, in order (``SpecGate.fold_rest``). Called at the lease's last step and wherever the chain
        stops taking leased steps: before the gate is asked in full, when the chain ends or is carried
        through a prompt step, and when the engine idles (``SpecEngine.step``). ``keep_lease``: the gate
        takes the steps so far and the lease goes on; ``SpecEngine.step`` asks this of a rest span when its
        batch empties (``_keeps_span``)."""
        if self._span_sample is not None:
            self._take_span_sample()     # a span step's sample still held (``_observe_span``) comes first
        if chain is None:
            return
        if chain.leased:
            chain.gate.fold_rest(chain.key, chain.size, chain.leased, chain.pending)
            chain.leased, chain.pending = 0, []
        if not keep_lease:
            chain.lease, chain.emptied = 0, False     # ``emptied`` lives with a kept lease only

    def _keeps_span(self) -> None:
        """The batch emptied at this step's end: the gate takes the chain's leased steps now, so its stats
        hold every step of the batch whatever comes next, but a rest span keeps its lease, so that a request
        admitted before the next step joins it (``_join_span``) as one admitted beside a running batch does.
        If the next step finds no batch, the engine is idle and the lease ends there (``SpecEngine.step``).
        Why: at c = 1 each request empties the batch. Ending the span there sent every request through
        ``_rest_prompts``, a full gate walk at its first decode step and a new lease at its second: on the
        CPU machine ~80 + ~30 µs of ``_add_drafts`` a request (stories260K, a closed loop of 28-68-token
        answers), and on the H200 (session 35, run CZ) the resting row's runs at c = 1 spent +16 µs a step
        scheduling over `none`, the knowledge cell 0.992 (0.987-0.997) of it."""
        chain = self._rest_chain
        if chain is not None:
            chain.emptied = chain.span and not chain.broken
            self._fold(chain, keep_lease=chain.emptied)

    def _carries(self, batch: list[ScheduledSeq], group: list[ScheduledSeq], chain: "RestChain | None") -> bool:
        """A steady rest carried through a step with prompt chunks: the group's decoders rest (such a step
        drafts for nobody: ``SpecGate.beside_prompts`` is off), and the chain goes on to the next step, where
        ``_rests_again`` may take the shortcut again, once ``_rest_prompts`` has folded this step's joining
        requests into the bound (``SpecGate.join_rest``) or ended the chain. The full path would walk the
        group to rest each decoder and, at the next decode step, ask the gate over every record: ~40 µs at
        c = 32 on the CPU machine (tests/engine/prompt_gate_probe.py), where prompts arrive every step or
        two. The decoders of a steady rest capture nothing (no features to keep: ``_keeps``), so resting
        their key whole (``_resting_keys``) rests each of them as ``_rest`` would."""
        if (chain is None or self._decode_step or not self._gate_on() or self.spec_gate.beside_prompts
                or chain.step + 1 != self._counters["steps_total"] or len(group) > chain.count):
            return False
        self._fold(chain)        # the joining prompts are weighed against the gate's current state
        self._counters["spec_paused_steps_total"] += 1
        self._counters["spec_rest_again_steps_total"] += 1
        self._resting_keys.add(chain.key)
        chain.settle()
        chain.records = [s.seq.gate_acceptance for s in group]   # the members now: those who left age no more
        chain.count = len(group)
        chain.step += 1
        chain.exact = False          # the next decode step's group may differ in size: the bound for any subset
        self._rest_chain = chain
        return True

    def _end_carried(self, batch: list[ScheduledSeq], chain: RestChain) -> None:
        """A chain carried into this step ends in it (a prompt of its key captures, or cannot join): its
        decoders rest one by one (``_rest``), so its key's capturing prompts capture; the next decode step
        asks in full."""
        self._fold(chain)
        self._rest_chain = None
        self._resting_keys.discard(chain.key)
        self._rest([s.seq for s in batch if s.seq.gate_key == chain.key and s.decodes])

    def _resumes(self, batch: list[ScheduledSeq], key: str, records: list[Acceptance]) -> bool:
        """Age the resting requests' records (``Acceptance.rest``) and say whether, aged, they would draft
        at the next step. Then this step captures their features (as before a probe), so they resume from
        a context that ends at their newest token instead of one that misses the whole rest. Only pure
        decode steps age: a step with prompt chunks measures nothing. Lossless: earlier steps' counts only."""
        if not self._decode_step:
            return False
        Acceptance.rest_all(records)
        # asked every RESUME_EVERY steps: records drift by 5% a step, and the question costs a pass over
        # the batch (~15 µs a step at c = 32 on the CPU machine, tests/engine/gate_cost_probe.py)
        if self._counters["steps_total"] % RESUME_EVERY:
            return False
        return self.spec_gate.resumes(key, len(batch), records)

    def _rest_prompts(self, batch: list[ScheduledSeq]) -> None:
        """Prompt chunks of gated requests capture no features where the gate rests their method at this
        load (and no probe is announced). Features wait in ``draft_feats`` until a proposal absorbs them,
        or a rest does (``_rest``, since session 12; dropped before), so a request that rests from its
        first decode step captured, fused and absorbed its whole prompt before any draft needed it. On
        the H200 (run J) that waste was the scheduled row's whole loss where the gate rested every step:
        2-5% of throughput, the most on the longest prompts (knowledge, c = 32: 7.83 against 7.39 ms per
        step, no verification). The question is asked for a
        batch of requests like this one (its class's acceptance, ``SpecGate.record``), and a request
        exploring its class captures. It is asked at the prefill's first chunk only, and the later chunks
        follow that answer (``Sequence.prompt_captures``): asked again at each chunk, a "rest" dropped the
        earlier chunks' features and a "draft" after a rest captured the rest of the prompt alone, a
        context without its start (session 12, CPU: a 45-token prompt in 16-token chunks kept 13).
        Lossless: the features only feed drafts, and the answer depends on earlier steps' measurements
        only."""
        if self._decode_step or self._whole_rest or not self._gate_on():
            return                                    # a pure decode step has no prompt chunk; a span's were vetted
        chain = self._rest_chain
        if chain is not None:
            chain.settle()     # a preempted request of the chain may prefill again: read below
            if chain.step != self._counters["steps_total"]:
                self._fold(chain)
                chain = None   # not carried through this step (``_carries``): it ends here
        joining: list[Acceptance] = []       # the carried chain's key's prompts that rest: they join its rest
        for sched in batch:
            seq = sched.seq
            key = seq.gate_key
            if key is None or sched.decodes:          # not gated, or a decoder (gated in _add_drafts)
                continue
            if not getattr(self._proposer(seq.method), "capture_layers", ()):
                continue                              # nothing to capture (ngram)
            captures = seq.prompt_captures
            if captures is None:              # the first chunk decides for the whole prefill
                record = seq.gate_acceptance
                load = self._decode_load(len(batch))
                captures = seq.prompt_captures = (
                    self.spec_gate.explores(record)
                    or self.spec_gate.should_draft(key, load, measured=False, requests=[record], copies=load)
                    or self.spec_gate.probe_next(key, len(batch)))
                if not captures and (self.spec_gate.captures_prompt(load)      # settings, off by default
                                     or self.spec_gate.keeps_context(key, load)):
                    captures = seq.prompt_captures = seq.prompt_forced = True
                    self._counters["spec_prompts_captured_anyway_total"] += 1
            if not captures:
                self._rest([seq])
                if not seq.gate_acceptance.lacks_prompt:  # rated by its class's prompt-less drafting steps
                    seq.gate_acceptance.lacks_prompt = True
                    self._counters["spec_promptless_requests_total"] += 1
            if chain is not None and key == chain.key:
                if captures:                  # it may draft from its first decode step: ask in full then
                    self._end_carried(batch, chain)
                    chain = None
                else:
                    joining.append(seq.gate_acceptance)
        if chain is not None and joining:
            if self.spec_gate.join_rest(chain.key, chain.bucket, joining):
                chain.records.extend(joining)          # settled above: they owe no aging yet
                chain.count += len(joining)            # upper bounds: a chunked prompt joins once a chunk
                chain.size += len(joining)
            else:
                self._end_carried(batch, chain)

    def _decode_load(self, batch_size: int) -> int:
        """The decode batch a prompt admitted now will join: every running, waiting and parked request,
        up to ``max_num_seqs`` (at least this step's batch). ``_rest_prompts`` asks the gate at this load,
        not at the batch's size.

        Why: when many requests arrive together, their prompts are prefilled a few per step (the token
        budget), so the first ones are asked at a small batch, where drafting may win, and capture their
        prompts; a few steps later they all decode together at the full load, where the gate rests them
        and each rest absorbs its captured prompt (a drafter pass) for nothing. H200, session 14 (run AS,
        commit 8ae95cb): at c = 32 on extraction 35 of 128 prompts per run captured (93 did not) while
        the b32 cell rested throughout (~4 prompts fit a prompt step there); on knowledge (~1,100-token
        prompts), c = 16 and 32, the runs that captured more prompts spent 0.3-0.8 ms a step more than
        `none` in scheduling and output. That the ramp-up caused those captures is likely, not isolated on
        the GPU; this change is not GPU-run yet."""
        sched = self.scheduler
        queued = len(sched.running) + len(sched.waiting) + len(sched.parked)
        return max(batch_size, min(sched.max_num_seqs, queued))

    def _gate_found(self, batch: list[ScheduledSeq], group: list[ScheduledSeq], drafts: list[Draft]) -> list[Draft]:
        """The gate for a proposer that costs nothing to ask (ngram: a host lookup), decided after it
        proposed, over the requests that got a draft: only verifying costs, and a step where ngram found
        nothing is a plain step whatever the gate says. Their acceptance records then count steps with
        a draft, so a request copying from its prompt is not rated by the steps between its copies
        (H200, run I: gated before proposing, ngram kept 1.09× of its 1.63× on extraction at c = 1).
        A resting request's draft is dropped. Lossless: ngram's drafts are a deterministic function of
        the context, and whether one is verified changes no output distribution."""
        found = [s for s, d in zip(group, drafts) if d.tokens]
        lengths = {id(s): len(d.tokens) for s, d in zip(group, drafts) if d.tokens}
        rests = self._gate_rests(batch, found, lengths)
        if len(rests) == 1 and self._decode_step and self._lookup_chain is None:
            self._lease_found(batch, group, rests[0][0])
        resting = {id(s) for _, members in rests for s in members}
        return [d.truncated(0) if id(s) in resting else d for s, d in zip(group, drafts)]

    def _lease_found(self, batch: list[ScheduledSeq], group: list[ScheduledSeq], key: str) -> None:
        """A pure decode step where the gate, asked with the drafts found (``_gate_found``), rested gate key
        ``key``: grant the key a lookup lease by the rule a feature drafter's asked rest is granted one
        (``_rests_again``: ``SpecGate.rest_lease``, up to ``LEASE_STEPS`` steps, ending before a probe could
        be announced; none after an exploration's or a probe's answer), kept where ``_cheap_unlooked`` keeps
        its own, so the steps it covers rest with no lookup and no question (``_lookup_leased``) and are
        folded as those are. The same limits as that lease: one a step, only where ``key`` is the group's
        only gated key and none of its requests explores its class (the ones that found nothing were not
        asked), ``exact`` where the key's requests are the whole group (where ``_cheap_unlooked`` took another
        key out of the group this step, the next step's group outnumbers the lease's count, which then covers
        nothing: ``_lease_covers``). The leased steps advance the probe clock as the sure lease's do, found
        drafts or not. The asked step itself is an ordinary
        rest: its plain sample goes to ``observe`` (``_observe_gate``); only the leased steps wait for the fold.

        Why: the sure bound (``SpecGate.rests_unlooked``) is the best case of any m requests finding a
        1-token draft, and at c = 32 on coding the gate's model prices one such draft at nearly a plain step,
        so a request with a decent acceptance estimate makes drafting possible and the bound is never sure:
        on the H100 (session 45, old 3f3787a against new 60fc98d, turn-length answers, 4 repeats) the gated
        ngram row's lookup-leased steps were 220-357 of ~510 rested steps a run at c = 16 (0.91 -> 0.94x
        `none`) but 0-1 at c = 32 (0.90 -> 0.88x), where the real found drafts rested nearly every step.
        On the CPU probe with the taught gate never sure beforehand (tests/engine/ngram_gate_cost_probe.py
        ``--gate asked``, stories260K, c = 32, three invocations each) ``_add_drafts`` took 241-279 µs a decode
        step before and 53-62 after, 364 of 413 decode steps leased (`none` 7-10); not GPU-run yet.
        The trade, as for the feature drafters' leases: for at most ``LEASE_STEPS`` steps drafts the lookups
        would have found are not verified, though one might have made drafting win. Lossless: ngram's
        drafts are a deterministic function of the context, and verifying one or not changes no output."""
        if self._gate_arms.get(key) is not False:       # an explorer drafted: no rest answer to lease on
            return
        gated = 0
        explores = self.spec_gate.explores
        for sched in group:
            other = sched.seq.gate_key
            if other is not None:
                if other != key or explores(sched.seq.gate_acceptance):
                    return
                gated += 1
        size = len(batch)
        lease = self.spec_gate.rest_lease(key, size, found=True)
        if lease:
            self._lookup_lease(key, size, group, gated, lease)

    def _lookup_lease(self, key: str, size: int, group: list[ScheduledSeq], gated: int, lease: int) -> None:
        """Keep a lookup lease of ``lease`` steps for gate key ``key``, granted at this step in a batch of
        ``size`` (``_cheap_unlooked``'s sure rest, ``_lease_found``'s asked one): ``group`` is the method's
        group, ``gated`` how many of it are the key's requests (``exact`` when all)."""
        self._lookup_chain = RestChain(key, load_bucket(size), size, len(group), self._counters["steps_total"],
                                       [], exact=gated == len(group), lease=lease,
                                       admitted=self.spec_gate.admitted, gate=self.spec_gate)

    def _cheap_unlooked(self, batch: list[ScheduledSeq], group: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """A pure decode step: the gated requests of ``group`` (a cheap proposer's) whose gate key the gate is
        sure to rest whatever their lookups would find (``SpecGate.rests_unlooked``) leave it before the
        lookup; the rest stay, and are looked up and gated after (``_gate_found``) as before. Such a key is
        told it rested, as a found step's rest tells it (its arm, the paused count, the step's plain sample),
        and the lease the answer grants rests its requests at the next steps with no lookup and no question:
        the steps a lease covers (the same batch size and method group on consecutive pure decode steps, no
        admission: ``_lease_covers``) are counted and reported as the feature drafters' leased steps are, their
        plain samples folded into the gate when the lease ends (``_fold``), at its last step, at the next step
        it does not cover, at a step with prompt chunks, and when the batch empties or the engine idles
        (``_end_lookup``). Ungated requests (fixed γ) keep their lookup. Where the gate is not sure beforehand
        but rests the key when asked with the drafts found, that answer grants the same lease (``_lease_found``),
        which this method takes at the next steps alike.

        Why: the gate decides after the lookup (``_gate_found``), so a resting key's requests were looked up at
        every decode step and their drafts dropped. On the CPU probe (tests/engine/ngram_gate_cost_probe.py,
        stories260K, c = 32) ``_add_drafts`` took ~225 µs a decode step against ~8 µs for `none`; on the H100
        (session 44, run DS) the gated ngram row on coding drafted 2-20 of hundreds of steps a run and ran
        0.91-0.93× `none`. ``_cheap_beside_prompts`` removed the prompt steps' share; this removes the decode
        steps' where the gate is sure: on that probe with the real gate taught to rest, 275-309 µs a step
        before, 35-39 after (`none` 9-11; three invocations each). The sure bound alone left c = 32 untouched on
        the H100 (session 45: 0-1 leased steps a run, 0.90 -> 0.88x `none`; 220-357 of ~510 at c = 16, 0.91 ->
        0.94x), hence the asked rest's lease: on the probe with that gate never sure (``--gate asked``),
        241-279 µs a step before, 53-62 after, 364 of 413 decode steps leased (`none` 7-10); not GPU-run yet.
        Lossless: ngram's drafts are a deterministic function of the context, and verifying one or not
        changes no output."""
        chain, self._lookup_chain = self._lookup_chain, None
        if chain is not None:
            if (chain.gate is self.spec_gate and self._gate_on() and chain.step + 1 == self._counters["steps_total"]
                    and self._lease_covers(chain, len(batch), len(group))):
                return self._lookup_leased(chain, group)
            self._fold(chain)    # the gate sees the leased steps before it is asked
        if not self._gate_on():
            return group
        keyed = by_gate_key(group)
        rested = set()
        counters, size = self._counters, len(batch)
        for key, members in keyed.items():
            if not self.spec_gate.may_rest_unlooked(key, size):
                continue
            lease = self.spec_gate.rests_unlooked(key, size, [s.seq.gate_acceptance for s in members],
                                                  caps=[self._draft_limit(s.seq) + 1 for s in members])
            if lease is None:
                continue
            rested.add(key)
            self._gate_arms[key] = False
            counters["spec_paused_steps_total"] += 1
            counters["spec_rest_unlooked_steps_total"] += 1
            if lease and len(keyed) == 1:   # one lease a step
                self._lookup_lease(key, size, group, len(members), lease)
        if not rested:
            return group
        return [s for s in group if s.seq.gate_key not in rested]

    def _lookup_leased(self, chain: RestChain, group: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """A step ``chain``'s lookup lease covers (``_cheap_unlooked``): its key's requests rest unasked, the
        step is counted and its plain sample kept for the fold (``_observe_gate``), as a feature drafter's
        leased step (``_rests_again``); returns the rest of ``group``. The records are not aged: a resting
        request of a cheap proposer never was (its record counts steps with a draft found)."""
        counters = self._counters
        counters["spec_paused_steps_total"] += 1
        counters["spec_rest_leased_steps_total"] += 1
        counters["spec_rest_unlooked_steps_total"] += 1
        chain.lease -= 1
        chain.leased += 1
        chain.step += 1
        self._gate_arms[chain.key] = False
        self._lookup_step = self._lookup_chain = chain
        return [] if chain.exact else [s for s in group if s.seq.gate_key != chain.key]

    def _end_lookup(self) -> None:
        """A lookup lease (``_cheap_unlooked``) whose batch is gone, or that a step with prompt chunks broke,
        ends: the gate takes its leased steps now."""
        chain, self._lookup_chain = self._lookup_chain, None
        self._fold(chain)

    def _cheap_beside_prompts(self, batch: list[ScheduledSeq], group: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """A step with prompt chunks: the requests of ``group`` (a cheap proposer's) that the gate rests
        whatever they would find leave it before the lookup; the rest stay. With ``beside_prompts`` off (the
        default) the gate rests every gated request of such a step without asking (``_gate_drafts``), so
        ngram's lookup for them was done for nothing; each gate key is still told, as before, so its arm
        and the paused-step count are set alike (a key is now counted even where no request of it found a
        draft). Ungated requests (fixed γ) keep their lookup.
        Why: at turn lengths on the H100 (session 44, run DS) the gated ngram row on coding drafted 6-20
        steps a run and still ran 0.91-0.93× `none`, its decode steps ~9% slower: every resting step looks
        up every request (0.16-0.28 ms a step for 32 coding prompts on the CPU machine,
        tests/engine/ngram_rest_probe.py). This removes the prompt steps' share of that; the decode steps'
        share goes where the gate is sure to rest (``_cheap_unlooked``). Lossless: ngram's drafts
        are a deterministic function of the context, and these would all have been dropped."""
        self._end_lookup()           # no lease covers a step with prompt chunks
        if not self._gate_on() or self.spec_gate.beside_prompts:
            return group
        gated = [s for s in group if s.seq.gate_key is not None]
        if gated:
            self._gate_rests(batch, gated)     # every key rests on this step: the arm and counter as before
        return [s for s in group if s.seq.gate_key is None]

    def _drop_undrafted(self, proposer, group: list[ScheduledSeq], limits: list[int]) -> None:
        """Requests the gate let draft that the proposer cannot draft for (a feature drafter's request
        with no features since a rest, or no room left under max_tokens) do not draft: they leave this
        step's drafting records (``_gate_drafting``), and a gate key none of whose requests drafts
        reports no sample. Asked before proposing: a proposer that works and finds nothing (ngram) paid
        for its drafting step, which stays a sample.

        Why: a resting request has dropped its features (``_rest``), so at the first step the gate lets
        it draft without an announcement (a new request's class turned the batch's prediction) it has
        nothing to draft from, and emits one token. Recorded as a drafting step, that token lowered its
        own record and, before its first capture (no drafter context yet), its class's pooled record:
        the next prediction rested it again, and the next request of its class started lower. A step
        where nobody drafted was a plain step, and is no sample of the drafting arm either. H200,
        session 12 (run AI): support and coding at c = 8 drafted through the first of three repeats
        (support 1.32× plain), then rested through the other two, whose probes' drafts were accepted at
        0.13-0.14 a token against 0.47 in the first; these records are one way a rest feeds itself
        (which step turned them is not in the run's records)."""
        features = bool(getattr(proposer, "capture_layers", ()))
        empty = {id(s.seq) for s, limit in zip(group, limits)
                 if limit <= 0 or features and s.seq.draft_feats is None}
        if not empty:
            return
        for key in {s.seq.gate_key for s in group if id(s.seq) in empty}:
            kept = [q for q in self._gate_drafting.get(key, ()) if id(q) not in empty]
            if kept:
                self._gate_drafting[key] = kept
            elif self._gate_drafting.pop(key, None) is not None:
                self._gate_arms.pop(key, None)

    def _gate_rests(self, batch: list[ScheduledSeq], candidates: list[ScheduledSeq],
                    lengths: dict[int, int] | None = None) -> list[tuple[str, list[ScheduledSeq]]]:
        """Ask the gate once per gate key about the gated requests among ``candidates``; the keys it rests,
        with their requests. The ones that draft go on the acceptance records (``_gate_drafting``).
        ``lengths``: each candidate's draft length, when proposed before the gate (the tokens to verify)."""
        rests = []
        for key, members in by_gate_key(candidates).items():
            verify = None if lengths is None else sum(lengths[id(s)] for s in members)
            if self._gate_drafts(batch, key, members, verify):
                if self._gate_arms.get(key):        # the gate is on and chose to draft
                    self._gate_drafting.setdefault(key, []).extend(s.seq for s in members)
                continue
            # asked on pure decode steps only, the only ones where an explorer drafts (a step with prompt
            # chunks asked it of every gated decoder for nothing)
            explorers = {id(s) for s in members
                         if self.spec_gate.explores(s.seq.gate_acceptance)} if self._decode_step else ()
            if explorers:                                # they draft to measure their class (``explores``);
                self._gate_arms.pop(key, None)            # the step is no sample of the cell
                # counted apart where an auto request measuring its method drafts (``Choice.drafts``): the
                # steps a batch paid for the chooser's measurements (session 58, runs QA-QD)
                measuring = any(s.seq.gate_acceptance.measures for s in members if id(s) in explorers)
                self._counters["spec_measure_steps_total" if measuring else "spec_class_explore_steps_total"] += 1
                self._gate_drafting.setdefault(key, []).extend(s.seq for s in members if id(s) in explorers)
                members = [s for s in members if id(s) not in explorers]
            if members:
                rests.append((key, members))
        return rests

    def _gate_key_for(self, method: str, request) -> str | None:
        """The gate key of a request of ``method`` (its ``Request``), or None when the gate does not decide
        for it. A request's method and schedule never change, so the engine sets ``seq.gate_key`` once, at
        admission (``_admit_speculation``): asked for every request at every step, these checks were a third
        of the gate's host time per step on the CPU probe."""
        if method == "none":
            return None
        schedule = self._schedule_of(request)
        return gate_key_name(method, schedule) if self._gated(self._proposer(method), schedule) else None

    def _gate_drafts(self, batch: list[ScheduledSeq], method: str, gated: list[ScheduledSeq],
                     verify: int | None = None) -> bool:
        """The measured pre-draft gate (specd/engine/spec_gate.py): do the ``gated`` requests of gate key
        ``method`` draft this step? Confidence-scheduled requests of feature drafters with a confidence
        head and requests on the ``gated`` schedule are gated; ``fixed`` requests always draft (their γ is
        what was asked for). A profile injected into ``self.sps`` (tests pinning the scheduler's decisions)
        keeps the gate off (``_gate_on``). Lossless: the answer depends on earlier steps' measured rates and acceptance only,
        never on this step's drafts."""
        if not self._gate_on():
            return True
        if not (self._decode_step or self.spec_gate.beside_prompts):
            # a step with prompt chunks (never measured) drafts only with ``beside_prompts`` (off): not
            # asked, so the records of every gated decoder are not gathered for nothing
            drafting = False
        else:
            records = [s.seq.gate_acceptance for s in gated]
            drafting = (self.spec_gate.should_draft(method, len(batch), requests=records, verify=verify,
                                                    caps=[self._draft_limit(s.seq) + 1 for s in gated])
                        if self._decode_step
                        else self.spec_gate.drafts_beside_prompts(method, len(batch), records, verify))
        self._gate_arms[method] = drafting
        self._counters["spec_paused_steps_total"] += not drafting
        return drafting

    def _rest(self, seqs: list[Sequence]) -> None:
        """A resting sequence captures no target features, so a step where all of them rest is exactly a
        plain decode step (on CUDA: the plain decode graph). Its unabsorbed features are absorbed into its
        drafter context first where the drafter allows (``FeatureProposer.absorb_before_rest``; until
        session 12 they were dropped, and with them the accepted tokens of its last drafting step, or its
        whole prompt when it rested from its first decode step); its context is kept, and the features
        after the rest are appended behind it (``_stitch``)."""
        pending: dict[str, list[Sequence]] = {}
        for seq in seqs:
            if seq.draft_feats is not None and len(seq.draft_feats):
                pending.setdefault(seq.method, []).append(seq)
        for method, group in pending.items():
            self._absorb_pending(method, group)
        for seq in seqs:
            self._resting.add(id(seq))
            seq.draft_feats = None
            seq.prompt_forced = False

    def _absorb_pending(self, method: str, group: list[Sequence]) -> None:
        """The pending features of resting requests (``_rest``) or kept ones (``_keep_context``) of one
        method into their drafter contexts, where the drafter allows (``FeatureProposer.absorb_before_rest``).

        A drafter pass in a step the gate would report as plain: the step is no sample of either arm
        (``_observe_gate``), and its time is charged to drafting, which the contexts serve. H200, session 13,
        run AP: the b16 cell's exploration sampled plain steps of 16 at 4.1, 10.3, 4.1, 7.8 and 7.6 ms (warm-up
        runs, where new requests with captured prompts rest from their first decode step: the likely cause,
        not isolated), rated plain decoding at 2,328 tok/s where its steps ran ~3,500, and coding drafted at
        c = 16 through three of four repeats at 0.86x `none`. A prompt captured only by
        ``SpecGate.capture_prompts`` is absorbed whichever arm the cell takes: that setting's cost, not
        drafting's. H100, session 47, run FD: charged to drafting, the capture row's b4 cell on extraction
        read drafting at 1,522 tok/s (the default row's: 3,300-4,300) and rested where drafting ran 1.68x
        `none`."""
        absorb = getattr(self._proposer(method), "absorb_before_rest", None)
        if absorb is not None and absorb(group):
            self._rest_absorbed = True
            self._gate_capturing.update(q.gate_key for q in group if q.gate_key is not None and not q.prompt_forced)

    @staticmethod
    def _keeps(seq: Sequence) -> bool:
        """Does a decoding request keep capturing through a step with prompt chunks? Yes when it is
        capturing now (its features are not None: unabsorbed ones, or the drafter's raw tail).

        Why: such a step drafts for nobody (it is never measured, and its shape is one the warm-up did
        not see), and until session 12 it also rested every gated decoder, which drops unabsorbed
        features (``_rest``). A request whose prefill finished one step before another request's prompt
        chunk lost its whole prompt's features that way, and drafted from a context without its prompt
        to its end; a request that had just drafted lost its accepted tokens' features (a gap). H200,
        runs AF/AH: at c ≥ 8, where prompts arrive beside decoders, scheduled dspark's drafts were
        accepted at 0.36 a token on extraction against fixed γ = 7's 0.44-0.47 (fixed requests are not
        gated, so they never rested), and it ran at 0.97× plain decoding where fixed γ = 7 ran 1.32×.
        Capturing in such a step costs little beside the prompt chunk it runs with."""
        return seq.draft_feats is not None

    @staticmethod
    def _stitch(seq: Sequence, first: int) -> None:
        """The first features after a rest start at absolute position ``first``; the context ends at
        ``offset + n``. The positions in between were never captured: the drafter context simply lacks
        them (its positions are its own, so RoPE distances across the gap are shorter than the true
        ones: lower acceptance, never a wrong token). ``offset`` grows by the gap, which keeps
        ``offset + n`` the next absolute position and marks the context as gapped, so it never
        publishes to kvd again (its blocks would not match the target's)."""
        ctx = seq.draft_ctx
        ctx.offset += max(0, first - (ctx.offset + ctx.n))

    @staticmethod
    def _gated(proposer, schedule: str | None) -> bool:
        """Does the measured gate decide whether a request on ``schedule`` (its own, else the deployment's;
        None: unset) drafts? Confidence-scheduled requests of feature drafters with a confidence head, and
        every request on the ``gated`` schedule (fixed γ, any method: on the H200 ngram ran at 1.24× plain
        decoding at c = 1 and 0.57× at c = 32, run H)."""
        if schedule == "gated":
            return True
        confident = getattr(proposer, "capture_layers", ()) and getattr(proposer, "has_confidence", True)
        return bool(confident) and confidence_scheduled(schedule)
