"""KvdClient.watch / poll_watches: a parked wait_ready is answered out of order, and the engine must
learn its answer without ever waiting for it. A raw ROUTER stands in for kvd so the test decides when
(and whether) the watch is answered."""
from __future__ import annotations

import time

import pytest

from client.kvd_client import KvdClient, KvdUnavailable, PromotionFailed
from kvd import protocol as P
from tests.fake_kvd import fake_kvd_socket


@pytest.fixture
def fake_kvd(tmp_path):
    with fake_kvd_socket(tmp_path / "run") as router:
        client = KvdClient(tmp_path / "run", timeout_s=0.5)
        yield router, client
        client.close()


def receive(router) -> tuple[bytes, int]:
    """The sender and request id of the next frame the client sent."""
    ident, payload = router.recv_multipart()
    return ident, P.unpack(payload)["id"]


def test_a_watch_answered_late_is_handed_out_by_poll_without_blocking(fake_kvd):
    router, client = fake_kvd
    got = []
    client.watch(P.WaitReady(lease=7, timeout_s=10.0), got.append)
    ident, watch_id = receive(router)
    client.post(P.Heartbeat())                        # a posted op answered before the watch
    _, post_id = receive(router)
    router.send_multipart([ident, P.encode_reply(post_id, {})])
    assert client.settle() == 1                       # settle does not wait for the parked watch
    t0 = time.perf_counter()
    assert client.poll_watches() == 0 and got == [] and client.watching == 1
    assert time.perf_counter() - t0 < 0.1             # no answer yet: poll returns at once
    router.send_multipart([ident, P.encode_reply(watch_id, {"ready": True})])
    router.send_multipart([ident, P.encode_error(watch_id + 100, "timeout", "a stray reply")])
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        client.poll_watches()
    assert got == [{"ready": True}] and client.watching == 0


def test_a_failed_promotion_and_a_dead_kvd_are_answers_too(fake_kvd):
    router, client = fake_kvd
    failed, lost, dropped = [], [], []
    client.watch(P.WaitReady(lease=1, timeout_s=10.0), failed.append)
    ident, first = receive(router)
    client.watch(P.WaitReady(lease=2, timeout_s=0.0), lost.append)    # never answered: expires
    wid = client.watch(P.WaitReady(lease=3, timeout_s=10.0), dropped.append)
    client.unwatch(wid)                                               # released meanwhile
    router.send_multipart([ident, P.encode_error(first, "promotion_failed", "copy failed")])
    deadline = time.monotonic() + 5
    while (not failed or not lost) and time.monotonic() < deadline:
        client.poll_watches()
    assert isinstance(failed[0], PromotionFailed)
    assert isinstance(lost[0], KvdUnavailable)        # past timeout_s + the client's timeout
    assert dropped == [] and client.watching == 0
