"""Cache-aware routing on the CPU: two real specd workers (stories260K) on one kvd.

The workers run with different tenant salts, so each one's blocks are only useful to itself (as two
GPUs' pools would be): a turn routed to the worker holding its prefix gets cached tokens, the same
turn sent to the other worker gets none."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from bench.kvd_process import KvdProcess
from client.router import Router, render, text_chain
from client.specd_client import SpecdClient
from tests.serving import specd_process

pytestmark = pytest.mark.slow

SYSTEM = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
          "her dog Max and her friend Tom. ")
PARAMS = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    kvd = KvdProcess(tmp_path_factory.mktemp("kvd"), gpu_bytes=8 << 20, dram_bytes=0, max_groups=1).start()
    procs = []
    try:
        for salt in ("w0", "w1"):
            procs.append(specd_process.start(["-m", "specd", "--kvd-run-dir", str(kvd.run_dir),
                                              "--tenant-salt", salt]))
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                specd_process.stop(p)
        kvd.stop()


def chat(user: str, history: list[dict] | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *(history or []), {"role": "user", "content": user}]


def test_cost_prefers_the_longest_prefix_against_load():
    r = Router(["/nonexistent/a", "/nonexistent/b"], load_weight=2.0)
    chain = text_chain(render(None, chat("One day she saw a big red ball in the garden near the old tree.")))
    r.workers[1].remember(chain[:3])
    assert r.rank(chain, 0.0)[0] == 1
    r.workers[1].running = len(chain)          # holding 3 links is not worth that much queueing
    assert r.rank(chain, 0.0)[0] == 0


def test_sessions_stick_to_the_worker_holding_their_prefix(workers):
    router = Router([w.run_dir for w in workers])
    first = {}
    for s, user in (("a", "Lily found a shiny red ball."), ("b", "Tom wanted to climb the tall tree.")):
        msgs = [{"role": "system", "content": f"Story {s}. " + SYSTEM}, {"role": "user", "content": user}]
        i, deltas = router.generate(messages=msgs, session=s, **PARAMS)
        first[s] = (i, msgs, "".join(d.text for d in deltas))
    assert {first["a"][0], first["b"][0]} == {0, 1}          # nothing shared yet: load spreads
    for s, (i, msgs, answer) in first.items():
        turn2 = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "What happened next?"}]
        j, deltas = router.generate(messages=turn2, session=s, **PARAMS)
        assert j == i, "the session's second turn left the worker holding its prefix"
        assert deltas[-1].usage.cached_tokens > 0
        with SpecdClient(workers[1 - i].run_dir, timeout_s=30) as other:
            assert other.generate(messages=turn2, **PARAMS).usage.cached_tokens == 0


def test_concurrent_unrelated_requests_spread(workers):
    router = Router([w.run_dir for w in workers])
    used: list[int] = []

    def one(k: int) -> None:
        used.append(router.generate(f"The dog number {k} ran to the big park and played all day long.",
                                    **PARAMS)[0])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(used) == [0, 0, 1, 1]


def test_a_dead_worker_is_skipped(workers):
    router = Router([w.run_dir for w in workers], timeout_s=2.0, retry_after_s=60.0)
    msgs = chat("Max barked at the little cat on the wall.")
    i, _ = router.generate(messages=msgs, **PARAMS)
    os.kill(workers[i].proc.pid, signal.SIGKILL)
    workers[i].proc.wait()
    j, deltas = router.generate(messages=msgs, **PARAMS)      # prefers the dead one, fails over
    assert j == 1 - i and deltas[-1].finish_reason in ("stop", "length")
    t0 = time.monotonic()
    k, _ = router.generate(messages=chat("A bird sang a song."), **PARAMS)
    assert k == 1 - i and time.monotonic() - t0 < 2.0         # no second timeout on the dead worker
