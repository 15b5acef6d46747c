"""Which speculation method a request of method ``auto`` runs: per (prompt class, load bucket), the candidate
whose finished requests decoded fastest, measured on whole requests.

Why a choice per request class and not one method per deployment: in session 55's table (H100, runs MA + MB,
docs/results/speedup.md) fixed-γ ngram ran 2.12x `none` on creative at c = 1 where scheduled dspark ran 0.99x,
and 1.88x against 1.28x on support; on coding dspark led (1.36x against 1.18x) and on knowledge at c ≥ 4. No
single method wins every workload, and a server's traffic mixes them.

Why whole requests and not the spec gate's step records: the gate learns acceptance from the steps it chose
to draft (session 55, ``bench.gate_trace --reasons``), so its records of a method are selected, high where the
method drafts little. A finished request's decode rate, output tokens over the time from its first token to
its finish, counts every step it ran, drafting or resting, at the load it ran under: it is the per-user
throughput the table reports. It is noisier (answers differ in length and content) and slower to learn (one
sample a request), which is why a cell explores every candidate on ``EXPLORE`` requests before it compares
them and decays the older ones slowly.

The choice is made at a request's first step and never changes, and it depends only on requests that finished
before: each method's verification stays lossless, so the mixture is too.

Pure logic: the engine (``SpecEngine._resolve_auto``) asks ``choose`` and reports ``observe``; the spec gate
owns one chooser (``SpecGate.methods``), so a benchmark row with a gate of its own has a chooser of its own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

EXPLORE = 2          # finished requests of each candidate in a cell before the cell compares them ...
EXPLORE_TOKENS = 256 # ... and output tokens they decoded. Why tokens too: a few short answers say little about
                     # a method's rate on the long ones. H100, session 56, run NA (tree 63bc8be, requests alone):
                     # the bench's 8-token warm-ups explored every cell, and auto put support c = 1 on dspark
                     # (1.31x `none`) where ngram-gated ran 1.89x, creative c = 4 on dspark (0.98x; 1.31x)
DECAY = 0.8          # weight of a candidate's older requests at each new one (~5 requests of memory)
PROBE_FIRST = 8      # admissions a cell gives its winner before the first request that re-measures the loser
PROBE_MOST = 64      # the longest wait: it doubles each time a probe finds the winner still ahead (a loser
                     # 2x slower costs ≤ 1/64 of a request's worth of time at the longest wait, ~0.8%)
MARGIN = 0.02        # a candidate takes over from the winner only when faster by this fraction (noise)
DRAFT_MOST = 1       # the largest load bucket where a measuring request drafts at every step (``Choice.drafts``)
MAX_CELLS = 4096     # (class, bucket) cells remembered, least recently used forgotten first


class ChoiceError(ValueError):
    """A bad setting or measurement for the method chooser."""


class Choice(NamedTuple):
    """A request's method; whether it goes there to measure it (exploring the cell, or probing a loser); and
    whether it drafts at every step whatever the spec gate decides (``Acceptance.measures``): a measuring
    request at a load bucket of at most ``MethodChoice.draft_most``."""

    method: str
    measures: bool
    drafts: bool = False


@dataclass
class Arm:
    """One candidate's decayed record in a cell: its finished requests' output tokens and decode seconds,
    and the requests admitted to it (undecayed, for the exploration's round robin)."""

    tokens: float = 0.0
    seconds: float = 0.0
    finished: int = 0
    admitted: int = 0
    decoded: int = 0          # output tokens of its finished requests, undecayed (the exploration's count)
    measuring: int = 0        # its requests in flight that measure it (``Choice.measures``)

    @property
    def rate(self) -> float:
        """Tokens per second of one request's decode: the per-user rate."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ChoiceCell:
    """One (prompt class, load bucket): each candidate's record and the probe clock."""

    arms: dict[str, Arm] = field(default_factory=dict)
    winner: str | None = None     # the candidate last found fastest (None: still exploring)
    since: int = 0                # admissions to the winner since the last probe
    wait: int = PROBE_FIRST       # admissions between probes
    probing: str | None = None    # the loser a probe request went to, until one of its requests finishes
    prior: str | None = None      # the winner of the class's nearest explored load when this cell was made:
                                  # run while the cell explores, the others one admission in ``probe_first``


def check_measurement(tokens: int, seconds: float, mix: float, load: float) -> None:
    """ChoiceError for a finished request's measurement that cannot be (``MethodChoice.observe``)."""
    if tokens < 0 or seconds < 0 or seconds != seconds or not 0.0 <= mix <= 1.0 or load < 0:
        raise ChoiceError(f"bad request measurement: {tokens} tokens in {seconds} s, mix {mix}, load {load}")


class MethodChoice:
    """Per (prompt class, load bucket): explore each candidate on ``explore`` requests (round robin), then
    run the fastest by its finished requests' decode rate, re-measuring the others by one request every
    ``wait`` admissions (doubling while the winner holds, from ``probe_first`` to ``probe_most``)."""

    cell_type = ChoiceCell    # what ``_cell`` makes: a subclass may keep more state per cell

    def __init__(self, explore: int = EXPLORE, decay: float = DECAY, probe_first: int = PROBE_FIRST,
                 probe_most: int = PROBE_MOST, margin: float = MARGIN, max_cells: int = MAX_CELLS,
                 explore_tokens: int = EXPLORE_TOKENS, draft_most: int = DRAFT_MOST):
        if (explore < 1 or not 0.0 <= decay < 1.0 or probe_first < 1 or probe_most < probe_first or margin < 0
                or explore_tokens < 0 or draft_most < 0):
            raise ChoiceError(f"bad method choice settings: explore={explore}, decay={decay}, probe_first="
                              f"{probe_first}, probe_most={probe_most}, margin={margin}, explore_tokens="
                              f"{explore_tokens}, draft_most={draft_most}")
        self.explore, self.decay, self.margin, self.explore_tokens = explore, decay, margin, explore_tokens
        self.draft_most = draft_most
        self.probe_first, self.probe_most, self.max_cells = probe_first, probe_most, max_cells
        self.cells: OrderedDict[tuple, ChoiceCell] = OrderedDict()
        self.chosen: dict[str, int] = {}          # requests given each method, in all (stats)
        self.probes = 0                           # of them, probes of a cell's loser
        self.measured = 0                         # of them, requests sent to measure their method (``Choice``)

    def _cell(self, key: tuple) -> ChoiceCell:
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = self.cell_type(prior=self._nearest_winner(*key))
            if len(self.cells) > self.max_cells:
                self.cells.popitem(last=False)
        else:
            self.cells.move_to_end(key)
        return cell

    def _nearest_winner(self, prompt_class: tuple, bucket: int) -> str | None:
        """The winner of ``prompt_class``'s cell at the load nearest ``bucket`` (by ratio; the lighter on a
        tie) that has one. Why: every load of a class explored every candidate from nothing, and a cell of a
        closed-loop benchmark runs 8-32 requests a run (H100, session 56, run ND: knowledge c = 1 explored
        through all 16 of its timed requests; creative c = 1 gave dspark 10 of 16 and ran 1.14x `none`, where
        ngram-gated ran 1.78x). Only the winner carries over, not the rates: per-user rates fall with the load
        for every method, so a load's records compared with another's would favour whichever was measured
        lighter."""
        best, far = None, None
        for (cls, b), cell in self.cells.items():
            if cls != prompt_class or b == bucket or cell.winner is None:
                continue
            d = (abs(b.bit_length() - bucket.bit_length()), b > bucket)
            if far is None or d < far:
                best, far = cell.winner, d
        return best

    def choose(self, prompt_class: tuple, bucket: int, candidates: tuple[str, ...] | list[str]) -> Choice:
        """The method for one new request of ``prompt_class`` at load ``bucket``, among ``candidates`` (the
        served ones, in the deployment's order of preference: ties go to the first), and whether the request
        measures it: every request but those given to the cell's winner, or to the nearest load's winner
        while the cell explores behind it, or to a candidate exploring from nothing that already has
        ``explore`` measuring requests in flight (a heavy load's first wave would otherwise draft throughout:
        fixed γ = 7 ran 0.65x `none` at c = 32 in run NC).

        Why a measuring request drafts at every step at load bucket 1 (``Choice.drafts``): each method runs
        behind the spec gate, whose cells (method, load) and class records learn from the requests they serve. A
        method that a cell gives one request in eight or fewer has its gate records starved, and they rest its
        requests: the chooser then measures it at plain decoding's rate, and it never wins. H100, session 56,
        run NF (tree 70cceea): creative at c = 1 gave ngram 3 requests of 16; the auto runs rested 880-959 of
        their 951-1,014 steps (31-35 verifications, against 270-293 in the ngram-gated row's), and rated ngram
        at 507 tok/s a request against dspark's 497, where the ngram-gated row, every request ngram, ran
        1,270-1,780 tok/s a request (1.92x `none`). Drafting throughout, the request measures what the method
        can do here; where that is slower than the winner's gated rate the method loses, which is right, since
        gated it would rest and do no better than plain decoding.

        Why only there (``draft_most``): in a batch, one request that drafts makes the step a drafting step for
        every request in it, so the batch pays the draft pass and the verify rows while the resting others
        gain nothing. H100, session 58, runs QA-QD (tree 96667d0): in the auto row the steps drafted for
        measuring requests alone (the gate's "class" reason; 0 in the single-method rows) were 61-301 a run
        at c = 16 and 32, each 4.2-9 ms against a plain step's 2.5-3.7 ms for about a plain step's tokens
        (16 against 15 at c = 16); the row ran 0.93 / 0.95x `none` there, below both `dspark` (1.07 / 0.99)
        and `ngram-gated` (1.09 / 1.09). Its runs where such steps were over 10% of the steps ran 0.92x
        (c = 4-8) and 0.87x (c >= 16) the same repeat's row of their main method, the others 1.01x and 0.95x.
        At c = 1 the drafting costs only the request itself, and that is where run NF found the starvation."""
        if not candidates:
            raise ChoiceError("no candidate method to choose from")
        cell = self._cell((prompt_class, bucket))
        arms = [cell.arms.setdefault(m, Arm()) for m in candidates]
        young = [(arm.admitted, i) for i, arm in enumerate(arms) if self._explores(arm)]
        prior = cell.prior if cell.prior in candidates else None
        measures = True
        if young and prior is not None:           # explore behind the nearest load's winner
            others = [(adm, i) for adm, i in young if candidates[i] != prior]
            if others and cell.since >= self.probe_first:
                method, cell.since = candidates[min(others)[1]], 0
            else:
                method, measures = prior, False
                cell.since += 1
        elif young:                               # explore: the least admitted young candidate
            method = candidates[min(young)[1]]
            measures = cell.arms[method].measuring < self.explore
        else:
            method = self._winner(cell, candidates)
            if cell.since >= cell.wait and cell.probing is None and len(candidates) > 1:
                rates = {m: cell.arms[m].rate for m in candidates if m != method}
                method = cell.probing = max(rates, key=rates.get)     # the best loser
                cell.since = 0
                self.probes += 1
            else:
                measures = False
                cell.since += 1
        self._admit(cell, method, measures)
        return Choice(method, measures, measures and bucket <= self.draft_most)

    def _admit(self, cell: ChoiceCell, method: str, measures: bool) -> None:
        """Count one admission to ``method`` in ``cell`` (and whether it measures) and in the stats."""
        arm = cell.arms[method]
        arm.admitted += 1
        arm.measuring += measures
        self.chosen[method] = self.chosen.get(method, 0) + 1
        self.measured += measures

    def _winner(self, cell: ChoiceCell, candidates, margin: float | None = None) -> str:
        """The fastest candidate; the holder keeps its place unless another beats it by ``margin`` (by default
        the chooser's)."""
        best = max(candidates, key=lambda m: cell.arms[m].rate)
        held = cell.winner if cell.winner in candidates else None
        margin = self.margin if margin is None else margin
        if held is not None and cell.arms[best].rate <= cell.arms[held].rate * (1.0 + margin):
            best = held
        if best != cell.winner:
            cell.winner, cell.wait, cell.since = best, self.probe_first, 0
        return best

    def observe(self, prompt_class: tuple, bucket: int, method: str, tokens: int, seconds: float,
                measured: bool = False, mix: float = 1.0, load: float = 0.0) -> None:
        """A request chosen here finished: ``tokens`` output tokens after its first, over ``seconds`` from its
        first token to its finish; ``measured``: it was sent to measure its method (``Choice.measures``). A
        request of one token, or one measured in no time, says nothing. ``mix`` (the mean share of its batch
        on its own method over its steps) and ``load`` (the mean batch size) are read by ``EpochChoice``;
        this chooser learns from every request, as it was measured on the GPU."""
        check_measurement(tokens, seconds, mix, load)
        cell = self.cells.get((prompt_class, bucket))
        if cell is None:          # forgotten since (MAX_CELLS): its choice is made again from nothing
            return
        arm = cell.arms.setdefault(method, Arm())
        if measured and arm.measuring > 0:
            arm.measuring -= 1
        if tokens > 0 and seconds > 0:
            arm.tokens = arm.tokens * self.decay + tokens
            arm.seconds = arm.seconds * self.decay + seconds
            arm.finished += 1
            arm.decoded += tokens
        if cell.probing == method and measured:   # the probe's answer (an empty one too: an aborted probe must
                                                  # not stop the probes): the winner held, or it lost its place.
                                                  # Not a gated request of the same method (one the cell gave
                                                  # while that method held it, still in flight): it was not sent
                                                  # to measure, so it is not the probe's measurement
            cell.probing = None
            held = cell.winner
            if held is not None and self._winner(cell, list(cell.arms)) == held:
                cell.wait = min(self.probe_most, cell.wait * 2)

    def young(self, classes, bucket: int) -> int:
        """How many of ``classes``' cells at load ``bucket`` still explore: not yet made, or with a candidate
        short of ``explore`` finished requests or ``explore_tokens`` decoded tokens. A benchmark's untimed
        warm-ups run until it is 0 (``bench.speedup.explore_auto``), as a server that has served the class at
        this load before would have explored it."""
        n = 0
        for cls in set(classes):
            cell = self.cells.get((cls, bucket))
            n += cell is None or not cell.arms or any(map(self._explores, cell.arms.values()))
        return n

    def _explores(self, arm: Arm) -> bool:
        """Is this candidate still explored in its cell: short of ``explore`` finished requests, or of
        ``explore_tokens`` decoded tokens? (``choose`` and ``young`` share the rule.)"""
        return arm.finished < self.explore or arm.decoded < self.explore_tokens

    def snapshot(self) -> list[dict]:
        """Every cell's state, for the records (``bench speedup`` writes it per cell): its class as a short
        hash, its load bucket, its winner and probe wait, and each candidate's rate and counts."""
        return [{"class": f"{hash(cls) & 0xFFFFFFFF:08x}", "bucket": bucket, "winner": cell.winner,
                 "wait": cell.wait, "arms": {m: {"tok_s": round(a.rate, 2), "finished": a.finished,
                                                 "admitted": a.admitted, "decoded": a.decoded}
                                             for m, a in cell.arms.items()}}
                for (cls, bucket), cell in self.cells.items()]

    def stats(self) -> dict[str, int]:
        """Requests given each method, and the probes and measuring requests among them (named apart from
        ``spec_auto_<method>_requests_total``, so a reader can take every such key as a method's)."""
        out = {f"spec_auto_{m}_requests_total": n for m, n in sorted(self.chosen.items())}
        out["spec_auto_probes_total"] = self.probes
        out["spec_auto_measuring_total"] = self.measured
        out["spec_auto_cells"] = len(self.cells)
        return out
