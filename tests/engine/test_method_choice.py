"""Speculation method `auto`: the chooser's rules on made-up measurements (specd/engine/method_choice.py),
then the engine on stories260K choosing between dspark and ngram per request, losslessly, with bad
settings refused."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.errors import EngineError
from specd.engine.method_choice import ChoiceError, MethodChoice
from specd.engine.request import Request
from specd.sampling_params import SamplingParams, SpeculationParams
from tests.greedy_runs import batch_outputs

CLS = (1, 2, 3)
BOTH = ("dspark", "ngram")


def admit(chooser: MethodChoice, n: int, bucket: int = 1, cls=CLS, measures: list | None = None) -> list[str]:
    """n admissions; their methods (and, into ``measures``, whether each was sent to measure it)."""
    got = [chooser.choose(cls, bucket, BOTH) for _ in range(n)]
    if measures is not None:
        measures.extend(c.measures for c in got)
    return [c.method for c in got]


def finish(chooser: MethodChoice, method: str, rate: float, n: int = 1, bucket: int = 1, cls=CLS,
           measured: bool = True) -> None:
    """n requests of ``method`` finish at ``rate``; sent to measure it (exploring, probing) unless told."""
    for _ in range(n):
        chooser.observe(cls, bucket, method, 100, 100 / rate, measured=measured)


def test_every_candidate_is_explored_before_any_comparison():
    chooser = MethodChoice(explore=2, explore_tokens=0)
    assert admit(chooser, 4) == ["dspark", "ngram", "dspark", "ngram"]      # round robin, ties to the first
    finish(chooser, "dspark", 500.0, n=2)
    finish(chooser, "ngram", 100.0, n=1)
    # ngram has one finished request of the two it needs: it alone is young, so it takes the next one
    assert admit(chooser, 1) == ["ngram"]
    finish(chooser, "ngram", 100.0, n=1)
    assert chooser.cells[(CLS, 1)].winner is None
    assert admit(chooser, 3) == ["dspark"] * 3
    assert chooser.cells[(CLS, 1)].winner == "dspark"


def test_short_answers_do_not_end_the_exploration():
    """A candidate stays young until its finished requests decoded ``explore_tokens`` tokens: a few 8-token
    answers say little about a method's rate on long ones."""
    chooser = MethodChoice(explore=2, explore_tokens=256)
    admit(chooser, 4)
    for method in BOTH:
        for _ in range(2):
            chooser.observe(CLS, 1, method, 7, 0.01)        # two short answers each: still exploring
    assert admit(chooser, 2) == ["dspark", "ngram"] and chooser.cells[(CLS, 1)].winner is None
    chooser.observe(CLS, 1, "dspark", 300, 1.0)
    assert admit(chooser, 2) == ["ngram", "ngram"]           # dspark has its tokens; ngram is young alone
    chooser.observe(CLS, 1, "ngram", 300, 0.5)
    assert admit(chooser, 1) == ["ngram"] and chooser.cells[(CLS, 1)].winner == "ngram"
    snap = chooser.snapshot()
    assert snap[0]["bucket"] == 1 and snap[0]["winner"] == "ngram"
    assert snap[0]["arms"]["ngram"]["decoded"] == 314 and snap[0]["arms"]["dspark"]["finished"] == 3


def test_the_faster_candidate_wins_and_the_loser_is_probed_ever_more_rarely():
    chooser = MethodChoice(explore=1, probe_first=4, probe_most=16, explore_tokens=0)
    admit(chooser, 2)
    finish(chooser, "dspark", 100.0)
    finish(chooser, "ngram", 300.0)
    got = admit(chooser, 5)
    assert got == ["ngram"] * 4 + ["dspark"]        # four to the winner, then a probe of the loser
    assert chooser.probes == 1
    assert admit(chooser, 3) == ["ngram"] * 3        # no second probe while the first is unanswered ...
    finish(chooser, "dspark", 100.0)                 # ... answered: ngram still wins, the wait doubles
    cell = chooser.cells[(CLS, 1)]
    assert cell.winner == "ngram" and cell.wait == 8 and cell.probing is None
    got = admit(chooser, 6)                          # 3 admissions since the probe, then 5 more to reach 8
    assert got == ["ngram"] * 5 + ["dspark"]
    finish(chooser, "dspark", 100.0)
    assert cell.wait == 16
    admit(chooser, 17)
    finish(chooser, "dspark", 100.0)
    assert cell.wait == 16                           # at most probe_most


