"""rlhflab.intervals against hand-worked values and brute-force references; the one "better / within noise" rule."""

import math
from pathlib import Path

import pytest

from rlhflab.intervals import (Interval, _log_pmf, binomial_cdf, clopper_pearson, difference_from_dict, mcnemar_p,
                               paired_counts, paired_difference, percent, points, rate_from_dict, rate_interval,
                               unpaired_difference, verdict, wilson)

Z = 1.959963984540054


def test_wilson_against_hand_worked_values():
    seven = wilson(7, 10)  # p = .7: centre (.7 + z²/20) / (1 + z²/10) = .6447, half-width .2477
    assert (seven.low, seven.high) == pytest.approx((0.39678, 0.89221), abs=1e-5)
    none = wilson(0, 300)  # 0 of n: [0, z² / (n + z²)]
    assert none.low == 0.0 and none.high == pytest.approx(Z**2 / (300 + Z**2)) == pytest.approx(0.012643, abs=1e-6)
    every = wilson(300, 300)
    assert every.high == 1.0 and every.low == pytest.approx(1 - none.high)
    half = wilson(150, 300)  # the width the 300-prompt splits buy: about ±5.6 points at 50 % (±9.7 with 100)
    assert half.high - 0.5 == pytest.approx(0.0562, abs=1e-4) and wilson(50, 100).high - 0.5 == pytest.approx(0.0962, abs=1e-4)
    assert rate_interval(0.39, 100) == wilson(39, 100)
    assert math.isnan(wilson(0, 0).estimate) and (wilson(0, 0).low, wilson(0, 0).high) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"successes must be in \[0, 10\], got 11"):
        wilson(11, 10)


def test_clopper_pearson_closed_forms_and_a_table_value():
    assert clopper_pearson(7, 10) == pytest.approx((0.34755, 0.93326), abs=1e-5)  # standard tables
    for m in (1, 5, 30):  # all successes: lower = (α/2)^(1/m); none: upper = 1 - (α/2)^(1/m)
        assert clopper_pearson(m, m) == pytest.approx((0.025 ** (1 / m), 1.0), abs=1e-9)
        assert clopper_pearson(0, m) == pytest.approx((0.0, 1 - 0.025 ** (1 / m)), abs=1e-9)


def test_mcnemar_against_hand_worked_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(5, 0) == 2 / 32  # all 5 discordant prompts one way: 2 * (1/2)^5
    assert mcnemar_p(3, 1) == mcnemar_p(1, 3) == 2 * (1 + 4) / 16


def _agresti_min(fixed: int, broken: int, n: int) -> tuple[float, float]:
    """Agresti & Min (2005) by the book: add 1/2 to each cell a, b, c, d; Wald interval of (c - b) / n."""
    concordant = n - fixed - broken
    a = d = concordant / 2 + 0.5  # only a + d enters the formula
    b, c = broken + 0.5, fixed + 0.5
    total = a + b + c + d
    p12, p21 = b / total, c / total
    se = math.sqrt((p12 + p21 - (p21 - p12) ** 2) / total)
    return max(-1.0, (p21 - p12) - Z * se), min(1.0, (p21 - p12) + Z * se)  # a difference of rates: within [-1, 1]


@pytest.mark.parametrize("fixed, broken, n", [(7, 2, 12), (0, 3, 12), (5, 5, 20), (9, 0, 10), (60, 0, 300)])
def test_paired_difference_is_agresti_min(fixed, broken, n):
    diff = paired_difference(fixed, broken, n)
    assert diff.estimate == pytest.approx((fixed - broken) / n)
    assert (diff.low, diff.high) == pytest.approx(_agresti_min(fixed, broken, n), abs=1e-12)


def test_paired_interval_hand_worked_and_not_stuck_at_the_estimate():
    # 60 fixed, 0 broken of 300: centre 60 / 302 = .19868, se sqrt(61 - 60² / 302) / 302 = .023198
    sixty = paired_difference(60, 0, 300)
    assert (sixty.low, sixty.high) == pytest.approx((0.15321, 0.24414), abs=1e-5)
    assert sixty.high > sixty.estimate  # the discordance rate is noisy too: the far end is not the observed value
    none = paired_difference(0, 0, 300)  # identical answers: a narrow interval around 0, not zero-width
    assert none.low == pytest.approx(-Z / 302) and points(none) == "+0.0 pts [-0.6, +0.6]"


def test_paired_interval_agrees_with_exact_mcnemar_away_from_the_boundary():
    for fixed in range(61):
        for broken in range(61 - fixed):
            excludes_zero = verdict(paired_difference(fixed, broken, 300)) != "within noise"
            p = mcnemar_p(fixed, broken)
            if p < 0.05:
                assert excludes_zero, (fixed, broken, p)
            elif p >= 0.075:
                assert not excludes_zero, (fixed, broken, p)


