"""Method `auto` at c > 1 in epochs: a cell's admissions go to one method for a run of them, and a method is
rated only by requests that ran in batches of their own method at the load they were chosen for.

Why: ``MethodChoice`` rates each candidate by its finished requests' decode rate, request by request. At
c = 1 that is the method's rate. In a batch, every request shares the step, whose time the batch's methods
shape together, so a request of the method that has few requests in the batch decodes at a step time the
other method set. Sessions 57-59 (H100, ``python -m bench.mix_rates`` over their auto rows): at the end of each
cell, the chooser's rate of the cell's winner was 1.13x that method's own row's per-user p50 at c >= 16 and
its loser's 0.82x (at c = 1, where nothing mixes, 1.00x and 0.89x: the selection alone). Once a method leads,
its rival is measured only by lone probes in the leader's batches, so it rarely wins back a cell: session 59's
creative c = 16 gave dspark 63 of 64 requests in every repeat of run RB, where `ngram-gated` ran 1.53x `none`
per user and `dspark` 1.03x.

So at a load bucket above ``draft_most`` (where batches mix) a cell hands out its method by epochs of
``epoch`` times the bucket admissions: exploring, each young candidate in turn; then the winner, with one
epoch of the best loser every ``wait`` epochs (doubling while the winner holds, as ``MethodChoice``'s probes
do). A finished request teaches its cell only if its batch was at least ``clean`` its own method on average
and its mean batch at least ``floor`` of the bucket (a closed loop's last requests finish in a draining batch,
faster per user). The first requests of an epoch share their batch with the last epoch's and teach nothing;
the later ones run in a batch of their own method. At bucket ``draft_most`` and below, ``MethodChoice``
chooses request by request, as before.

The choice is made at a request's first step and never changes, and depends only on requests that finished
before, so the mixture stays lossless (each method's verification is).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.engine.method_choice import Arm, Choice, ChoiceCell, ChoiceError, MethodChoice, check_measurement

EPOCH = 2         # admissions an epoch holds, per unit of load bucket: the first bucket's worth share their batch
                  # with the last epoch's, the rest run in a batch of their own method
CLEAN = 0.8       # a request teaches its cell when at least this share of its batch was its method, on average
FLOOR = 0.75      # ... and its mean batch was at least this share of its load bucket
HOLD = 0.02       # a challenger takes a cell's next epoch from the winner only when faster by this fraction: the
                  # chooser's margin by default, as run in session 60 (H200, run SA). There its cells at c = 8 whose
                  # methods were close flipped winner epoch by epoch (coding 32 / 32 requests a run, the chooser's
                  # rates 330 / 329 tok/s), each epoch's first half ran mixed, and its mixed runs ran 0.90x the
                  # two rows' blend (``bench.measuring_cost --row auto-epoch``); the row ``auto-epoch-hold`` holds
                  # at 10%: a method within 10% costs less than the mixing a switch brings (not GPU-run yet)
UNCLEAN_MOST = 8  # a candidate's requests in a row that taught nothing, after which the next one teaches anyway:
                  # in traffic of many prompt classes whose cells chose differently no batch is ever clean, and
                  # a cell that never learns would explore for ever


@dataclass
class Epoch:
    """A cell's current run of admissions: its method, admissions left, and whether it measures (explores
    or probes) rather than serves the winner."""

    method: str | None = None
    left: int = 0
    measures: bool = False


@dataclass
class EpochCell(ChoiceCell):
    """A ``ChoiceCell`` with its current epoch and, per candidate, its requests in a row that taught nothing:
    kept in the cell, so they are forgotten with it (``MAX_CELLS``)."""

    run: Epoch | None = None
    unclean: dict[str, int] = field(default_factory=dict)


class EpochChoice(MethodChoice):
    """``MethodChoice`` that, above ``draft_most``, chooses by epochs and learns only from clean requests."""

    cell_type = EpochCell

    def __init__(self, epoch: int = EPOCH, clean: float = CLEAN, floor: float = FLOOR,
                 unclean_most: int = UNCLEAN_MOST, hold: float = HOLD, **settings):
        super().__init__(**settings)
        if epoch < 1 or not 0.0 < clean <= 1.0 or not 0.0 <= floor <= 1.0 or unclean_most < 1 or hold < 0:
            raise ChoiceError(f"bad epoch choice settings: epoch={epoch}, clean={clean}, floor={floor}, "
                              f"unclean_most={unclean_most}, hold={hold}")
        self.epoch, self.clean, self.floor, self.unclean_most = epoch, clean, floor, unclean_most
        self.hold = hold
        self.unclean = 0          # finished requests that taught nothing (a mixed or draining batch)

    def choose(self, prompt_class: tuple, bucket: int, candidates) -> Choice:
        if bucket <= self.draft_most:
            return super().choose(prompt_class, bucket, candidates)
        if not candidates:
            raise ChoiceError("no candidate method to choose from")
        cell = self._cell((prompt_class, bucket))
        for m in candidates:
            cell.arms.setdefault(m, Arm())
        run = cell.run
        if run is None or run.left <= 0 or run.method not in candidates:
            run = cell.run = self._next_epoch(cell, list(candidates), bucket)
        run.left -= 1
        if not run.measures:
            cell.since += 1
        self._admit(cell, run.method, run.measures)
        return Choice(run.method, run.measures, False)

    def _next_epoch(self, cell, candidates: list[str], bucket: int) -> Epoch:
        """The next run of ``epoch * bucket`` admissions: the least admitted young candidate while any explores;
        else the best loser when the winner has held ``wait`` epochs since the last probe (the wait doubles),
        else the winner."""
        size = self.epoch * bucket
        young = [(cell.arms[m].admitted, i) for i, m in enumerate(candidates) if self._explores(cell.arms[m])]
        if young:
            return Epoch(candidates[min(young)[1]], size, True)
        winner = self._winner(cell, candidates, self.hold)
        if len(candidates) > 1 and cell.since >= cell.wait * size:
            rates = {m: cell.arms[m].rate for m in candidates if m != winner}
            cell.since = 0
            cell.wait = min(self.probe_most, cell.wait * 2)
            self.probes += 1
            return Epoch(max(rates, key=rates.get), size, True)
        return Epoch(winner, size, False)

    def observe(self, prompt_class: tuple, bucket: int, method: str, tokens: int, seconds: float,
                measured: bool = False, mix: float = 1.0, load: float = 0.0) -> None:
        cell = self.cells.get((prompt_class, bucket))
        if (bucket <= self.draft_most or cell is None or (mix >= self.clean and load >= self.floor * bucket)
                or cell.unclean.get(method, 0) >= self.unclean_most):
            if cell is not None:
                cell.unclean.pop(method, None)
            super().observe(prompt_class, bucket, method, tokens, seconds, measured, mix, load)
            return
        check_measurement(tokens, seconds, mix, load)
        cell.unclean[method] = cell.unclean.get(method, 0) + 1
        self.unclean += 1
        arm = cell.arms.get(method)
        if arm is not None and measured and arm.measuring > 0:
            arm.measuring -= 1

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "spec_auto_unclean_total": self.unclean}