def test_only_a_measuring_request_answers_a_probe():
    """A gated request of the probed method, given while that method held the cell and finishing after the
    probe began, did not draft throughout: it leaves the probe open, and the wait does not double on it."""
    chooser = MethodChoice(explore=1, probe_first=2, decay=0.0, explore_tokens=0)
    admit(chooser, 2)
    finish(chooser, "dspark", 300.0)
    finish(chooser, "ngram", 100.0)
    assert admit(chooser, 1) == ["dspark"]           # dspark holds; this one is gated (not measuring)
    finish(chooser, "dspark", 50.0, measured=False)  # dspark slows: ngram takes the cell
    assert admit(chooser, 3) == ["ngram", "ngram", "dspark"]     # the third probes dspark
    cell = chooser.cells[(CLS, 1)]
    assert cell.winner == "ngram" and cell.probing == "dspark"
    finish(chooser, "dspark", 50.0, measured=False)  # an older gated dspark request: not the probe
    assert cell.probing == "dspark" and cell.wait == 2
    finish(chooser, "dspark", 50.0)                  # the probe: ngram holds, the wait doubles
    assert cell.probing is None and cell.wait == 4


def test_a_probe_that_finds_the_loser_faster_hands_it_the_cell():
    chooser = MethodChoice(explore=1, probe_first=2, decay=0.0, explore_tokens=0)
    admit(chooser, 2)
    finish(chooser, "dspark", 100.0)
    finish(chooser, "ngram", 300.0)
    assert admit(chooser, 3) == ["ngram", "ngram", "dspark"]
    finish(chooser, "dspark", 900.0)                 # decay 0: the newest request is the record
    assert admit(chooser, 1) == ["dspark"]
    cell = chooser.cells[(CLS, 1)]
    assert cell.winner == "dspark" and cell.wait == 2


def test_the_holder_keeps_the_cell_within_the_margin():
    chooser = MethodChoice(explore=1, margin=0.05, decay=0.0, explore_tokens=0)
    admit(chooser, 2)
    finish(chooser, "dspark", 100.0)
    finish(chooser, "ngram", 90.0)
    assert admit(chooser, 1) == ["dspark"]
    finish(chooser, "ngram", 104.0)                  # 4% faster: inside the margin, dspark holds
    assert admit(chooser, 1) == ["dspark"]
    finish(chooser, "ngram", 106.0)                  # 6%: ngram takes over
    assert admit(chooser, 1) == ["ngram"]


def test_classes_and_loads_are_separate_cells():
    chooser = MethodChoice(explore=1, decay=0.0, explore_tokens=0)
    admit(chooser, 2, bucket=1)
    finish(chooser, "dspark", 100.0, bucket=1)
    finish(chooser, "ngram", 300.0, bucket=1)
    assert admit(chooser, 1, bucket=1) == ["ngram"]
    assert admit(chooser, 2, bucket=16) == ["ngram", "ngram"]           # a new load explores behind the winner
    assert chooser.cells[(CLS, 16)].winner is None                      # ... and compares at its own load
    assert admit(chooser, 2, cls=(9,)) == ["dspark", "ngram"]           # a new class explores from nothing


