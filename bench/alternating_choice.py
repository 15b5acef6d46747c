"""A method chooser that alternates the candidates request by request: the ``auto-alternate`` row of
``bench speedup``.

Why: session 59's runs (H100, RA-RC) put the `auto` row's auto runs whose minority method had more than 15%
of the requests at 0.940x the blend of the two single-method rows by requests at c >= 16, against 1.000x for
runs of one method (``python -m bench.measuring_cost``, its second table). That is a correlation: 7 of those
14 runs were knowledge, the shortest and noisiest workload, where the chooser switched because the two
methods are close. This chooser makes every batch half dspark and half gated ngram whatever the rates say,
on every workload and load, so the row measures what a mixed batch costs against the two rows in the same
run, with no choice in it. Not a serving setting: a deployment asks for `auto` or for one method.
"""
from __future__ import annotations

from specd.engine.method_choice import Choice, ChoiceError, MethodChoice


class AlternatingChoice(MethodChoice):
    """``MethodChoice`` whose answer is the next candidate in turn, never measuring. It makes no cell, so the
    inherited ``observe`` checks a measurement and has no cell to learn it in, and nothing explores (``young``
    is 0): the bench runs no extra warm-ups for it. Requests given each method are counted as ``MethodChoice``
    counts them, so the run records and the markdown's line per cell read the same."""

    def __init__(self) -> None:
        super().__init__()
        self.turn = 0

    def choose(self, prompt_class: tuple, bucket: int, candidates) -> Choice:
        if not candidates:
            raise ChoiceError("no candidate method to choose from")
        method = candidates[self.turn % len(candidates)]
        self.turn += 1
        self.chosen[method] = self.chosen.get(method, 0) + 1
        return Choice(method, False, False)

    def young(self, classes, bucket: int) -> int:
        return 0
