"""The vectorized verify against the per-sequence loop it replaced: the same target and draft rows at
every position the kernel reads (bit for bit, except the rounding of top-k rows batched with a larger
k) and the same chains under the same generators."""
from __future__ import annotations

import pytest
import torch

import kvspec_kernels as kernels
import specd.engine.speculation as speculation
from specd.engine.sampler import draw_uniforms, sampling_probs
from specd.engine.speculation import Draft, verify
from specd.sampling_params import SamplingParams

VOCAB = 300
GREEDY = SamplingParams(temperature=0.0)
SETTINGS = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
            SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=5)]


def old_target_probs(logits, params):
    """The former per-sequence transform (one sampling_probs call per sequence, settings re-uploaded)."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(1, logits.argmax(1, keepdim=True), 1.0)
    n = logits.shape[0]
    return sampling_probs(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
                          torch.full((n,), params.top_p))


def old_verify(logits, drafts, params, generators, seen):
    """The former loop: one target_probs, one draft copy and one token upload per sequence."""
    s, k_max = len(drafts), max(len(d.tokens) for d in drafts)
    p_t = torch.zeros(s, k_max + 1, VOCAB)
    p_d = torch.zeros(s, k_max, VOCAB)
    toks = torch.zeros(s, k_max, dtype=torch.int64)
    for i, (lg, d, p) in enumerate(zip(logits, drafts, params)):
        k = len(d.tokens)
        p_t[i, : k + 1] = old_target_probs(lg, p)
        if k:
            probs = d.probs if d.probs is not None else (d.origin[0][d.origin[1], :k] if d.origin else None)
            if probs is None:
                probs = torch.zeros(k, VOCAB).scatter_(1, torch.tensor(d.tokens)[:, None], 1.0)
            p_d[i, :k] = probs
            toks[i, :k] = torch.tensor(d.tokens)
    seen.append((p_t, p_d))
    num = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.int32)
    u = draw_uniforms(generators, k_max + 1)
    accepted, out = kernels.rejection_sample(p_t, p_d, toks, num, u[:, :k_max].contiguous(), u[:, k_max].contiguous())
    return [row[: a + 1] for row, a in zip(out.tolist(), accepted.tolist())]


def random_case(seed: int, n: int, kinds: str):
    """n sequences with k_i in 1..5 drafts; kinds: 'batched' (one proposal's [n, γ, V] block, in order),
    'shuffled' (rows of two proposals, out of order), 'mixed' (batched, explicit and one-hot drafts)."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(1, 6, (n,), generator=g).tolist()
    block = torch.softmax(torch.randn(n, 5, VOCAB, generator=g) * 3, dim=2)
    other = torch.softmax(torch.randn(n, 5, VOCAB, generator=g) * 3, dim=2)
    drafts = []
    for i, k in enumerate(ks):
        toks = torch.randint(0, VOCAB, (k,), generator=g).tolist()
        form = {"batched": 0, "shuffled": 1 + i % 2, "mixed": i % 3}[kinds]
        if form == 0:
            drafts.append(Draft(toks, origin=(block, i)))
        elif form == 1:
            drafts.append(Draft(toks, other[n - 1 - i, :k].clone() if kinds == "mixed" else None,
                                origin=None if kinds == "mixed" else (other, n - 1 - i)))
        else:
            drafts.append(Draft(toks) if kinds == "mixed" else Draft(toks, origin=(block, (i * 7) % n)))
    rows = sum(k + 1 for k in ks) + n                 # one plain (non-verified) row between sequences
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    starts, at = [], 0
    for k in ks:
        at += 1
        starts.append(at)
        at += k + 1
    params = [SETTINGS[(seed + i) % len(SETTINGS)] for i in range(n)]
    return logits, starts, drafts, params


@pytest.mark.parametrize("kinds", ["batched", "shuffled", "mixed"])
@pytest.mark.parametrize("n", [1, 3, 16])
def test_vectorized_verify_equals_the_per_sequence_loop(kinds, n, monkeypatch):
    for seed in range(4):
        logits, starts, drafts, params = random_case(seed, n, kinds)
        old_seen, new_seen = [], []
        want = old_verify([logits[s: s + len(d.tokens) + 1] for s, d in zip(starts, drafts)], drafts, params,
                          [torch.Generator().manual_seed(100 + i) for i in range(n)], old_seen)
        real = kernels.rejection_sample

        def spy(p_t, p_d, *rest):
            new_seen.append((p_t, p_d))
            return real(p_t, p_d, *rest)

        monkeypatch.setattr(kernels, "rejection_sample", spy)
        got = verify(logits, starts, drafts, params, [torch.Generator().manual_seed(100 + i) for i in range(n)])
        monkeypatch.setattr(kernels, "rejection_sample", real)
        assert got == want
        # greedy requests take the argmax chain, not the kernel (tests/engine/test_greedy_verify.py): the
        # kernel's batch holds the sampled requests, in order
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            assert not new_seen
            continue
        (old_t, old_d), (new_t, new_d) = old_seen[0], new_seen[0]
        old_t, old_d = old_t[sampled], old_d[sampled]
        drafts, params = [drafts[i] for i in sampled], [params[i] for i in sampled]
        max_k = max(p.top_k for p in params)
        for i, (d, p) in enumerate(zip(drafts, params)):
            k = len(d.tokens)
            assert torch.equal(new_d[i, :k], old_d[i, :k])
            if 0 < p.top_k < max_k:
                # a top-k row batched with a larger k is sorted among max_k candidates: the same
                # distribution up to float rounding (a plain step's batch has the same rounding)
                assert torch.equal(new_t[i, : k + 1] > 0, old_t[i, : k + 1] > 0)
                assert (new_t[i, : k + 1] - old_t[i, : k + 1]).abs().max() <= 2e-7
            else:
                assert torch.equal(new_t[i, : k + 1], old_t[i, : k + 1])


def test_one_in_order_proposal_is_verified_without_copying_it(monkeypatch):
    logits, starts, drafts, params = random_case(0, 4, "batched")
    params = [p if not p.greedy else SETTINGS[1] for p in params]     # greedy ones would take the chain
    seen = []
    real = kernels.rejection_sample
    monkeypatch.setattr(kernels, "rejection_sample", lambda p_t, p_d, *r: seen.append(p_d) or real(p_t, p_d, *r))
    verify(logits, starts, drafts, params, [None] * 4)
    assert seen[0].data_ptr() == drafts[0].origin[0].data_ptr()


def test_target_rows_use_each_rows_own_settings():
    """target_probs with per-row settings equals it applied to each row alone with that row's settings."""
    torch.manual_seed(5)
    logits = torch.randn(len(SETTINGS), VOCAB) * 2
    together = speculation.target_probs(logits, SETTINGS)
    for i, p in enumerate(SETTINGS):
        alone = speculation.target_probs(logits[i:i + 1], p)[0]
        assert torch.equal(alone, old_target_probs(logits[i:i + 1], p)[0])
        if p.top_k == 5:              # sorted among the batch's 20 candidates: rounding only
            assert torch.equal(together[i] > 0, alone > 0) and (together[i] - alone).abs().max() <= 2e-7
        else:
            assert torch.equal(together[i], alone)