def test_paired_counts_from_verdicts():
    before = [True, True, False, False, True, False]
    after = [True, False, True, True, True, True]  # fixed 3 (prompts 2, 3, 5), broken 1 (prompt 1)
    counts = paired_counts(before, after)
    assert (counts["fixed"], counts["broken"], counts["n"]) == (3, 1, 6)
    assert counts["difference"] == pytest.approx(2 / 6) and counts["p_value"] == mcnemar_p(3, 1)
    assert (counts["low"], counts["high"]) == pytest.approx(_agresti_min(3, 1, 6), abs=1e-12)
    with pytest.raises(ValueError, match="differ in length"):
        paired_counts([True], [True, False])


def test_newcombe_unpaired_difference_against_the_published_example():
    # Newcombe (1998), Statistics in Medicine 17:873, Table II: 56/70 - 48/80, method 10: 0.0524 to 0.3339
    diff = unpaired_difference(wilson(48, 80), wilson(56, 70))
    assert diff.estimate == pytest.approx(0.2)
    assert (diff.low, diff.high) == pytest.approx((0.0524, 0.3339), abs=1e-4)


def test_the_rule_on_300_prompts_small_gain_is_noise_large_gain_is_better():
    small = paired_difference(20, 14, 300)  # +2 points: 20 prompts fixed, 14 broken
    assert verdict(small) == "within noise" and points(small) == "+2.0 pts [-1.8, +5.8]"
    large = paired_difference(60, 15, 300)  # +15 points
    assert verdict(large) == "better" and large.low > 0.09
    assert verdict(paired_difference(15, 60, 300)) == "worse"
    assert verdict(paired_difference(0, 0, 300)) == "within noise"  # identical answers: nothing to call
    assert percent(wilson(109, 300)) == "36.3% [31.1–41.9]"
    assert percent(Interval(float("nan"), 0.0, 1.0, 0)) == "—"


def test_eval_tables_carry_intervals_beside_the_old_keys():
    from rlhflab.eval import format_table, table_from_rows

    rows = [{"family": "lowercase", "passed": i < 7, "kind": "pass" if i < 7 else "wrong_case"} for i in range(10)]
    rows += [{"family": "yes_no", "passed": False, "kind": "wrong_content"} for _ in range(290)]
    table = table_from_rows(rows)
    assert table["overall"] == pytest.approx(7 / 300) and table["per_family"]["lowercase"] == 0.7  # as before
    assert table["intervals"]["lowercase"] == wilson(7, 10).as_rate()
    assert table["intervals"]["yes_no"] == {"rate": 0.0, "low": 0.0, "high": pytest.approx(Z**2 / (290 + Z**2)), "n": 290}
    assert table["intervals"]["overall"]["n"] == 300
    text = format_table({"sft": table})
    assert "70% [40–89]   (n=10)" in text and "2.3% [1.1–4.7]   (n=300)" in text


def test_sweep_table_judges_every_value_against_the_best_with_the_same_rule():
    from rlhflab.sweep import SweepPlan, SweepRun, format_sweep_table, table_rows

    def run(label, end):
        return SweepRun(label, Path(label), {"validation_pass_rate": {"start": 0.3, "end": end}}, 1.0, held_out_n=300)

    runs = [run("0.1", 0.40), run("0.2", 0.62), run("0.3", 0.58)]
    rows = table_rows("ppo", runs)
    assert rows[1]["vs_best"]["difference"] == 0 and rows[0]["vs_best"]["verdict"] == "worse"
    assert rows[2]["vs_best"]["verdict"] == "within noise"  # 4 points on 300 prompts
    assert rows[0]["held_out_interval"] == rate_interval(0.40, 300).as_rate()
    text = format_sweep_table(SweepPlan("ppo", "cliprange", ("0.1", "0.2", "0.3"), (), Path(".")), runs)
    assert "62.0% [56.4–67.3]" in text and "best" in text
    assert text.splitlines()[-1].startswith("cliprange=0.2 has the best held-out number; better beyond noise than 0.1; "
                                            "within noise of 0.3")


# --- the edges (issue 36: mutants of intervals.py that the cases above let through) ---------------------------------


def test_a_stored_rate_of_zero_or_one_is_rebuilt_as_zero_or_every_prompt():
    assert rate_interval(0.0, 300) == wilson(0, 300) and rate_interval(0.0, 300).estimate == 0.0  # not 1 / 300
    assert rate_interval(1.0, 300) == wilson(300, 300)
    assert rate_interval(1.2, 10) == wilson(10, 10) and rate_interval(-0.1, 10) == wilson(0, 10)  # clamped counts
    assert rate_from_dict(wilson(7, 10).as_rate()) == wilson(7, 10)
    assert difference_from_dict(paired_difference(3, 1, 6).as_difference()) == paired_difference(3, 1, 6)
    for bad in (None, [], {"rate": 0.5, "low": 0.4, "high": 0.6}, {"rate": True, "low": 0.0, "high": 1.0, "n": 3},
                {"rate": None, "low": 0.0, "high": 1.0, "n": 3}, {"rate": "0.5", "low": 0.0, "high": 1.0, "n": 3}):
        assert rate_from_dict(bad) is None, bad


