"""Method `auto` in epochs (specd/engine/epoch_choice.py): the rules on made-up measurements, then the engine's
batch accounting (``SpecEngine._count_batch``) on stories260K."""
from __future__ import annotations

from pathlib import Path

import pytest

from specd.engine.epoch_choice import EpochChoice
from specd.engine.method_choice import ChoiceError, MethodChoice

CLS = (1, 2, 3)
BOTH = ("dspark", "ngram")


def _take(chooser, n: int, bucket: int = 4):
    return [chooser.choose(CLS, bucket, BOTH) for _ in range(n)]


def _teach(chooser, method: str, rate: float, n: int = 2, bucket: int = 4, mix: float = 1.0, load: float = 4.0,
           measured: bool = True):
    for _ in range(n):
        chooser.observe(CLS, bucket, method, 200, 200 / rate, measured=measured, mix=mix, load=load)


def test_at_load_one_it_chooses_request_by_request_as_method_choice_does():
    epochs, plain = EpochChoice(), MethodChoice()
    for _ in range(6):
        a, b = epochs.choose(CLS, 1, BOTH), plain.choose(CLS, 1, BOTH)
        assert a == b
        epochs.observe(CLS, 1, a.method, 100, 1.0, measured=a.measures, mix=0.1, load=0.5)   # mix not read at 1
        plain.observe(CLS, 1, b.method, 100, 1.0, measured=b.measures)
    assert epochs.unclean == 0


def test_a_cell_explores_each_candidate_for_a_whole_epoch_then_serves_the_faster():
    chooser = EpochChoice(epoch=2)
    first = _take(chooser, 8)                    # 2 x bucket 4: one epoch of the least admitted young candidate
    assert {c.method for c in first} == {"dspark"} and all(c.measures and not c.drafts for c in first)
    second = _take(chooser, 8)
    assert {c.method for c in second} == {"ngram"} and all(c.measures for c in second)
    _teach(chooser, "dspark", 100.0)
    _teach(chooser, "ngram", 150.0)
    assert chooser.young([CLS], 4) == 0
    third = _take(chooser, 8)
    assert {c.method for c in third} == {"ngram"} and not any(c.measures for c in third)


def test_requests_from_a_mixed_or_draining_batch_teach_nothing():
    chooser = EpochChoice(epoch=2, clean=0.8, floor=0.75)
    _take(chooser, 16)
    _teach(chooser, "dspark", 100.0)
    _teach(chooser, "ngram", 500.0, mix=0.5)               # in a batch half the other method's
    _teach(chooser, "ngram", 500.0, load=2.0)              # in a batch drained to 2 of load 4
    assert chooser.unclean == 4
    cell = chooser.cells[(CLS, 4)]
    assert cell.arms["ngram"].finished == 0 and cell.arms["ngram"].measuring == 4    # 8 sent, 4 came back
    assert chooser.young([CLS], 4) == 1                    # ngram still explores: its next epoch measures again
    assert {c.method for c in _take(chooser, 8)} == {"ngram"}
    assert chooser.stats()["spec_auto_unclean_total"] == 4


def test_a_candidate_that_never_runs_clean_learns_after_unclean_most_requests():
    """Traffic whose batches are always mixed (many classes, each cell its own winner): after ``unclean_most``
    requests in a row that taught nothing, the next teaches anyway, so the cell stops exploring."""
    chooser = EpochChoice(epoch=2, unclean_most=3)
    _take(chooser, 16)
    _teach(chooser, "dspark", 100.0, n=4, mix=0.5)
    cell = chooser.cells[(CLS, 4)]
    assert cell.arms["dspark"].finished == 1 and chooser.unclean == 3      # the 4th taught
    _teach(chooser, "dspark", 100.0, n=3, mix=0.5)                     # its streak began again
    assert cell.arms["dspark"].finished == 1 and chooser.unclean == 6
    _teach(chooser, "dspark", 100.0, n=1, mix=0.5)
    assert cell.arms["dspark"].finished == 2


