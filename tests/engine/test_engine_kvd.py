"""The engine on the real stories260K model against a real kvd process: prefix reuse, identical
outputs with and without the cache, and serving on when kvd is missing or dies."""
from __future__ import annotations

import logging

import pytest

from bench.kvd_process import KvdProcess
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")


def run(engine: SpecEngine, rid: str, prompt: list[int], **params) -> tuple[list[int], object]:
    engine.add_request(Request(rid, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **params})))
    ids, usage = [], None
    while engine.has_work():
        for out in engine.step():
            assert out.id == rid and out.error is None
            ids += out.token_ids
            if out.finished:
                usage = out.usage
    return ids, usage


@pytest.fixture
def kvd(tmp_path):
    with KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=8 << 20) as proc:
        yield proc


def test_shared_prefix_is_prefilled_once_and_decodes_identically(kvd):
    local = SpecEngine.from_config(EngineConfig())
    cached = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
    assert cached.source.connected and not local.source.connected
    prompt = cached.tokenizer.encode(STORY)
    longer = prompt + cached.tokenizer.encode(" Her friend Tom came to play.", add_bos=False)
    want_a, _ = run(local, "a", prompt)
    want_b, _ = run(local, "b", longer)
    got_a, usage_a = run(cached, "a", prompt)
    got_b, usage_b = run(cached, "b", longer)
    assert usage_a.cached_tokens == 0
    full_blocks = (len(prompt) - 1) // 16 * 16
    assert usage_b.cached_tokens == full_blocks > 0     # only the new tokens were prefilled
    assert got_a == want_a and got_b == want_b            # the cache changes nothing in the output
    # sampled decoding with a seed is reproducible through the cache too
    s1, _ = run(local, "s", longer, temperature=0.9, seed=11)
    s2, u2 = run(cached, "s", longer, temperature=0.9, seed=11)
    assert s1 == s2 and u2.cached_tokens > 0


def test_concurrent_identical_prompts_deduplicate_without_corruption(tmp_path):
    """Two sequences prefill the same prompt in one step; the second commit is a duplicate, so kvd
    returns the canonical blocks and keeps the copies leased to the writer (protocol v3) until it has
    switched its table and given them back. A second worker then takes every free block (the given-back
    ones included) and writes its own KV there: the first worker must not read it."""
    block_bytes = 5 * 2 * 16 * 4 * 8 * 4            # stories260K: L * 2 * bs * Hkv * D * fp32
    with KvdProcess(tmp_path / "kvd", gpu_bytes=24 * block_bytes, dram_bytes=0, max_groups=1) as kvd:
        local = SpecEngine.from_config(EngineConfig())
        first = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
        second = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir))
        prompt = first.tokenizer.encode(STORY)
        other = first.tokenizer.encode(" ".join(["Tom had a big dog and the dog liked to run in the sun."] * 12))[:200]
        want, _ = run(local, "w", prompt)
        want_other, _ = run(local, "o", other)
        for rid in ("a", "b"):
            first.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=24)))
        got = {"a": [], "b": []}
        for out in first.step():                     # both prefill
            got[out.id] += out.token_ids
        seq_a, seq_b = first._seqs["a"], first._seqs["b"]
        own_b = list(seq_b.block_table)
        for out in first.step():                     # and commit, in the next step's forward: b's is a duplicate
            got[out.id] += out.token_ids
        full = len(prompt) // 16
        source = first.blocks.source
        source.settle()        # b's commit answer: its table switches to a's blocks, its own go back (posted)
        source.settle()        # and kvd has taken them back
        assert seq_b.block_table[:full] == seq_a.block_table[:full] != own_b[:full]
        got_other, _ = run(second, "o", other)       # fills kvd's free blocks with other KV
        while first.has_work():
            for out in first.step():
                got[out.id] += out.token_ids
        assert got_other == want_other
        assert got["a"] == want and got["b"] == want


def test_no_kvd_serves_without_cache_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="specd.engine"):
        engine = SpecEngine.from_config(EngineConfig(kvd_run_dir=tmp_path / "absent"))
    assert engine.stats()["kvd_connected"] == 0
    assert any("kvd unavailable" in r.getMessage() for r in caplog.records)
    ids, usage = run(engine, "a", engine.tokenizer.encode(STORY))
    assert len(ids) == 24 and usage.cached_tokens == 0


def test_kvd_killed_mid_run_degrades_then_recovers(tmp_path):
    local = SpecEngine.from_config(EngineConfig())
    prompt = local.tokenizer.encode(STORY)
    want, _ = run(local, "w", prompt)
    proc = KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=8 << 20).start()
    engine = SpecEngine.from_config(EngineConfig(kvd_run_dir=proc.run_dir))
    engine.add_request(Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=24)))
    ids = []
    for out in engine.step():               # prefill through kvd
        ids += out.token_ids
    proc.kill()
    while engine.has_work():                # decodes from its leased blocks: nothing waits on kvd here
        for out in engine.step():
            ids += out.token_ids
    assert ids == want
    again, usage = run(engine, "b", prompt)     # its lookup finds kvd gone: served, without the cache
    assert engine.stats()["kvd_connected"] == 0
    assert usage.cached_tokens == 0 and again == want
    proc = KvdProcess(tmp_path / "kvd", gpu_bytes=8 << 20, dram_bytes=8 << 20).start()
    try:
        engine._last_reconnect_s = 0.0
        run(engine, "c", prompt)                # re-attaches while idle, fills the new cache
        assert engine.stats()["kvd_connected"] == 1
        _, usage = run(engine, "d", prompt)
        assert usage.cached_tokens > 0
    finally:
        proc.stop()
