"""bench/eviction_ablation.py: replaying a built session file the way ``bench serve`` plays it."""
import argparse
import json

from bench import eviction_ablation as ea
from bench.workloads.format import Message, Sampling, Session, Turn, write_sessions

CODE = "def f(x):\n    return [i * x for i in range(10)]  # a line of code\n" * 12


def session(i: int, arrival_s: float) -> Session:
    turns = [Turn(messages=[Message(role="user" if k == 0 else "tool", content=f"{i}-{k}\n{CODE}")],
                  max_tokens=8, think_time_s=0.0 if k == 0 else 2.0) for k in range(4)]
    return Session(id=f"s{i}", workload="coding", split="eval", arrival_s=arrival_s, system="You are a coding agent.",
                   turns=turns, sampling=Sampling(temperature=0.0))


def sessions_file(tmp_path, n=6):
    path = tmp_path / "agentic.jsonl"
    write_sessions(path, [session(i, 5.0 * (i + 1)) for i in range(n)])
    return path


def test_session_file_scales_think_times_and_opens_closed_loop_at_zero(tmp_path):
    path = sessions_file(tmp_path)
    closed = ea.load_session_file(path, 4, 4.0, "closed", 0)
    assert len(closed) == 4 and [s.arrival_s for s in closed] == [0.0] * 4
    assert [t[2] for t in closed[0].turns] == [0.0, 8.0, 8.0, 8.0]          # think 2 s x 4
    recorded = ea.load_session_file(path, 4, 4.0, "recorded", 0)
    assert [s.arrival_s for s in recorded] == [20.0, 40.0, 60.0, 80.0]    # arrivals x 4 too


def test_replay_takes_the_half_life_and_a_cleaner_that_keeps_up(tmp_path):
    """A GPU tier of a few requests: inline, a full tier drops its victims; keeps-up demotes them to DRAM
    instead, so nothing is dropped for pressure and the hit rate is at least as high."""
    streams = ea.load_session_file(sessions_file(tmp_path), 6, 4.0, "closed", 0)
    unique = ea.unique_blocks(streams)
    lru = next(v for v in ea.VARIANTS if v.name == "lru-offload")
    rows = {}
    for cleaner in ("inline", "keeps-up"):
        replay = ea.Replay(streams, lru, unique // 5, unique, tmp_path / cleaner, ea.Costs(), 60.0, cleaner)
        assert replay.core.config.half_life_s == 60.0
        rows[cleaner] = replay.run()
    assert rows["inline"]["pressure_drops"] > 0 and rows["keeps-up"]["pressure_drops"] == 0
    assert rows["keeps-up"]["token_hit_rate"] >= rows["inline"]["token_hit_rate"] > 0


def test_cli_replays_a_sessions_file(tmp_path, capsys):
    p = argparse.ArgumentParser()
    ea.add_arguments(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(["--sessions-file", str(sessions_file(tmp_path)), "--sessions", "3", "--time-scale", "4",
                         "--half-life", "60", "--gpu", "0.3", "--dram", "0.6", "--cleaner", "keeps-up",
                         "--variants", "lru-offload,reuse (all)", "--out", str(out)])
    assert ea.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["lru-offload", "reuse (all)"]
    assert "3 sessions, 12 turns" in capsys.readouterr().out