def test_requests_sent_to_measure_a_method_are_marked_and_draft_throughout():
    """Exploring and probing requests measure their method (they draft whatever the gate decides); the
    winner's and the inherited winner's do not. The gate drafts a measuring request's steps."""
    from specd.engine.gate_records import Acceptance, ClassRecord
    from specd.engine.spec_gate import SpecGate

    chooser = MethodChoice(explore=1, probe_first=2, explore_tokens=0)
    flags: list = []
    admit(chooser, 2, measures=flags)                        # exploring: both measure
    finish(chooser, "dspark", 100.0)
    finish(chooser, "ngram", 300.0)
    admit(chooser, 3, measures=flags)                        # winner, winner, then a probe of dspark
    admit(chooser, 2, bucket=8, measures=flags)              # a new load: ngram inherited, then dspark explores
    admit(chooser, 1, bucket=8, measures=flags)
    assert flags == [True, True, False, False, True, False, False, True]
    assert chooser.stats()["spec_auto_measuring_total"] == 4
    assert chooser.choose(CLS, 1, ("dspark", "ngram")).drafts is False     # the winner's: measures nothing
    gate = SpecGate()
    assert gate.explores(Acceptance(measures=True))
    assert not gate.explores(Acceptance(group=ClassRecord(requests=5, samples=10)))


def test_only_a_light_loads_measuring_requests_draft_throughout():
    """A measuring request drafts at every step only at load buckets up to ``draft_most`` (1 by default):
    in a batch its drafting makes every request's step a drafting one (session 58, runs QA-QD)."""
    for bucket, drafts in ((1, True), (2, False), (8, False), (32, False)):
        choice = MethodChoice(explore=1, explore_tokens=0).choose(CLS, bucket, ("dspark", "ngram"))
        assert choice.measures and choice.drafts is drafts, bucket
    wide = MethodChoice(explore=1, explore_tokens=0, draft_most=8)
    assert wide.choose(CLS, 8, ("dspark", "ngram")).drafts and not wide.choose(CLS, 16, ("dspark", "ngram")).drafts
    assert not MethodChoice(draft_most=0).choose(CLS, 1, ("dspark", "ngram")).drafts
    with pytest.raises(ChoiceError):
        MethodChoice(draft_most=-1)


def test_a_heavy_loads_first_wave_measures_only_explore_requests_a_method():
    """Exploring from nothing, each candidate has at most ``explore`` measuring requests in flight: the rest
    of a first wave of 32 runs behind the gate as usual."""
    chooser = MethodChoice(explore=2, explore_tokens=0)
    flags: list = []
    got = admit(chooser, 8, bucket=32, measures=flags)
    assert got == ["dspark", "ngram"] * 4 and flags == [True] * 4 + [False] * 4
    chooser.observe(CLS, 32, "dspark", 0, 0.0, measured=True)     # one measuring dspark request ends (empty)
    assert chooser.cells[(CLS, 32)].arms["dspark"].measuring == 1
    flags.clear()
    admit(chooser, 2, bucket=32, measures=flags)
    assert flags == [True, False]                                  # dspark may measure one more, ngram not


def test_a_new_load_runs_the_nearest_loads_winner_while_it_explores():
    """A class's new load bucket starts from the winner of its nearest explored load (not its rates): that
    winner takes the admissions, the other candidate one in ``probe_first`` until it has its samples here."""
    chooser = MethodChoice(explore=1, probe_first=4, decay=0.0, explore_tokens=0)
    admit(chooser, 2, bucket=1)
    finish(chooser, "dspark", 100.0, bucket=1)
    finish(chooser, "ngram", 300.0, bucket=1)
    assert admit(chooser, 1, bucket=1) == ["ngram"]
    got = admit(chooser, 5, bucket=8)
    assert got == ["ngram"] * 4 + ["dspark"] and chooser.cells[(CLS, 8)].prior == "ngram"
    assert admit(chooser, 2, bucket=8) == ["ngram"] * 2      # dspark's one exploring request is in flight
    finish(chooser, "ngram", 200.0, bucket=8)                # rates at load 8 are this load's own
    finish(chooser, "dspark", 250.0, bucket=8)
    assert admit(chooser, 1, bucket=8) == ["dspark"]         # compared at this load, dspark wins here
    assert admit(chooser, 2, bucket=2) == ["ngram"] * 2      # bucket 2's nearest: 1 (ratio 2) before 8
    assert admit(chooser, 2, bucket=4, cls=(5,)) == ["dspark", "ngram"]   # another class: nothing to inherit


