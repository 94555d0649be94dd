"""analysis.py on synthetic numbers whose answers are known by construction."""

import math

import numpy as np
import pytest

from harness.report.analysis import classify_change, crossover, loglog_slope, pareto_front

N = np.array([256, 512, 1024, 2048, 4096, 8192, 16384])


@pytest.mark.parametrize("k", [1, 2, 1.5])
def test_slope_of_a_power_law_is_its_exponent(k):
    assert loglog_slope(N, 3.7e-4 * N ** k) == pytest.approx(k, abs=1e-9)


def test_slope_ignores_missing_and_needs_two_lengths():
    t = 2.0 * N ** 2.0
    t_missing = t.copy()
    t_missing[[1, 4]] = np.nan
    assert loglog_slope(N, t_missing) == pytest.approx(2.0)
    assert loglog_slope([1024], [5.0]) is None
    assert loglog_slope([1024, 1024], [5.0, 6.0]) is None


def test_crossover_of_two_power_laws_is_exact():
    # a = 3000 N (linear), b = N^2 (quadratic): equal at N = 3000, a below b beyond it.
    c = crossover(N, 3000.0 * N, N.astype(float) ** 2)
    assert c.kind == "at"
    assert c.n == pytest.approx(3000, rel=1e-12)
    assert c.text() == "3,000"


def test_crossover_at_a_measured_length_and_unsorted_input():
    order = np.random.default_rng(0).permutation(len(N))
    c = crossover(N[order], (1024.0 * N)[order], (N.astype(float) ** 2)[order])
    assert c.kind == "at" and c.n == pytest.approx(1024)


def test_always_faster_and_never_faster():
    always = crossover(N, 0.5 * N, N.astype(float))
    assert always.kind == "always" and "always" in always.text()
    # Same exponent, a always 2x slower: the gap never closes, nothing to extrapolate.
    never = crossover(N, 2.0 * N, N.astype(float))
    assert never.kind == "beyond" and never.n is None
    assert never.text() == "beyond range (> 16384)"


def test_beyond_range_extrapolates_a_closing_gap():
    # Crossing at 65536, past the measured 16384: said as beyond range, with the estimate.
    c = crossover(N, 65536.0 * N, N.astype(float) ** 2)
    assert c.kind == "beyond" and c.n == pytest.approx(65536)
    assert c.text().startswith("beyond range (> 16384")


def test_crossover_uses_the_last_crossing_when_lines_wiggle():
    a = np.array([1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    b = np.array([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    c = crossover(N, a, b)
    # faster at 256, slower at 512, faster from between 512 and 1024 on
    assert c.kind == "at" and 512 < c.n < 1024
    expected = math.exp(math.log(512) + math.log(3 / 2) / math.log(3) * math.log(2))
    assert c.n == pytest.approx(expected)


def test_crossover_with_no_data():
    assert crossover([], [], []).kind == "none"


def test_pareto_front():
    cost = [1, 2, 3, 4, 2]
    err = [0.5, 0.1, 0.2, 0.01, 0.1]
    assert pareto_front(cost, err).tolist() == [True, True, False, True, True]


@pytest.mark.parametrize("a,a_iqr,b,b_iqr,want", [
    (10.0, 0.1, 20.0, 0.1, "regression"),     # 2x slower, little noise
    (10.0, 0.1, 5.0, 0.1, "improvement"),
    (10.0, 4.0, 13.0, 4.0, ""),                # 30% slower but inside the runs' IQRs
    (10.0, 0.01, 10.5, 0.01, ""),              # beyond the noise but under 10%
    (10.0, float("nan"), 12.0, float("nan"), "regression"),
    (float("nan"), 0.1, 12.0, 0.1, ""),
])
def test_classify_change(a, a_iqr, b, b_iqr, want):
    assert classify_change(a, a_iqr, b, b_iqr, 0.10) == want
