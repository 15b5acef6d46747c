"""Prefetch on arrival (stories260K, real kvd process with a DRAM tier): ``SpecEngine.warm`` starts the
promotion of a demoted prompt's prefix before the prompt is added, so its lookup finds the blocks landed
and it is not parked; the output is the uncached greedy one. The forward hook runs in long prompt steps
only (once on the CPU, where the forward has already run)."""
from __future__ import annotations

import time

import pytest
import torch

from client.kvd_client import KvdClient
from specd.engine import engine as engine_mod
from specd.engine.request import Request
from specd.engine.sequence import SeqStatus
from tests.engine.test_parked_admission import drain, engine, greedy, reference   # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def kvd_stats(kvd) -> dict:
    with KvdClient(kvd.run_dir) as c:
        return c.stats()


def test_a_warmed_prompt_is_not_parked_and_decodes_exactly(engine, reference):
    eng, kvd = engine
    before = kvd_stats(kvd)
    assert eng.warm(reference["first"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:                # the warm's promotion lands in kvd, no engine step needed
        st = kvd_stats(kvd)
        if st["warm_blocks"] > before.get("warm_blocks", 0) and st["promotion_backlog_s"] == 0:
            break
        time.sleep(0.01)
    assert st["warm_blocks"] - before.get("warm_blocks", 0) >= 1       # the prompt's demoted blocks
    assert st["lookups"] == before["lookups"]                           # a warm is no lookup
    eng.add_request(Request("b", reference["first"], greedy()))
    eng.step()
    seq = eng._seqs["b"]
    assert seq.status is SeqStatus.RUNNING and seq.num_cached_tokens >= 9 * 16   # admitted from the cache
    got = drain(eng)
    assert [*seq.output_ids] == reference["want"]
    assert eng.stats()["parked_total"] == 0 and eng.stats()["warmed_requests_total"] == 1
    assert got  # outputs came


def test_warm_of_a_prompt_kvd_cannot_hold_asks_nothing(engine, reference):
    eng, _ = engine
    assert not eng.warm(reference["short"][:10])       # not one full block to look up
    other = torch.randint(3, eng.model.config.vocab_size, (100,), generator=torch.Generator().manual_seed(3))
    assert not eng.warm(other.tolist())                # its first block is not in kvd (the roots filter)
    assert eng.stats()["warmed_requests_total"] == 0


def test_the_forward_hook_runs_in_long_prompt_steps_only(engine, reference):
    eng, _ = engine
    calls = []
    eng.forward_hook = lambda: calls.append(eng.stats()["steps_total"])
    long_prompt = torch.randint(3, eng.model.config.vocab_size, (engine_mod.FORWARD_HOOK_MIN_TOKENS + 20,),
                                generator=torch.Generator().manual_seed(5)).tolist()     # nothing of it cached
    eng.add_request(Request("long", long_prompt, greedy(4)))
    eng.step()                                          # the prompt step: the hook runs once (CPU)
    assert len(calls) == 1
    drain(eng)                                          # decode steps: no hook
    assert len(calls) == 1
    eng.add_request(Request("short", reference["short"], greedy(2)))   # a short prompt step: no hook
    drain(eng)
    assert len(calls) == 1
    st = eng.stats()
    assert st["forward_hook_steps_total"] == 1 and st["forward_hook_calls_total"] == 1
