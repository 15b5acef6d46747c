"""specd's wire contract: every bad frame gets a typed error reply and the server keeps serving."""
from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.specd_client import SpecdClient
from specd import protocol
from specd.protocol import ProtocolError, decode_request, generate_request, pack


def _code(frame: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    return info.value.code


def test_valid_messages_decode():
    msg = decode_request(pack(generate_request(7, prompt=[1, 2, 3], params={"temperature": 0, "max_tokens": 4})))
    assert isinstance(msg, protocol.Generate)
    assert (msg.id, msg.prompt, msg.params.max_tokens, msg.params.greedy) == (7, [1, 2, 3], 4, True)
    chat = decode_request(pack(generate_request(8, messages=[{"role": "user", "content": "hi"}], session="s1")))
    assert chat.messages[0].content == "hi" and chat.session == "s1"
    assert isinstance(decode_request(pack(protocol.simple_request("cancel", 9))), protocol.Cancel)


@pytest.mark.parametrize("frame, code", [
    (b"\xc1garbage", "malformed"),
    (pack([1, 2]), "malformed"),
    (pack({"v": 99, "type": "generate", "id": 1}), "bad_version"),
    (pack({"v": 1, "type": "explode", "id": 1}), "unknown_type"),
    (pack({"v": 1, "type": "generate", "id": 1}), "bad_request"),                       # no prompt at all
    (pack({**generate_request(1, prompt="a"), "messages": [{"role": "user", "content": "b"}]}), "bad_request"),
    (pack({**generate_request(1, prompt="a"), "surprise": 1}), "bad_request"),
    (pack(generate_request(1, prompt=[1, -5])), "bad_request"),
    (pack({"v": 1, "type": "cancel", "id": -1}), "bad_request"),
    (pack(generate_request(1, prompt="a", params={"temperature": -1})), "invalid_params"),
    (pack(generate_request(1, prompt="a", params={"top_p": 1.5})), "invalid_params"),
    (pack(generate_request(1, prompt="a", params={"tempreature": 1})), "invalid_params"),
    (b"\x00" * (protocol.MAX_FRAME_BYTES + 1), "frame_too_large"),
], ids=lambda v: v if isinstance(v, str) else f"{len(v)}B")   # a 16 MiB frame must not become a test id
def test_bad_frames_get_stable_codes(frame, code):
    assert _code(frame) == code


def test_error_carries_the_request_id_when_readable():
    with pytest.raises(ProtocolError) as info:
        decode_request(pack(generate_request(42, prompt="a", params={"temperature": -1})))
    assert info.value.msg_id == 42


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
near_valid = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 2, "1", None]), "type": st.sampled_from(["generate", "cancel", "stats", "info", "x"]),
     "id": st.one_of(st.integers(-3, (1 << 64) - 1), st.text(max_size=3))},
    optional={"prompt": msgpack_values, "messages": msgpack_values, "params": msgpack_values,
              "session": msgpack_values})


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), msgpack_values.map(pack), near_valid.map(pack)))
def test_decoder_only_ever_raises_protocol_error(frame):
    try:
        decode_request(frame)
    except ProtocolError as exc:
        assert exc.code in {"malformed", "bad_version", "unknown_type", "bad_request", "invalid_params"}


@pytest.fixture
def raw(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(server.address)
    yield sock
    sock.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=st.one_of(st.binary(max_size=64), msgpack_values.map(pack), near_valid.map(pack)))
def test_server_answers_every_bad_frame_and_keeps_serving(raw, server, frame):
    try:
        msg = decode_request(frame)
    except ProtocolError as exc:
        raw.send(frame)
        reply = msgpack.unpackb(raw.recv())
        assert reply["type"] == "error" and reply["error"]["code"] == exc.code
    else:
        if isinstance(msg, protocol.Generate):
            return  # a valid request; served like any other
    assert server._thread.is_alive()


def test_multipart_frames_are_refused_then_service_continues(raw, server):
    raw.send_multipart([pack(protocol.simple_request("stats", 1)), b"extra"])
    reply = msgpack.unpackb(raw.recv())
    assert reply["type"] == "error" and reply["error"]["code"] == "malformed"
    with SpecdClient(address=server.address, timeout_s=5) as client:
        assert client.generate("abc", max_tokens=3).text == "abc"
    assert server.stats()["ipc_errors_total"] >= 1
