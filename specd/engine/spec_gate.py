"""The measured pre-draft gate: whether the scheduled requests of a method draft at all this step.

The confidence scheduler decides *how many* drafts a request verifies from a cost model (SPS(B), the step
overhead). A cost model can be wrong (CUDA graphs vs eager, a Markov loop that costs a third of a round,
kernel launch overhead that no profile saw), and a wrong one keeps drafting where drafting loses: on the
H200, scheduled DSpark ran at 0.46-0.87× plain decoding. So whether to draft is decided by measurement
only: the engine reports every measurable step's output (tokens emitted by the whole batch) and wall time
under the arm it ran (drafting or resting), per method and per load bucket (the batch's sequences, rounded
down to a power of two), and the gate drafts only where drafting's measured rate beats plain decoding's
by ``margin`` (3%), both per sequence of the batch (``Rate.per_seq_s``: a bucket holds n to 2n − 1).

Whose acceptance: the step time of an arm is a property of the load, but the tokens a drafting step
emits are a property of the requests in it. One engine serves workloads whose drafts are accepted at very
different rates (on the H200, fixed γ = 7 ran at 1.46× plain decoding on extraction and 0.59× on creative
writing at concurrency 1). So the cell's measured drafting rate is scaled, for each step, by the requests
in the batch: each request that has drafted carries its own decayed record of tokens per drafting step,
shrunk toward the cell's drafting requests (``PRIOR_STEPS`` steps of weight), and the predicted drafting
rate is the cell's rate × (the batch's predicted tokens per sequence / the cell's measured ones), where a
sequence that does not draft this step counts one token. A new request starts at its prompt class's
acceptance (its first ``CLASS_TOKENS`` tokens: one application's system turn), pooled over the class's
requests and shrunk toward the cell's the same way; a class that recurs drafts its first few steps on its
own (``explores``), so a cell resting on one application still learns another's acceptance.
(Until session 6 the records, tokens per *drafting request*, were compared with the cell's tokens per
*sequence*. For ngram, gated over the few requests it found a match for, that overrated every match by
the share of the batch that found none: on the H200, ngram-gated drafted on at c = 32 at 0.57× plain.)

Recovery: the losing arm is probed for ``probe_steps`` steps, as often as a probe budget allows: the wait
before the next probe is the probe's expected cost (its steps × their length in winner's steps × the
fraction of its rate the loser loses) over ``PROBE_BUDGET`` (0.5% of the cell's time), between
``probe_every`` and ``probe_max`` steps. A
near-tie is probed often (it is cheap and likely to flip), a clear loser rarely. (Until session 4 the wait
doubled after each confirming probe; after two workloads where drafting lost, it had grown to hundreds of
steps, and the third workload, where drafting won, ran out before the next probe.) Measurements age by
steps of the cell, not by samples of an arm (both arms' sums shrink by ``decay`` at every measured step):
the winner averages its last ~1/(1 − decay) steps, and the loser's rate is essentially its latest probe,
so one probe is enough to see that the loser now wins. A probe of drafting that is a clear loser ends after
its first sample (``probe_cut``, ``_cuts``), except every third probe of a cell. ``probe_next`` tells the
engine a probe of drafting starts at the next measured step, so resting requests capture that step's target
features: the probe then drafts from a context that ends at the newest token instead of one that misses the
whole rest.

Load prior: drafting's advantage shrinks as the batch grows (verify tokens grow with it, the memory-bound
decode step does not). A new cell whose next smaller explored bucket rests starts resting: it explores
plain decoding, and drafting only through probes, instead of paying ``min_samples`` drafting steps at a
load where drafting already lost at a lighter one.

Warm-up samples: the first measured step of each arm in a cell is no sample (``warmup``). It is the
cell's first step at its shape, where one-off costs land that the engine cannot see (allocator growth,
library heuristics). Session 9, run X: the b4 cell's 5 exploring drafting samples averaged 78 tok/s
against 970 plain on coding, where fixed γ = 7 ran at 0.73× plain in the timed runs, not 0.08×. The
cell then rested, its probe wait at the 1,024-step maximum, through extraction, where fixed γ = 7 ran at
1.32× plain. Which step held the cost was not recorded; ``trace`` now keeps each cell's first
``trace_steps`` reports (``TRACE_STEPS`` by default), so the next run's records say. Triton compiles and CUDA graph captures are
excluded by the engine at any step (specd/engine/compile_count.py), one-off costs it can see.

Stalled plain steps: a plain sample counts at most ``PLAIN_CLIP`` times the fastest of its cell's last
``PLAIN_WINDOW`` plain steps (``_clip_plain``). One stall among a cell's few plain samples rated plain
decoding at well under half its rate, and the cell drafted where drafting lost (H100, session 41, run DN:
0.62x `none` on coding at c = 16). Drafting samples are taken as measured: a slow one can only make the
gate rest.

Steady rests: a resting step's full question walks every gated request, ~70 µs a step on the H200's host
at c = 8 (session 10, run AA: the scheduled row's whole 1.6% gap there). ``rests_again`` answers it
without the walk when the answer is sure: the same requests (or some of them) rested on the prediction at
the last step, and drafting at the most their aging records can reach (``Cell.rest_bound``) still loses.

Calibration (``calibrate``, off by default): a cell scales the acceptance its requests' records predict by
what its own drafting steps emitted against their predictions (``Cell.calibration``, shrunk toward 1). The
records are learnt where each request drafted; at a heavier load, or after a rest that left its drafter
context gapped, the same requests emit less (session 52, run JB: support at c = 32, 0.66 of the prediction,
0.96x `none`). Measured in session 53 it did not pay (``SpecGate.__init__`` says where it lost).

Steady prices (``steady_price``, on by default since session 54): a resting cell's drafting arm is its
latest probe, a drafting phase's opening, whose steps cost 10-50% more than the same cell's steady drafting
(H100 and H200, sessions 53-54); each cell measures that ratio (``Cell.opening``) and prices its drafting
arm at a steady step's time, so a switch is judged by the phase it would start, not by its first steps.

Lossless: whether a step drafts depends only on the wall time and token counts of earlier, finished
steps, never on the drafts of this step; verification is untouched.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from math import ceil, inf

from specd.engine.gate_records import (CLASS_DECAY, CLASS_TOKENS, REQUEST_DECAY,  # noqa: F401 (re-exported)
                                       RESTING_DECAY, Acceptance, ClassRecord, Drafters, Rate, prompt_class)
from specd.engine.method_choice import MethodChoice

MIN_SAMPLES = 5      # measured steps per arm before the comparison is trusted (drafting explored first);
                     # a step's accepted drafts vary a lot, so fewer samples often misjudge drafting
PROBE_EVERY = 16     # the shortest wait (measured steps of a cell) between probes of the losing arm
PROBE_MAX = 2048     # the longest wait (~5-7 s of a resting cell at c = 16-32 on the H200)
PROBE_BUDGET = 0.005 # a probe's expected cost over the steps waited before it: ≤ 0.5% of a cell's throughput.
                     # 1% until session 31: where the gate rested, exploration cost 0.55-0.75% of a run's wall at
                     # c = 16 / 32 against 0.23-0.47% at 0.5% (H200, session 30, runs CQ and CR, the same runs;
                     # ``python -m bench.exploration_cost``), and 1% was as much as the row's whole gap to `none`
PROBE_STEPS = 3      # consecutive steps of a probe
PROBE_CUT = 2.0      # a probe of drafting ends once it has a sample when drafting at this many times the rate
                     # now predicted would still lose (``SpecGate._cuts``): a clear loser
PROBE_FULL_EVERY = 3 # ... but at least every third probe of a cell runs all its steps (the first sample is biased low)
DECAY = 0.9          # weight of the older measurements at each measured step of a cell (~10 steps of memory)
MARGIN = 0.03        # drafting must beat plain decoding by this fraction: a rate measured over a 2-step probe
                     # is noisy, and on the H200 near-ties flipped the arms and cost more than they won
PRIOR_STEPS = 2.0    # weight, in drafting steps, of the cell's acceptance in a request's own estimate
CLASS_EXPLORE = 3    # drafting steps a recurring class takes on its own before the gate trusts its record
MAX_CLASSES = 4096   # classes remembered (least recently admitted forgotten first): unique prompts stay bounded
WARMUP = 1           # first measured steps of each arm of a cell that are no sample (one-off costs)
TRACE_STEPS = 16     # reports kept per cell, in order, for the records (``SpecGate.trace``)
KEEP_NEAR = 0.7      # with ``keep_context``: a resting cell keeps its requests' drafter contexts whole while its
                     # last prediction put drafting at this share of plain decoding's rate or more (``keeps_context``)
LEASE_STEPS = 8      # steps of a steady rest the engine may take after one sure answer without asking (``rest_lease``)
SPAN_STEPS = 32      # decode steps of a rest span: a whole-batch lease that also covers prompt steps and the
                     # admissions that join the rest's bound (``GateSteps._span_rests``, session 32)
CHARGE_STEPS = 1.0   # held capture time a drafting sample carries at most, in the cell's plain steps; the rest
                     # waits for the next drafting samples (``SpecGate.charge``, session 39)
PLAIN_CLIP = 2.0     # a plain sample counts at most this many times the fastest of its cell's last PLAIN_WINDOW plain
PLAIN_WINDOW = 8     # steps (warm-ups included): one stalled step must not make drafting look faster. H100,
                     # session 41, run DN (undertrained drafters, τ ~1.5): one plain sample of 23.3 ms among
                     # ~2.9 ms ones rated plain decoding at 2,160 tok/s in coding's b16 cell, drafting
                     # (~3,000) ran as the winner for ~100 steps a run at ~3.2 tok/ms against plain's ~6, and
                     # scheduled dspark ran 0.62x `none` there (0.67x at c = 4, the same way)
CALIBRATION_STEPS = 5.0  # weight, in drafting steps, of "predictions are right" (a factor of 1) in a cell's
                         # calibration (``Cell.calibration``): one probe's steps cannot halve a prediction
CALIBRATION_DECAY = 0.98 # weight of a cell's older calibrated drafting steps (~50 steps of memory, by drafting
                         # step: a resting cell's probes, hundreds of steps apart, still add up). Chosen on
                         # session 51-52's records (``python -m bench.gate_trace RESULT --replay-calibration``):
                         # against 0.95 and 3 steps it turns about half as many near-tie winner steps at c <= 8 to
                         # rests (157 against 278 of 3,208 in JA; a step at c = 1 emits whole tokens, so a short
                         # memory swings the factor 0.88-1.21) and nearly as many of support c = 32's (23 against 25
                         # of 28 in JB)
OPENING_STEPS = 3     # a drafting phase's first steps (a probe's), which ``SpecGate.steady_price`` prices apart
OPENING_DECAY = 0.95  # weight of a cell's older opening (or steady) drafting steps, by its own steps of that kind
OPENING_MIN = 2.5     # weight each kind needs before ``Cell.opening`` is taken as measured (3 steps, decayed)
OPENING_MAX = 2.0     # the most ``Cell.opening`` reads: a phase's opening at twice a steady step's time
DRAFT_REASONS = ("explore", "probe", "winner")   # a new cell's exploration, a probe of the losing arm, the winner


def _basis(basis: tuple) -> list:
    """A report's decision basis, rounded for the records; [None] * 3 when the step had none."""
    if not basis:
        return [None, None, None]
    acceptance, predicted, plain = basis
    return [None if acceptance is None else round(acceptance, 3), round(predicted, 1), round(plain, 1)]


