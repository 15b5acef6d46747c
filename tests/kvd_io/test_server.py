"""KvdServer's envelope handling, admin gate, batching and failure isolation, in-process.

The core here is a tiny fake (tests only): these tests pin down what the server does around any core,
including one that raises unexpected exceptions. The real core is exercised in test_daemon.py."""
from __future__ import annotations

import gc

import os
import stat
import threading

import msgpack
import pytest
import zmq

from client.kvd_client import BadChain, Forbidden, KvdClient, KvdClientError, ReadyTimeout
from kvd import protocol as P
from kvd.core_types import KvdError, LookupResult, PoolInfo
from kvd.server import KvdServer


class FakeCore:
    def __init__(self):
        self.ready_after = 0  # wait_ready polls before the lease is ready
        self.ticks = 0

    def attach(self, client, group, block_bytes, tail_blocks=None):
        return PoolInfo(group, block_bytes, 4, "shm", path="/dev/null")

    def lookup(self, client, group, hashes, session=None, tokens=None, block_tokens=None, recompute_s=None):
        return LookupResult(1, [0] * len(hashes), [0] * len(hashes), True)

    def allocate(self, client, group, n):
        return 5, list(range(n))

    def commit(self, client, lease, blocks):
        if blocks and blocks[0][2] == b"\xff" * 16:
            raise KvdError("bad_chain", "parent unknown")
        return [b for b, _, _ in blocks]

    def release(self, client, lease, hints=None):
        if lease == 666:
            raise ZeroDivisionError("a core bug")

    def heartbeat(self, client):
        pass

    def wait_ready(self, lease, timeout):
        self.ready_after -= 1
        return self.ready_after < 0

    def tick(self, now):
        self.ticks += 1

    def stats(self, client):
        return {"lookups": 1}

    def top(self, client, n):
        return [object()]  # not msgpack-able: the server must answer, not die

    def flush(self, client, tier):
        return {"flushed": 0 if tier is None else tier}


@pytest.fixture
def served(tmp_path):
    core = FakeCore()
    server = KvdServer(core, tmp_path / "run")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield core, server, tmp_path / "run"
    server.request_stop()
    thread.join(5)
    server.close()


def raw_socket(path, kind=zmq.DEALER):
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{path}")
    return sock


def test_sockets_are_0660_and_pid_file_written(served):
    _, _, run = served
    for name in ("kvd.sock", "kvd-admin.sock"):
        assert stat.S_IMODE(os.stat(run / name).st_mode) == 0o660
    assert int((run / "kvd.pid").read_text()) == os.getpid()


def test_client_round_trip_and_batch(served):
    _, _, run = served
    with KvdClient(run) as c:
        assert c.attach("full", 64).gpu_blocks == 4
        assert c.lookup("full", [b"\x01" * 16] * 3).num_hits == 3
        lease, blocks = c.allocate("full", 2)
        assert (lease, blocks) == (5, [0, 1])
        results = c.batch([P.Commit(lease=5, blocks=[(0, b"\x02" * 16, b"\xff" * 16)]),
                           P.Commit(lease=5, blocks=[(1, b"\x03" * 16, None)]),
                           P.Release(lease=666)])
        assert isinstance(results[0], BadChain)
        assert results[1] == [1]
        assert results[2].code == "internal"
        server_stats = c.stats()["server"]
        assert server_stats["requests"] >= 4
        lookups = server_stats["busy"]["lookup"]   # server-side latency per verb: count, total, longest
        assert lookups["count"] == 1 and 0 < lookups["max_s"] <= lookups["seconds"]
        full = server_stats["gc"]["gc_gen2_passes_total"]   # the collector's passes (in-process server: ours)
        gc.collect()
        assert c.stats()["server"]["gc"]["gc_gen2_passes_total"] == full + 1
        with pytest.raises(KvdClientError, match="internal"):
            c.top()
        c.heartbeat()  # still serving


def test_admin_verbs_only_on_admin_socket(served):
    _, _, run = served
    with KvdClient(run) as c, pytest.raises(Forbidden):
        c.flush()
    with KvdClient(run, admin=True) as a:
        assert a.flush(2) == {"flushed": 2}


def test_multi_frame_and_req_envelopes(served):
    _, _, run = served
    dealer = raw_socket(run / "kvd.sock")
    dealer.send_multipart([b"a", b"b", b"c"])
    reply = msgpack.unpackb(dealer.recv(), raw=False)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_frame"
    req = raw_socket(run / "kvd.sock", zmq.REQ)  # REQ adds an empty delimiter frame
    req.send(P.encode_request(9, "heartbeat"))
    reply = msgpack.unpackb(req.recv(), raw=False)
    assert reply == {"v": P.PROTOCOL_VERSION, "id": 9, "ok": True}


def test_wait_ready_is_parked_not_blocking(served):
    core, _, run = served
    core.ready_after = 3
    with KvdClient(run) as c, KvdClient(run) as other:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", c.wait_ready(1, timeout_s=5)))
        t.start()
        other.heartbeat()  # the loop keeps serving while the wait is parked
        t.join(10)
        assert box["r"] is True
        core.ready_after = 10**9
        with pytest.raises(ReadyTimeout):
            c.wait_ready(1, timeout_s=0.2)
    assert core.ticks > 0
