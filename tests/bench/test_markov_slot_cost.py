"""bench.markov_slot_cost's CPU smoke run: a record per batch and setting, the round's references reproducing
the round the engine ran before the fused slots bit for bit (tokens and probabilities), slot_logits the torch
formula bit for bit, and every timing positive."""
import json

from bench.markov_slot_cost import SETTINGS, main


def test_the_tiny_run_reproduces_the_former_round(tmp_path):
    out = tmp_path / "m.json"
    assert main(["--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    records = doc["records"]
    assert [(r["batch"], r["setting"]) for r in records] == [(b, s) for b in (1, 3) for s in SETTINGS]
    for r in records:
        assert r["refs_tokens_equal_former"] == 1.0 and r["refs_max_abs_probs_diff_former"] == 0.0, r
        assert r["fused_tokens_equal_refs"] == 1.0 and r["fused_max_abs_probs_diff_refs"] == 0.0, r
        assert all(r[k]["ms_p50"] > 0 for k in ("fused", "refs", "former"))
    assert all(r["slot_logits_bit_identical"] for r in records if r["setting"] == "T0.7-p0.9")
    assert doc["meta"]["vocab"] == 4096 and doc["meta"]["device"] == "cpu"
