"""The measured pre-draft gate: whether the scheduled requests of a method draft at all this step.

The confidence scheduler decides *how many* drafts a request verifies from a cost model (SPS(B), the step
overhead). A cost model can be wrong (CUDA graphs vs eager, a Markov loop that costs a third of a round,
kernel launch overhead that no profile saw), and a wrong one keeps drafting where drafting loses: on the
H200, scheduled DSpark ran at 0.46-0.87× plain decoding. So whether to draft is decided by measurement
only: the engine reports every measurable step's output (tokens emitted by the whole batch) and wall time
under the arm it ran (drafting or resting), per method and per load bucket (the batch's sequences, rounded
down to a power of two), and the gate drafts only where drafting's measured rate beats plain decoding's
by ``margin`` (3%).

Recovery: the losing arm is probed for ``probe_steps`` steps after ``probe_every`` measured steps of the
cell, so a change of conditions (a longer context, a warmer drafter, another load) is seen. Each probe that
confirms the winner doubles the wait before the next one (up to ``probe_max``): a steady loser costs
less and less; a probe that changes the winner resets the wait. Measurements age by
steps of the cell, not by samples of an arm (both arms' sums shrink by ``decay`` at every measured step):
the winner averages its last ~1/(1 − decay) steps, and the loser's rate is essentially its latest probe,
so one probe is enough to see that the loser now wins.

Lossless: whether a step drafts depends only on the wall time and token counts of earlier, finished
steps, never on the drafts of this step; verification is untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_SAMPLES = 5      # measured steps per arm before the comparison is trusted (drafting explored first);
                     # a step's accepted drafts vary a lot, so fewer samples often misjudge drafting
PROBE_EVERY = 64     # measured steps of a cell before the first probe of the losing arm
PROBE_MAX = 1024     # the wait doubles after each probe that confirms the winner, up to this many steps
PROBE_STEPS = 3      # consecutive steps of a probe: after a rest the first one only regathers features
DECAY = 0.9          # weight of the older measurements at each measured step of a cell (~10 steps of memory)
MARGIN = 0.03        # drafting must beat plain decoding by this fraction: a rate measured over a 2-step probe
                     # is noisy, and on the H200 near-ties flipped the arms and cost more than they won


class GateError(ValueError):
    """A gate setting or a step measurement that cannot be used."""


def load_bucket(sequences: int) -> int:
    """1, 2, 4, 8, ...: the largest power of two ≤ ``sequences``. Rates differ by load; buckets keep a
    handful of cells, so each one gets enough samples."""
    return 1 << (max(1, sequences).bit_length() - 1)


@dataclass
class Rate:
    """Exponentially decayed sums of emitted tokens and seconds: the rate is their ratio, so a long step
    weighs by its length, as it does in throughput."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.samples += 1

    def age(self, decay: float) -> None:
        self.tokens *= decay
        self.seconds *= decay

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Cell:
    """One (method, load bucket): both arms' rates and the probe clock."""

    draft: Rate = field(default_factory=Rate)
    plain: Rate = field(default_factory=Rate)
    wait: int = PROBE_EVERY   # measured steps between the last probe and the next
    clock: int = 0            # measured steps since the last probe (or since both arms were explored)
    probe_left: int = 0       # steps of the current probe still to run
    probe_arm: bool = False   # the arm the current probe runs (fixed when it starts)
    probed_from: bool | None = None   # the winner when the last probe started, until it is judged

    def drafting_wins(self, margin: float = 0.0) -> bool:
        return self.draft.per_s > self.plain.per_s * (1.0 + margin)


class SpecGate:
    """Per (method, load bucket): explore both arms, then run the measured winner, probing the loser."""

    def __init__(self, min_samples: int = MIN_SAMPLES, probe_every: int = PROBE_EVERY,
                 probe_steps: int = PROBE_STEPS, decay: float = DECAY, probe_max: int = PROBE_MAX,
                 margin: float = MARGIN):
        if (min_samples < 1 or probe_steps < 1 or probe_every < 1 or probe_max < probe_every
                or not 0 < decay <= 1 or not 0 <= margin < 1):
            raise GateError(f"bad gate settings: min_samples={min_samples}, probe_every={probe_every}, "
                            f"probe_max={probe_max}, probe_steps={probe_steps}, decay={decay}, margin={margin}")
        self.min_samples, self.probe_every, self.probe_steps, self.decay = min_samples, probe_every, probe_steps, decay
        self.margin = margin
        self.probe_max = probe_max
        self.cells: dict[tuple[str, int], Cell] = {}
        self.probes = 0

    def should_draft(self, method: str, sequences: int, measured: bool = True) -> bool:
        """Does this step draft for ``method``'s scheduled requests, in a batch of ``sequences``?

        ``measured``: the step will be reported to ``observe`` (a pure decode step). Only such steps
        explore, probe and advance the probe clock; any other step runs the current winner (drafting while
        the cell is unexplored)."""
        cell = self._cell(method, sequences)
        if cell.draft.samples < self.min_samples:
            return True
        if cell.plain.samples < self.min_samples:
            return not measured
        winner = cell.drafting_wins(self.margin)
        if not measured:
            return winner
        if cell.probe_left:
            cell.probe_left -= 1
            return cell.probe_arm
        if cell.probed_from is not None:         # the last probe's steps are measured: judge it
            confirmed = cell.probed_from == winner
            cell.wait = min(2 * cell.wait, self.probe_max) if confirmed else self.probe_every
            cell.probed_from = None
        cell.clock += 1
        if cell.clock < cell.wait:
            return winner
        cell.clock, cell.probe_left, cell.probe_arm, cell.probed_from = 0, self.probe_steps - 1, not winner, winner
        self.probes += 1
        return cell.probe_arm

    def _cell(self, method: str, sequences: int) -> Cell:
        key = (method, load_bucket(sequences))
        if key not in self.cells:
            self.cells[key] = Cell(wait=self.probe_every)
        return self.cells[key]

    def observe(self, method: str, sequences: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A finished measured step: ``tokens`` emitted by the whole batch in ``seconds`` of wall time
        (drafting included), with ``method``'s scheduled requests drafting or resting."""
        if tokens < 0 or not seconds > 0:
            raise GateError(f"a step emits ≥ 0 tokens in > 0 s, got {tokens} in {seconds}")
        cell = self._cell(method, sequences)
        cell.draft.age(self.decay)
        cell.plain.age(self.decay)
        (cell.draft if drafted else cell.plain).add(tokens, seconds)

    def stats(self) -> dict[str, float | int]:
        """Flat, for engine stats and /metrics: per cell the measured tok/s of each arm, the samples, and
        whether drafting currently wins (1) or the drafter rests (0)."""
        out: dict[str, float | int] = {"spec_gate_probes_total": self.probes}
        for (method, bucket), cell in sorted(self.cells.items()):
            name = f"spec_gate_{method}_b{bucket}"
            out[f"{name}_draft_tok_s"] = cell.draft.per_s
            out[f"{name}_plain_tok_s"] = cell.plain.per_s
            out[f"{name}_draft_samples"] = cell.draft.samples
            out[f"{name}_plain_samples"] = cell.plain.samples
            explored = min(cell.draft.samples, cell.plain.samples) >= self.min_samples
            out[f"{name}_drafting"] = int(not explored or cell.drafting_wins(self.margin))
            out[f"{name}_probe_wait_steps"] = cell.wait
        return out