def test_an_empty_or_aborted_request_says_nothing_but_ends_its_probe():
    chooser = MethodChoice(explore=1, probe_first=1, explore_tokens=0)
    admit(chooser, 2)
    chooser.observe(CLS, 1, "dspark", 0, 1.0)        # one token: no rate
    chooser.observe(CLS, 1, "ngram", 10, 0.0)        # no time: no rate
    assert chooser.cells[(CLS, 1)].arms["dspark"].finished == 0
    finish(chooser, "dspark", 100.0)
    finish(chooser, "ngram", 300.0)
    assert admit(chooser, 2) == ["ngram", "dspark"]
    chooser.observe(CLS, 1, "dspark", 0, 0.0, measured=True)    # the probe, aborted before its second token
    assert chooser.cells[(CLS, 1)].probing is None
    assert "dspark" in admit(chooser, 3)             # and the probes go on
    chooser.observe((7,), 4, "dspark", 10, 1.0)      # a cell never chosen in: ignored


@pytest.mark.parametrize("kwargs", [{"explore": 0}, {"decay": 1.0}, {"probe_first": 0},
                                    {"probe_first": 8, "probe_most": 4}, {"margin": -0.1}, {"explore_tokens": -1}])
def test_bad_settings_and_measurements_are_refused(kwargs):
    with pytest.raises(ChoiceError):
        MethodChoice(**kwargs)
    chooser = MethodChoice()
    with pytest.raises(ChoiceError):
        chooser.observe(CLS, 1, "dspark", -1, 1.0)
    with pytest.raises(ChoiceError):
        chooser.observe(CLS, 1, "dspark", 1, float("nan"))
    with pytest.raises(ChoiceError):
        chooser.choose(CLS, 1, ())


# ---- the engine ---------------------------------------------------------------------------------------
DSPARK = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PROMPTS = ["Once upon a time, there was a", "Tom had a big dog. The dog", "One day, Lily went to the",
           "The cat sat on the mat. The cat sat on the mat. The cat sat on the"]


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.from_config(EngineConfig(max_num_seqs=8, num_local_blocks=2048, speculation="auto",
                                               drafters={"dspark": DSPARK}, device="cpu"))


