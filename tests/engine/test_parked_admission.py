"""Promotions never stop the engine (stories260K, real kvd process with a DRAM tier).

A prompt whose cached blocks were demoted to DRAM hits there; kvd promotes them back asynchronously.
The engine parks that prompt and keeps stepping the others. To make the promotion "slow" without
timing luck, the test holds back the engine's readiness poll (``hold``): kvd promotes and answers at
once, but the engine does not learn it until the test lets go, exactly as if the copy were still in
flight. The engine's blocking ``wait_ready`` is replaced by one that raises: it must never be called.
"""
from __future__ import annotations

import pytest
import torch

from bench.kvd_process import KvdProcess
from client.kvd_client import KvdClient, PromotionFailed
from specd.engine.config import EngineConfig
from specd.engine.engine import SpecEngine
from specd.engine.request import Request
from specd.engine.sequence import SeqStatus
from specd.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

BLOCK_BYTES = 5 * 2 * 16 * 4 * 8 * 4      # stories260K: L * 2 * bs * Hkv * D * fp32


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: SpecEngine, rid: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    engine.add_request(Request(rid, prompt, greedy(max_tokens)))
    ids = []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            ids += out.token_ids
    return ids


def drain(engine: SpecEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            got.setdefault(out.id, []).extend(out.token_ids)
    return got


def never_wait(*_a, **_k):
    raise AssertionError("the engine called a blocking wait_ready")


class Hold:
    """Hide kvd's readiness answers from the engine until ``release``: a promotion that has not landed."""

    def __init__(self, engine: SpecEngine):
        self.source = engine.source
        self.real = engine.source.poll
        self.source.poll = lambda: None

    def release(self) -> None:
        self.source.poll = self.real


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    local = SpecEngine.from_config(EngineConfig(cuda_graphs=False))
    g = torch.Generator().manual_seed(7)
    vocab = local.model.config.vocab_size
    first = torch.randint(3, vocab, (150,), generator=g).tolist()
    short = torch.randint(3, vocab, (20,), generator=g).tolist()
    flood = [torch.randint(3, vocab, (150,), generator=g).tolist() for _ in range(3)]
    return {"first": first, "short": short, "flood": flood,
            "want": run(local, "w", first), "want_short": run(local, "s", short, max_tokens=40)}


@pytest.fixture
def engine(tmp_path, reference):
    """An engine whose first prompt was served once, then pushed down to kvd's DRAM tier by others."""
    with KvdProcess(tmp_path / "kvd", gpu_bytes=40 * BLOCK_BYTES, dram_blocks=128, policy="lru-offload",
                    max_groups=1) as kvd:
        eng = SpecEngine.from_config(EngineConfig(kvd_run_dir=kvd.run_dir, cuda_graphs=False))
        eng.source.client.wait_ready = never_wait
        assert run(eng, "a", reference["first"]) == reference["want"]
        for i, p in enumerate(reference["flood"]):
            run(eng, f"f{i}", p)
        yield eng, kvd
        eng.source.close()


def park_first(eng: SpecEngine, reference) -> object:
    """Add the demoted prompt again and step once: it must be parked on its promotion."""
    eng.add_request(Request("b", reference["first"], greedy()))
    eng.step()
    seq = eng._seqs["b"]
    assert seq.status is SeqStatus.PARKED and seq.num_cached_tokens > 0 and seq.leases
    assert eng.stats()["requests_parked"] == 1
    return seq


def test_others_keep_decoding_while_a_hit_is_promoted(engine, reference):
    eng, _ = engine
    eng.add_request(Request("s", reference["short"], greedy(40)))
    got = {"s": [], "b": []}
    for out in eng.step():                              # "s" prefills and starts decoding
        got[out.id] += out.token_ids
    hold = Hold(eng)
    eng.add_request(Request("b", reference["first"], greedy()))
    for _ in range(10):
        outs = eng.step()
        assert [o.id for o in outs] == ["s"] and len(outs[0].token_ids) == 1   # one token per step: never stalled
        got["s"] += outs[0].token_ids
    b = eng._seqs["b"]
    assert b.status is SeqStatus.PARKED and not got["b"]
    hold.release()
    for rid, ids in drain(eng).items():
        got[rid] += ids
    usage = b.usage()                                   # the engine's split of its TTFT (IPC usage, bench records)
    assert 0 < usage.parked_s <= usage.queue_s <= usage.ttft_s
    assert got["b"] == reference["want"]                # the promoted hit gives the uncached greedy output
    assert got["s"] == reference["want_short"]
    st = eng.stats()
    assert st["parked_total"] == 1 and st["parked_admitted_total"] == 1 and st["parked_giveups_total"] == 0
    assert st["parked_seconds_max"] > 0 and st["parked_seconds_total"] >= st["parked_seconds_max"]
    assert st["cached_tokens_total"] >= 9 * 16          # the second "b" ran from the promoted blocks
    assert st["kvd_post_wait_ready_total"] >= 1 and "kvd_rpc_wait_ready_total" not in st


def test_abort_while_parked_releases_the_lease(engine, reference):
    eng, kvd = engine
    Hold(eng)
    seq = park_first(eng, reference)
    lease = seq.leases[0]
    eng.abort("b")
    eng.source.settle()                                 # the posted release has been served
    with KvdClient(kvd.run_dir) as other:
        assert lease not in {entry["lease"] for entry in other.leases()}
    assert not eng.has_work() and eng.stats()["requests_parked"] == 0
    assert eng.source.client.watching == 0              # nothing left waiting for an answer


def test_a_promotion_slower_than_the_limit_is_given_up_and_recomputed(engine, reference):
    eng, _ = engine
    eng.scheduler.park_limit_s = 0.2
    Hold(eng)
    park_first(eng, reference)
    got = drain(eng)
    assert got["b"] == reference["want"]
    st = eng.stats()
    assert st["parked_giveups_total"] == 1 and st["parked_admitted_total"] == 0
    assert st["parked_seconds_max"] >= 0.2


def test_a_failed_promotion_is_recomputed(engine, reference):
    eng, _ = engine
    client = eng.source.client
    real_watch = client.watch
    # what kvd answers when a promotion's copy failed (kvd/core.py wait_ready: ``promotion_failed``)
    client.watch = lambda op, on_reply: real_watch(op, lambda _out: on_reply(PromotionFailed("promotion_failed", "test")))
    park_first(eng, reference)
    got = drain(eng)
    assert got["b"] == reference["want"]
    st = eng.stats()
    assert st["parked_giveups_total"] == 1 and st["kvd_promotion_failures_total"] == 1


def test_kvd_killed_while_parked_recomputes(engine, reference):
    eng, kvd = engine
    eng.scheduler.park_limit_s = 0.3
    Hold(eng)
    park_first(eng, reference)
    kvd.kill()
    got = drain(eng)
    assert got["b"] == reference["want"]                # recomputed: no block that did not land is read
    st = eng.stats()
    assert st["parked_giveups_total"] == 1 and st["kvd_connected"] == 0
