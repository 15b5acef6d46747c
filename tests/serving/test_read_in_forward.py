"""Requests read while a forward runs (SpecdServer._in_forward, the engine's ``forward_hook``): warmed at
once, added to the engine only after the step, in arrival order; bad frames and cancels read early get
the same answers as read late. A real ROUTER socket and DEALER client; the engine is the echo fake."""
from __future__ import annotations

import time

import zmq

from specd import protocol
from specd.server import SpecdServer
from tests.serving.fake_engine import FakeEngine


class HookEngine(FakeEngine):
    """A fake whose step runs ``during_step`` (the test sends frames) and then calls ``forward_hook`` until it
    has read ``expect`` frames, as SpecEngine does while the GPU computes a long prompt step."""

    def __init__(self):
        super().__init__()
        self.forward_hook = None
        self.warmed: list[list[int]] = []
        self.added_during_step: list[int] = []
        self.during_step = None
        self.expect = 0

    def warm(self, prompt_ids: list[int]) -> bool:
        self.warmed.append(list(prompt_ids))
        return True

    def has_work(self) -> bool:
        return super().has_work() or self.during_step is not None

    def step(self):
        if self.during_step is not None:
            send, self.during_step = self.during_step, None
            send()
            deadline = time.monotonic() + 5
            server = self.server
            while len(server._early) < self.expect and time.monotonic() < deadline:
                self.forward_hook()
            self.added_during_step.append(len(self.added))
        return super().step()


def setup(tmp_path):
    engine = HookEngine()
    server = SpecdServer(engine, f"ipc://{tmp_path / 'specd.sock'}")
    engine.server = server
    sock = server._bind()
    server._sock = sock
    engine.forward_hook = server._in_forward
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(server.address)
    return engine, server, sock, client


def send(client, msg) -> None:
    client.send(protocol.pack(msg))


def test_requests_read_in_a_forward_are_warmed_at_once_and_added_after_the_step(tmp_path):
    engine, server, sock, client = setup(tmp_path)
    try:
        send(client, protocol.generate_request(1, prompt=[5, 6, 7, 8, 9], params={"max_tokens": 1}))
        server._turn(sock)                       # read late (no step running): added at once
        assert len(engine.added) == 1 and engine.warmed == []

        def during():
            send(client, protocol.generate_request(2, prompt=[10, 11, 12, 13], params={"max_tokens": 1}))
            send(client, protocol.generate_request(3, prompt=[20, 21, 22], params={"max_tokens": 1}))
        engine.during_step, engine.expect = during, 2
        server._turn(sock)                       # the step: both read and warmed in its forward
        assert engine.warmed == [[10, 11, 12, 13], [20, 21, 22]]
        assert engine.added_during_step == [1]   # not added while the step ran
        assert server.stats()["ipc_read_in_forward_total"] == 2
        server._turn(sock)                       # the next turn adds them, in arrival order
        assert [r.prompt_ids for r in engine.added[1:]] == [[10, 11, 12, 13], [20, 21, 22]]
        assert engine.added[1].arrival_s < engine.added[2].arrival_s <= time.monotonic()
    finally:
        client.close(0)
        sock.close(0)


def test_bad_frames_and_cancels_read_in_a_forward_get_their_answers_after_it(tmp_path):
    engine, server, sock, client = setup(tmp_path)
    try:
        send(client, protocol.generate_request(1, prompt=[5, 6, 7, 8], params={"max_tokens": 50}))
        server._turn(sock)

        def during():
            client.send(b"\xc1 not msgpack")                                       # malformed
            send(client, protocol.generate_request(2, prompt=[], params={"max_tokens": 1}))   # engine refuses
            send(client, protocol.simple_request("cancel", 1))
        engine.during_step, engine.expect = during, 3
        server._turn(sock)
        assert engine.aborted == []              # the cancel waits for the step to end
        server._turn(sock)
        assert len(engine.aborted) == 1 and engine.aborted[0].endswith("-1")
        got = [protocol.decode_reply(f) for f in _frames(client, 100, timeout_s=0.5)]   # tokens of 1 too
        errors = [r for r in got if r.type == "error"]
        assert len(errors) == 2
        assert {e.error["code"] for e in errors} == {"malformed", "empty_prompt"}
        assert engine.warmed == []               # an empty prompt is not warmed (nothing to look up)
    finally:
        client.close(0)
        sock.close(0)


def _frames(client, n: int, timeout_s: float = 5.0) -> list[bytes]:
    out: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if client.poll(50):
            out.append(client.recv())
    return out


def test_reading_in_the_forward_is_off_by_default_and_sets_the_hook_when_on(tmp_path):
    engine = HookEngine()
    server = SpecdServer(engine, f"ipc://{tmp_path / 'specd.sock'}")             # the default: off
    server.start()
    try:
        assert engine.forward_hook is None
    finally:
        server.stop()
    on = HookEngine()
    server = SpecdServer(on, f"ipc://{tmp_path / 'specd2.sock'}", read_in_forward=True)
    server.start()
    try:
        assert on.forward_hook == server._in_forward
    finally:
        server.stop()
    assert on.forward_hook is None