def test_auto_requests_run_both_candidates_and_match_plain_decoding(engine):
    """Greedy, 3 waves of 8: every auto request takes dspark or ngram (both, while the cell explores), on
    the schedule the chooser gives it, and its tokens are plain decoding's: each method is lossless, and the
    choice is made from earlier requests only."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 8
    want = batch_outputs(engine, "plain-", prompts, params, "none")
    chosen = []
    real = engine._assign_method

    def spy(seq, method, gate_key, measures=False):
        chosen.append((seq.request.speculation, seq.request.spec_schedule, gate_key))
        return real(seq, method, gate_key, measures)

    engine._assign_method = spy
    verified = engine.stats()["spec_verifications_total"]
    finished = []
    real_finish = engine._finish
    engine._finish = lambda seq, reason: (finished.append(seq), real_finish(seq, reason))[1]
    try:
        for wave in range(3):
            got = batch_outputs(engine, f"auto{wave}-", prompts, params, None)
            assert got == want, f"wave {wave}: auto parted from plain decoding"
    finally:
        engine._assign_method = real
        engine._finish = real_finish
    # each auto request's usage says which method it ran, drafted or not
    assert [seq.usage().speculation["method"] for seq in finished] == [seq.method for seq in finished]
    assert {seq.method for seq in finished} == {"dspark", "ngram"}
    # requests were sent to measure a method, but at load 8 none drafts throughout (``Choice.drafts``)
    assert any(seq.auto_choice[3] for seq in finished)
    assert not any(seq.gate_acceptance.measures for seq in finished)
    assert len(chosen) == 24
    assert {c[0] for c in chosen} == {"dspark", "ngram"}
    assert {(m, s, k) for m, s, k in chosen} <= {("dspark", "confidence", "dspark"), ("ngram", "gated", "ngram_gated")}
    assert engine.auto_gate_keys() == ("dspark", "ngram_gated")      # what a benchmark warms for the auto row
    stats = engine.stats()
    assert stats["spec_auto_dspark_requests_total"] + stats["spec_auto_ngram_requests_total"] == 24
    assert engine.stats()["spec_verifications_total"] > verified, "no auto request drafted: nothing was checked"
    cells = engine.spec_gate.methods.cells
    assert all(b == 8 for _, b in cells), "a wave of 8 added before one step is chosen at load 8"
    assert sum(a.finished for c in cells.values() for a in c.arms.values()) == 24


def test_a_request_measuring_a_method_alone_drafts_throughout(engine):
    """At load 1 a request sent to measure its method drafts at every step whatever the gate decides, and its
    answer is plain decoding's. A new class explores from nothing, so its first request measures."""
    prompt = "A lonely fox walked in the snow. The fox"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = batch_outputs(engine, "alone-plain-", [prompt], [params], "none")
    finished = []
    real_finish = engine._finish
    engine._finish = lambda seq, reason: (finished.append(seq), real_finish(seq, reason))[1]
    try:
        got = batch_outputs(engine, "alone-", [prompt], [params], None)
    finally:
        engine._finish = real_finish
    assert got == want
    (seq,) = finished
    assert seq.auto_choice[2] == 1 and seq.auto_choice[3], "the class's first request at load 1 measures"
    assert seq.gate_acceptance.measures and seq.spec_verifications > 0


def test_a_burst_is_chosen_at_the_load_it_runs_at(engine):
    """Requests added one by one before a step are all chosen at the load of that step, not at 1, 2, 4."""
    before = set(engine.spec_gate.methods.cells)
    for i in range(8):
        engine.add_request(Request(f"burst{i}", engine.tokenizer.encode(f"A new tale {i}. Once there was"),
                                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), speculation="auto"))
    engine.step()
    new = set(engine.spec_gate.methods.cells) - before
    assert new and {bucket for _, bucket in new} == {8}
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("fields, words", [
    ({"speculation": "auto", "spec_schedule": "fixed"}, "picks the method"),
    ({"speculation": "auto", "num_speculative_tokens": 3}, "picks the method"),
])
def test_auto_with_a_schedule_is_refused(engine, fields, words):
    with pytest.raises(EngineError, match=words):
        engine.add_request(Request("bad", [1, 2, 3], SamplingParams(max_tokens=2), **fields))
    with pytest.raises(ValidationError, match="auto"):
        SpeculationParams(method="auto", schedule="fixed")


def test_auto_leaves_out_what_it_cannot_serve():
    e = SpecEngine.from_config(EngineConfig(max_num_seqs=2, num_local_blocks=256, device="cpu"))
    assert e.auto_candidates() == ("ngram",)          # no dspark drafter: ngram alone
    assert e.auto_gate_keys() == ("ngram_gated",)
    e2 = SpecEngine.from_config(EngineConfig(max_num_seqs=2, num_local_blocks=256, device="cpu",
                                             auto_methods="dflash"))
    with pytest.raises(EngineError, match="no method it can serve"):
        e2.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2), speculation="auto"))
    with pytest.raises(ValidationError):
        EngineConfig(auto_methods="dspark,medusa")