class GateError(ValueError):
    """A gate setting or a step measurement that cannot be used."""


def load_bucket(sequences: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two ≤ ``sequences``. Rates differ by load; buckets keep a
    handful of cells, so each one gets enough samples."""
    return 1 << (max(1, sequences).bit_length() - 1)


def carried_bound(high: "Cell", low: "Cell") -> float | None:
    """The bound ``high``'s rest holds for any subset of its requests (``rest_bound``), as a bound at ``low``:
    raised by how much more ``low``'s drafting prior is (``SpecGate.carries_rest`` says why that covers
    every estimate there); None without a prior in either cell (no drafting sample: no estimate to bound)."""
    high_prior, low_prior = high.draft.per_drafter_step, low.draft.per_drafter_step
    if high.rest_bound is None or high_prior <= 0 or low_prior <= 0:
        return None
    return high.rest_bound[1] + max(0.0, low_prior - high_prior)


@dataclass
class Cell:
    """One (method, load bucket): both arms' rates and the probe clock."""

    draft: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    wait: int = PROBE_EVERY   # measured steps between the last probe and the next
    clock: int = 0            # measured steps since the last probe (or since both arms were explored)
    probe_left: int = 0       # steps of the current probe still to run
    probe_arm: bool = False   # the arm the current probe runs (fixed when it starts)
    probe_from: int | None = None   # the drafting arm's samples when the current probe started; None: it runs
                                    # all its steps (``SpecGate._cuts``)
    cuts_in_row: int = 0      # probes cut since the last one that could not be (``PROBE_FULL_EVERY``)
    resting_prior: bool = False   # started resting: a smaller bucket of the method had drafting lose
    trace: list = field(default_factory=list)   # the first ``SpecGate.trace_steps`` reports (``SpecGate.trace``)
    recent: deque = field(default_factory=lambda: deque(maxlen=TRACE_STEPS))   # the latest ones
    reason: str = ""          # why the last measured step of this cell ran its arm (DRAFT_REASONS)
    basis: tuple = ()         # what decided it: (predicted acceptance, predicted drafting tok/s, plain tok/s),
                              # both rates per sequence × the step's sequences
    rest_bound: tuple | None = None   # while the prediction rests its requests: the highest acceptance they
                                      # can drift to, for them and for any subset (``SpecGate.rests_again``)
    rest_admitted: int = -1   # ``SpecGate.admitted`` when ``rest_bound`` was taken (a new request may explore)
    capture_s: float = 0.0    # capture steps' time over plain steps since the last drafting sample (``charge``)
    plain_recent: deque = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))   # raw plain step seconds
                                                                                     # (``SpecGate._clip_plain``)
    lease_basis: tuple = ()   # ``basis`` of the answer that granted the current rest lease (``rest_lease``)
    near: bool = True         # the last measured prediction put drafting at ``keep_near`` of plain or more
                              # (``SpecGate.keeps_context``; True until a prediction is made)
    cal_emitted: float = 0.0     # decayed sums over the cell's drafting samples decided on a prediction: tokens
    cal_predicted: float = 0.0   # emitted a sequence, the acceptance predicted for them, and the steps
    cal_steps: float = 0.0       # (``calibration``; SpecGate.calibrate)
    phase_at: int = 0            # the last measured step's place in its drafting phase (0: it rested)
    # drafting samples' step times at places 1 to ``OPENING_STEPS`` of their phase, and at the later places,
    # each decayed by ``OPENING_DECAY`` at its own samples (``opening``; SpecGate.steady_price)
    opening_steps: Rate = field(default_factory=Rate)
    steady_steps: Rate = field(default_factory=Rate)

    @property
    def calibration(self) -> float:
        """Emitted over predicted tokens a sequence in this cell's drafting steps, shrunk toward 1 by
        ``CALIBRATION_STEPS``: what ``draft_rate`` scales a prediction from the requests' records by.

        Why: a request's record, and its class's, are learnt where it drafted, and the load and the
        context it drafts from here can make the same request emit less. H100, session 52, run JB: support
        at c = 32 rested and drafted after rests, from gapped contexts and at the short verify lengths of
        a full batch; its b32 cell predicted 2.8-3.6 tokens a sequence from records learnt at lighter
        loads, the steps gave 1.0-2.5 (emitted / predicted 0.66 over 37 steps; HB's 0.70), so it drafted
        21 steps a run at 6.5 tokens a ms against plain decoding's 9.1, 0.96x `none` (``python -m
        bench.gate_trace RESULT --calibration``). Where cells draft steadily the ratio was 0.97-1.04, so
        the factor stays near 1 there. Per cell (method, load), because the load is what the records do
        not see; it moves only on a drafting sample, as the drafting arm does, so the steady-rest bounds
        (``SpecGate.rests_again``) stay sure between drafting samples."""
        if self.cal_predicted <= 0:
            return 1.0
        ratio = self.cal_emitted / self.cal_predicted
        return (ratio * self.cal_steps + CALIBRATION_STEPS) / (self.cal_steps + CALIBRATION_STEPS)

    def calibrate(self, emitted: float, predicted: float) -> None:
        """One drafting sample decided on a prediction: ``emitted`` and ``predicted`` tokens a sequence."""
        self.cal_emitted = self.cal_emitted * CALIBRATION_DECAY + emitted
        self.cal_predicted = self.cal_predicted * CALIBRATION_DECAY + predicted
        self.cal_steps = self.cal_steps * CALIBRATION_DECAY + 1.0

    @property
    def opening(self) -> float:
        """How much longer a drafting phase's first ``OPENING_STEPS`` steps take than its later ones, in this
        cell: the ratio of their decayed mean step times, 1 until each kind has ``OPENING_MIN`` steps of
        weight, at most ``OPENING_MAX``.

        Why: a resting cell's drafting arm is essentially its latest probe (``DECAY``), and a probe is a
        phase's opening, whose steps cost more than the phase's later ones (why is not measured; its drafts
        come from a context with the rest's gaps). H100, session 53, runs KA and KC, within one (workload,
        concurrency) cell: b4 phases opened at 4.1-4.4 ms a step on coding, knowledge and support and
        settled at 3.3-3.7 from the 4th step on (b8 on extraction 5.4 against 3.8; ``python -m
        bench.gate_trace RESULT --phase-steps``). Priced at its opening, a switch to drafting that would run
        as a long phase looks 10-40% dearer than it is, and the cell rests where fixed γ = 7 ran 1.42x
        `none` (support at c = 4; the schedule 1.16x). H200, session 54, run LB: on extraction at c = 16 the
        b16 phases opened at 7.5-8.1 ms and settled at 5.2; priced at steady phases the cell drafted and ran
        1.37x `none`, priced at its probes it rested (0.99x)."""
        opened, steady = self.opening_steps, self.steady_steps
        if opened.steps < OPENING_MIN or steady.steps < OPENING_MIN or steady.step_s <= 0:
            return 1.0
        return min(OPENING_MAX, max(1.0, opened.step_s / steady.step_s))

    def time_phase(self, seconds: float) -> float:
        """One drafting sample of ``seconds`` at place ``phase_at`` of its phase: into the opening or steady
        sums (every cell measures them; ``stats``). Returns the seconds a steady-priced drafting arm takes
        (``SpecGate.steady_price``): an opening step's over ``opening`` as it read before this sample, a
        steady step's as measured."""
        opening = self.phase_at <= OPENING_STEPS
        scaled = seconds / self.opening if opening else seconds
        kind = self.opening_steps if opening else self.steady_steps
        kind.age(OPENING_DECAY)
        kind.add(0, seconds, 1)
        return scaled

    def draft_rate(self, acceptance: float | None, verify: int | None = None) -> float:
        """The drafting rate per sequence (``Rate.per_seq_s``) predicted for a batch whose drafting step
        emits ``acceptance`` tokens per sequence (all of the batch's sequences, drafting or not) and
        verifies ``verify`` draft tokens, from the cell's measured rate, tokens per sequence and step
        times.

        Per sequence, because a bucket's batches differ in size: at c = 8 under a closed loop, a request
        that finishes leaves 7 decoding beside the next one's prompt, and 7 is bucket 4, where c = 4 runs
        4. Compared in tokens per second, an arm sampled on 7-sequence batches beat one sampled on
        4-sequence batches by up to 7/4 whatever it did (H200, session 12, run AL: the b2 cell's plain
        arm, sampled on 2 sequences, rated 514 tok/s, and drafting on 3 sequences was predicted to beat
        it while a plain step of 3 ran ~700 tok/s; knowledge at c = 4 drafted 4-11 steps a run, these
        among them, at 4-9% acceptance, and ran 0.85× plain; at c = 16 the b8 cell's plain rate followed
        the draining batch's sizes). A decode step's time grows slowly with the batch (memory-bound), so
        tokens per second per sequence is about constant across a bucket, for both arms alike."""
        rate = self.draft.per_seq_s
        measured = self.draft.per_seq_step
        if acceptance is not None and measured > 0:
            rate *= acceptance * self.calibration / measured
        if verify is not None:
            rate *= self._time_scale(verify)
        return rate

    def _time_scale(self, verify: int) -> float:
        """The cell's drafting step time over the one predicted for ``verify`` draft tokens: a line
        through the two measured points, a plain step (no draft token) and the mean drafting step
        (its mean draft tokens). Why: the drafting rate was measured on whichever requests drafted
        before; a batch where ngram matched for every request verifies several times the tokens of one
        where it matched for a few (H200, run L: ngram-gated drafted every step of extraction at c = 32,
        0.81× plain decoding, as fixed-γ ngram did). 1.0 when either point is missing."""
        mean = self.draft.verified / self.draft.steps if self.draft.steps > 0 else 0.0
        t_draft, t_plain = self.draft.step_s, self.plain.step_s
        if mean <= 0 or t_plain <= 0 or t_draft <= t_plain:
            return 1.0
        return t_draft / (t_plain + (t_draft - t_plain) * max(0, verify) / mean)

    def drafting_wins(self, margin: float = 0.0, acceptance: float | None = None, verify: int | None = None) -> bool:
        return self.beats_plain(self.draft_rate(acceptance, verify), margin)

    def beats_plain(self, rate: float, margin: float = 0.0) -> bool:
        """Does a predicted drafting ``rate`` (per sequence) beat plain decoding's measured one by ``margin``?"""
        return rate > self.plain.per_seq_s * (1.0 + margin)


