"""The engine answer generator (specd/drafter/engine_answers.py) against the eager harness
(specd.drafter.data.generate) on stories260K, fp32 CPU: lengths, stops, reproducibility, exact greedy
equality, and a two-sample chi-square test that its sampled tokens follow the harness's distribution
(which must reject a planted temperature bug)."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from specd.drafter import data
from specd.drafter.engine_answers import AnswerError, EngineAnswers, engine_generate
from tests.token_stats import token_p_value

ALPHA = 1e-3           # a correct generator fails the two-sample test 0.1% of the time
STORY = "Once upon a time, there was a"
STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260K.gguf"


@pytest.fixture(scope="module")
def openings(target, one_thread):
    model, tok = target
    return data.self_openings(model, tok, 24, 8, seed=5)


def _prompts(openings, temperature, lengths=(24,), **kw):
    return [data.Prompt(ids, temperature, max_new_tokens=lengths[i % len(lengths)], **kw)
            for i, ids in enumerate(openings)]


def test_answers_have_the_asked_lengths_and_end_at_a_stop_token(target, openings):
    model, tok = target
    prompts = _prompts(openings, 1.0, lengths=(1, 5, 17, 40))
    free = engine_generate(model, prompts, 3, frozenset(), progress=False)
    assert [len(a) for a in free] == [p.max_new_tokens for p in prompts]
    # stop on the commonest generated token: most answers now end early, on it (kept)
    stop = collections.Counter(t for a in free for t in a).most_common(1)[0][0]
    stopped = engine_generate(model, prompts, 3, frozenset({stop}), progress=False)
    for a, full, p in zip(stopped, free, prompts):
        assert 1 <= len(a) <= p.max_new_tokens
        assert stop not in a[:-1]
        assert a[-1] == stop or len(a) == p.max_new_tokens
        assert a == full[:len(a)]          # a stop only cuts: the same seed draws the same tokens before it
    assert sum(a[-1] == stop and len(a) < p.max_new_tokens for a, p in zip(stopped, prompts)) >= len(prompts) // 2


def test_same_seeds_reproduce_and_other_seeds_differ(target, openings):
    model, _ = target
    prompts = _prompts(openings, 1.0, top_p=0.9, top_k=40)
    answers = EngineAnswers(model, capacity=64, max_num_seqs=8)
    first = answers(prompts, 11, frozenset(), progress=False)
    assert answers(prompts, 11, frozenset(), progress=False) == first     # the same engine, reused
    assert engine_generate(model, prompts, 11, frozenset(), progress=False) == first   # a fresh one, other batch
    other = answers(prompts, 12, frozenset(), progress=False)
    assert sum(a != b for a, b in zip(first, other)) >= len(prompts) // 2


def test_a_prompt_the_pool_cannot_hold_is_an_error(target, openings):
    model, _ = target
    too_small = EngineAnswers(model, capacity=16, max_num_seqs=1)      # 2 blocks of 16 tokens
    with pytest.raises(AnswerError, match="too small"):
        too_small([data.Prompt(openings[0] * 5, 1.0, max_new_tokens=4)], 0, frozenset(), progress=False)


def test_greedy_answers_equal_the_harness(target, openings):
    model, tok = target
    prompts = _prompts(openings, 0.0, lengths=(8, 32))
    want = data.generate(model, prompts, 0, tok.stop_ids, batch_size=8, progress=False)
    assert engine_generate(model, prompts, 0, tok.stop_ids, progress=False) == want


def test_sampled_answers_equal_the_harness_at_equal_seeds(target, openings):
    """Both draw one uniform per sampled token from the prompt's generator seeded seed + i, through
    the same sampler: at equal seeds they agree wherever the two forwards' logits round alike."""
    model, tok = target
    prompts = _prompts(openings, 1.0, lengths=(32,), top_k=50)
    want = data.generate(model, prompts, 21, tok.stop_ids, batch_size=8, progress=False)
    got = engine_generate(model, prompts, 21, tok.stop_ids, progress=False)
    assert sum(a == b for a, b in zip(got, want)) >= 0.9 * len(prompts)


N = 400


@pytest.fixture(scope="module")
def harness_samples(target, one_thread):
    """N answers of 2 tokens to one prompt at T = 1 from the harness (seeds 0..N-1)."""
    model, tok = target
    prompts = [data.Prompt(tok.encode(STORY), 1.0, max_new_tokens=2)] * N
    return data.generate(model, prompts, 0, frozenset(), batch_size=64, progress=False)


@pytest.mark.parametrize("temperature, same", [(1.0, True), (1.6, False)], ids=["T1", "planted-T1.6"])
def test_sampled_tokens_follow_the_harness_distribution(target, harness_samples, temperature, same):
    """Independent samples (seeds N..2N-1): the engine at the harness's temperature passes at α; a
    planted bug (the engine samples at T = 1.6) must be rejected, so the test has power."""
    model, tok = target
    prompts = [data.Prompt(tok.encode(STORY), temperature, max_new_tokens=2)] * N
    got = engine_generate(model, prompts, N, frozenset(), progress=False)
    p = min(token_p_value([a[pos] for a in harness_samples], [a[pos] for a in got]) for pos in (0, 1))
    assert (p > ALPHA / 2) == same, f"p = {p:.2e}"          # Bonferroni over the two positions


def test_train_drafter_answers_flag_is_recorded_and_kept_on_resume(tmp_path, one_thread):
    """`specd train-drafter --answers`: both generators write the same data here (fp32 CPU, equal seeds),
    training.json names the one used, and --resume reports the generator of the reused data."""
    import json

    from specd.drafter.cli import main

    reports = {}
    for kind in ("engine", "harness"):
        out = tmp_path / kind
        argv = ["--target", str(STORIES), "--self-prompts", "6", "--method", "dspark", "--out", str(out),
                "--steps", "1", "--layers", "1", "--markov-rank", "8", "--max-new-tokens", "16", "--batch-size", "2",
                "--anchors", "2", "--holdout", "0.34", "--answers", kind]
        assert main(argv) == 0
        reports[kind] = json.loads((out / "training.json").read_text())["data"]
        assert reports[kind]["answers"] == kind
    assert reports["engine"]["answers_sha256"] == reports["harness"]["answers_sha256"]
    assert main(argv[:-1] + ["engine", "--resume"]) == 0      # the harness's data reused: still says harness
    assert json.loads((tmp_path / "harness" / "training.json").read_text())["data"]["answers"] == "harness"
