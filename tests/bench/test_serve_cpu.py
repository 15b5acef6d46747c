"""`python -m bench serve` on the CPU: the load generator's rules on a fake transport, then every workload
through the real stack (kvd + specd processes serving stories260K over IPC, and once over HTTP), checked
for a complete, consistent report in which `ours` serves prompt tokens from cache and `standard` none."""
from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.loadgen import (Final, LoadResult, Piece, RequestRecord, SessionScript, TurnRequest, arrival_times,
                           run_load, stable_seed, stream_timings)
from bench.report import check_report
from bench.serve import Cell, cell_metrics, plan
from bench.trace_replay import trace_scripts
from bench.mooncake import TraceRequest
from bench.workloads.format import Message, Sampling, Session, Turn, read_sessions

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "stories260K.gguf"
MULTI_TURN = ("creative", "support", "knowledge", "coding")


# ---- the load generator's rules, no processes --------------------------------------------------------

def _session(sid: str, turns: int = 2, think: float = 0.0) -> Session:
    return Session(id=sid, workload="t", split="eval", arrival_s=0.0, system="Be brief.",
                   turns=[Turn(messages=[Message(role="tool", name="search", content=f"q{k}")], max_tokens=4,
                               think_time_s=think if k else 0.0) for k in range(turns)],
                   sampling=Sampling(temperature=0.7, top_p=0.9))


class FakeTransport:
    """Streams `tokens` one-token pieces per request; records what was sent and how many ran at once."""

    errors = (ValueError,)

    def __init__(self, tokens: int = 3, gap_s: float = 0.01, fail_turn: int | None = None):
        self.tokens, self.gap_s, self.fail_turn = tokens, gap_s, fail_turn
        self.sent: list[TurnRequest] = []
        self.in_flight = self.max_in_flight = 0

    async def stream(self, request: TurnRequest, session: str):
        self.sent.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_turn is not None and len(request.messages) > 2 * self.fail_turn + 1:
                raise ValueError("refused")
            for i in range(self.tokens):
                await asyncio.sleep(self.gap_s)
                yield Piece(f"a{i}", 1)
            yield Piece(final=Final("length", prompt_tokens=10, completion_tokens=self.tokens, cached_tokens=4))
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        pass


def test_stream_timings_split_a_multi_token_piece_into_per_token_gaps():
    ttft, itl = stream_timings(0.5, [(1.0, 1), (1.5, 1), (2.1, 3), (2.2, 0)])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.5, 0.2, 0.2, 0.2])
    assert stream_timings(0.0, [(1.0, 0)]) == (None, [])


def test_session_script_sends_the_history_with_the_models_answers():
    script = SessionScript(_session("s"), max_tokens=7, seed_salt="r0")
    req = script.request(1, ["ANSWER0"])
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "tool", "assistant", "tool"]
    assert req.messages[2]["content"] == "ANSWER0" and "name" not in req.messages[1]
    assert req.params["max_tokens"] == 7 and req.params["top_p"] == 0.9
    assert req.params["seed"] == script.request(1, ["other"]).params["seed"] == stable_seed("r0", "s", 1)
    assert req.params["seed"] != SessionScript(_session("s"), seed_salt="r1").request(1, ["x"]).params["seed"]


def test_closed_loop_caps_concurrency_feeds_answers_back_and_waits_think_times():
    transport = FakeTransport()
    scripts = [SessionScript(_session(f"s{i}", think=10.0)) for i in range(5)]
    result = asyncio.run(run_load(transport, scripts, 2, time_scale=0.005))
    assert transport.max_in_flight == 2
    assert len(result.completed) == 10 and not result.failed
    assert all(r.text == "a0a1a2" for r in result.records)
    second_turns = [m for req in transport.sent for m in req.messages if m["role"] == "assistant"]
    assert second_turns == [{"role": "assistant", "content": "a0a1a2"}] * 5
    by_key = {(r.script_id, r.turn): r for r in result.records}
    for i in range(5):
        assert by_key[(f"s{i}", 1)].sent_s - by_key[(f"s{i}", 0)].done_s >= 0.05 - 1e-3
    for r in result.records:
        assert r.ttft_s >= 0.01 - 1e-3 and len(r.itl_s) == 2 and r.cached_tokens == 4
    span = max(r.done_s for r in result.records) - min(r.sent_s for r in result.records)
    assert result.wall_time_s == pytest.approx(span)


def test_a_failed_turn_is_recorded_and_ends_its_conversation():
    result = asyncio.run(run_load(FakeTransport(fail_turn=1), [SessionScript(_session("s", turns=3))], 1))
    assert [(r.turn, r.ok) for r in result.records] == [(0, True), (1, False)]
    assert "refused" in result.failed[0].error


