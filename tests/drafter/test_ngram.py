import torch

from specd.drafter import DrafterConfig, build_drafter


def _ngram(target, gamma=4):
    return build_drafter(DrafterConfig.for_target(target[0].config, "ngram", gamma=gamma))


def test_longest_suffix_wins_and_most_recent_occurrence(target):
    ngram = _ngram(target)
    # suffix [7, 8, 9] occurred once (-> 1, 2); the 1-gram [9] alone last preceded 5
    history = [7, 8, 9, 1, 2, 3, 9, 5, 6, 7, 8, 9]
    assert ngram.propose(history) == [1, 2, 3, 9]
    assert ngram.propose([4, 1, 2, 4, 3, 3, 4]) == [3, 3, 4]      # most recent earlier [4] -> 3, 3, 4


def test_draft_lengths_and_one_hot_probs(target):
    ngram = _ngram(target, gamma=3)
    out = ngram.draft([[1, 2, 3, 1, 2], [5, 6, 7], [9, 9]], [], [])
    assert out.tokens[0].tolist() == [3, 1, 2] and out.lengths.tolist() == [3, 0, 1]
    assert out.tokens[2, 0] == 9
    assert out.probs.shape == (3, 3, 512)
    assert torch.equal(out.probs.argmax(-1), out.tokens) and torch.equal(out.probs.sum(-1), torch.ones(3, 3))
    assert out.confidence is None and ngram.num_parameters() == 0
