"""bench.alternating_choice: the auto-alternate row's chooser gives the candidates in turn and measures nothing."""
from __future__ import annotations

import pytest

from bench.alternating_choice import AlternatingChoice
from specd.engine.method_choice import ChoiceError


def test_it_alternates_the_candidates_whatever_the_rates_and_never_measures():
    chooser = AlternatingChoice()
    cls = (1, 2)
    first = [chooser.choose(cls, 8, ("dspark", "ngram")) for _ in range(4)]
    assert [c.method for c in first] == ["dspark", "ngram", "dspark", "ngram"]
    assert not any(c.measures or c.drafts for c in first)
    # a far faster ngram changes nothing: the chooser learns nothing
    for _ in range(5):
        chooser.observe(cls, 8, "ngram", 500, 0.1)
        chooser.observe(cls, 8, "dspark", 50, 1.0)
    assert [chooser.choose(cls, 8, ("dspark", "ngram")).method for _ in range(2)] == ["dspark", "ngram"]
    assert chooser.young([cls], 8) == 0 and chooser.cells == {}     # no cell explores: no extra warm-ups
    stats = chooser.stats()            # counted as MethodChoice counts them (the run records' auto_methods)
    assert stats["spec_auto_dspark_requests_total"] == 3 and stats["spec_auto_ngram_requests_total"] == 3
    assert stats["spec_auto_probes_total"] == 0 and stats["spec_auto_measuring_total"] == 0


def test_it_refuses_no_candidates_and_bad_measurements():
    chooser = AlternatingChoice()
    with pytest.raises(ChoiceError):
        chooser.choose((1,), 1, ())
    with pytest.raises(ChoiceError):
        chooser.observe((1,), 1, "dspark", 3, float("nan"))