def test_every_prompt_flipping_is_a_valid_pair_of_counts():
    # 4 fixed, 6 broken of 10: a + d = 1 after adding the halves; centre (4.5 - 6.5) / 12, se sqrt(11 - 4/12) / 12
    flips = paired_difference(4, 6, 10)
    assert flips.estimate == pytest.approx(-0.2)
    assert (flips.low, flips.high) == pytest.approx((-1 / 6 - Z * math.sqrt(32 / 3) / 12, -1 / 6 + Z * math.sqrt(32 / 3) / 12))
    assert (flips.low, flips.high) == pytest.approx((-0.70010, 0.36677), abs=1e-5)
    # all 10 fixed: centre 10 / 12, se sqrt(11 - 100/12) / 12; the upper end clamped to 1, and the reverse to -1
    every = paired_difference(10, 0, 10)
    assert (every.estimate, every.high) == (1.0, 1.0) and every.low == pytest.approx(10 / 12 - Z * math.sqrt(8 / 3) / 12)
    worst = paired_difference(0, 10, 10)
    assert (worst.estimate, worst.low) == (-1.0, -1.0) and worst.high == pytest.approx(-every.low)
    one = paired_difference(0, 0, 1)  # a single shared prompt is an interval, not "no data": ±z / 3
    assert (one.estimate, one.low, one.high, one.n) == (0.0, pytest.approx(-Z / 3), pytest.approx(Z / 3), 1)
    empty = paired_difference(0, 0, 0)
    assert math.isnan(empty.estimate) and (empty.low, empty.high, empty.n) == (-1.0, 1.0, 0)
    for fixed, broken, n in [(4, 3, 5), (-1, 2, 5), (2, -1, 5), (6, 0, 5)]:
        with pytest.raises(ValueError, match=f"fixed {fixed} \\+ broken {broken} must be counts within n = {n}"):
            paired_difference(fixed, broken, n)


def test_unpaired_difference_of_an_empty_sample_is_uninformative_and_of_one_prompt_is_not():
    for before, after in [(wilson(0, 0), wilson(3, 10)), (wilson(3, 10), wilson(0, 0))]:
        empty = unpaired_difference(before, after)
        assert math.isnan(empty.estimate) and (empty.low, empty.high, empty.n) == (-1.0, 1.0, 0)
    stored = Interval(0.5, 0.2, 0.8, 0)  # a rate read back from a summary.json with n = 0: no interval either
    for before, after in [(stored, wilson(3, 10)), (wilson(3, 10), stored)]:
        empty = unpaired_difference(before, after)
        assert math.isnan(empty.estimate) and (empty.low, empty.high, empty.n) == (-1.0, 1.0, 0)
    assert unpaired_difference(wilson(3, 10), wilson(1, 1)).n == 1
    one = unpaired_difference(wilson(1, 1), wilson(3, 10))  # Newcombe from the two Wilson intervals, n the smaller
    assert one.estimate == pytest.approx(-0.7) and one.n == 1
    assert one.low == pytest.approx(-0.7 - math.sqrt((0.3 - wilson(3, 10).low) ** 2 + (1.0 - 1.0) ** 2))
    assert one.high == pytest.approx(-0.7 + math.sqrt((wilson(3, 10).high - 0.3) ** 2 + (1 - wilson(1, 1).low) ** 2))


def test_the_exact_pieces_at_their_ends():
    assert _log_pmf(0, 5, 0.0) == 0.0 and _log_pmf(1, 5, 0.0) == -math.inf  # p = 0: surely no success
    assert _log_pmf(5, 5, 1.0) == 0.0 and _log_pmf(4, 5, 1.0) == -math.inf  # p = 1: surely all
    assert _log_pmf(2, 4, 0.5) == pytest.approx(math.log(6 / 16))
    assert binomial_cdf(-1, 5, 0.5) == 0.0 and binomial_cdf(2, 4, 0.5) == pytest.approx(11 / 16)
    assert binomial_cdf(7, 7, 0.3) == 1.0  # exactly: the sum of the 8 terms is 0.9999999999999998
    assert binomial_cdf(6, 7, 0.002) == 1.0  # clamped: the sum of the 7 terms is 1.0000000000000002
    assert binomial_cdf(0, 3, 0.0) == 1.0 and binomial_cdf(2, 3, 1.0) == 0.0
    assert clopper_pearson(0, 0) == (0.0, 1.0)
    assert clopper_pearson(0, 5)[0] == 0.0 and clopper_pearson(5, 5)[1] == 1.0  # exact ends, not 1e-14 off
    assert mcnemar_p(2, 2) == 1.0 and mcnemar_p(1, 0) == 1.0  # 2 x 11/16 clamped to 1


def test_an_interval_touching_zero_is_within_noise_and_a_rounded_zero_has_no_sign():
    assert verdict(Interval(0.1, 0.0, 0.2, 10)) == "within noise"  # "better" only strictly above 0
    assert verdict(Interval(-0.1, -0.2, 0.0, 10)) == "within noise"
    assert points(Interval(-0.0004, -0.0004, -0.0, 1)) == "+0.0 pts [+0.0, +0.0]"  # -0.04 points rounds to 0

