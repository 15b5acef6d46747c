"""The prefetch budget's recompute price (specd/engine/prefill_rate.py) is the marginal cost of a token in a
prefill step: the slope of step time against new tokens, not the step's time shared by its tokens."""
from __future__ import annotations

import pytest

from specd.engine.prefill_rate import MIN_SLOPE_FRACTION, PrefillRate

FIXED_S, PER_TOKEN_S = 0.015, 8e-6   # an eager step's launches, then ~125k tokens/s (H200-like)


def _fed(counts) -> PrefillRate:
    rate = PrefillRate(block_size=16)
    for n in counts:
        rate.observe(n, FIXED_S + PER_TOKEN_S * n)
    return rate


def test_nothing_measured_no_price():
    rate = PrefillRate(16)
    rate.observe(32, 0.007)          # a decode step (< MIN_TOKENS): launch-bound, says nothing
    assert rate.block_seconds() is None and rate.tokens_per_s is None


def test_the_price_is_the_slope_once_step_sizes_spread():
    rate = _fed([72, 4096, 500, 2048, 130, 3000] * 3)
    assert rate.block_seconds() == pytest.approx(16 * PER_TOKEN_S, rel=1e-6)
    assert rate.tokens_per_s == pytest.approx(1 / PER_TOKEN_S, rel=1e-6)
    # the old price (seconds / token, averaged) charged the fixed part to every token: many times higher
    assert rate.average_s > 5 * PER_TOKEN_S


def test_equal_step_sizes_fall_back_to_the_average():
    rate = _fed([1024] * 10)
    assert rate.block_seconds() == pytest.approx(16 * (FIXED_S / 1024 + PER_TOKEN_S), rel=1e-6)


def test_the_slope_is_bounded_by_the_average_and_a_tenth_of_it():
    rate = PrefillRate(16)
    for n in [100, 4000] * 5:        # bigger steps faster: a noisy negative slope
        rate.observe(n, 0.05 - 1e-5 * n)
    assert rate.token_seconds() == pytest.approx(MIN_SLOPE_FRACTION * rate.average_s)
    steep = PrefillRate(16)
    for n in [100, 4000] * 5:        # no fixed part at all, superlinear: never above the average
        steep.observe(n, 1e-9 * n * n)
    assert steep.token_seconds() <= steep.average_s
