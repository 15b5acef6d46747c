"""bench.mix_rates: a method's requests in an auto row's runs against its own row, and the chooser's view."""
from __future__ import annotations

import gzip
import json

import pytest

from bench.mix_rates import chooser_view, main, request_rates, share_of


def _run(*requests) -> dict:
    return {"requests": [list(r) for r in requests]}


def _result(auto_requests, snapshots=None) -> dict:
    """One workload at c = 16: own rows whose requests decode at 100 (dspark) and 200 (ngram) tok/s, and an
    auto run with ``auto_requests``."""
    rows = {"dspark": {"runs": [_run((0, 100, 1.0, "dspark"), (1, 50, 0.5, "dspark"))],
                       "per_user_tok_s_p50": 100.0},
            "ngram-gated": {"runs": [_run((0, 200, 1.0, "ngram"), (1, 100, 0.5, "ngram"))],
                            "per_user_tok_s_p50": 200.0},
            "auto": {"runs": [_run(*auto_requests)]}}
    cell = {"rows": rows}
    if snapshots is not None:
        cell["auto_choice_by_row"] = {"auto": snapshots}
    return {"workloads": {"creative": {"16": cell}}}


def test_share_of_splits_at_the_mixed_share():
    assert [share_of(n, 10, 0.15) for n in (10, 9, 5, 2, 1)] == \
        ["alone-ish", "alone-ish", "mixed", "mixed", "minority"]


def test_request_rates_set_each_method_against_its_own_row_by_its_share():
    # 9 dspark requests at 100 tok/s (its own row's p50: 1.00), 1 ngram request at 100 (its row's: 200, 0.50)
    auto = [(i, 100, 1.0, "dspark") for i in range(9)] + [(9, 50, 0.5, "ngram")]
    out = request_rates([_result(auto)], {"dspark": "dspark", "ngram": "ngram-gated"}, "auto", 0.15)
    assert out == {("c >= 16", "alone-ish"): [pytest.approx(1.0)], ("c >= 16", "minority"): [pytest.approx(0.5)]}


def test_runs_without_each_requests_method_are_skipped():
    auto = [(i, 100, 1.0) for i in range(4)]            # recorded before session 60: three fields
    assert request_rates([_result(auto)], {"dspark": "dspark", "ngram": "ngram-gated"}, "auto", 0.15) == {}


def test_the_chooser_view_reads_the_workloads_own_class_only():
    snaps = [{"class": "aaaa", "bucket": 16, "winner": "dspark",
              "arms": {"dspark": {"tok_s": 110.0}, "ngram": {"tok_s": 150.0}}},
             {"class": "aaaa", "bucket": 8, "winner": "ngram",            # another load: not this cell
              "arms": {"dspark": {"tok_s": 1.0}, "ngram": {"tok_s": 1.0}}}]
    out = chooser_view([_result([(0, 10, 1.0, "dspark")], snaps)], {"dspark": "dspark", "ngram": "ngram-gated"},
                       "auto")
    assert out == {("c >= 16", "winner"): [pytest.approx(1.1)], ("c >= 16", "loser"): [pytest.approx(0.75)]}


def test_main_prints_both_tables_and_refuses_a_result_without_an_auto_row(tmp_path, capsys):
    auto = [(0, 100, 1.0, "dspark"), (1, 100, 1.0, "ngram")]
    snaps = [{"class": "aaaa", "bucket": 16, "winner": "ngram",
              "arms": {"dspark": {"tok_s": 90.0}, "ngram": {"tok_s": 200.0}}}]
    path = tmp_path / "speedup.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_result(auto, snaps), f)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| c >= 16 | – | 0.707 (2) | – |" in out                   # dspark 1.00, ngram 0.50 (half each: mixed)
    assert "| c >= 16 | 1.000 (1) | 0.900 (1) |" in out
    assert main([str(path), "--row", "auto-alternate"]) == 2
    assert "no auto-alternate run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(path), "--mixed", "0.5"])
