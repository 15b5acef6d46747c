"""anchor_rows: the padded anchor grid both batched training forwards share, and its range checks."""
import pytest
import torch

from specd.drafter.anchor_rows import anchor_rows
from specd.drafter.base import DrafterError


def _seq(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(t, 4), torch.arange(t)


def test_rows_are_padded_with_pad_and_marked_real():
    (c1, t1), (c2, t2) = _seq(6), _seq(9)
    rows = anchor_rows([c1, c2], [t1, t2], [torch.tensor([1, 3]), torch.tensor([2, 4, 8])],
                       lo=0, tail=0, pad=7, what="x")
    assert rows.anchor.tolist() == [[1, 3, 7], [2, 4, 8]]
    assert rows.real.tolist() == [[True, True, False], [True, True, True]]
    assert rows.counts == [2, 3]


@pytest.mark.parametrize("lo,tail,bad", [(0, 0, 6), (1, 0, 0), (1, 2, 4), (0, 0, -1)])
def test_out_of_range_anchors_are_refused(lo, tail, bad):
    c, t = _seq(6)           # valid anchors: lo .. 5 - tail
    with pytest.raises(DrafterError, match=r"anchors in"):
        anchor_rows([c], [t], [torch.tensor([lo, bad])], lo=lo, tail=tail, pad=lo, what="x")
    anchor_rows([c], [t], [torch.tensor([lo, 5 - tail])], lo=lo, tail=tail, pad=lo, what="x")   # the bounds pass


def test_empty_and_mismatched_inputs_are_refused():
    c, t = _seq(5)
    with pytest.raises(DrafterError, match="anchors in"):
        anchor_rows([c], [t], [torch.tensor([], dtype=torch.int64)], lo=0, tail=0, pad=0, what="x")
    with pytest.raises(DrafterError, match="anchor rows"):
        anchor_rows([c, c], [t, t], [torch.tensor([1])], lo=0, tail=0, pad=0, what="x")
    with pytest.raises(DrafterError, match="positions"):
        anchor_rows([torch.zeros(4, 4)], [t], [torch.tensor([1])], lo=0, tail=0, pad=0, what="x")
    with pytest.raises(DrafterError):
        anchor_rows([], [], [], lo=0, tail=0, pad=0, what="x")
