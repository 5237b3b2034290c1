"""Student t quantiles, the mean of repetitions and the ratio estimator (gpuscout.domain.intervals) against tables and
hand-computed numbers; the arithmetic is in the comments."""

from __future__ import annotations

import pytest

from gpuscout.domain import intervals


# -- Student t ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        # two-sided 95 % critical values from any t table (e.g. NIST/SEMATECH e-Handbook table 1.3.6.7.2)
        (0.975, 1, 12.7062),
        (0.975, 2, 4.3027),
        (0.975, 4, 2.7764),
        (0.975, 10, 2.2281),
        (0.975, 30, 2.0423),
        (0.975, 120, 1.9799),
        (0.95, 5, 2.0150),
        (0.995, 3, 5.8409),
    ],
)
def test_t_quantile_matches_tables(p: float, df: int, expected: float) -> None:
    assert intervals.student_t_quantile(p, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_is_symmetric_and_tends_to_the_normal() -> None:
    assert intervals.student_t_quantile(0.025, 7) == pytest.approx(-intervals.student_t_quantile(0.975, 7))
    assert intervals.student_t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # z_0.975
    assert intervals.student_t_cdf(0.0, 3) == pytest.approx(0.5)
    # df = 1 is Cauchy: F(1) = 1/2 + atan(1)/pi = 0.75
    assert intervals.student_t_cdf(1.0, 1) == pytest.approx(0.75)


def test_t_quantile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        intervals.student_t_quantile(1.0, 3)
    with pytest.raises(ValueError):
        intervals.student_t_cdf(1.0, 0)


def test_mean_ci95_of_three_repetitions() -> None:
    # mean = 110, sample sd = sqrt((100 + 0 + 100) / 2) = 10, half width = t(0.975, 2) x 10 / sqrt(3)
    # = 4.302653 x 5.773503 = 24.8414
    mean, ci = intervals.mean_ci95([100.0, 110.0, 120.0])
    assert mean == 110.0
    assert ci is not None
    assert ci[0] == pytest.approx(110 - 24.8414, abs=1e-3)
    assert ci[1] == pytest.approx(110 + 24.8414, abs=1e-3)


def test_mean_ci95_needs_two_values_for_an_interval() -> None:
    assert intervals.mean_ci95([42.0]) == (42.0, None)
    with pytest.raises(ValueError):
        intervals.mean_ci95([])


def test_t_quantile_far_beyond_small_tables() -> None:
    # t(0.975, 40) = 2.0211 and t(0.975, 1000) = 1.9623 (tables; the normal's 1.95996 is the limit)
    assert intervals.student_t_quantile(0.975, 40) == pytest.approx(2.0211, abs=1e-4)
    assert intervals.student_t_quantile(0.975, 1000) == pytest.approx(1.9623, abs=1e-4)


def test_ratio_ci95_by_hand() -> None:
    # Equal step times: the ratio estimator is the plain mean. R = 36 / 3 = 12; residuals -2, 0, 2;
    # s = sqrt(8 / 2) = 2, se = 2 / sqrt(3) / mean(t) = 2 / sqrt(3); half-width = t(0.975, 2) = 4.302653 x se.
    mean, low, high = intervals.ratio_ci95([10.0, 12.0, 14.0], [1.0, 1.0, 1.0])
    assert mean == 12.0
    assert high - mean == pytest.approx(4.302653 * 2 / 3**0.5)
    assert mean - low == pytest.approx(high - mean)


def test_ratio_ci95_is_centred_on_total_over_total() -> None:
    # 6,000 tokens in 10 s (one slow 5 s step): R = 600, not the mean of per-step rates (~866.7)
    mean, low, high = intervals.ratio_ci95([1000.0] * 6, [1.0, 1.0, 1.0, 5.0, 1.0, 1.0])
    assert mean == pytest.approx(600.0)
    assert low < mean < high
    assert intervals.ratio_ci95([5.0], [2.0]) == (2.5, 2.5, 2.5)  # one pair: no spread to estimate
    with pytest.raises(ValueError):
        intervals.ratio_ci95([1.0], [0.0])
    with pytest.raises(ValueError):
        intervals.ratio_ci95([1.0, 2.0], [1.0])