def test_arrivals_closed_poisson_recorded():
    scripts = [SessionScript(_session(f"s{i}").model_copy(update={"arrival_s": 10.0 * i})) for i in range(50)]
    assert arrival_times(scripts, "closed", None, 1.0) == [0.0] * 50
    assert arrival_times(scripts, "recorded", None, 0.1)[:3] == pytest.approx([0.0, 1.0, 2.0])
    poisson = arrival_times(scripts, "poisson", 5.0, 1.0, seed=3)
    assert poisson == arrival_times(scripts, "poisson", 5.0, 1.0, seed=3)
    assert all(b > a for a, b in zip(poisson, poisson[1:]))
    assert 0.1 < poisson[-1] / 49 < 0.4  # mean gap 1/rate = 0.2 s


def test_plan_alternates_configs_inside_each_repeat_and_level():
    cells = plan(["standard", "ours"], [1, 8], 2)
    assert [(c.repeat, c.concurrency, c.config) for c in cells[:4]] == [
        (0, 1, "standard"), (0, 1, "ours"), (0, 8, "standard"), (0, 8, "ours")]
    assert len(cells) == 8 and cells[4] == Cell(1, 1, "standard")


def test_trace_scripts_keep_shared_prefixes_and_fit_the_context():
    reqs = [TraceRequest(0, 2000, 100, (7, 8, 9)), TraceRequest(500, 3000, 5, (7, 8, 10, 11, 12, 13))]
    a, b = trace_scripts(reqs, tokens_per_hash=16, vocab=512, max_model_len=256, max_tokens=16)
    assert a.prompt_ids[:32] == b.prompt_ids[:32] and a.prompt_ids[32:48] != b.prompt_ids[32:48]
    assert len(a.prompt_ids) == 48 and len(b.prompt_ids) == 94  # 3000 of 6 x 512 tokens -> 93.75 of 96
    assert (a.max_tokens, b.max_tokens) == (16, 5) and b.arrival_s == 0.5
    a_cut, b_cut = trace_scripts(reqs, tokens_per_hash=16, vocab=512, max_model_len=64, max_tokens=16)
    assert len(a_cut.prompt_ids) == 64 - 16 - 1 and len(b_cut.prompt_ids) == 64 - 5 - 1
    assert a_cut.prompt_ids == a.prompt_ids[:47]
    assert max(a.prompt_ids + b.prompt_ids) < 512
    assert a.request(0, []).params["ignore_eos"] is True


def test_cell_metrics_pool_repeats_into_a_consistent_report_cell():
    def rec(i: int) -> RequestRecord:
        return RequestRecord(f"s{i}", 0, sent_s=0.0, ttft_s=0.1, itl_s=[0.01] * 3, done_s=1.0, prompt_tokens=20,
                             cached_tokens=16, completion_tokens=4, finish_reason="length")
    runs = [LoadResult([rec(0), rec(1)], 2.0), LoadResult([rec(2), RequestRecord("s3", 0, 0.0, error="x")], 1.0)]
    m = cell_metrics(runs, lambda done: {})
    assert (m["requests"], m["failed_requests"], m["wall_time_s"]) == (3, 1, 3.0)
    assert (m["prompt_tokens"], m["cached_prompt_tokens"], m["completion_tokens"]) == (60, 48, 12)
    assert [r["output_tok_s"] for r in m["repeats"]] == [4.0, 4.0]
    assert check_report({"configs": {"standard": {1: m}}}) == []


# ---- the real stack ----------------------------------------------------------------------------------