class SpecGate:
    """Per (method, load bucket): explore both arms, then run the predicted winner, probing the loser."""

    def __init__(self, min_samples: int = MIN_SAMPLES, probe_every: int = PROBE_EVERY,
                 probe_steps: int = PROBE_STEPS, decay: float = DECAY, probe_max: int = PROBE_MAX,
                 margin: float = MARGIN, probe_budget: float = PROBE_BUDGET, prior_steps: float = PRIOR_STEPS,
                 warmup: int = WARMUP, beside_prompts: bool = False, probe_cut: float | None = PROBE_CUT,
                 charge_steps: float | None = CHARGE_STEPS, plain_clip: float | None = PLAIN_CLIP,
                 capture_prompts: int | None = None, trace_steps: int = TRACE_STEPS,
                 keep_context: int | None = None, keep_near: float = KEEP_NEAR, calibrate: bool = False,
                 steady_price: bool = True, class_decay: float = CLASS_DECAY):
        if (min_samples < 1 or probe_steps < 1 or probe_every < 1 or probe_max < probe_every
                or not 0 < decay <= 1 or not 0 <= margin < 1 or not 0 < probe_budget <= 1 or prior_steps < 0
                or warmup < 0 or probe_cut is not None and not probe_cut >= 1
                or charge_steps is not None and not charge_steps > 0
                or plain_clip is not None and not plain_clip >= 1
                or capture_prompts is not None and not capture_prompts >= 1
                or keep_context is not None and not keep_context >= 1 or not 0 <= keep_near <= 1
                or not 0 < class_decay <= 1):
            raise GateError(f"bad gate settings: min_samples={min_samples}, probe_every={probe_every}, "
                            f"probe_max={probe_max}, probe_steps={probe_steps}, decay={decay}, margin={margin}, "
                            f"probe_budget={probe_budget}, prior_steps={prior_steps}, warmup={warmup}, "
                            f"probe_cut={probe_cut}, charge_steps={charge_steps}, plain_clip={plain_clip}, "
                            f"capture_prompts={capture_prompts}, keep_context={keep_context}, keep_near={keep_near}, "
                            f"class_decay={class_decay}")
        self.warmup = warmup
        # True: gated requests draft in a step with prompt chunks where the measured steps say drafting
        # wins (``drafts_beside_prompts``). Off: on the H200 it lost (session 13, run AP, in the same run:
        # 0.94 / 0.92x `none` at c = 16 / 32 against 0.99 / 0.96x off; a step with a prompt chunk and
        # drafts cost ~2x one without at c >= 16). ``bench speedup``'s dspark-beside-prompts row runs it.
        self.beside_prompts = beside_prompts
        self.min_samples, self.probe_every, self.probe_steps, self.decay = min_samples, probe_every, probe_steps, decay
        self.margin, self.probe_budget, self.prior_steps = margin, probe_budget, prior_steps
        self.probe_max = probe_max
        # a probe of drafting whose first sample shows drafting losing even at ``probe_cut`` times its
        # predicted rate ends there instead of after ``probe_steps`` steps (None: every probe runs them all)
        self.probe_cut = probe_cut
        self.probes_cut = 0        # probes ended after their first sample (``should_draft``)
        # the held capture time a drafting sample carries at most, in plain steps (None: all of it, as
        # until session 39; ``charge``)
        self.charge_steps = charge_steps
        # a plain sample counts at most ``plain_clip`` times its cell's fastest recent plain step (None: as
        # measured, the rule until session 41; ``_clip_plain``)
        self.plain_clip = plain_clip
        self.plain_clipped_s = 0.0   # plain steps' time over their clip, left out of the plain arm, in all
        # a prompt joining a decode batch of this load bucket or a lighter one captures its target features
        # whatever the cell decides (``captures_prompt``; None: only where the gate would draft, explore or
        # probe). Off by default: ``bench speedup``'s dspark-capture-prompts row measured it on the H100 in
        # session 47 (runs FD, FE): 0.90-0.98x `none` at c = 4 against the default's 1.08-1.15x
        self.capture_prompts = capture_prompts
        # in this load bucket and lighter ones, requests the gate rests keep capturing their target features
        # while the cell is near a tie (``keeps_context``; None: a rest captures nothing). Off by default:
        # ``bench speedup``'s dspark-keep-context row measures it (session 48)
        self.keep_context, self.keep_near = keep_context, keep_near
        # each cell scales the acceptance its requests' records predict by what its drafting steps emitted
        # against their predictions (``Cell.calibration``; False: records taken as they are). Off by default:
        # on the H100 in session 53 (runs KA-KC, against the records as they are in the same runs) it lost
        # at c = 4 in two runs (geometric means 1.02 and 1.12 against 1.16 and 1.17; coding 0.92x `none` in
        # KC), where a factor a little under 1 carried from one workload's cell into the next turned near
        # ties to rests that a probe's wait then held; at c = 16 / 32 1.00 / 1.00 against 0.99 / 0.99.
        # ``bench speedup``'s dspark-calibrated row measures it
        self.calibrate = calibrate
        # each cell prices its drafting arm at a steady phase's step time: a phase's opening steps (a probe's)
        # join the arm at their time over the cell's measured opening ratio (``Cell.opening``, ``time_phase``;
        # False: as measured, the rule until session 54). On by default since session 54's H200 runs (LA, LB,
        # against the old rule in the same runs): geometric mean over 25 cells 1.127x `none` against 1.111;
        # 1.28 / 1.19 / 1.10 / 1.06 / 1.02 at c = 1 / 4 / 8 / 16 / 32 against 1.31 / 1.17 / 1.12 / 1.00 / 0.98;
        # extraction at c = 16 1.37x against 0.99 (b16 phases opened at 7.5-8.1 ms a step and settled at 5.2).
        # ``bench speedup``'s dspark-opening-priced row runs the old rule
        self.steady_price = steady_price
        # the weight a prompt class's pooled record keeps of its older drafting steps at each new one
        # (``ClassRecord.decay``): where a resting request's estimate drifts back to (``Acceptance.rest``).
        # 0.95 is ~20 drafting steps: at c = 1 the tail of the last drafting phase, which ended because its
        # drafts stopped being accepted (session 55, H100, support c = 1: rests predicted 1.53-1.55 tokens a
        # sequence, the class's drafting steps averaged 2.05-2.13, fixed γ = 7's τ was 2.43 over all its
        # steps). ``bench speedup``'s dspark-class-long row runs 0.995 (~200 steps); not GPU-run yet
        self.class_decay = class_decay
        # reports each cell keeps for the records, its first ones and its latest ones (``trace``). More than
        # the default only for a diagnosis: session 47's question (why a resting b4 cell priced drafting at
        # 8.8 ms) needed a cell's whole history, and 16 reports held two probes. ``bench speedup
        # --gate-trace-steps``; checked by ``keep_trace``
        self.cells: dict[tuple[str, int], Cell] = {}
        self.keep_trace(trace_steps)
        self.classes: OrderedDict[tuple[str, tuple[int, ...]], ClassRecord] = OrderedDict()
        self.probes = 0
        self.admitted = 0          # records made (``record``): a new request can make its class explore
        # measured steps that drafted, by why (DRAFT_REASONS): what a run's drafting steps were for
        self.drafted_by = dict.fromkeys(DRAFT_REASONS, 0)
        self.charged_s = 0.0       # capture steps' time charged to drafting samples (``charge``), in all
        # which method each request of method auto runs (specd/engine/method_choice.py): here so that a
        # benchmark row with a gate of its own (``bench.speedup.row_gate``) chooses from its own requests
        self.methods = MethodChoice()

    def record(self, method: str, prompt: list[int]) -> Acceptance:
        """A new request's acceptance record, tied to its prompt class's pooled record under ``method``
        (its gate key). A new request starts from its class's acceptance, not the cell's: one engine serves
        applications whose drafts are accepted at very different rates, and a cell that learned to rest
        on one of them otherwise rates every new request of another by it (H200, run L: scheduled dspark
        rested through extraction at c = 1 and 4, where fixed γ = 7 ran at 1.42× and 1.16× plain)."""
        key = (method, prompt_class(prompt))
        group = self.classes.get(key)
        if group is None:
            group = self.classes[key] = ClassRecord(decay=self.class_decay)
            if len(self.classes) > MAX_CLASSES:
                self.classes.popitem(last=False)
        else:
            self.classes.move_to_end(key)
        group.requests += 1
        self.admitted += 1
        return Acceptance(group=group)

    @staticmethod
    def explores(record: Acceptance) -> bool:
        """Does this request draft whatever its cell decides, to measure its class? A class explores
        once it recurs (a second request: one-off prompts never pay for it) until it has drafted
        ``CLASS_EXPLORE`` steps. Why: a resting cell drafts only in probes, and a request that rested from
        its first step probes from a drafter context without its prompt, which underrates it; an
        exploring request captures its prompt's features and drafts from its first decode step. The
        cost is bounded: a few drafting steps per recurring class (``MAX_CLASSES`` of them at most).
        An auto request sent to measure its method (``Acceptance.measures``) drafts at every step too: see
        ``MethodChoice.choose`` for why."""
        if record.measures:
            return True
        group = record.group
        return group is not None and group.requests >= 2 and group.samples < CLASS_EXPLORE

    def acceptance(self, method: str, sequences: int, requests: list[Acceptance] | None,
                   caps: list[int] | None = None) -> float | None:
        """The batch's predicted tokens per sequence of a drafting step, when ``requests`` draft in a batch
        of ``sequences``: each drafting request's own record shrunk toward the cell's drafting requests
        (a new request starts at its class's), at most its cap in ``caps`` (the tokens it may still emit in
        one step), and one token for each sequence that does not draft. None: no record yet."""
        return self._acceptance(self._cell(method, sequences), requests, sequences, caps=caps)

    def _acceptance(self, cell: Cell, requests: list[Acceptance] | None, sequences: int,
                    highest: bool = False, copies: int = 1, caps: list[int] | None = None,
                    estimates: list[float] | None = None):
        """``acceptance``'s body. ``highest``: each request counts at the larger of its own estimate and
        where it starts (its class's), the most a resting request's estimate can reach: resting only ages
        its own steps (``Acceptance.rest``), which moves the estimate from where it is toward its start.
        Then it returns (the batch's bound, the bound of any subset of it in any batch: the largest
        request's, at least the 1 token of a sequence that does not draft); (None, None) with no record.
        ``copies``: each request stands for that many requests with the same record (a new prompt asks
        for a batch of requests like itself: ``copies`` = the load, one pass instead of a list that long).
        ``caps``: per request, the most tokens its drafting step can emit (its draft limit + 1: a request
        near ``max_tokens`` cannot emit its record's 4 tokens with 2 left). Why: at the end of a wave every
        request is near its end, and an uncapped prediction drafts there on records earned mid-request
        (H200, session 18, run BI: extraction at c = 32 drafted 6-11 steps in the tail's b16 cell, where
        drafting had measured 6,598 against 6,951 tok/s plain, and ran 0.92x `none`; not shown to be this
        cause). A cap only lowers a prediction, so the bound ``highest`` takes stays an upper bound without
        one. ``estimates``: a list each request's estimate (capped) is appended to (``rests_unlooked``)."""
        if not requests:
            return (None, None) if highest else None
        prior = cell.draft.per_drafter_step
        if prior <= 0:
            return (None, None) if highest else None
        # Each request's own record with ``prior_steps`` steps of where it starts added: its class's pooled
        # record shrunk toward ``prior`` the same way, or ``prior`` without a class record. One loop, no
        # helper calls: it runs for every gated request at every step (~1 µs a request in calls alone on
        # the CPU machine, c = 32; tests/engine/gate_cost_probe.py).
        # A request without its prompt starts from its class's prompt-less record, shrunk toward the
        # whole-context start.
        k = self.prior_steps
        drafting, top = 0.0, 1.0
        for i, r in enumerate(requests):
            g = r.group
            start = prior if g is None or g.steps <= 0 else (g.tokens + k * prior) / (g.steps + k)
            if r.lacks_prompt and g is not None and g.promptless_steps > 0:
                start = (g.promptless_tokens + k * start) / (g.promptless_steps + k)
            own = (r.tokens + k * start) / (r.steps + k)
            if caps is not None and caps[i] < own:
                own = caps[i]
            if estimates is not None:
                estimates.append(own)
            if highest:
                own = start if start > own else own
                top = own if own > top else top
            drafting += own
        n = len(requests) * copies
        batch = (drafting * copies + max(0, sequences - n)) / max(sequences, n)
        return (batch, top) if highest else batch

    def should_draft(self, method: str, sequences: int, measured: bool = True,
                     requests: list[Acceptance] | None = None, verify: int | None = None, copies: int = 1,
                     caps: list[int] | None = None) -> bool:
        """Does this step draft for ``method``'s scheduled requests, in a batch of ``sequences``?

        ``measured``: the step will be reported to ``observe`` (a pure decode step). Only such steps
        explore, probe and advance the probe clock; any other step runs the current winner, or, while the
        cell explores, the arm it explores now (the engine asks so for prompts: capture their features or
        not). ``requests``: the acceptance records of the requests that would draft; ``verify``: the draft
        tokens they would verify, when known before deciding (ngram); ``copies``: each record stands for
        that many requests; ``caps``: the most tokens each request's drafting step can emit (both
        ``_acceptance``).

        Why the explored arm, not "draft" (sessions 6-12, unless the cell had the resting prior): a prompt
        captured while the cell explores plain decoding rests from its first decode step, which absorbs
        its features (a drafter pass) in a step that is then no sample (``GateSteps._rest``); in a closed
        loop at c = 16, new requests arrive after nearly every run of decode steps (H200, session 13)."""
        cell = self._cell(method, sequences)
        explore = self._exploring(cell)
        if explore is not None:
            return self._drafts(cell, "explore", explore) if measured else explore
        acceptance = self._acceptance(cell, requests, sequences, copies=copies, caps=caps)
        predicted = cell.draft_rate(acceptance, verify)
        winner = cell.beats_plain(predicted, self.margin)
        if not measured:
            return winner
        cell.near = predicted >= self.keep_near * cell.plain.per_seq_s
        cell.basis = (acceptance, predicted * sequences, cell.plain.per_seq_s * sequences)   # for ``trace``
        cell.rest_bound = None
        if cell.probe_left:
            if not self._cuts(cell, predicted):
                cell.probe_left -= 1
                return self._drafts(cell, "probe", cell.probe_arm)
            cell.probe_left = 0
            cell.cuts_in_row += 1
            self.probes_cut += 1
        if cell.clock == 0:      # the first step after a probe or the exploration: both rates are fresh
            cell.wait = 1 if cell.draft.samples == 0 else self._wait(cell, winner, predicted)
        cell.clock += 1
        if cell.clock < cell.wait:
            if not winner and verify is None:    # the bound ``rests_again`` keeps for the same requests
                cell.rest_bound = self._acceptance(cell, requests, sequences, highest=True, copies=copies)
                cell.rest_admitted = self.admitted
            return self._drafts(cell, "winner", winner)
        cell.clock, cell.probe_left, cell.probe_arm = 0, self.probe_steps - 1, not winner
        cell.probe_from = cell.draft.samples
        if cell.cuts_in_row >= PROBE_FULL_EVERY - 1:      # this one runs all its steps
            cell.probe_from, cell.cuts_in_row = None, 0
        self.probes += 1
        return self._drafts(cell, "probe", cell.probe_arm)

    def _cuts(self, cell: Cell, predicted: float) -> bool:
        """Does the running probe of drafting end now, before its next step? When it has taken a sample
        (``probe_from``: a warm-up or an unreported step is none) and drafting at ``probe_cut`` times the
        rate now predicted for this batch still loses to plain decoding by the margin. The cell's drafting
        rate is then essentially that sample (``DECAY``: the probe before it lies hundreds of steps back).
        Never in every ``PROBE_FULL_EVERY``-th probe of a cell, which runs all its steps.

        Why: at c ≥ 16 on the H200 a drafting step costs 3-5 plain steps, and a probe's 3 steps are most
        of what a resting cell's probes cost: in session 32's runs (CS-CW, c = 32) a run with a probe ran
        ~4% behind `none`, and the resting cells' probes took ~0.5% of the wall. Of the probes of drafting
        that sessions 30 and 32's records hold at b16 and b32 (runs CO-CW), 14 of 15 were predicted at
        0.22-0.50 of plain decoding's rate after their first sample (the 15th at 0.53), and after none of
        them did the cell draft as the winner (``python -m bench.probe_cut``, which judges the records as
        this does). The wait before the next probe is still priced for ``probe_steps`` steps (``_wait``),
        so a cut probe spends about a third of its budget.
        Why every third probe runs in full: the first sample is biased low. It carries the capture step
        before it (``charge``) and drafts from a context whose rested positions are missing; in run CU
        (no-span row, b32) a probe's first step predicted 0.42 of plain and its next two steps ran at 0.92.
        A cell where drafting would now win by less than that bias cannot be turned by a cut probe, and
        the full one sees it at most two waits later."""
        if (self.probe_cut is None or not cell.probe_arm or cell.probe_from is None
                or cell.draft.samples <= cell.probe_from):
            return False
        return not cell.beats_plain(predicted * self.probe_cut, self.margin)

    def rests_again(self, method: str, sequences: int, subset: bool = False) -> bool:
        """``should_draft``'s measured answer for the same resting requests as this cell's last step, one
        resting step later, when it is sure to be a rest on the prediction; False: ask ``should_draft``.
        ``subset``: some of those requests (others left), in a batch of ``sequences`` of the same bucket.

        Why: a resting step's gate work walks every gated request (the prediction, the exploration check,
        the grouping by key): ~70 µs a step at c = 32 on the CPU machine (tests/engine/gate_cost_probe.py),
        where a plain H200 step at c = 8 lasts ~3.8 ms. Session 9, run X: scheduled dspark rested through
        whole cells at 0.97-0.98x plain decoding, ~75 µs a step behind. Sure means: the cell's last step
        rested on the prediction, with the acceptance bound ``rest_bound`` (each request at the most its
        aged record can reach); the draft arm has not changed since (only a drafting step changes it, and
        uniform aging leaves its rates as they are); no request was admitted (a new one may make its class
        explore); no probe is due; and drafting at the bound still loses to plain decoding's current rate.
        Then the full question would rest too, and it advances the clock as it would. The caller vouches
        for "the same requests" or a subset (the engine: consecutive pure decode steps, ``RestChain``)."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.rest_bound is None or cell.rest_admitted != self.admitted or not self._steady(cell):
            return False
        return self._rests_at(cell, cell.rest_bound[1 if subset else 0], sequences)

    @staticmethod
    def _steady(cell: Cell) -> bool:
        """Between probes: none running or due at the next step, and not the first step after one (whose
        fresh clock ``should_draft`` sets the next wait from)."""
        return not cell.probe_left and cell.clock != 0 and cell.clock + 1 < cell.wait

    def _rests_at(self, cell: Cell, acceptance: float, sequences: int) -> bool:
        """The rest ``rests_again`` and ``carries_rest`` answer once sure of the requests' bound: False where
        drafting at ``acceptance`` would beat plain decoding; else the step's basis and clock, as
        ``should_draft``'s winner would take them, and True."""
        predicted = cell.draft_rate(acceptance)
        if cell.beats_plain(predicted, self.margin):
            return False
        cell.basis = (acceptance, predicted * sequences, cell.plain.per_seq_s * sequences)
        cell.clock += 1
        return not self._drafts(cell, "winner", False)

    def carries_rest(self, method: str, bucket: int, sequences: int) -> bool:
        """``rests_again`` for the same resting requests (or some of them) one step later in a batch of
        ``sequences`` of a smaller bucket than ``bucket``, where their rest was answered: the batch drains.
        Sure, as ``rests_again`` is, when the smaller cell has explored both arms, has no probe running or due
        and no fresh clock, the larger cell's bound is current (no admission since), and drafting at that
        bound, raised by how much more the smaller cell's drafting prior is (``per_drafter_step``), still
        loses to plain decoding there. The raise keeps it a bound: each request's estimate is its own record
        shrunk toward a start that is its class's record shrunk toward the cell's prior (``_acceptance``),
        with weights of at most 1 on the prior, so a prior higher by d moves no estimate by more than d.
        Then the full question would rest too; the smaller cell takes the bound, for later ``rests_again``,
        and its clock advances as it would.

        Why: at c = 16 in a closed loop the drain after each round changes the bucket four times (16 to 8,
        4, 2, 1 sequences), and each change walked the whole batch again and took a second step before a
        rest span began: ~130 + ~30 µs of gate time each on the CPU probe (tests/engine/span_gap_probe.py),
        a third of the resting row's excess over `none` there."""
        high = self.cells.get((method, bucket))
        low = self.cells.get((method, load_bucket(sequences)))
        if (high is None or low is None or low is high or high.rest_admitted != self.admitted
                or self._exploring(low) is not None or not self._steady(low)):
            return False
        top = carried_bound(high, low)
        if top is None or not self._rests_at(low, top, sequences):
            return False
        low.rest_bound, low.rest_admitted = (top, top), self.admitted
        return True

    def rest_lease(self, method: str, sequences: int, most: int = LEASE_STEPS, found: bool = False) -> int:
        """After ``rests_again`` answered yes: how many more steps the same requests may rest without asking
        (0: ask at the next step), while no request is admitted and the group keeps its size (the engine
        checks both). The lease ends before a probe could be announced (``probe_next``), so the steps it
        covers are steps the clock would only advance through. Their plain samples come in afterwards, in
        order, through ``fold_rest``.

        Why: a steady rest still asked ``rests_again``, ``probe_next`` and ``observe`` at every step. Each
        takes ~2 µs alone, but ~10 µs in a step, where the forward has just evicted the interpreter's
        caches: ~25 µs a resting step over `none` on the CPU machine (stories260K, c = 4), and on the H200
        (session 18, runs BH and BI) ~38 µs of host time on a 2.05 ms plain step, ~1.8%, in every cell where
        the gate rests (scheduled dspark ran 0.97-0.99× `none` there; docs/results/speedup.md, session 26).
        What it gives up: for at most ``LEASE_STEPS`` steps the answer does not see the newest plain
        samples, so a rest can outlast a sudden slowdown of plain steps by that many steps. ``most``: the
        lease's length where no probe is near (``SPAN_STEPS`` for a rest span).

        ``found``: the rest was ``should_draft``'s answer for the drafts a cheap proposer found (``verify``
        given: ngram, ``GateSteps._lease_found``), which keeps no bound: the caller vouches that the answer
        was a rest, and the cell's reason says it was the prediction's (not an exploration's or a probe's
        step), as ``resumes`` reads it. The lease then assumes that answer stands for its steps whatever
        the lookups would find, as a feature drafter's lease assumes its answer stands."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.probe_left or (cell.reason != "winner" if found else cell.rest_bound is None):
            return 0
        return self._lease(cell, most)

    @staticmethod
    def _lease(cell: Cell, most: int) -> int:
        """A sure rest's lease (``rest_lease``, ``rests_unlooked``): at most ``most`` steps, ending before a
        probe could be announced."""
        cell.lease_basis = cell.basis          # what the granting answer was made from, for its steps' reports
        return max(0, min(most, cell.wait - cell.clock - 2))

    def may_rest_unlooked(self, method: str, sequences: int) -> bool:
        """Can ``rests_unlooked`` be sure for this cell at all (explored, steady between probes)? Asked first,
        so that a cell that cannot costs the engine no pass over its requests (their records and caps)."""
        cell = self.cells.get((method, load_bucket(sequences)))
        return cell is not None and self._exploring(cell) is None and self._steady(cell)

    def rests_unlooked(self, method: str, sequences: int, requests: list[Acceptance], caps: list[int] | None = None,
                       most: int = LEASE_STEPS) -> int | None:
        """For a proposer the gate decides after (ngram, ``proposes_cheaply``: ``should_draft`` is asked with
        the drafts it found, over the requests that found one): is this measured step sure to rest
        ``requests`` (all of the key's gated requests in a batch of ``sequences``; ``caps`` as for
        ``should_draft``) whatever their lookups would find? None: not sure, look them up and ask as before.
        Else the step is taken as ``should_draft``'s rest on the prediction would take it (basis, clock), and
        the number returned is a lease (``rest_lease``'s rule): the steps after this one that the same
        requests may rest without a lookup or a question, their plain samples folded in by ``fold_rest``.

        Sure means what ``rests_again`` means, without a kept bound: the cell has explored both arms, no
        probe is running or due at the next step and its clock is not fresh (``_steady``), no request
        explores its class, and drafting loses at the best the lookups could give. The prediction adds one
        request's estimate per request that found a draft and prices the step by the draft tokens it
        verifies (``Cell.draft_rate``: fewer tokens, a shorter step); a found draft has at least one token,
        so for m requests finding drafts the best is the m highest estimates at m tokens, and the bound is
        the best over every m. A found step's answer rests where this one does; a step where nothing would
        have been found was no sample before (not asked) and is one now, a plain step like the others: the
        probe clock now counts every resting decode step of the key, not only those where a draft was
        found.

        Why: a resting gated ngram request was looked up at every step, and its draft dropped: on the CPU
        probe (tests/engine/ngram_gate_cost_probe.py, stories260K, c = 32) ``_add_drafts`` took ~225 µs a
        decode step against ~8 µs for `none` (lookups ~125, the gate's question ~53, limits ~50), and on
        the H100 (session 44, run DS) the gated ngram row on coding rested nearly every step at 0.91-0.93×
        `none`."""
        if not self.may_rest_unlooked(method, sequences):
            return None
        cell = self.cells[(method, load_bucket(sequences))]
        if any(self.explores(r) for r in requests):
            return None
        estimates: list[float] = []
        if self._acceptance(cell, requests, sequences, caps=caps, estimates=estimates) is None:
            return None
        estimates.sort(reverse=True)
        best = acceptance = 0.0
        drafting = 0.0
        for m, own in enumerate(estimates, 1):
            drafting += own
            batch = (drafting + sequences - m) / sequences
            rate = cell.draft_rate(batch, m)
            if cell.beats_plain(rate, self.margin):
                return None
            if rate > best:
                best, acceptance = rate, batch
        cell.basis = (acceptance, best * sequences, cell.plain.per_seq_s * sequences)
        cell.rest_bound = None       # as ``should_draft``'s measured answer: no bound kept for ``rests_again``
        cell.clock += 1
        self._drafts(cell, "winner", False)
        return self._lease(cell, most)

    def fold_rest(self, method: str, sequences: int, steps: int, samples: list[tuple[int, int, float]]) -> None:
        """A lease's ``steps`` resting steps in a batch of ``sequences`` (``rest_lease``): advance the clock as
        ``rests_again`` would have at each, and take their plain ``samples`` ((sequences, tokens, seconds) of
        each step that was measured, in order) as ``observe`` would have, each reported under the answer
        that granted the lease."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or not steps:
            return
        cell.clock += steps
        # a lease's samples all have its batch size, so they are this cell's: ``observe`` without its cell
        # lookup (``_take``). Why: an ``observe`` call per leased step was the largest item of a resting
        # step's gate time left on the CPU machine's cProfile at c = 16 (session 30)
        for n, tokens, seconds in samples:
            cell.reason, cell.basis = "winner", cell.lease_basis
            if n != sequences:                   # not the lease's batch size: the general path
                self.observe(method, n, False, tokens, seconds)
                continue
            self._check_sample(n, tokens, seconds)
            self._take(cell, False, tokens, seconds, n)

    def join_rest(self, method: str, sequences: int, requests: list[Acceptance]) -> bool:
        """Requests join a steady rest of this cell (``rests_again``): fold the most their records can reach
        into the rest's bound, so the shortcut goes on for the group with them; False: it cannot (no rest
        to join, a probe running, or a joining request explores its class), ask in full.

        Why: at c = 32 under a closed loop a request finishes every step or two and its successor's prompt
        chunk breaks the steady rest, so most resting steps asked in full (H200, session 17, run BE: 28-148
        of ~110-200 rested steps took the shortcut; scheduled dspark's schedule phase ran 0.07-0.15 ms a
        step over `none`'s in resting cells). The folded bound is the larger of the two tops, for the batch
        and any subset alike: every member's estimate is at most its own top, and a batch's acceptance is
        at most its largest member's (or the 1 token of a sequence that does not draft), so where drafting
        at it loses, the full question for the joined group rests too. The caller vouches that every
        request joining the group comes through here (the engine: each prompt chunk of the rest's key, in
        ``GateSteps._rest_prompts``); admitted requests that have not joined yet will, so the admission
        count is taken as folded."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.rest_bound is None or cell.probe_left or cell.clock == 0:
            return False
        if any(self.explores(r) for r in requests):
            return False
        _, top = self._acceptance(cell, requests, sequences, highest=True)
        if top is None:
            return False
        top = max(top, cell.rest_bound[1])
        cell.rest_bound = (top, top)
        cell.rest_admitted = self.admitted
        return True

    def rejoin_rest(self, method: str, sequences: int) -> bool:
        """``join_rest`` for a request whose top is already in the rest's bound: the admission count is taken
        as folded, the bound stays; False where ``join_rest`` would refuse for the cell's state. The caller
        vouches for the top and asks ``explores`` itself (the engine, in a rest span: a new request of a
        prompt class a new request of which joined this span; nothing drafts in a span, so the class's
        record and the cell's drafting prior are those that first join used). Why: ``join_rest`` at each
        admission cost ~16 µs a call on the CPU probe at c = 32 (tests/engine/closed_loop_probe.py)."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.rest_bound is None or cell.probe_left or cell.clock == 0:
            return False
        cell.rest_admitted = self.admitted
        return True

    def resumes(self, method: str, sequences: int, requests: list[Acceptance]) -> bool:
        """Did this step rest ``requests`` on the prediction (not in an exploration or a probe), and would
        the prediction now draft for them (their records aged by ``Acceptance.rest``)? The engine then
        captures their features this step, so the next step drafts from a fresh context."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.reason != "winner" or self._exploring(cell) is not None:
            return False
        return cell.drafting_wins(self.margin, self._acceptance(cell, requests, sequences))

    def drafts_beside_prompts(self, method: str, sequences: int, requests: list[Acceptance],
                              verify: int | None = None) -> bool:
        """Do ``requests`` draft in a step with prompt chunks, in a batch of ``sequences``? Yes when their
        cell is explored and its prediction for them beats plain decoding: such a step is never measured
        (no exploration, no probe, no clock), so it follows the measured steps' answer.

        Off unless ``beside_prompts``. The idea: drafting adds a cost D to a step (the draft pass, the
        verify rows, the rejection sampling) and multiplies its decoders' tokens by the acceptance τ; it
        wins where τ > 1 + D/P, P the step's cost without drafts, and a prompt chunk makes P larger. It
        was tried because requests that draft finish at different steps, so prompts arrive all through
        a run: at c = 32 on extraction, 53 of scheduled dspark's 96 steps had a prompt chunk and drafted
        nothing (H200, session 13, run AN). Measured (run AP, the same run): D is not the same beside a
        prompt chunk. At c = 32 on extraction a prompt step with drafts took 20.9 ms against 9.2 without
        (+11.7 ms), where a drafting decode step took 10.8 against a plain one's 4.1 (+6.7 ms); the row
        ran 0.91x `none` against 0.99x with this off, and 0.94 / 0.92x against 0.99 / 0.96x over the five
        workloads at c = 16 / 32. Where the extra cost goes (the prefill-shaped graph's query bound
        applied to the verify rows, the new requests' prompt absorbs) is not measured."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if not self.beside_prompts or cell is None or self._exploring(cell) is not None:
            return False
        return cell.beats_plain(cell.draft_rate(self._acceptance(cell, requests, sequences), verify), self.margin)

    def _drafts(self, cell: Cell, reason: str, drafting: bool) -> bool:
        """Count a measured step's decision to draft under its reason, and keep the reason for the
        step's report (``trace``); returns the decision unchanged."""
        cell.reason = reason
        if drafting:
            self.drafted_by[reason] += 1
        return drafting

    def captures_prompt(self, sequences: int) -> bool:
        """Does a prompt joining a decode batch of ``sequences`` capture its features whatever the cell
        decides (``capture_prompts``)?

        Why: a prompt that captures no features drafts, if ever, from a context without its prompt, and
        such drafts are rarely accepted. The gate then rates the request by that low acceptance and rests
        it, so a run in which the first prompts rested tends to rest throughout. Session 46, H100, runs
        EC, EF and EH: in the c = 4-8 cells where fixed γ = 7 won (1.07-1.72× `none`), the scheduled row's
        runs in which every request was prompt-less (`gate_promptless_requests` = all) drafted 0-28 winner
        steps and ran at 0.97-1.02×. Its runs that captured most prompts drafted 18-89 winner steps and
        ran at 0.95-1.70× (extraction c = 8: 0.99 with 32 of 32 prompt-less, 1.46 and 1.49 with none).
        The cost: a prompt that rests after all has its features fused and absorbed (``GateSteps._rest``),
        the waste that made ``_rest_prompts`` ask the gate (2-5% at c = 32 on long prompts, session 12);
        so it is bounded by load."""
        return self.capture_prompts is not None and load_bucket(sequences) <= self.capture_prompts

    def keeps_context(self, method: str, sequences: int) -> bool:
        """Do the requests this cell rests keep capturing their target features (``keep_context``), so that
        their drafter contexts stay whole? In load buckets up to the setting, while the cell explores or its
        last measured prediction put drafting at ``keep_near`` of plain decoding's rate or more.

        Why: a request that rests captures nothing, so its drafter context lacks the rested positions for
        good (``GateSteps._stitch``), and one admitted into a resting cell lacks its prompt. Its drafts are
        then accepted less, its own record says so, and the cell keeps resting where fixed γ = 7 wins. H100,
        session 47 (``bench.gate_trace --prices`` over runs DV-FA): in 13 of 14 such cells the gate priced a
        drafting step fairly but predicted 1.31-2.42 tokens a sequence against fixed γ = 7's 2.23-2.62. Near a
        tie only, because keeping costs every resting step a capture (H100, run FA, coding c = 1: 2.27 ms
        against a plain step's 2.04 before session 48's fuse in the forward's shadow)."""
        if self.keep_context is None:
            return False
        bucket = load_bucket(sequences)
        if bucket > self.keep_context:
            return False
        cell = self.cells.get((method, bucket))
        return cell is None or cell.near

    def probe_next(self, method: str, sequences: int) -> bool:
        """Will the next measured step of this cell start a probe of drafting? The engine then captures
        target features in this resting step, so the probe drafts from a fresh context.

        The engine does not report an announced step (its capture costs time a plain step does not), so
        only a step that advances the clock without a report may announce: the steady state's waits. An
        announced exploring step would never count, and the cell would announce forever (on the H200 that
        made every resting step capture features: 10-15% slower than plain decoding at c ≥ 4)."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or cell.probe_left or self._exploring(cell) is not None:
            return False
        return cell.clock > 0 and cell.clock + 1 >= cell.wait

    def _exploring(self, cell: Cell) -> bool | None:
        """The arm an unexplored cell measures next, or None once both arms are measured. A cell with the
        resting prior measures plain decoding only; its drafting arm is measured by probes."""
        if cell.resting_prior:     # its first probe of drafting follows at once (``should_draft``)
            return False if cell.plain.samples < self.min_samples else None
        if cell.draft.samples < self.min_samples:
            return True
        if cell.plain.samples < self.min_samples:
            return False
        return None

    def _wait(self, cell: Cell, winner: bool, predicted: float | None = None) -> int:
        """Measured steps until the probe after this one: its expected cost within the probe budget.

        ``predicted``: the drafting rate per sequence predicted for this batch (``Cell.draft_rate`` at
        its requests' acceptance); None: the cell's measured one. The batch's own prediction decides,
        because it is what decided the winner: a cell whose drafting arm was measured on requests that
        draft well (one workload) and a batch of requests that draft badly (another) rest on the
        prediction while the cell's rates say drafting wins. Its loss, computed from the cell's rates,
        was then below zero and the wait fell to ``probe_every``. H200, session 12: at c = 1 creative
        writing (τ ~1.1) came after coding had made drafting win at b1; it rested on the prediction (184
        against 266 tok/s) and was probed every ~16 steps, 6-9 probe steps a run of 384 steps, each ~7 ms
        against a 3.7 ms plain step.

        The cost is counted in time, not steps: a probe's steps last ``lose.step_s`` each and lose
        ``loss`` of the winner's rate over that time, while the wait's steps last ``win.step_s``. So the
        wait is probe_steps × (lose.step_s / win.step_s) × loss / budget steps of the winner. (Until
        session 6 the step-length ratio was left out; on the H200 a drafting step at c ≥ 8 lasts 3-5 plain
        steps, so a probe of drafting cost 3-5× its budget: ~3-5% of a resting cell, not 1%.)"""
        draft = cell.draft.per_seq_s if predicted is None else predicted
        plain = cell.plain.per_seq_s
        win, lose = (cell.draft, cell.plain) if winner else (cell.plain, cell.draft)
        win_rate, lose_rate = (draft, plain) if winner else (plain, draft)
        loss = 1.0 - lose_rate / win_rate if win_rate > 0 else 1.0
        length = lose.step_s / win.step_s if win.step_s > 0 and lose.step_s > 0 else 1.0
        steps = ceil(self.probe_steps * length * max(0.0, loss) / self.probe_budget - 1e-9)   # 20.000001 is 20
        return max(self.probe_every, min(self.probe_max, steps))

    def _cell(self, method: str, sequences: int) -> Cell:
        bucket = load_bucket(sequences)
        key = (method, bucket)
        if key not in self.cells:
            self.cells[key] = Cell(wait=self.probe_every, resting_prior=self._lighter_rests(method, bucket),
                                   recent=deque(maxlen=self.trace_steps))
        return self.cells[key]

    def _lighter_rests(self, method: str, bucket: int) -> bool:
        """Does the nearest smaller explored bucket of ``method`` rest the drafter?"""
        for b in sorted((b for m, b in self.cells if m == method and b < bucket), reverse=True):
            cell = self.cells[(method, b)]
            if self._exploring(cell) is None:
                return not cell.drafting_wins(self.margin)
        return False

    def observe(self, method: str, sequences: int, drafted: bool, tokens: int, seconds: float,
                drafters: Drafters | None = None) -> None:
        """A finished measured step: ``tokens`` emitted by the whole batch of ``sequences`` in ``seconds``
        of wall time (drafting included), with ``method``'s scheduled requests drafting or resting.
        ``drafters``: the drafting side of a drafting step; None: every sequence drafted."""
        self._check_sample(sequences, tokens, seconds)
        if drafters is not None and not (0 <= drafters.count <= sequences and 0 <= drafters.emitted <= tokens
                                         and drafters.verified >= 0):
            raise GateError(f"drafters {drafters} do not fit a step of {sequences} sequences and {tokens} tokens")
        self._take(self._cell(method, sequences), drafted, tokens, seconds, sequences, drafters)

    def _take(self, cell: Cell, drafted: bool, tokens: int, seconds: float, sequences: int,
              drafters: Drafters | None = None) -> None:
        """``observe`` once its sample is checked and its cell found (``fold_rest`` comes here directly):
        the report under the cell's reason and basis, then a warm-up or a sample of the arm."""
        arm = cell.draft if drafted else cell.plain
        used = arm.warmups >= self.warmup
        cell.phase_at = cell.phase_at + 1 if drafted else 0
        report = (drafted, tokens, seconds, sequences, used, cell.reason, cell.basis)    # formatted by ``trace``
        cell.reason, cell.basis = "", ()
        if len(cell.trace) < self.trace_steps:
            cell.trace.append(report)
        cell.recent.append(report)
        if not drafted:
            seconds = self._clip_plain(cell, seconds)
        if not used:             # the arm's first step at this cell's shape: one-off costs, no sample
            arm.warmups += 1
            return
        cell.draft.age(self.decay)
        cell.plain.age(self.decay)
        if drafted:
            cell.rest_bound = None
            predicted = report[6][0] if report[6] else None
            if self.calibrate and predicted is not None and predicted > 0:
                cell.calibrate(tokens / sequences, predicted)
            steady = cell.time_phase(seconds)      # every cell measures its phases' openings (``stats``)
            if self.steady_price:
                seconds = steady
            held = min(cell.capture_s, self._sample_charge(cell))   # the captures this drafting took,
            seconds, cell.capture_s = seconds + held, cell.capture_s - held   # a plain step a sample
            cell.draft.add(tokens, seconds, sequences, drafters)
        else:
            cell.plain.add(tokens, seconds, sequences)

    def _clip_plain(self, cell: Cell, seconds: float) -> float:
        """A plain step's seconds as the plain arm takes them: at most ``plain_clip`` times the fastest of
        the cell's last ``PLAIN_WINDOW`` plain steps (its warm-ups included; the raw time joins them).

        Why only plain: a pure decode step's time barely moves within a load bucket (memory-bound; a bucket's
        batches differ by less than 2x in size), so a step at twice the fastest recent one is a stall (a
        collector pass, the host), not the arm's cost. A stalled plain sample makes drafting look faster
        than it is, and the gate then drafts where it loses: the one error that breaks "never slower than
        `none`". A slow drafting sample errs the other way (the gate rests where drafting might win), and
        drafting steps vary for real with their verify lengths, so they are taken as measured. The window's
        minimum follows a real slowdown within ``PLAIN_WINDOW`` steps, and the arm's decayed sums forget a
        clipped sample like any other; the trace keeps the raw time."""
        fastest = min(cell.plain_recent, default=inf)
        cell.plain_recent.append(seconds)
        if self.plain_clip is None or seconds <= self.plain_clip * fastest:
            return seconds
        clipped = self.plain_clip * fastest
        self.plain_clipped_s += seconds - clipped
        return clipped

    @staticmethod
    def _check_sample(sequences: int, tokens: int, seconds: float) -> None:
        if tokens < 0 or not seconds > 0 or sequences < 1:
            raise GateError(f"a step emits ≥ 0 tokens in > 0 s for ≥ 1 sequence, got {tokens} in {seconds} "
                            f"for {sequences}")

    def charge(self, method: str, sequences: int, seconds: float) -> float:
        """A measured-shape step that drafted for nobody but captured target features or absorbed them
        for drafting (a probe's announcement, resuming requests, a rest's absorb: the engine's ``capture``
        steps) lasted ``seconds``: its time over this cell's plain step goes on the next drafting sample,
        which it served. Returns the seconds charged.

        Why: such steps are no sample of either arm, so the comparison of drafting with plain decoding
        did not see them, nor did a probe's wait (``_wait``). H200, session 18, run BF: where the arms
        were near a tie (coding at c = 4, drafting ~5% behind), the gate drafted intermittently and each
        switch cost capture steps at 1.3-1.5x a plain step, 5-10 a run; scheduled dspark ran 0.93x `none`
        there. Charged to the next drafting sample, not to the arm's decayed sums: a resting cell's
        drafting arm is essentially its latest probe (``DECAY``), and the charge belongs with it.

        At most ``charge_steps`` plain steps of it a sample (``CHARGE_STEPS``), the rest on the samples
        after: a switch's captures are paid once for a whole drafting phase, not by its first sample.
        H100, session 39, run DH (c = 1): the capture steps that ended a drafting phase on creative writing
        (five at 5.1 ms against a 2.3 ms plain step) were held for ~750 steps and landed on the next probe's
        one sample (2 tokens in 4.7 ms): the cell read drafting at 132 tok/s against plain's 429, cut the
        probe and set the wait to its 2,048-step cap, and extraction, where drafting ran 2.2× plain, rested
        1,532 steps (four runs) until the next probe. Capped, that sample reads ~290 tok/s: not cut. And
        at most ``probe_steps`` × that is held (one full probe's samples), the excess not charged: without
        a bound, a resting cell whose captures outgrow what its cut probes carry would build a backlog that
        a later drafting phase, perhaps on another workload, pays a plain step a sample long after the
        switches that caused it."""
        cell = self.cells.get((method, load_bucket(sequences)))
        if cell is None or not cell.plain.samples or not cell.draft.samples:
            return 0.0
        extra = seconds - cell.plain.step_s
        if extra <= 0:
            return 0.0
        # held: at most what one full probe's samples carry
        extra = min(extra, max(0.0, self.probe_steps * self._sample_charge(cell) - cell.capture_s))
        cell.capture_s += extra
        self.charged_s += extra
        return extra

    def _sample_charge(self, cell: Cell) -> float:
        """The held capture time one drafting sample of ``cell`` carries at most: ``charge_steps`` of its
        plain steps (infinite with ``charge_steps`` None, the rule until session 39: all of it)."""
        return inf if self.charge_steps is None else self.charge_steps * cell.plain.step_s

    def exploring(self, method: str) -> list[int]:
        """The load buckets of ``method``'s cells that are still exploring (a new cell measures both arms
        before it decides). For benchmarks: exploring is a once-per-cell cost, and a warm-up that ends
        before it does moves it into the timed runs (``bench speedup``)."""
        return sorted(b for (m, b), cell in self.cells.items() if m == method and self._exploring(cell) is not None)

    def keep_trace(self, steps: int) -> None:
        """Keep ``steps`` reports a cell from now on (``trace_steps``), the cells made so far included: their
        latest reports are kept up to the new length, and their first ones grow to it (or are cut to it)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise GateError(f"trace_steps must be a positive integer, got {steps!r}")
        self.trace_steps = steps
        for cell in self.cells.values():
            cell.recent = deque(cell.recent, maxlen=steps)
            del cell.trace[steps:]

    def trace(self, latest: bool = False) -> dict[str, list]:
        """Each cell's first ``trace_steps`` reports (``latest``: its last ones), in order: [drafted (1/0),
        tokens, ms, sequences, used as a sample (1) or a warm-up (0), reason (``DRAFT_REASONS``; "" for a
        step whose arm no measured decision chose), predicted acceptance, predicted drafting tok/s, plain
        tok/s (the last three None while the cell explores)], keyed ``<method>_b<bucket>``. For benchmark
        records: what each cell's decision was made from, and what it did lately."""
        return {f"{method}_b{bucket}": [[int(d), t, round(1e3 * sec, 3), n, int(u), why, *_basis(basis)]
                                         for d, t, sec, n, u, why, basis in (cell.recent if latest else cell.trace)]
                for (method, bucket), cell in sorted(self.cells.items())}

    def stats(self) -> dict[str, float | int]:
        """Flat, for engine stats and /metrics: per cell the measured tok/s of each arm, the samples, and
        whether drafting currently wins (1) or the drafter rests (0), at the cell's own acceptance."""
        out: dict[str, float | int] = {"spec_gate_probes_total": self.probes,
                                       "spec_gate_probes_cut_total": self.probes_cut,
                                       "spec_gate_capture_charged_seconds_total": self.charged_s,
                                       "spec_gate_plain_clipped_seconds_total": self.plain_clipped_s}
        for reason, n in self.drafted_by.items():
            out[f"spec_gate_drafted_{reason}_steps_total"] = n
        for (method, bucket), cell in sorted(self.cells.items()):
            name = f"spec_gate_{method}_b{bucket}"
            out[f"{name}_draft_tok_s"] = cell.draft.per_s
            out[f"{name}_plain_tok_s"] = cell.plain.per_s
            out[f"{name}_draft_samples"] = cell.draft.samples
            out[f"{name}_plain_samples"] = cell.plain.samples
            out[f"{name}_draft_acceptance"] = cell.draft.per_seq_step
            explored = self._exploring(cell) is None
            out[f"{name}_drafting"] = int(cell.drafting_wins(self.margin) if explored else not cell.resting_prior)
            out[f"{name}_probe_wait_steps"] = cell.wait
            out[f"{name}_calibration"] = cell.calibration
            out[f"{name}_opening"] = cell.opening
        if self.methods.chosen:
            out.update(self.methods.stats())
        return out
