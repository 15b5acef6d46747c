"""Workload builders: determinism, the recorded split, the file format, and each profile's defining shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench.workloads import build as build_cli
from bench.workloads.bm25 import BM25
from bench.workloads.build import BUILDERS, PROFILES, build_sessions
from bench.workloads.extraction import score_extraction
from bench.workloads.format import FormatError, Session, prompt_messages, read_sessions, write_sessions
from bench.workloads.profile import SCALES, BuildOptions, default_corpora_dir
from bench.workloads.split import SplitError, load_or_create_split

CORPORA = default_corpora_dir()
pytestmark = pytest.mark.skipif(not CORPORA.is_dir(), reason="shared corpora not present")


@pytest.fixture(scope="module")
def base_opts(tmp_path_factory) -> BuildOptions:
    """Small builds, with split manifests and the knowledge cache in tmp (never the repo's)."""
    root = tmp_path_factory.mktemp("workloads")
    return BuildOptions(sessions=4, turns=3, time_scale=0.01, seed=7, manifest_dir=root / "splits",
                        cache_dir=root / "cache", file_chars=3000, docs_per_question=2)


def _prompt_chars(session: Session, turn: int) -> int:
    answers = ["A" * 10] * turn
    return sum(len(m["content"]) for m in prompt_messages(session, turn, answers))


@pytest.mark.parametrize("workload", sorted(BUILDERS))
def test_same_seed_gives_identical_bytes(workload, base_opts, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_sessions(a, build_sessions(workload, base_opts))
    write_sessions(b, build_sessions(workload, base_opts))
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c.jsonl"
    write_sessions(c, build_sessions(workload, replace(base_opts, seed=8)))
    assert c.read_bytes() != a.read_bytes()


@pytest.mark.parametrize("workload", sorted(PROFILES))
def test_train_and_eval_share_no_source_item(workload, base_opts):
    """Drafter training must never see an eval item: whole splits are disjoint, and so are built sessions."""
    items = {}
    for split in ("train", "eval"):
        sessions = build_sessions(workload, replace(base_opts, split=split, sessions=40, turns=1))
        assert all(s.split == split for s in sessions)
        items[split] = {i for s in sessions for i in s.meta["source_items"]}
    assert items["train"] and items["eval"]
    assert not items["train"] & items["eval"]
    manifest = json.loads((base_opts.manifest_dir / f"{workload}.json").read_text())
    assert not set(manifest["train"]) & set(manifest["eval"])
    assert items["eval"] <= set(manifest["eval"])
    assert 0.1 < len(manifest["eval"]) / (len(manifest["train"]) + len(manifest["eval"])) < 0.3


def test_split_manifest_is_reused_and_guards_the_source(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("v1")
    ids = [f"item/{i}" for i in range(200)]
    first = load_or_create_split(tmp_path / "m", "toy", [source], ids)
    again = load_or_create_split(tmp_path / "m", "toy", [source], list(reversed(ids)) + ["item/new"])
    assert again == first  # recorded once: neither order nor new items move anything
    source.write_text("v2")
    with pytest.raises(SplitError):
        load_or_create_split(tmp_path / "m", "toy", [source], ids)


def test_format_round_trip(base_opts, tmp_path):
    sessions = build_sessions("all", base_opts)
    assert {s.workload for s in sessions} == set(PROFILES)
    assert [s.arrival_s for s in sessions] == sorted(s.arrival_s for s in sessions)
    path = tmp_path / "all.jsonl"
    write_sessions(path, sessions)
    assert read_sessions(path) == sessions


def test_format_rejects_bad_lines(tmp_path):
    good = {"format_version": 1, "id": "s1", "workload": "mine", "split": "eval", "arrival_s": 0.0,
            "turns": [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}],
            "sampling": {"temperature": 0.0}}
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(good) + "\n\n")
    assert read_sessions(path)[0].turns[0].think_time_s == 0.0
    for bad in ({**good, "split": "dev"}, {**good, "turns": []}, {**good, "format_version": 2},
                {**good, "extra_field": 1}, {**good, "arrival_s": -1}):
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(FormatError) as err:
            read_sessions(path)
        assert err.value.line == 2
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(FormatError, match="duplicate"):
        read_sessions(path)


def test_prompt_history_rule():
    s = Session.model_validate({"id": "s", "workload": "w", "split": "eval", "arrival_s": 0, "system": "SYS",
                                "turns": [{"messages": [{"role": "user", "content": "q1"}], "max_tokens": 4},
                                          {"messages": [{"role": "tool", "name": "t", "content": "r"},
                                                        {"role": "user", "content": "q2"}], "max_tokens": 4}],
                                "sampling": {"temperature": 1.0}})
    assert prompt_messages(s, 1, ["a1"]) == [
        {"role": "system", "content": "SYS"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "tool", "name": "t", "content": "r"},
        {"role": "user", "content": "q2"}]


def test_support_sessions_share_the_exact_system_prompt(base_opts):
    sessions = build_sessions("support", replace(base_opts, sessions=6))
    assert len({s.system for s in sessions}) == 1
    assert len(sessions[0].system) > 90_000  # the whole ABCD guideline file
    assert len({s.meta["source_items"][0] for s in sessions}) == 6
    assert all(t.max_tokens <= 128 for s in sessions for t in s.turns)


def test_coding_context_grows_every_turn(base_opts):
    for s in build_sessions("coding", replace(base_opts, turns=6)):
        assert len(s.turns) == 6 and s.tools and {t["function"]["name"] for t in s.tools} == {
            "read_file", "write_file", "run_tests", "search"}
        sizes = [_prompt_chars(s, k) for k in range(6)]
        assert all(later > earlier + 1000 for earlier, later in zip(sizes, sizes[1:]))


def test_creative_is_hot_long_and_slow(base_opts):
    sessions = build_sessions("creative", replace(base_opts, sessions=8, time_scale=1.0))
    assert all(0.8 <= s.sampling.temperature <= 1.0 for s in sessions)
    assert all(t.max_tokens >= 512 for s in sessions for t in s.turns)
    pauses = sorted(t.think_time_s for s in sessions for t in s.turns[1:])
    assert 60 < pauses[len(pauses) // 2] < 600  # minutes, not seconds
    compressed = build_sessions("creative", replace(base_opts, sessions=8, time_scale=0.01))
    assert compressed[3].turns[1].think_time_s == pytest.approx(sessions[3].turns[1].think_time_s * 0.01, abs=2e-3)


def test_knowledge_prompt_is_retrieved_context_then_question(base_opts):
    s = build_sessions("knowledge", base_opts)[0]
    text = s.turns[0].messages[0].content
    assert text.startswith("Context documents:\n\n[1] ") and "\n\n[2] " in text
    assert text.endswith("?") and s.turns[0].reference["answer"]
    assert list((base_opts.cache_dir / "knowledge").glob("stdlib_docs-*.json"))


def test_tiny_scale_fits_a_small_context(base_opts):
    tiny = replace(base_opts, scale=SCALES["tiny"], turns=None)
    for s in build_sessions("all", tiny):
        assert len(s.turns) <= 2 and s.tools is None
        assert all(t.max_tokens <= 16 and all(m.role == "user" for m in t.messages) for t in s.turns)
        # stories260K: about one token per character, 512 tokens of context (measured: at most 418 tokens)
        assert _prompt_chars(s, len(s.turns) - 1) < 600


def test_bm25_ranks_the_matching_document_first():
    index = BM25(["the cat sat on the mat", "json decoder parses text", "decoder of json and json lines"])
    assert index.top_k("json decoder", 3)[0] in (1, 2)
    assert index.top_k("cat mat", 1) == [0]
    assert index.top_k("unknown words", 2) == []


def test_extraction_scorer_known_cases():
    ref = {"company": "BOOK TA .K (TAMAN DAYA) SDN BHD", "date": "25/12/2018",
           "address": "NO.53 55,57 & 59, JALAN SAGU 18, TAMAN DAYA", "total": "9.00"}
    perfect = score_extraction("```json\n" + json.dumps(ref) + "\n```", ref)
    assert perfect["json_valid"] and perfect["field_accuracy"] == 1.0
    variant = score_extraction('Here: {"company": "book ta.k (taman daya) sdn bhd", "date": "2018-12-25", '
                               '"address": "NO.53 55, 57 & 59 JALAN SAGU 18 TAMAN DAYA", "total": "RM 9"}', ref)
    assert variant == {"json_valid": True, "company": True, "date": True, "address": True, "total": True,
                       "field_accuracy": 1.0}
    wrong = score_extraction('{"company": "OTHER SDN BHD", "date": "26/12/2018", "total": "9.01"}', ref)
    assert wrong["json_valid"] and wrong["field_accuracy"] == 0.0
    broken = score_extraction('{"company": "BOOK TA', ref)
    assert not broken["json_valid"] and broken["field_accuracy"] == 0.0


def test_cli_writes_the_file(base_opts, tmp_path, capsys):
    out = tmp_path / "ex.jsonl"
    rc = build_cli.main(["--workload", "extraction", "--split", "eval", "--sessions", "3", "--turns", "2",
                         "--split-dir", str(base_opts.manifest_dir), "--cache-dir", str(base_opts.cache_dir),
                         "--out", str(out)])
    assert rc == 0 and "wrote 3 sessions (6 turns)" in capsys.readouterr().err
    sessions = read_sessions(out)
    assert all(s.split == "eval" and len(s.turns) == 2 and s.turns[1].reference for s in sessions)


def test_default_split_manifests_are_recorded():
    """The committed manifests are the split of record; a corpus change would show up here first."""
    for workload in PROFILES:
        path = Path(build_cli.DEFAULT_MANIFEST_DIR) / f"{workload}.json"
        assert path.exists(), f"{path} not committed"
        manifest = json.loads(path.read_text())
        assert manifest["train"] and manifest["eval"] and not set(manifest["train"]) & set(manifest["eval"])


def test_docs_example_is_a_valid_session():
    """The example users copy from docs/workloads.md must parse, or the "replay your traffic" guide lies."""
    doc = (Path(__file__).resolve().parents[2] / "docs/workloads.md").read_text()
    block = doc.split("<!-- example -->\n```json\n", 1)[1].split("```", 1)[0]
    session = Session.model_validate_json(block)
    assert session.turns[1].messages[0].role == "tool" and session.turns[1].think_time_s == 9.0


@pytest.mark.slow
def test_bytes_do_not_depend_on_the_hash_seed(base_opts, tmp_path):
    """Two processes with different PYTHONHASHSEED (set iteration, BM25 score sums) write the same file."""
    outs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"k{hash_seed}.jsonl"
        subprocess.run([sys.executable, "-m", "bench.workloads.build", "--workload", "knowledge", "--sessions", "3",
                        "--split-dir", str(base_opts.manifest_dir), "--cache-dir", str(tmp_path / f"c{hash_seed}"),
                        "--out", str(out)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": hash_seed}, cwd=Path(__file__).resolve().parents[2])
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0]


def test_unique_prompts_differ_from_their_first_characters(base_opts):
    """The 0%-hit workload: one turn each, greedy, and no two prompts share even a 12-character opening,
    so no KV block (block 0 holds the template header and the tag) can be shared."""
    sessions = build_sessions("unique", replace(base_opts, sessions=20))
    assert len(sessions) == 20 and all(len(s.turns) == 1 and s.sampling.temperature == 0.0 for s in sessions)
    openings = {s.system[:12] for s in sessions}
    assert len(openings) == 20
    assert "unique" not in {s.workload for s in build_sessions("all", base_opts)}
