"""The greedy verification (specd/engine/greedy_verify.py) against the rejection sampler it stands in for
(``speculation.VerifyInputs`` and ``verify_prepared``): the same chains, token for token, on random
logits with drafts that match the argmax for a random prefix, on exact ties, and for every form a draft's
distribution comes in; and a step mixing greedy and sampled requests splits them without changing any
request's chain."""
from __future__ import annotations

import pytest
import torch

import kvspec_kernels as kernels
from specd.engine.greedy_verify import GreedyVerify, accept_greedy
from specd.engine.speculation import Draft, MixedVerify, VerifyInputs, prepare_verify, verify_prepared
from specd.sampling_params import SamplingParams

VOCAB = 257
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def case(seed: int, n: int, form: str, ties: bool = False):
    """n requests with 0..6 drafts each; each draft follows the target's argmax for a random number of
    positions, then (if any are left) takes another token. form: the draft distribution ('one-hot',
    'explicit' [k, V] probs, 'batched' rows of one [n, γ, V] proposal). ties: every row's two largest
    logits are equal (the argmax takes the first)."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, 7, (n,), generator=g).tolist()
    rows = sum(k + 1 for k in ks) + n                        # a plain row before each request's rows
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    if ties:
        top2 = logits.topk(2, dim=1).indices
        logits[torch.arange(rows), top2[:, 1]] = logits[torch.arange(rows), top2[:, 0]]
    argmax = logits.argmax(dim=1).tolist()
    block = torch.softmax(torch.randn(n, 6, VOCAB, generator=g), dim=2)
    starts, drafts, at = [], [], 0
    for i, k in enumerate(ks):
        at += 1
        starts.append(at)
        match = int(torch.randint(0, k + 1, (1,), generator=g))
        tokens = [argmax[at + j] for j in range(match)]
        tokens += [(argmax[at + j] + 1 + int(torch.randint(0, VOCAB - 1, (1,), generator=g))) % VOCAB
                   for j in range(match, k)]
        if form == "one-hot":
            drafts.append(Draft(tokens))
        elif form == "explicit":
            drafts.append(Draft(tokens, torch.softmax(torch.randn(k, VOCAB, generator=g), dim=1)))
        else:
            drafts.append(Draft(tokens, origin=(block, i)))
        at += k + 1
    return logits, starts, drafts


@pytest.mark.parametrize("form", ["one-hot", "explicit", "batched"])
@pytest.mark.parametrize("n", [1, 4, 32])
@pytest.mark.parametrize("ties", [False, True])
def test_greedy_chains_equal_the_rejection_samplers(form, n, ties):
    for seed in range(5):
        logits, starts, drafts = case(seed, n, form, ties)
        params = [GREEDY] * n
        reference = VerifyInputs.of(starts, drafts, params, [torch.Generator().manual_seed(i) for i in range(n)],
                                    VOCAB, CPU)
        fast = prepare_verify(starts, drafts, params, [None] * n, VOCAB, CPU)
        assert isinstance(fast, GreedyVerify)
        want = verify_prepared(logits, reference)
        assert verify_prepared(logits, fast) == want
        for d, chain in zip(drafts, want):                 # and the chains are what greedy decoding emits
            assert chain[:-1] == d.tokens[: len(chain) - 1]


def test_the_fast_path_launches_no_rejection_kernel(monkeypatch):
    logits, starts, drafts = case(0, 4, "batched")
    monkeypatch.setattr(kernels, "rejection_sample", lambda *a: pytest.fail("greedy rows reached the kernel"))
    verify_prepared(logits, prepare_verify(starts, drafts, [GREEDY] * 4, [None] * 4, VOCAB, CPU))


@pytest.mark.parametrize("n", [2, 5, 16])
def test_a_mixed_step_gives_each_kind_what_the_reference_gives_it(n):
    """Greedy and sampled requests in one step (``MixedVerify``), put back in order: the greedy ones get the
    reference's chains (the argmax chain), the sampled ones exactly what the rejection sampler gives them
    as a batch of their own under the same generators. (Not what it gives them beside the greedy ones:
    each request draws K + 1 uniforms, K the batch's longest draft, and its last token reads draw K + 1,
    so the split moves which draw that is; the same distribution, another sample.)"""
    settings = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]
    checked = 0
    for seed in range(6):
        logits, starts, drafts = case(seed, n, "batched")
        params = [settings[(seed + i) % len(settings)] for i in range(n)]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not greedy or not sampled:
            continue
        gens = lambda idx: [torch.Generator().manual_seed(10 * seed + i) for i in idx]   # noqa: E731
        mixed = prepare_verify(starts, drafts, params, gens(range(n)), VOCAB, CPU)
        assert isinstance(mixed, MixedVerify)
        got = verify_prepared(logits, mixed)
        everyone = verify_prepared(logits, VerifyInputs.of(starts, drafts, params, gens(range(n)), VOCAB, CPU))
        alone = verify_prepared(logits, VerifyInputs.of([starts[i] for i in sampled], [drafts[i] for i in sampled],
                                                        [params[i] for i in sampled], gens(sampled), VOCAB, CPU))
        assert [got[i] for i in greedy] == [everyone[i] for i in greedy]
        assert [got[i] for i in sampled] == alone
        checked += 1
    assert checked


def test_without_the_chain_every_request_takes_the_rejection_sampler():
    logits, starts, drafts = case(1, 3, "one-hot")
    params = [GREEDY, SamplingParams(temperature=0.7), GREEDY]
    assert isinstance(prepare_verify(starts, drafts, params, [None] * 3, VOCAB, CPU, greedy_chain=False),
                      VerifyInputs)
    assert isinstance(prepare_verify(starts, drafts, [GREEDY] * 3, [None] * 3, VOCAB, CPU, greedy_chain=False),
                      VerifyInputs)


def test_accept_greedy_by_hand():
    # request 0: both drafts match, bonus 9; request 1: the first draft misses, target 5 (its later rows,
    # 6 and 7, are not read); request 2: no drafts, one target token
    assert accept_greedy([[1, 2], [4, 6], []], [1, 2, 9, 5, 6, 7, 8]) == [[1, 2, 9], [5], [8]]
    # a match after a miss is not accepted
    assert accept_greedy([[3, 4, 5]], [3, 0, 5, 8]) == [[3, 0]]
