"""The drafter pipeline end to end on stories260K at a tiny scale: every stage runs, a second run resumes
(skips every stage), the JSON holds every row × workload × temperature, and a budget that is already
spent cuts training short and skips what cannot start, saying so."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from bench.__main__ import main
from bench.drafter_pipeline import METHODS, ROWS, TEMPERATURES, WORKLOADS

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"
TINY = ["--steps", "2", "--tune-steps", "1", "--layers", "1", "--markov-rank", "8", "--max-len", "512",
        "--batch-size", "2", "--anchors", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    assert main(["drafter-pipeline", "--prepare", "--sessions", str(d), "--out", str(d), "--scale", "tiny",
                 "--train-sessions", "4", "--eval-sessions", "2", "--turns", "2", "--max-tokens", "8",
                 "--max-chars", "80"]) == 0
    return d


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pipeline(sessions: Path, work: Path, out: Path, *extra: str) -> int:
    return main(["drafter-pipeline", "--target", str(STORIES), "--sessions", str(sessions), "--work", str(work),
                 "--out", str(out), *TINY, *extra])


def test_pipeline_runs_every_stage_then_resumes(sessions, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    assert _pipeline(sessions, work, out) == 0
    first = capsys.readouterr().out
    assert "done earlier" not in first
    rep = json.loads((out / "acceptance-qwen.json").read_text())
    for row in ROWS:
        for w in WORKLOADS:
            for t in TEMPERATURES:
                s = rep["results"][row][w][f"{t:g}"]
                assert s["rounds"] > 0 and 1.0 <= s["tau"] <= 8.0, (row, w, t)
    assert rep["results"]["dspark"]["creative"]["1"]["ece_raw"] is not None
    assert all(rep["tau"][f"{t:g}"][row]["mean"] is not None for t in TEMPERATURES for row in ROWS)
    assert set(rep["ratios"]["0"]) == {"dspark/dflash", "dspark/eagle3"}
    assert not rep["skipped"] and not rep["truncated"]
    # the three generic drafters trained on the same data for the same steps
    shas = {json.loads((work / "drafters" / m / "training.json").read_text())["data"]["answers_sha256"]
            for m in METHODS}
    assert len(shas) == 1
    assert rep["answers"] == rep["stages"]["data"]["answers"] == "harness"       # the CPU default, recorded
    assert {json.loads((work / "drafters" / m / "training.json").read_text())["data"]["answers"]
            for m in METHODS} == {"harness"}
    assert {rep["stages"][f"train-{m}"]["steps_done"] for m in METHODS} == {2}
    assert "| dspark-tuned |" in (out / "acceptance-qwen.md").read_text()
    assert (out / "acceptance-by-position-t0.png").stat().st_size > 0

    weights = work / "drafters" / "dspark" / "drafter.safetensors"
    before = weights.stat().st_mtime_ns
    assert _pipeline(sessions, work, out) == 0
    second = capsys.readouterr().out
    stage_lines = [ln for ln in second.splitlines() if "] " in ln and ": " in ln.split("] ", 1)[1]]
    resumed = [ln for ln in stage_lines if "done earlier, skipped" in ln]
    assert len(resumed) == 1 + len(METHODS) + len(WORKLOADS) + 4 + len(WORKLOADS)   # data, train, tune, eval
    assert "load:" not in second                      # nothing left to do: the target is never loaded
    assert weights.stat().st_mtime_ns == before
    assert json.loads((out / "acceptance-qwen.json").read_text())["results"] == rep["results"]


def test_engine_data_stage_writes_the_harness_data(sessions, tmp_path):
    """--answers engine: same seeds, same sampler, fp32 CPU logits that round alike -> the same data.jsonl."""
    markers = {}
    for kind in ("engine", "harness"):
        work = tmp_path / kind
        assert _pipeline(sessions, work, tmp_path / f"out-{kind}", "--answers", kind, "--stop-after", "data") == 0
        markers[kind] = json.loads((work / "stages" / "data.json").read_text())
        assert markers[kind]["answers"] == kind and markers[kind]["sequences"] > 0
    assert markers["engine"]["answers_sha256"] == markers["harness"]["answers_sha256"]


def test_spent_budget_truncates_training_and_skips_the_rest(sessions, tmp_path, capsys):
    out = tmp_path / "out"
    assert _pipeline(sessions, tmp_path / "work", out, "--budget-s", "0.001") == 0
    rep = json.loads((out / "acceptance-qwen.json").read_text())
    assert {rep["stages"][f"train-{m}"]["status"] for m in METHODS} == {"truncated"}
    assert rep["stages"]["train-dspark"]["steps_done"] == 0
    assert len(rep["truncated"]) == len(METHODS)
    assert len(rep["skipped"]) == len(WORKLOADS) + 4 + len(WORKLOADS)       # tuning, evaluations
    assert all(v is None for v in rep["tau"]["0"]["dspark"].values())
    assert "Cut by the budget" in (out / "acceptance-qwen.md").read_text()


def test_methods_flag_takes_known_names_and_needs_dspark_past_training():
    """--methods names known drafters; one without dspark only stops after training (tuning starts from
    dspark), so a session can give the whole window to dflash and eagle3 beside a carried dspark."""
    import argparse

    import pytest

    from bench.drafter_pipeline import _methods, check_methods, eval_plan

    assert _methods("dspark") == ("dspark",)
    assert _methods("eagle3, dspark,eagle3") == ("eagle3", "dspark")
    assert _methods("dflash,eagle3") == ("dflash", "eagle3")
    for bad in ("dspark,medusa", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="one or more of dspark, dflash, eagle3"):
            _methods(bad)
    for stop in ("data", "train"):
        check_methods(("dflash", "eagle3"), stop)
    for stop in ("tune", None):
        with pytest.raises(SystemExit, match="leaves out dspark"):
            check_methods(("dflash",), stop)
    check_methods(("dspark",), None)
    names = [name for name, _, _ in eval_plan(__import__("pathlib").Path("/w"), ("dspark",))]
    assert "dflash" not in names and "eagle3" not in names and "ngram" in names and "dspark" in names


def test_served_copy_casts_a_copy_only_when_asked():
    """The data stage answers in bf16 on CUDA (what specd serves), the target elsewhere; a cast is a
    copy, so the later stages still read the fp32 target."""
    import torch

    from specd.drafter.data import served_copy
    from specd.models.config import ModelConfig
    from specd.models.decoder import DecoderModel

    model = DecoderModel(ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5,
                                     rope_theta=10000.0))
    assert served_copy(model, "auto") is model            # CPU: the target itself
    assert served_copy(model, "target") is model
    assert served_copy(model, "float32") is model
    cast = served_copy(model, "bfloat16")
    assert cast is not model and cast.embed_tokens.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("method,flag", [("dspark", "--init-dspark"), ("dspark", "--init"),
                                         ("dflash", "--init"), ("eagle3", "--init")])
def test_init_warm_starts_a_generic_drafter(sessions, tmp_path, method, flag):
    """--init METHOD=DIR (--init-dspark DIR for dspark): the method's generic stage starts from a trained
    drafter (a device session's), so more data and steps add to the steps already paid for. With no steps
    of its own, the stage writes the drafter it started from, weight for weight, and its training.json names
    it."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert _pipeline(sessions, first, tmp_path / "out1", "--methods", method, "--stop-after", "train") == 0
    start = first / "drafters" / method
    second = tmp_path / "second"
    arg = str(start) if flag == "--init-dspark" else f"{method}={start}"
    assert _pipeline(sessions, second, tmp_path / "out2", "--methods", method, "--stop-after", "train",
                     flag, arg, "--steps", "0") == 0
    got = load_file(str(second / "drafters" / method / "drafter.safetensors"))
    want = load_file(str(start / "drafter.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((second / "drafters" / method / "training.json").read_text())["init"] == str(start)
    fresh = tmp_path / "fresh"                       # the same stage without it starts elsewhere
    assert _pipeline(sessions, fresh, tmp_path / "out3", "--methods", method, "--stop-after", "train",
                     "--steps", "0") == 0
    other = load_file(str(fresh / "drafters" / method / "drafter.safetensors"))
    assert not all(torch.equal(other[k], want[k]) for k in want)


def test_warm_starts_are_refused_before_any_work(tmp_path):
    """A warm start that would be ignored or cannot load stops the run before the data stage: a typo must
    not spend a device session's window training from scratch."""
    from bench.drafter_pipeline import _warm_start, warm_starts

    good = tmp_path / "d"
    good.mkdir()
    (good / "drafter.safetensors").write_bytes(b"")
    ns = lambda methods, init=(), dspark=None: argparse.Namespace(methods=methods, init=list(init), init_dspark=dspark)
    assert warm_starts(ns(("dspark", "dflash"), [("dflash", good)], good)) == {"dflash": good, "dspark": good}
    assert warm_starts(ns(("dflash",))) == {}
    for bad, match in [(ns(("dflash",), [("dflash", tmp_path / "none")]), "no drafter.safetensors"),
                       (ns(("dflash",), [("eagle3", good)]), "does not train eagle3"),
                       (ns(("dspark",), [("dspark", good)], good), "twice")]:
        with pytest.raises(SystemExit, match=match):
            warm_starts(bad)
    assert _warm_start(" eagle3 = /x ") == ("eagle3", Path("/x"))
    for text in ("eagle3", "medusa=/x", "dflash="):
        with pytest.raises(argparse.ArgumentTypeError):
            _warm_start(text)


def test_the_last_stage_of_a_stop_after_run_takes_the_skipped_stages_windows():
    """--stop-after train: training may run to STOP_SHARE of the budget, not to its own 62% (session 10:
    176 of 565 s left unused); without --stop-after, the shares are the pipeline's."""
    from bench.drafter_pipeline import SHARES, STOP_SHARE, Budget

    full, cut = Budget(100.0, 0.0), Budget(100.0, 0.0, "train")
    assert cut.deadline("train") - cut.t0 == pytest.approx(100.0 * STOP_SHARE)
    assert full.deadline("train") - full.t0 == pytest.approx(100.0 * SHARES["train"])
    assert cut.deadline("data") - cut.t0 == pytest.approx(100.0 * SHARES["data"])
    tune = Budget(100.0, 0.0, "tune")
    assert tune.deadline("tune") - tune.t0 == pytest.approx(100.0 * STOP_SHARE)


def test_a_truncated_training_stage_is_continued_by_a_later_run(sessions, tmp_path, capsys):
    """A training stage the budget cut is not done: the next run with time left goes on from its
    checkpoint to the full step count, and its marker counts both attempts' wall time."""
    work, out = tmp_path / "work", tmp_path / "out"
    args = ("--methods", "dspark", "--stop-after", "train")
    assert _pipeline(sessions, work, out, *args, "--budget-s", "0.001") == 0
    first = json.loads((work / "stages" / "train-dspark.json").read_text())
    assert first["status"] == "truncated" and first["steps_done"] == 0
    capsys.readouterr()
    assert _pipeline(sessions, work, out, *args) == 0
    assert "cut earlier at step 0 of 2, resuming" in capsys.readouterr().out
    second = json.loads((work / "stages" / "train-dspark.json").read_text())
    assert second["status"] == "done" and second["steps_done"] == 2
    assert second["wall_s"] > first["wall_s"]
    assert _pipeline(sessions, work, out, *args) == 0       # now done: skipped
    assert "done earlier, skipped" in capsys.readouterr().out


def test_a_run_without_dspark_trains_the_others_and_stops(sessions, tmp_path):
    """--methods dflash,eagle3 --stop-after train: both drafters written on the same data, no dspark; the
    same methods without --stop-after are refused before any work."""
    work = tmp_path / "work"
    assert _pipeline(sessions, work, tmp_path / "out", "--methods", "dflash,eagle3", "--stop-after", "train") == 0
    assert sorted(p.name for p in (work / "drafters").iterdir()) == ["dflash", "eagle3"]
    shas = {json.loads((work / "drafters" / m / "training.json").read_text())["data"]["answers_sha256"]
            for m in ("dflash", "eagle3")}
    assert len(shas) == 1
    with pytest.raises(SystemExit, match="leaves out dspark"):
        _pipeline(sessions, tmp_path / "w2", tmp_path / "o2", "--methods", "dflash")
    assert not (tmp_path / "w2").exists()


def test_answers_from_an_earlier_run_skip_the_data_stage_and_cost_no_budget(sessions, tmp_path, capsys):
    """--answers-from DIR: a device session carries back the data stage (its answers and marker) and the
    next one trains on them without answering again. The copy is the earlier run's answers, byte for
    byte; its marker says where they came from, and its wall time counts 0 against this run's budget."""
    first = tmp_path / "first"
    assert _pipeline(sessions, first, tmp_path / "out1", "--stop-after", "data") == 0
    capsys.readouterr()
    second = tmp_path / "second"
    assert _pipeline(sessions, second, tmp_path / "out2", "--methods", "dflash", "--stop-after", "train",
                     "--answers-from", str(first)) == 0
    log = capsys.readouterr().out
    assert "data: done earlier, skipped" in log
    marker = json.loads((second / "stages" / "data.json").read_text())
    made = json.loads((first / "stages" / "data.json").read_text())
    assert marker["wall_s"] == 0.0 and marker["carried_wall_s"] == made["wall_s"] > 0
    assert marker["carried_from"] == str(first) and marker["answers_sha256"] == made["answers_sha256"]
    for f in (first / "data").iterdir():
        assert (second / "data" / f.name).read_bytes() == f.read_bytes()
    assert (second / "drafters" / "dflash" / "drafter.safetensors").exists()


def test_answers_from_refuses_answers_this_run_would_not_write(sessions, tmp_path):
    """Answers to other sessions or settings, or a copy cut short, stop the run before any work."""
    first = tmp_path / "first"
    assert _pipeline(sessions, first, tmp_path / "out1", "--stop-after", "data") == 0
    cases = [(first, ["--train-sessions", "3"], "answered with"),
             (tmp_path / "nothing", [], "no stages/data.json")]
    cut = tmp_path / "cut"
    (cut / "stages").mkdir(parents=True)
    (cut / "stages" / "data.json").write_bytes((first / "stages" / "data.json").read_bytes())
    (cut / "data").mkdir()
    for f in (first / "data").iterdir():
        (cut / "data" / f.name).write_bytes(f.read_bytes())
    whole = (cut / "data" / "all.jsonl").read_bytes()
    (cut / "data" / "all.jsonl").write_bytes(whole[: len(whole) // 2])
    cases.append((cut, [], "not the file its marker hashed"))
    other = tmp_path / "other-sessions"                 # the same files but one train session changed
    other.mkdir()
    for f in sessions.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    train = other / f"{WORKLOADS[0]}.train.jsonl"
    train.write_text(train.read_text() + "\n")
    for i, (src, extra, match) in enumerate(cases + [(first, [], "other sessions")]):
        work = tmp_path / f"w{i}"
        which = other if match == "other sessions" else sessions
        with pytest.raises(SystemExit, match=match):
            _pipeline(which, work, tmp_path / f"o{i}", "--stop-after", "train", "--answers-from", str(src), *extra)
        assert not (work / "stages" / "data.json").exists()


def test_train_weights_split_the_window_by_weight_and_bad_ones_are_refused():
    """--train-weights dspark=2: dspark's stage ends by half of what is left of the window, and the next two by
    half of what is then left each; equal parts without it (session 61: equal time was not equal steps)."""
    import argparse as ap

    from bench.drafter_pipeline import Budget, _train_weights, train_windows

    methods = ("dspark", "dflash", "eagle3")
    assert train_windows(methods, {}) == [(1.0, 3.0), (1.0, 2.0), (1.0, 1.0)]
    assert train_windows(methods, _train_weights("dspark=2")) == [(2.0, 4.0), (1.0, 2.0), (1.0, 1.0)]
    budget = Budget(100.0, 0.0, "train")          # the train window ends at 90 s
    w, left = train_windows(methods, {"dspark": 2.0})[0]
    end = budget.share("train", left / w)
    assert end - budget.t0 == pytest.approx(45.0, abs=0.5)           # half of the 90 s window
    for bad in ("dspark", "dspark=0", "dspark=x", "dspark=inf", "dspark=nan", "medusa=2", "dspark=2,dspark=3"):
        with pytest.raises(ap.ArgumentTypeError, match="--train-weights takes"):
            _train_weights(bad)
