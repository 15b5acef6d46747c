"""Posted ops (KvdClient.post / settle): sent without waiting, answered in order, errors handed back.

The fixture ``kvd`` (conftest.py): a real KvdCore behind a KvdServer on a thread; a raw ROUTER stands in for
a kvd that loses a reply."""
from __future__ import annotations

import hashlib
import threading
import time
from contextlib import contextmanager

import pytest

from client.kvd_client import KvdClient, KvdUnavailable, UnknownLease
from kvd import protocol as P
from tests.fake_kvd import fake_kvd_socket


def h(i: int) -> bytes:
    return hashlib.blake2b(b"p%d" % i, digest_size=16).digest()


def test_a_posted_release_is_applied_before_a_later_call(kvd):
    lease, blocks = kvd.allocate("full", 4)
    got = []
    kvd.post(P.Release(lease=lease), got.append)
    assert len(kvd.allocate("full", 4)[1]) == 4      # the pool was full: only the posted release made room
    assert got == []                                # answers are handed out at settle, not before
    assert kvd.settle() == 1 and got == [{}]


def test_a_posted_commit_hands_back_canonical_ids_at_settle(kvd):
    first, (a,) = kvd.allocate("full", 1)
    assert kvd.commit(first, [(a, h(0), None)]) == [a]
    second, (b,) = kvd.allocate("full", 1)
    got = []
    kvd.post(P.Commit(lease=second, blocks=[(b, h(0), None)]), got.append)
    kvd.heartbeat()                                 # a waited call in between keeps the answer for settle
    assert got == [] and kvd.unsettled == 1
    kvd.settle()
    assert got == [[a]] and kvd.unsettled == 0     # a duplicate: kvd's block is the canonical one


def test_a_refused_posted_op_is_returned_not_raised(kvd):
    got = []
    kvd.post(P.Release(lease=999), got.append)
    kvd.settle()
    assert isinstance(got[0], UnknownLease)
    assert kvd.round_trips["settle"][0] == 1 and kvd.posts["release"][0] == 1


def test_settle_without_kvd_raises_unavailable(tmp_path):
    with fake_kvd_socket(tmp_path / "run"):
        client = KvdClient(tmp_path / "run", timeout_s=0.3)
        try:
            client.post(P.Heartbeat())
            with pytest.raises(KvdUnavailable):
                client.settle()
            assert client.unsettled == 0
        finally:
            client.close()


def test_drain_raises_unavailable_once_a_post_goes_unanswered_past_the_timeout(tmp_path):
    """An engine whose commits are posted and not needed never waits on kvd in a decode step; ``drain``
    is where it learns that kvd is gone, once the oldest post is older than the call timeout. Before
    that, drain never waits and never raises."""
    with fake_kvd_socket(tmp_path / "run"):            # takes frames, never answers (a dead kvd)
        client = KvdClient(tmp_path / "run", timeout_s=0.3)
        try:
            got = []
            client.post(P.Heartbeat(), got.append, needed=False)
            assert client.drain() == 0 and client.unsettled == 1
            time.sleep(0.4)
            with pytest.raises(KvdUnavailable, match="unanswered"):
                client.drain()
            assert client.unsettled == 0 and got == []
            assert client.drain() == 0                # nothing posted: nothing to age
        finally:
            client.close()


@contextmanager
def client_losing_the_first_frame(tmp_path):
    """A client of a fake kvd that drops the first frame it gets (a posted op, or a corked batch) and
    answers the second: kvd answers in order, so the client must report the first one lost."""
    with fake_kvd_socket(tmp_path / "run") as router:
        def run() -> None:
            router.recv_multipart()
            ident, payload = router.recv_multipart()
            router.send_multipart([ident, P.encode_reply(P.unpack(payload)["id"], {})])
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        client = KvdClient(tmp_path / "run", timeout_s=3.0)
        try:
            yield client
        finally:
            thread.join(5)
            client.close()


def test_a_posted_op_whose_reply_never_comes_is_reported_lost(tmp_path):
    """kvd answers in order, so a later id's reply means an earlier posted one will never come."""
    with client_losing_the_first_frame(tmp_path) as client:
        got = []
        client.post(P.Heartbeat(), got.append)
        client.heartbeat()
        client.settle()
        assert len(got) == 1 and isinstance(got[0], KvdUnavailable)


# -- corked posts (KvdClient.cork / uncork): a step's posts in one batch frame ---------------------------
def test_corked_posts_go_in_one_frame_and_each_op_gets_its_own_answer(kvd):
    first, (a,) = kvd.allocate("full", 1)
    assert kvd.commit(first, [(a, h(0), None)]) == [a]
    second, (b,) = kvd.allocate("full", 1)
    frames, got = kvd.frames_posted, []
    assert kvd.cork()
    kvd.post(P.Commit(lease=second, blocks=[(b, h(0), None)]), got.append)
    kvd.post(P.Release(lease=999), got.append, needed=False)
    kvd.post(P.Release(lease=first), got.append, needed=False)
    assert kvd.frames_posted == frames and kvd.unsettled == 3 and kvd.awaiting   # held, not sent yet
    kvd.uncork()
    assert kvd.frames_posted == frames + 1 and kvd.posts["batch"][0] == 1
    assert kvd.posts["commit"][0] == 1 and kvd.posts["release"][0] == 2          # ops are still counted by verb
    kvd.settle()
    assert got[0] == [a] and isinstance(got[1], UnknownLease) and got[2] == {}   # as if posted one by one
    assert kvd.unsettled == 0


def test_a_call_while_corked_sends_the_held_posts_first(kvd):
    lease, _ = kvd.allocate("full", 4)                # the pool is full
    got = []
    assert kvd.cork() and not kvd.cork()              # nested: the outer uncork sends
    kvd.post(P.Release(lease=lease), got.append)
    assert len(kvd.allocate("full", 4)[1]) == 4      # the held release reached kvd before the allocate
    frames = kvd.frames_posted
    kvd.uncork()
    assert kvd.frames_posted == frames and "batch" not in kvd.posts   # nothing left; a lone op went as itself
    kvd.settle()
    assert got == [{}]


def test_settle_while_corked_waits_for_the_held_posts(kvd):
    first, (a,) = kvd.allocate("full", 1)
    second, (b,) = kvd.allocate("full", 1)
    got = []
    kvd.cork()
    kvd.post(P.Commit(lease=first, blocks=[(a, h(1), None)]), got.append)
    kvd.post(P.Commit(lease=second, blocks=[(b, h(1), None)]), got.append)
    kvd.settle(needed_only=True)
    assert got == [[a], [a]] and kvd.unsettled == 0   # the second is a duplicate of the first
    kvd.uncork()
    assert kvd.posts["batch"][0] == 1


def test_a_lost_corked_frame_reports_every_op_lost(tmp_path):
    with client_losing_the_first_frame(tmp_path) as client:
        got = []
        client.cork()
        client.post(P.Heartbeat(), got.append)
        client.post(P.Heartbeat(), got.append)
        client.uncork()
        client.heartbeat()
        client.settle()
        assert len(got) == 2 and all(isinstance(g, KvdUnavailable) for g in got)