def _serve(out: Path, *extra: str) -> dict:
    argv = ["serve", "--model", str(MODEL), "--configs", "standard,ours", "--max-model-len", "512",
            "--time-scale", "0.001", "--out", str(out), "--no-progress", *extra]
    assert bench_main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _requests(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def every_workload(tmp_path_factory):
    """All five profiles in one mixed file (2 sessions each), concurrency 1 and 2, standard vs ours."""
    out = tmp_path_factory.mktemp("serve-all")
    results = _serve(out, "--workload", "all", "--scale", "tiny", "--sessions", "2", "--concurrency", "1,2")
    return out, results


@pytest.mark.slow
def test_every_workload_runs_through_the_stack_into_a_complete_report(every_workload, capsys):
    out, results = every_workload
    assert check_report(results) == []
    for name in ("results.json", "report.md", "latency_vs_throughput.png", "ttft.png", "sessions.jsonl"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "logs" / "r0-c2-ours" / "kvd.log").exists()
    assert (out / "logs" / "r0-c1-standard" / "specd.log").exists()
    sessions = read_sessions(out / "sessions.jsonl")
    assert {s.workload for s in sessions} == {"creative", "support", "knowledge", "coding", "extraction"}
    turns = sum(len(s.turns) for s in sessions)
    for name in ("standard", "ours"):
        for level in ("1", "2"):
            cell = results["configs"][name][level]
            assert cell["requests"] == turns and cell["failed_requests"] == 0
            assert len(cell["ttft_s"]) == turns and cell["completion_tokens"] >= turns
    report = (out / "report.md").read_text()
    assert "| ours | 2 |" in report and "| standard | 1 |" in report and "CPU" in report
    assert "field_accuracy" in report  # the extraction sessions were scored


@pytest.mark.slow
def test_ours_serves_multi_turn_prompts_from_cache_and_standard_serves_none(every_workload):
    out, results = every_workload
    for level in ("1", "2"):
        assert results["configs"]["standard"][level]["cached_prompt_tokens"] == 0
        assert results["summary"]["ours"][level]["cache_share"] > 0.2
    cached = defaultdict(int)
    for r in _requests(out):
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"] and r["error"] is None
        cached[(r["config"], r["script_id"].split("-")[0], r["turn"])] += r["cached_tokens"]
    for workload in MULTI_TURN:  # a later turn extends its own earlier prompt: a prefix cache must hit
        assert cached[("ours", workload, 1)] > 0, workload
        assert cached[("standard", workload, 1)] == 0, workload


@pytest.mark.slow
def test_client_side_timings_bracket_the_engines(every_workload):
    out, _ = every_workload
    for r in _requests(out):
        assert r["engine_ttft_s"] is not None and r["ttft_s"] >= r["engine_ttft_s"]
        assert r["sent_s"] + r["ttft_s"] <= r["done_s"]
        assert len(r["itl_s"]) == r["completion_tokens"] - 1  # IPC: one token per streamed piece
        assert sum(r["itl_s"]) <= r["done_s"] - r["sent_s"] - r["ttft_s"] + 1e-6


@pytest.mark.slow
def test_http_gateway_and_trace_replay(tmp_path):
    """The OpenAI gateway path on one multi-turn workload, and a Mooncake-style trace with shared prefixes."""
    results = _serve(tmp_path / "http", "--http", "--workload", "support", "--scale", "tiny", "--sessions", "2",
                     "--concurrency", "2")
    assert check_report(results) == [] and "HTTP" in results["meta"]["transport"]
    assert results["configs"]["standard"]["2"]["cached_prompt_tokens"] == 0
    assert results["configs"]["ours"]["2"]["cached_prompt_tokens"] > 0

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 2048, "output_length": 8, "hash_ids": [0, 1, 2 + i % 2, 10 + i]}
            for i in range(6)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = _serve(tmp_path / "trace", "--trace", str(trace), "--concurrency", "2", "--tokens-per-hash", "32")
    assert check_report(results) == []
    ours, standard = results["configs"]["ours"]["2"], results["configs"]["standard"]["2"]
    assert ours["requests"] == standard["requests"] == 6
    assert standard["cached_prompt_tokens"] == 0 and ours["cached_prompt_tokens"] >= 4 * 64


def test_device_and_capacity_flags_reach_both_daemons(tmp_path):
    """The GPU run's passthrough: --device cuda goes to specd and puts kvd's pool on CUDA; every config gets
    the same GPU capacity (kvd's pool, or specd's private pool for standard)."""
    from bench.stack import CONFIGS, StackOptions, kvd_fields, specd_argv

    opts = StackOptions(model=MODEL, device="cuda", gpu_blocks=77, dram_blocks=5, nvme_blocks=9,
                        specd_args=("--no-cuda-graphs",))
    argv = specd_argv(opts, tmp_path / "s", 8123, tmp_path / "k")
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--device"] == "cuda" and flags["--num-local-blocks"] == "77"
    assert flags["--kvd-run-dir"] == str(tmp_path / "k")
    assert argv[-1] == "--no-cuda-graphs"
    shortest = specd_argv(opts, tmp_path / "s", 8123, tmp_path / "k", CONFIGS["ours-shortest"])
    assert shortest[-2:] == ["--no-cuda-graphs", "--prefill-order=shortest"]   # its own switch, last
    assert kvd_fields(CONFIGS["ours-shortest"], opts, tmp_path) == kvd_fields(CONFIGS["ours"], opts, tmp_path)
    assert CONFIGS["standard-aa"] == CONFIGS["standard"]          # the A/A row is the same stack, started twice
    ours, offload, lru = (kvd_fields(CONFIGS[n], opts, tmp_path) for n in ("ours", "lru-offload", "prefix-lru"))
    assert {(f["device"], f["gpu_blocks"]) for f in (ours, offload, lru)} == {("cuda", 77)}
    assert (ours["dram_blocks"], ours["nvme_blocks"], ours["policy"]) == (5, 9, "reuse")
    assert ours["nvme_dir"] is not None
    assert (offload["dram_blocks"], offload["nvme_dir"], lru["dram_blocks"], lru["nvme_dir"]) == (5, None, 0, None)
