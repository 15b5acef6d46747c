"""bench.auto_replay: the method chooser replayed on rows' per-request records picks each workload's faster
method, and results without records are refused by name."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.auto_replay import ReplayError, main, replay
from specd.engine.method_choice import MethodChoice


def run(rate: float, n: int = 16, tokens: int = 100) -> dict:
    return {"requests": [[i, tokens, tokens / rate] for i in range(n)]}


def result(fast: dict[str, str]) -> dict:
    """Two workloads at c = 1, two repeats: per workload the faster method runs 2x `none`, the other 1x."""
    workloads = {}
    for wl, winner in fast.items():
        rows = {"none": {"runs": [run(100.0)] * 2}}
        for method, row in (("dspark", "dspark"), ("ngram", "ngram-gated")):
            rows[row] = {"runs": [run(200.0 if method == winner else 100.0)] * 2}
        workloads[wl] = {"1": {"rows": rows}}
    return {"workloads": workloads}


GATED = {"dspark": "dspark", "ngram": "ngram-gated"}


def test_the_replay_settles_on_each_workloads_faster_method():
    cells = replay(result({"coding": "dspark", "creative": "ngram"}), GATED, {}, ["1"],
                   MethodChoice(explore=2, explore_tokens=0))
    by = {c["workload"]: c for c in cells}
    assert by["coding"]["given"]["dspark"] > by["coding"]["given"].get("ngram", 0)
    assert by["creative"]["given"]["ngram"] > by["creative"]["given"].get("dspark", 0)
    for c in cells:
        r = c["per_user_tok_s"]
        assert r["none"] == pytest.approx(100.0)
        assert 100.0 < r["auto"] < 200.0          # exploring costs something; it is still well above `none`
        assert sum(c["given"].values()) == 32


def test_warm_repeats_prime_the_chooser_uncounted():
    """With the first repeat as a warm-up the exploration is over before the counted requests: more of them
    go to each workload's faster method, and only the second repeat's 16 are counted."""
    res = result({"coding": "dspark", "creative": "ngram"})
    cold = replay(res, GATED, {}, ["1"], MethodChoice(explore=2, explore_tokens=0))
    warm = replay(res, GATED, {}, ["1"], MethodChoice(explore=2, explore_tokens=0), warm=1)
    for c, w, fast in zip(cold, warm, ("dspark", "ngram")):
        assert sum(w["given"].values()) == 16
        assert w["given"][fast] / 16 > c["given"][fast] / 32
        assert w["per_user_tok_s"]["auto"] > c["per_user_tok_s"]["auto"]
    with pytest.raises(ReplayError, match="none left after 2 warm ones"):
        replay(res, GATED, {}, ["1"], MethodChoice(), warm=2)


def test_measuring_requests_take_the_measuring_rows_records():
    """Exploring and probing requests take the measuring row's records: with ngram's drafting-throughout row
    at 400 tok/s it wins the exploration and gets more requests than with its gated row's alone."""
    res = result({"coding": "dspark"})
    res["workloads"]["coding"]["1"]["rows"]["ngram"] = {"runs": [run(400.0)] * 2}   # ngram drafting throughout
    alone = replay(res, GATED, {}, ["1"], MethodChoice(explore=2, explore_tokens=0))[0]["given"]
    measured = replay(res, GATED, {"ngram": "ngram"}, ["1"], MethodChoice(explore=2, explore_tokens=0))[0]["given"]
    assert measured["ngram"] > alone["ngram"]


def test_results_without_records_are_refused(tmp_path, capsys):
    res = result({"coding": "dspark"})
    res["workloads"]["coding"]["1"]["rows"]["dspark"]["runs"] = [{"requests": []}] * 2
    with pytest.raises(ReplayError, match="no per-request records"):
        replay(res, GATED, {}, ["1"], MethodChoice())
    path = tmp_path / "speedup.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(res, f)
    assert main([str(path)]) == 2
    assert "no per-request records" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(result({"coding": "dspark"})))
    assert main([str(good), "--explore-tokens", "0"]) == 0
    assert "| coding | 1 |" in capsys.readouterr().out
