"""bench/step_profile.py on the CPU: the steps it builds are the engine's, and its keys differ only where
they claim to (the GPU run times them; see docs/results/speedup.md)."""
import json

from bench.step_profile import alternative_keys, mixed_step, run
from specd.engine.cuda_graphs import graph_key, prefill_keys


def test_mixed_step_lays_out_decoders_then_prompts_in_their_own_blocks():
    step = mixed_step(decoders=2, context=20, prompts=1, prompt_len=5)
    assert step.cu_q_lens == [0, 1, 2, 7]
    assert step.seq_lens == [21, 21, 5]
    assert step.positions == [20, 20, 0, 1, 2, 3, 4]
    blocks = [b for t in step.tables for b in t]
    assert len(blocks) == len(set(blocks))                     # no two sequences share a block
    assert step.max_q_len == 5


def test_alternative_keys_keep_the_step_and_change_one_part_each():
    step = mixed_step(decoders=16, context=200, prompts=3, prompt_len=110)    # 346 tokens
    engine = graph_key(len(step.ids), len(step.seq_lens), step.max_q_len, 32, 2048 + 224, ())
    keys = alternative_keys(step, engine)
    assert (keys["engine"].tokens, keys["engine"].q_bound) == (384, 384)      # prefill-shaped: q = bucket
    assert (keys["tight_q"].tokens, keys["tight_q"].q_bound) == (384, 128)
    assert (keys["exact"].tokens, keys["exact"].q_bound) == (352, 128)
    decode = mixed_step(decoders=16, context=200, prompts=0, prompt_len=110)
    assert list(alternative_keys(decode, graph_key(16, 16, 1, 32, 2272, ()))) == ["engine"]


def test_tiny_run_times_every_key_and_writes_its_table(tmp_path):
    res = run("tiny", [2], [0, 2], 20, 12, 2, tmp_path, max_seqs=4)
    mixed = next(c for c in res["cases"] if c["prompts"] == 2)
    assert set(mixed["keys"]) == {"engine", "tight_q", "exact"}
    assert all(k["ms_p50"] > 0 for k in mixed["keys"].values())
    assert mixed["keys"]["engine"]["key"]["q_bound"] == 48 and mixed["keys"]["tight_q"]["key"]["q_bound"] == 32
    assert json.loads((tmp_path / "step_profile-tiny.json").read_text())["cases"][1]["tokens"] == 42
    assert "| 2 | 2 | 42 | (48, 48) |" in (tmp_path / "step_profile-tiny.md").read_text()
    # the runner's start warm-up was timed: 3 decode buckets (1, 2, 4) and the prompt chunks up to the budget
    assert res["start_warm_up"]["decode"]["graphs"] == 3
    assert res["start_warm_up"]["prompt_chunks"]["graphs"] == len(prefill_keys(2048 + 4 * 7, ()))
