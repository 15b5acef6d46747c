"""The gate's measurements, apart from its decisions (specd/engine/spec_gate.py): a load cell's arm as
decayed sums (``Rate``), the drafting side of a measured step (``Drafters``), a request's decayed record of
its drafting steps (``Acceptance``) and its prompt class's pooled record (``ClassRecord``, keyed by
``prompt_class``).

Why a file of its own: these are plain records that the engine (specd/engine/gating.py) and the benchmarks
build and age directly (``Acceptance.rest_all`` at every resting step), while ``SpecGate`` holds the rules
that read them; ``spec_gate`` re-exports every name here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REQUEST_DECAY = 0.8  # weight of a request's older drafting steps (its text changes: quoting, then prose)
RESTING_DECAY = 0.95 # weight a request's record keeps at each step it rests: it drifts back to its class's
                     # acceptance over ~20 resting steps, so one bad start does not rest it to its end
CLASS_TOKENS = 32    # a prompt class is the first 32 prompt tokens: the chat template's system turn, so one
                     # application's requests share a class and different applications' do not
CLASS_DECAY = 0.95   # weight of a class's older drafting steps: pooled over its requests, ~20 steps of memory
                     # (``SpecGate(class_decay=...)`` sets another; the row dspark-class-long runs 0.995)


@dataclass(frozen=True)
class Drafters:
    """The drafting side of a measured drafting step: how many sequences drafted, the tokens they
    emitted, and the draft tokens verified (0: not reported)."""

    count: int
    emitted: int
    verified: int = 0


@dataclass
class Rate:
    """Exponentially decayed sums of emitted tokens, seconds and sequence-steps: the rate is tokens over
    seconds, so a long step weighs by its length, as it does in throughput; tokens over sequence-steps is
    the acceptance (tokens per request per step)."""

    tokens: float = 0.0
    seconds: float = 0.0
    seq_steps: float = 0.0
    steps: float = 0.0
    drafter_tokens: float = 0.0   # tokens emitted by the sequences that drafted (drafting arm only)
    drafter_steps: float = 0.0    # their sequence-steps
    verified: float = 0.0         # draft tokens verified (drafting arm only; 0 when not reported)
    samples: int = 0
    warmups: int = 0              # measured steps taken as warm-ups, not samples (``SpecGate.warmup``)

    def add(self, tokens: int, seconds: float, sequences: int, drafters: Drafters | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.seq_steps += sequences
        self.steps += 1.0
        self.samples += 1
        if drafters is None:      # every sequence drafted, or a plain step (no Drafters built: every step)
            self.drafter_steps += sequences
            self.drafter_tokens += tokens
        else:
            self.drafter_steps += drafters.count
            self.drafter_tokens += drafters.emitted
            self.verified += drafters.verified

    def age(self, decay: float) -> None:
        self.tokens *= decay
        self.seconds *= decay
        self.seq_steps *= decay
        self.steps *= decay
        self.drafter_tokens *= decay
        self.drafter_steps *= decay
        self.verified *= decay

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_seq_s(self) -> float:
        """Tokens per second per sequence of the batch: the rate of an average step of this arm over its
        average batch size. The gate compares arms in this unit (``Cell``), because a load bucket holds
        batches of n to 2n − 1 sequences and the arms are not sampled at the same sizes."""
        if self.seconds <= 0 or self.seq_steps <= 0:
            return 0.0
        return self.tokens * self.steps / (self.seconds * self.seq_steps)

    @property
    def step_s(self) -> float:
        """Seconds per step of this arm (decayed like the rate)."""
        return self.seconds / self.steps if self.steps > 0 else 0.0

    @property
    def per_seq_step(self) -> float:
        return self.tokens / self.seq_steps if self.seq_steps > 0 else 0.0

    @property
    def per_drafter_step(self) -> float:
        """Tokens per drafting request per drafting step: the unit of a request's own record. It differs
        from ``per_seq_step`` when only some of the batch drafts (ngram finds a match for a few)."""
        return self.drafter_tokens / self.drafter_steps if self.drafter_steps > 0 else 0.0


@dataclass
class ClassRecord:
    """A prompt class's pooled record: every drafting step of its requests from a whole drafter context,
    decayed by ``CLASS_DECAY``; the requests admitted and the drafting steps taken, undecayed (for its
    exploration); and, apart, the steps drafted by its requests whose drafter context lacks their prompt
    (``promptless_tokens``, ``promptless_steps``; ``Acceptance.lacks_prompt``).

    Why two records: where the gate rests at a load, prompts arriving then capture no features
    (``GateSteps._rest_prompts``), and when the load drops and drafting wins again, those requests draft
    from contexts without their prompts and accept far less. H200, session 14 (run AQ, extraction at
    c = 32, where every prompt arrived into a resting cell): at the tail of each run, as the batch drained
    to 17-24 requests, the class's whole-context record (~3.3 tokens a sequence) predicted 10,490 tok/s for
    drafting against 7,238 plain; the drafting steps emitted 1.35-1.5 tokens a sequence, 3,900 tok/s,
    several steps a run. Rated by what prompt-less contexts of their class draft, such requests rest."""

    tokens: float = 0.0
    steps: float = 0.0
    requests: int = 0
    samples: int = 0
    promptless_tokens: float = 0.0
    promptless_steps: float = 0.0
    decay: float = CLASS_DECAY    # weight of the older drafting steps at each new one (both records)

    def add(self, tokens: int) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.steps = self.steps * self.decay + 1.0
        self.samples += 1

    def add_promptless(self, tokens: int) -> None:
        """A drafting step from a context without its prompt: its own record, not the exploration count."""
        self.promptless_tokens = self.promptless_tokens * self.decay + tokens
        self.promptless_steps = self.promptless_steps * self.decay + 1.0


@dataclass
class Acceptance:
    """One request's decayed record of its drafting steps (tokens emitted, and steps), and its prompt
    class's pooled record (None: no class), which every step it records feeds too. ``lacks_prompt``: its
    prompt captured no features (the engine's ``_rest_prompts``), so its drafter context never holds its
    prompt; its estimate starts from the class's prompt-less record once that has a sample
    (``SpecGate._acceptance``)."""

    tokens: float = 0.0
    steps: float = 0.0
    group: ClassRecord | None = field(default=None, repr=False)
    lacks_prompt: bool = False
    measures: bool = False    # drafts at every decode step whatever its cell decides: an auto request sent to
                              # measure a method (``MethodChoice.choose``; ``SpecGate.explores``)

    def add(self, tokens: int, decay: float = REQUEST_DECAY, pool: bool = True) -> None:
        """One drafting step's emitted tokens. ``pool``: also into the class's whole-context record; False
        for a step drafted from a context that misses part of the request's history (the engine's
        ``_pools``), which feeds the class's prompt-less record if the part missing is the prompt. A whole
        context clears ``lacks_prompt``: its drafter KV came from kvd's prefix cache after all."""
        self.tokens = self.tokens * decay + tokens
        self.steps = self.steps * decay + 1.0
        if pool:
            self.lacks_prompt = False
        if self.group is not None:
            if pool:
                self.group.add(tokens)
            elif self.lacks_prompt:
                self.group.add_promptless(tokens)

    @property
    def fresh(self) -> bool:
        """A record of a prompt class that has not drafted yet: its estimate, and the most it can reach, is
        its class's start (``SpecGate._acceptance``), so one such record stands for its class's others."""
        return self.group is not None and not self.steps

    @staticmethod
    def rest_all(records: list["Acceptance"], decay: float = RESTING_DECAY) -> None:
        """``rest`` for every record of a step's resting requests, in one call (the engine's path)."""
        for r in records:
            r.tokens *= decay
            r.steps *= decay

    def rest(self, decay: float = RESTING_DECAY) -> None:
        """One measured step this request rested: its own record loses weight, so its estimate drifts
        back toward where it started (its class's acceptance, ``SpecGate._acceptance``). Why: a resting request
        produces no evidence, so without this a request whose first drafts were rejected rested to its
        end. Session 9, CPU (Qwen 0.5B, extraction, c = 1, run W's drafter): every request drafted its
        first 4-12 steps, fell just under break-even (1.6-2.2 tokens a step against ~2.3) and rested
        its remaining 20-35 steps, 179 of 253 steps in all, where drafting paid 1.16x overall. The class
        record is untouched (it learns only from whole contexts)."""
        Acceptance.rest_all([self], decay)


def prompt_class(prompt_ids: list[int]) -> tuple[int, ...]:
    """The class of a prompt: its first ``CLASS_TOKENS`` tokens."""
    return tuple(prompt_ids[:CLASS_TOKENS])
