"""Drafter context K/V from kvd's draft group (specd/engine/draft_cache.py), on stories260K with its
committed DSpark drafter against a real kvd process: a prefix hit restores the drafter's context at
absolute positions, proposes exactly the drafts of a cold run, and decodes the same tokens; another
drafter never hits; a shifted context never publishes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient
from specd.drafter.base import load_drafter, save_drafter
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DRAFTER = Path(__file__).resolve().parents[2] / "models" / "drafters" / "stories260K-dspark"
PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball. She wanted to play with it, but it was too high. Lily asked "
          "her mom to help her get the ball. Her mom said yes and they went to the park together.")
SUFFIXES = (" Then Lily saw a dog.", " Tom came to play with them.")


def config(drafter: Path = DRAFTER, **fields) -> EngineConfig:
    return EngineConfig(drafters=f"dspark={drafter}", speculation="dspark", spec_schedule="fixed", **fields)


def run(engine: SpecEngine, rid: str, prompt: list[int]) -> tuple[list[int], dict]:
    """Greedy decode; returns the tokens and what the drafter saw at the request's first proposal:
    its context length and offset, and the draft tokens it proposed."""
    proposer = engine._proposer("dspark")
    first: dict = {}
    propose = proposer.propose

    def recording(seqs, limits):
        drafts = propose(seqs, limits)
        for s, d in zip(seqs, drafts):
            if s.id == rid and not first and s.draft_ctx is not None:
                first.update(n=s.draft_ctx.n, offset=s.draft_ctx.offset, computed=s.num_computed_tokens,
                             cached=s.num_cached_tokens, tokens=list(d.tokens))
        return drafts

    proposer.propose = recording
    engine.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    ids = []
    try:
        while engine.has_work():
            for out in engine.step():
                ids += out.token_ids
    finally:
        proposer.propose = propose
    return ids, first


@pytest.fixture(scope="module")
def prompts():
    tok = SpecEngine.from_config(EngineConfig()).tokenizer
    prefix = tok.encode(PREFIX)
    return [prefix + tok.encode(s, add_bos=False) for s in SUFFIXES]


@pytest.fixture(scope="module")
def cold(prompts):
    """The second prompt served without kvd: its drafter saw the whole prefix computed."""
    engine = SpecEngine.from_config(config())
    ids, first = run(engine, "cold", prompts[1])
    return engine, ids, first


@pytest.fixture
def kvd(tmp_path):
    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=0) as proc:
        yield proc


def test_a_prefix_hit_restores_the_drafter_context_from_kvd(kvd, prompts, cold):
    engine = SpecEngine.from_config(config(kvd_run_dir=kvd.run_dir))
    run(engine, "a", prompts[0])
    published = engine.stats()["draft_published_blocks_total"]
    assert published >= (len(prompts[0]) - 1) // 16       # every prompt block reached the draft group
    ids, first = run(engine, "b", prompts[1])
    stats = engine.stats()
    hit_blocks = first["cached"] // 16
    assert hit_blocks >= 5                                 # a long shared prefix: several blocks
    assert stats["draft_hit_blocks_total"] == hit_blocks and stats["draft_hit_tokens_total"] == first["cached"]
    assert first["offset"] == 0 and first["n"] == first["cached"] + (first["computed"] - first["cached"])
    assert first["n"] == len(prompts[1])                   # the hit tokens plus the computed suffix
    _, cold_ids, cold_first = cold
    assert cold_first["n"] == len(prompts[1]) and cold_first["cached"] == 0
    assert first["tokens"] == cold_first["tokens"]         # the same context: the same drafts
    assert ids == cold_ids                                 # and the same greedy output
    with KvdClient(kvd.run_dir) as client:
        group = client.stats()["groups"]["draft"]
    assert group["hit_blocks"] >= hit_blocks and group["hit_tokens"] >= first["cached"]


def test_another_drafter_gets_no_draft_hit_and_never_publishes_shifted(kvd, prompts, cold, tmp_path):
    warm = SpecEngine.from_config(config(kvd_run_dir=kvd.run_dir))
    run(warm, "a", prompts[0])                             # the committed drafter's blocks are in kvd
    drafter = load_drafter(DRAFTER / "drafter.safetensors")
    with torch.no_grad():
        drafter.fc.weight.mul_(1.01)
    other_dir = tmp_path / "perturbed"
    save_drafter(drafter, other_dir / "drafter.safetensors")
    engine = SpecEngine.from_config(config(drafter=other_dir, kvd_run_dir=kvd.run_dir))
    ids, first = run(engine, "b", prompts[1])
    stats = engine.stats()
    assert first["cached"] >= 5 * 16                       # the target hit is the same
    assert stats["draft_lookups_total"] == 1 and stats["draft_hit_blocks_total"] == 0
    assert stats["draft_short_hits_total"] == 1
    assert first["offset"] == first["cached"] and first["n"] == len(prompts[1]) - first["cached"]
    assert stats["draft_published_blocks_total"] == 0      # a shifted context is never published
    assert ids == cold[1]                                  # greedy verification is lossless anyway


def test_without_kvd_nothing_changes(prompts, cold):
    engine, ids, first = cold
    stats = engine.stats()
    assert not engine.drafts.enabled
    assert all(stats[k] == 0 for k in engine.drafts.stats())
    assert first["offset"] == 0 and first["n"] == len(prompts[1])
    again, _ = run(SpecEngine.from_config(config()), "again", prompts[1])
    assert again == ids