def test_the_loser_gets_a_probe_epoch_after_wait_epochs_and_the_wait_doubles():
    chooser = EpochChoice(epoch=1, probe_first=2, probe_most=8)
    _take(chooser, 8)                                      # explore: 4 dspark, 4 ngram
    _teach(chooser, "dspark", 200.0)
    _teach(chooser, "ngram", 100.0)
    served = _take(chooser, 8)                             # wait 2 epochs of 4 admissions: 8 to the winner
    assert {c.method for c in served} == {"dspark"}
    probe = _take(chooser, 4)
    assert {c.method for c in probe} == {"ngram"} and all(c.measures for c in probe)
    assert chooser.probes == 1 and chooser.cells[(CLS, 4)].wait == 4
    assert {c.method for c in _take(chooser, 16)} == {"dspark"}       # 4 epochs now before the next probe
    assert {c.method for c in _take(chooser, 4)} == {"ngram"}
    _teach(chooser, "ngram", 400.0, n=6)                   # the probe finds ngram faster: it takes the cell
    assert {c.method for c in _take(chooser, 4)} == {"ngram"}
    assert chooser.cells[(CLS, 4)].winner == "ngram"


def test_a_close_challenger_takes_the_next_epoch_only_past_hold():
    """With ``hold`` 10%, a challenger 5% faster leaves the winner its cell; 15% faster takes the next epoch.
    With the chooser's 2% margin (the default), 5% is enough."""
    for hold, rate, taken in ((0.10, 105.0, False), (0.10, 115.0, True), (0.02, 105.0, True)):
        chooser = EpochChoice(epoch=1, hold=hold)
        _take(chooser, 8)                                  # explore: 4 dspark, 4 ngram
        _teach(chooser, "dspark", 100.0)
        _teach(chooser, "ngram", 90.0)
        assert {c.method for c in _take(chooser, 4)} == {"dspark"}
        _teach(chooser, "ngram", rate, n=10)               # the old samples decayed away: ngram's rate ~ ``rate``
        assert {c.method for c in _take(chooser, 4)} == ({"ngram"} if taken else {"dspark"}), (hold, rate)


def test_bad_settings_and_measurements_are_refused():
    for bad in ({"epoch": 0}, {"clean": 0.0}, {"clean": 1.5}, {"floor": -0.1}, {"unclean_most": 0}, {"hold": -0.1},
                {"explore": 0}):
        with pytest.raises(ChoiceError):
            EpochChoice(**bad)
    chooser = EpochChoice()
    _take(chooser, 1)
    for mix, load in ((1.5, 4.0), (-0.1, 4.0), (1.0, -1.0)):
        with pytest.raises(ChoiceError):
            chooser.observe(CLS, 4, "dspark", 10, 1.0, mix=mix, load=load)
    with pytest.raises(ChoiceError):
        chooser.choose(CLS, 4, ())


# ---- the engine ---------------------------------------------------------------------------------------
DSPARK = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
SHARED = ("Once upon a time, in a small town by the sea, there lived a little girl named Lily who loved to play "
          "with her dog Max every day in the park near her house.")      # over 32 tokens: one prompt class


@pytest.fixture(scope="module")
def engine():
    from specd.engine.config import EngineConfig
    from specd.engine.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=2048, speculation="auto",
                                               drafters={"dspark": DSPARK}, device="cpu"))


def _wave(engine, tag: str, n: int, method_of=None):
    """``n`` greedy auto requests added before one step; returns what each finished request told its chooser."""
    from specd.engine.request import Request, SamplingParams

    told = []
    chooser = engine.spec_gate.methods
    real = chooser.observe

    def spy(cls, bucket, method, tokens, seconds, measured=False, mix=1.0, load=0.0):
        told.append((method, mix, load))
        return real(cls, bucket, method, tokens, seconds, measured, mix, load)

    chooser.observe = spy
    try:
        for i in range(n):
            engine.add_request(Request(f"{tag}{i}", engine.tokenizer.encode(f"{SHARED} {tag} {i}: there was"),
                                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                       speculation="auto"))
        while engine.has_work():
            engine.step()
    finally:
        del chooser.observe
    return told


def test_each_auto_request_tells_its_chooser_the_share_of_its_batch_on_its_method_and_the_batch_size(engine):
    """A wave of 8 under ``MethodChoice``: its cell explores both methods in one batch, so each request's batch
    was partly the other method's; under ``EpochChoice`` the wave is one epoch of one method, every request's
    batch all its own."""
    told = _wave(engine, "mixed-", 8)
    assert len(told) == 8 and {m for m, _, _ in told} == {"dspark", "ngram"}
    assert all(0.0 < mix < 1.0 for _, mix, _ in told)
    assert all(1.0 <= load <= 8.0 for _, _, load in told)
    engine.spec_gate.methods = EpochChoice()
    told = _wave(engine, "epoch-", 8)
    assert len({m for m, _, _ in told}) == 1 and all(mix == 1.0 for _, mix, _ in told)
    assert all(1.0 <= load <= 8.0 for _, _, load in told)
