"""One flat forward over several sequences at different offsets equals separate forwards: positions
and the backend's segment layout, not padding, keep sequences apart."""
from __future__ import annotations

import torch

from specd.models import ContiguousKV

ATOL = 5e-5   # fp32 logits, a few ULPs: 1e-5 held on session 6's CPU; on session 7's (other BLAS kernels)
             # one logit was 1.14e-5 off. A mixed-up offset or cache row is off by ~1e-1 and more.


@torch.no_grad()
def test_two_sequences_at_different_offsets_in_one_step(stories):
    model, tok = stories
    a = torch.tensor(tok.encode("Once upon a time there was a dog", add_bos=True))
    b = torch.tensor(tok.encode("The sun was hot", add_bos=True))
    n_layers = model.config.num_layers

    def alone(ids, split):
        kv = ContiguousKV(n_layers)
        model(ids[:split], kv.begin([("x", split)]), kv)
        return model.logits(model(ids[split:], kv.begin([("x", len(ids) - split)]), kv).hidden)

    want_a, want_b = alone(a, 6), alone(b, 2)

    kv = ContiguousKV(n_layers)                 # both prefixes cached, at different lengths
    model(a[:6], kv.begin([("a", 6)]), kv)
    model(b[:2], kv.begin([("b", 2)]), kv)
    flat = torch.cat([b[2:], a[6:]])            # one step: b's tail, then a's tail
    positions = kv.begin([("b", len(b) - 2), ("a", len(a) - 6)])
    assert positions.tolist() == list(range(2, len(b))) + list(range(6, len(a)))
    got = model.logits(model(flat, positions, kv).hidden)
    assert (got[:len(b) - 2] - want_b).abs().max().item() < ATOL
    assert (got[len(b) - 2:] - want_a).abs().max().item() < ATOL
    assert kv.seq_len("a") == len(a) and kv.seq_len("b") == len(b)


@torch.no_grad()
def test_decode_batch_of_three_matches_single_decodes(stories):
    """A decode step with one token per sequence, each at its own position (the engine's common case)."""
    model, tok = stories
    prompts = [tok.encode(t, add_bos=True) for t in ("Tom", "A big red ball was in the", "She")]
    kv = ContiguousKV(model.config.num_layers)
    for i, p in enumerate(prompts):
        model(torch.tensor(p[:-1]), kv.begin([(i, len(p) - 1)]), kv)
    step = model.logits(model(torch.tensor([p[-1] for p in prompts]), kv.begin([(i, 1) for i in range(3)]), kv).hidden)
    for i, p in enumerate(prompts):
        solo = ContiguousKV(model.config.num_layers)
        want = model.logits(model(torch.tensor(p), solo.begin([("s", len(p))]), solo).hidden[-1:])
        assert (step[i] - want[0]).abs().max().item() < ATOL
