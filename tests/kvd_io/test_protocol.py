"""The wire contract on its own: valid frames parse to typed ops, every kind of garbage becomes a
ProtocolError with the right code, and nothing else ever escapes decode_request."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import protocol as P

H = b"\x01" * 16


def code_of(frame: bytes) -> str:
    with pytest.raises(P.ProtocolError) as info:
        P.decode_request(frame)
    return info.value.code


def test_valid_ops_parse_to_their_models():
    req = P.decode_request(P.encode_request(7, "commit", lease=3, blocks=[[0, H, None], [1, b"\x02" * 16, H]]))
    assert req.id == 7 and isinstance(req.op, P.Commit)
    assert req.op.blocks[1] == (1, b"\x02" * 16, H)
    req = P.decode_request(P.encode_op(8, P.Release(lease=3, hints={"session": "s", "kinds": {H: 1},
                                                                    "turn_end": True, "expected_return_s": 2})))
    assert req.op.hints.kinds == {H: 1} and req.op.hints.expected_return_s == 2.0


def test_batch_items_are_validated_and_restricted():
    req = P.decode_request(P.encode_op(1, P.Batch(ops=[P.Heartbeat().model_dump(),
                                                       P.Allocate(group="g", n=2).model_dump()])))
    assert [o.type for o in req.sub_ops] == ["heartbeat", "allocate"]
    assert code_of(P.encode_request(1, "batch", ops=[{"type": "flush"}])) == "bad_request"
    assert code_of(P.encode_request(1, "batch", ops=[{"type": "batch", "ops": []}])) == "bad_request"
    assert code_of(P.encode_request(1, "batch", ops=[{"type": "allocate", "group": "g", "n": -1}])) == "bad_request"


@pytest.mark.parametrize("frame, code", [
    (b"", "bad_frame"),
    (b"\xc1", "bad_frame"),                                        # reserved msgpack byte
    (msgpack.packb([1, 2]), "bad_frame"),                           # not a map
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "type": "stats"}), "bad_request"),      # no id
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": -1, "type": "stats"}), "bad_request"),
    (msgpack.packb({"v": 1, "id": 1, "type": "stats"}), "bad_version"),      # a v1 (old) client
    (msgpack.packb({"v": "1", "id": 1, "type": "stats"}), "bad_version"),
    (msgpack.packb({"v": True, "id": 1, "type": "stats"}), "bad_version"),
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "type": "drop_tables"}), "unknown_type"),
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1}), "unknown_type"),
    (P.encode_request(1, "stats", extra_field=1), "bad_request"),
    (P.encode_request(1, "lookup", group="g", hashes=[b"\x01" * 15]), "bad_request"),
    (P.encode_request(1, "lookup", group="g", hashes=["0" * 16]), "bad_request"),   # str is not bytes
    (P.encode_request(1, "lookup", group="g", hashes=[H] * (P.MAX_HASHES + 1)), "bad_request"),
    (P.encode_request(1, "allocate", group="g", n=-5), "bad_request"),
    (P.encode_request(1, "allocate", group="g", n=2**40), "bad_request"),
    (P.encode_request(1, "allocate", group="g", n=True), "bad_request"),
    (P.encode_request(1, "attach", group="", block_bytes=64), "bad_request"),
    (P.encode_request(1, "wait_ready", lease=1, timeout_s=float("nan")), "bad_request"),
    (P.encode_request(1, "commit", lease=1, blocks=[[0, H]]), "bad_request"),
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "type": "stats"}) + b"\x00", "bad_frame"),  # trailing bytes
    (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "type": "stats", "x": msgpack.ExtType(1, b"pickle")}), "bad_frame"),
    (b"\x00" * (P.MAX_FRAME_BYTES + 1), "too_large"),
])
def test_garbage_gets_the_right_code(frame, code):
    assert code_of(frame) == code


def test_request_id_is_echoed_when_readable():
    with pytest.raises(P.ProtocolError) as info:
        P.decode_request(msgpack.packb({"v": 9, "id": 42, "type": "stats"}))
    assert info.value.req_id == 42


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(frame):
    try:
        P.decode_request(frame)
    except P.ProtocolError as err:
        assert err.code in {"bad_frame", "bad_request", "bad_version", "unknown_type"}


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(P.OP_MODELS)), st.dictionaries(st.sampled_from(
    ["group", "hashes", "n", "lease", "blocks", "hints", "tier", "tokens", "block_size", "timeout_s", "ops", "x"]),
    values, max_size=4))
def test_random_fields_of_known_types_never_crash(kind, fields):
    frame = P.encode_request(1, kind, **fields)
    try:
        req = P.decode_request(frame)
    except P.ProtocolError as err:
        assert err.code == "bad_request" and err.req_id == 1
    else:
        assert req.op.type == kind


def test_a_batch_item_without_a_known_type_is_a_bad_request_of_the_batch():
    """Found by test_random_fields_of_known_types_never_crash (a batch of one empty op gave unknown_type): the
    batch is a known request whose ``ops`` field is bad, as a batch item of a type not allowed there is."""
    for op in ({}, {"type": "drop_tables"}):
        with pytest.raises(P.ProtocolError) as err:
            P.decode_request(P.encode_request(1, "batch", ops=[op]))
        assert err.value.code == "bad_request" and err.value.req_id == 1
