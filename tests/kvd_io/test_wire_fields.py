"""The wire-map fast path (kvd/protocol.py ``*_fields``) against its reference (a built, validated op).

The engine's hot ops (a step's posted commits, the admissions' lookup batch, the corked batch frame) are
packed from maps built directly; these must be the same bytes the validated op gives, and what the client
no longer validates must still be refused by kvd with a typed error."""
from __future__ import annotations

import hashlib

import pytest

from client.kvd_client import BadRequest
from kvd import protocol as P


def h(i: int) -> bytes:
    return hashlib.blake2b(b"w%d" % i, digest_size=16).digest()


COMMITS = [
    (7, [(3, h(0), None)]),
    (2**40, [(0, h(1), h(0)), (2**31 - 1, h(2), h(1))]),
    (1, []),
]
LOOKUPS = [
    dict(group="full", hashes=[h(i) for i in range(20)]),
    dict(group="full", hashes=[h(0)], session="s-1", recompute_s=0.0012),
    dict(group="g", hashes=[], session=None, tokens=33, block_tokens=16, recompute_s=None),
]


@pytest.mark.parametrize("lease,blocks", COMMITS)
def test_commit_fields_is_the_built_commits_frame(lease, blocks):
    ref = P.Commit(lease=lease, blocks=blocks)
    assert P.commit_fields(lease, blocks) == P.op_fields(ref)
    assert P.encode_fields(9, P.commit_fields(lease, blocks)) == P.encode_op(9, ref)


@pytest.mark.parametrize("kw", LOOKUPS)
def test_lookup_fields_is_the_built_lookups_frame(kw):
    ref = P.Lookup(**kw)
    assert P.lookup_fields(**kw) == P.op_fields(ref)
    assert list(P.lookup_fields(**kw)) == list(P.op_fields(ref))          # key order: the same bytes
    assert P.encode_fields(3, P.lookup_fields(**kw)) == P.encode_op(3, ref)


@pytest.mark.parametrize("kw", [dict(group="full"), dict(group="full", known=2**63, recompute_s=0.002, skipped=3,
                                                            skipped_blocks=200)])
def test_roots_fields_is_the_built_roots_frame(kw):
    ref = P.Roots(**kw)
    assert list(P.roots_fields(**kw).items()) == list(P.op_fields(ref).items())   # same keys, order, values
    assert P.encode_fields(5, P.roots_fields(**kw)) == P.encode_op(5, ref)


@pytest.mark.parametrize("kw", [dict(groups=["full"], hashes=[h(i) for i in range(5)]),
                                dict(groups=["full", "swa"], hashes=[h(0)], recompute_s=0.003)])
def test_warm_fields_is_the_built_warms_frame(kw):
    ref = P.Warm(**kw)
    assert list(P.warm_fields(**kw).items()) == list(P.op_fields(ref).items())
    assert P.encode_fields(4, P.warm_fields(**kw)) == P.encode_op(4, ref)


def test_batch_fields_is_the_built_batchs_frame():
    maps = [P.commit_fields(lease, blocks) for lease, blocks in COMMITS] + [P.lookup_fields(**kw) for kw in LOOKUPS]
    maps.append(P.op_fields(P.Release(lease=5, blocks=[1, 2])))
    ref = P.Batch(ops=[P.op_fields(P.Commit(lease=lease, blocks=blocks)) for lease, blocks in COMMITS]
                  + [P.op_fields(P.Lookup(**kw)) for kw in LOOKUPS] + [P.op_fields(P.Release(lease=5, blocks=[1, 2]))])
    assert P.encode_fields(11, P.batch_fields(maps)) == P.encode_op(11, ref)
    req = P.decode_request(P.encode_fields(11, P.batch_fields(maps)))     # and kvd reads it as the same ops
    assert req.sub_ops == P.decode_request(P.encode_op(11, ref)).sub_ops


