import argparse

import pytest

from bench.arg_types import non_negative_int, positive_int, positive_ints


def test_positive_ints_sorts_and_dedups_and_refuses_bad_lists():
    assert positive_ints("32,1,8,8") == [1, 8, 32]
    for bad in ("a,1", "0,1", "", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)


def test_positive_int_takes_one_value():
    assert positive_int("4") == 4
    for bad in ("0", "2,3", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_non_negative_int_takes_zero_and_refuses_negatives():
    assert non_negative_int("0") == 0 and non_negative_int("4") == 4
    for bad in ("-1", "x", "2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            non_negative_int(bad)
