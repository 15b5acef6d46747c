"""argparse types shared by the bench commands."""
from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: the distinct values, sorted; every one a positive integer (concurrency
    levels, batch sizes)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list of integers {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be positive integers")
    return values


def positive_int(text: str) -> int:
    """argparse type: one integer >= 1."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def non_negative_int(text: str) -> int:
    """argparse type: one integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def fraction(text: str) -> float:
    """argparse type: one number in (0, 1) (a relative width, a share)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: must lie between 0 and 1 (0.005 is ±0.5%)")
    return value


def non_negative_floats(text: str) -> list[float]:
    """'0.1,0.5' -> [0.1, 0.5]: in the order given, each a number >= 0 (cost fractions)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list of numbers {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be numbers >= 0")
    return values