def test_an_oversized_batch_is_refused_on_the_client_as_before():
    with pytest.raises(ValueError):         # pydantic's ValidationError, as a built Batch raises it
        P.batch_fields([P.commit_fields(1, [])] * (P.MAX_BATCH_OPS + 1))


@pytest.mark.parametrize("fields", [
    P.commit_fields(1, [(0, b"short", None)]),                       # a hash of the wrong length
    P.commit_fields(-1, [(0, h(0), None)]),                          # a negative lease
    P.commit_fields(1, [("0", h(0), None)]),                         # a block id that is not an int
    P.lookup_fields("full", [h(0)], recompute_s=float("nan")),
    P.lookup_fields("", [h(0)]),
])
def test_kvd_still_refuses_what_the_fast_path_does_not_check(fields):
    for frame in (P.encode_fields(4, fields), P.encode_fields(4, P.batch_fields([fields]))):
        with pytest.raises(P.ProtocolError) as err:
            P.decode_request(frame)
        assert err.value.code == P.ErrorCode.BAD_REQUEST and err.value.req_id == 4


def test_posted_commit_fields_get_the_same_answers_as_built_commits(kvd):
    first, (a,) = kvd.allocate("full", 1)
    second, (b,) = kvd.allocate("full", 1)
    got = []
    assert kvd.cork()
    kvd.post_fields(P.commit_fields(first, [(a, h(0), None)]), got.append)
    kvd.post(P.Commit(lease=second, blocks=[(b, h(0), None)]), got.append)     # a duplicate of the first
    kvd.uncork()
    kvd.settle()
    assert got == [[a], [a]] and kvd.frames_posted == 1


def test_a_bad_posted_commit_comes_back_refused(kvd):
    """What the client no longer checks, kvd refuses: a bad op refuses its whole frame (kvd validates a
    batch before running any of it), and each op's callback gets the typed error."""
    lease, (a,) = kvd.allocate("full", 1)
    got = []
    kvd.post_fields(P.commit_fields(lease, [(a, b"bad", None)]), got.append)
    assert kvd.cork()
    kvd.post_fields(P.commit_fields(lease, [(a, h(0), None)]), got.append)
    kvd.post_fields(P.commit_fields(lease, [(a, b"bad", None)]), got.append)
    kvd.uncork()
    kvd.settle()
    assert len(got) == 3 and all(isinstance(out, BadRequest) for out in got)
    assert kvd.commit(lease, [(a, h(0), None)]) == [a]     # nothing of the refused frame was run


def test_batch_fields_answers_like_batch(kvd):
    lease, (a,) = kvd.allocate("full", 1)
    kvd.commit(lease, [(a, h(0), None)])
    hashes = [h(0), h(1)]
    fast = kvd.batch_fields([P.lookup_fields("full", hashes), P.lookup_fields("full", [h(5)])])
    ref = kvd.batch([P.Lookup(group="full", hashes=hashes), P.Lookup(group="full", hashes=[h(5)])])
    assert [r.hits for r in fast] == [r.hits for r in ref] == [[a], []]
    with pytest.raises(BadRequest):
        kvd.batch_fields([P.lookup_fields("full", [b"bad"])])


def test_warm_over_the_socket(kvd):
    """A warm round trip and a posted one (as the engine sends it) answer with the blocks queued; a warm
    for a group kvd does not have is a typed refusal."""
    lease, (a,) = kvd.allocate("full", 1)
    kvd.commit(lease, [(a, h(0), None)])
    kvd.release(lease)
    assert kvd.warm(["full"], [h(0), h(1)]) == 0          # on the GPU already: nothing to move
    got = []
    kvd.post_fields(P.warm_fields(["full"], [h(0)], 0.001), got.append, needed=False)
    kvd.post_fields(P.warm_fields(["nope"], [h(0)]), got.append, needed=False)
    kvd.settle()
    assert got[0] == {"blocks": 0}
    assert getattr(got[1], "code", None) == "unknown_group"
