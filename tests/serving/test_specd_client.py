"""Client library against a real SpecdServer thread around the fake engine: results, streaming,
typed errors, timeouts, and cancellation/disconnection freeing the request in the engine."""
from __future__ import annotations

import asyncio
import os
import stat
import time

import pytest
import zmq
from fake_engine import FakeEngine

from client.specd_client import (AsyncSpecdClient, SpecdClient, SpecdRequestError, SpecdServerError,
                                 SpecdTimeoutError)
from specd import protocol


def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def client(server):
    with SpecdClient(address=server.address, timeout_s=5) as c:
        yield c


def test_generate_returns_text_tokens_and_usage(client):
    result = client.generate("hello", max_tokens=7, temperature=0)
    assert result.text == "hellohe"
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (6, 7)  # BOS + 5 bytes
    assert len(result.token_ids) == 7 and result.usage.ttft_s is not None


def test_token_id_prompt_and_repeat_is_served_from_cache(client):
    ids = [ord(c) + 3 for c in "abcdefghij"]
    first = client.generate(ids, max_tokens=2)
    second = client.generate(ids, max_tokens=2)
    assert first.text == "ab" and first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 8  # two full 4-token blocks of the fake's cache


def test_stream_yields_deltas_then_a_final_usage(client):
    deltas = list(client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    assert "".join(d.text for d in deltas) == "<use"
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]
    assert deltas[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("prompt, params, code", [
    ("", {}, "empty_prompt"),
    ("x" * 300, {}, "prompt_too_long"),
    ("x", {"temperature": -0.5}, "invalid_params"),
    ("x", {"top_p": 0}, "invalid_params"),
    ("x", {"no_such_param": 1}, "invalid_params"),
])
def test_bad_requests_raise_typed_errors_and_server_keeps_serving(client, prompt, params, code):
    with pytest.raises(SpecdRequestError) as info:
        client.generate(prompt, **params)
    assert info.value.code == code
    assert client.generate("ok", max_tokens=2).text == "ok"


def test_engine_failure_fails_inflight_requests_but_not_the_server(client, engine):
    engine.fail_next_step = True
    with pytest.raises(SpecdServerError) as info:
        client.generate("boom", max_tokens=3)
    assert info.value.code == "engine_failure"
    assert client.generate("fine", max_tokens=4).text == "fine"
    assert client.stats()["engine_failures_total"] == 1


def test_no_server_times_out(run_dir):
    with SpecdClient(run_dir, timeout_s=0.2) as c, pytest.raises(SpecdTimeoutError):
        c.generate("anyone?")


@pytest.fixture
def slow_server(run_dir):
    from specd.server import SpecdServer

    engine = FakeEngine(step_delay_s=0.01)
    srv = SpecdServer(engine, protocol.socket_address(run_dir))
    srv.start()
    yield srv, engine
    srv.stop()


def test_breaking_out_of_a_stream_cancels_and_frees_the_request(slow_server):
    srv, engine = slow_server
    with SpecdClient(address=srv.address, timeout_s=5) as c:
        for i, _ in enumerate(c.stream("long story", max_tokens=1000)):
            if i == 3:
                break
        assert wait_until(lambda: len(engine.aborted) == 1)
        assert wait_until(lambda: c.stats()["requests_running"] == 0)
        assert c.stats()["ipc_cancels_total"] == 1


def test_client_that_disconnects_mid_stream_is_aborted(slow_server):
    srv, engine = slow_server
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(srv.address)
    sock.send(protocol.pack(protocol.generate_request(1, prompt="abandon me", params={"max_tokens": 1000})))
    assert protocol.decode_reply(sock.recv()).type == "tokens"
    sock.close(linger=0)  # gone without a cancel: the server notices when it next sends
    assert wait_until(lambda: len(engine.aborted) == 1)
    assert wait_until(lambda: engine.stats()["requests_running"] == 0)
    assert srv.stats()["ipc_client_gone_total"] >= 1


def test_async_client_runs_concurrent_streams(server):
    async def run():
        async with AsyncSpecdClient(address=server.address, timeout_s=5) as c:
            results = await asyncio.gather(*[c.generate(f"p{i}q", max_tokens=3) for i in range(8)])
            streamed = [d.text async for d in c.stream("xyz", max_tokens=3)]
            info = await c.info()
            return results, streamed, info

    results, streamed, info = asyncio.run(run())
    assert [r.text for r in results] == [f"p{i}q" for i in range(8)]
    assert streamed == ["x", "y", "z", ""]
    assert info == {"model": "fake-echo", "max_model_len": 256}


def test_async_errors_are_typed(server):
    async def run():
        async with AsyncSpecdClient(address=server.address, timeout_s=5) as c:
            with pytest.raises(SpecdRequestError) as info:
                await c.generate("", max_tokens=3)
            return info.value.code

    assert asyncio.run(run()) == "empty_prompt"


def test_cancelled_async_task_cancels_the_request(slow_server):
    srv, engine = slow_server

    async def run():
        async with AsyncSpecdClient(address=srv.address, timeout_s=5) as c:
            got = asyncio.Event()

            async def consume():
                async for _ in c.stream("forever", max_tokens=1000):
                    got.set()

            task = asyncio.create_task(consume())
            await got.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert wait_until(lambda: len(engine.aborted) == 1)
    assert wait_until(lambda: engine.stats()["requests_running"] == 0)


def test_socket_is_not_world_accessible(server, run_dir):
    mode = stat.S_IMODE(os.stat(os.path.join(run_dir, protocol.SOCKET_NAME)).st_mode)
    assert mode == 0o660
