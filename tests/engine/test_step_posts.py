"""Fewer posts per step: the step commits only sequences with a newly full, computed block
(``BlockManager.commit_step``), and its commits and releases reach kvd in one frame
(``BlockManager.posting`` -> ``KvdClient.cork``). Both must leave what is published, and the outputs,
exactly as before."""
from __future__ import annotations

import pytest
import torch

from bench.kvd_process import KvdProcess
from kvd.hashing import namespace_root
from specd.engine.block_manager import BlockManager
from specd.engine.block_source import LocalBlockSource
from specd.engine.config import EngineConfig
from specd.engine.detokenizer import Detokenizer
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.engine.sequence import Sequence
from specd.sampling_params import SamplingParams

ROOT = namespace_root("m", "t", "f32", "l", 4)
BS = 4
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")


class CountingSource(LocalBlockSource):
    """A private pool that records every commit (kvd's synchronous path)."""

    def __init__(self, n):
        super().__init__(n, 8, torch.device("cpu"))
        self.commits = []

    @property
    def connected(self):
        return True

    def commit(self, lease, entries):
        self.commits.append([h for _, h, _ in entries])
        return [b for b, _, _ in entries]


def seq_of(prompt: list[int]) -> Sequence:
    return Sequence(Request("r", prompt, SamplingParams(max_tokens=64)), Detokenizer(lambda ids: "", []), None)


def decode(bm: BlockManager, seq: Sequence, steps: int, step) -> None:
    """``steps`` one-token decode steps; ``step`` commits (the engine's commit phase)."""
    for t in range(steps):
        bm.ensure_slots(seq, 1)
        seq.num_computed_tokens += 1 if seq.output_ids else len(seq.prompt_ids)
        seq.output_ids.append(100 + t)
        step(seq)


def test_a_step_without_a_newly_full_block_commits_nothing():
    bm = BlockManager(CountingSource(64), BS, ROOT)
    seq = seq_of(list(range(6)))          # one full prompt block, two tokens into the second
    bm.ensure_slots(seq, 6)
    seq.num_computed_tokens = 6
    bm.commit_step([seq])
    assert len(bm.source.commits) == 1 and seq.num_committed_blocks == 1
    seq.output_ids.append(7)              # token 7 sampled; its KV is computed next step
    bm.ensure_slots(seq, 1)
    seq.num_computed_tokens = 7           # block 2 not full of computed KV yet
    assert not bm.may_commit(seq)
    bm.commit_step([seq])
    assert len(bm.source.commits) == 1    # nothing posted
    seq.output_ids.append(8)
    bm.ensure_slots(seq, 1)
    seq.num_computed_tokens = 8           # now block 2 is full and computed
    bm.commit_step([seq])
    assert len(bm.source.commits) == 2 and seq.num_committed_blocks == 2
    assert bm.source.commits[1] == [seq.hashes[1]]


def test_commit_step_publishes_what_committing_every_sequence_did():
    """The reference path (``commit_full`` for every running sequence) and the fast path publish the
    same blocks at the same steps, under the same hashes, and leave the same tables."""
    ref, fast = BlockManager(CountingSource(64), BS, ROOT), BlockManager(CountingSource(64), BS, ROOT)
    a, b = seq_of(list(range(7))), seq_of(list(range(7)))
    decode(ref, a, 17, ref.commit_full)
    decode(fast, b, 17, lambda s: fast.commit_step([s]))
    assert ref.source.commits == fast.source.commits and len(ref.source.commits) == 5
    assert a.block_table == b.block_table and a.num_committed_blocks == b.num_committed_blocks == 5
    ref.extend_hashes(a), fast.extend_hashes(b)
    assert a.hashes == b.hashes


@pytest.mark.slow
def test_the_step_posts_one_frame_and_publishes_every_full_block(tmp_path):
    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0) as kvd:
        local = SpecEngine.from_config(EngineConfig())
        cached = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
        prompts = [cached.tokenizer.encode(f"{STORY} Story number {i}.") for i in range(6)]

        def run(engine, tag):
            for i, p in enumerate(prompts):
                engine.add_request(Request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=40,
                                                                          ignore_eos=True)))
            out = {}
            while engine.has_work():
                for o in engine.step():
                    out.setdefault(o.id, []).extend(o.token_ids)
            return {k[len(tag):]: v for k, v in out.items()}

        before = cached.stats()
        assert run(local, "a") == run(cached, "a")            # identical outputs through the cache
        st = cached.stats()
        steps = st["steps_total"] - before["steps_total"]
        frames = st["kvd_post_frames_total"] - before.get("kvd_post_frames_total", 0)
        ops = st["kvd_posted_total"] - before["kvd_posted_total"]
        assert st.get("kvd_post_batch_total", 0) > 0 and frames < ops     # commits and releases went together
        assert frames <= steps + 1        # at most one frame a step (plus the idle engine's reserve release)
        # every full block was published: the same prompts again hit all their full prompt blocks
        again = run(cached, "b")
        assert again == run(local, "b")
        hit = cached.stats()["cached_tokens_total"] - st["cached_tokens_total"]
        assert hit == sum((len(p) - 1) // 16 * 16 for p in prompts)
