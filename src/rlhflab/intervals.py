"""95 % intervals for pass rates and for the difference between two models: is a gain more than noise?

Pure Python (no torch, no scipy), so the torch-free report reads it as well as eval, compare and sweep.

- **A rate** (k of n prompts pass): the Wilson score interval (Wilson 1927). Unlike the
  normal-approximation interval it never leaves [0, 1] and is not zero-width at 0 / n or n / n.
- **Two models on the same prompts**: only the prompts where they disagree say which is better —
  `fixed` (the second passes, the first fails) and `broken` (the reverse). The difference in pass
  rate is (fixed − broken) / n; its interval is Agresti & Min's (2005): the Wald interval after
  adding 1/2 to each of the four cells of the paired 2 x 2 table. It accounts for the noise in how
  many prompts are discordant (an interval conditional on that count is too narrow and, at 60
  fixed / 0 broken, ends at the observed difference), and its coverage is close to 95 % down to
  small counts (Fagerland, Lydersen & Laake 2014 recommend it among the simple intervals). The
  exact McNemar p-value is reported beside it; the two agree on "beyond noise" except where p lies
  between 0.05 and ~0.07 (tests/test_intervals.py).
- **Two rates without per-prompt answers** (a run's first and last validation pass rate, runs
  of a sweep): Newcombe's hybrid score interval (Newcombe 1998, method 10) from the two Wilson
  intervals. It treats the two samples as independent; on the same prompts that is conservative.

`verdict(interval)` is the one rule every table and report uses: "better" only when the interval
of the difference lies above 0, "worse" only when below, otherwise "within noise".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Z95 = 1.959963984540054  # standard normal quantile at 0.975
ALPHA = 0.05
BETTER, WORSE, WITHIN_NOISE = "better", "worse", "within noise"


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95 % interval; n: the prompts (or pairs) it rests on."""

    estimate: float
    low: float
    high: float
    n: int

    def as_rate(self) -> dict:
        """summary.json's form of a rate's interval."""
        return {"rate": self.estimate, "low": self.low, "high": self.high, "n": self.n}

    def as_difference(self) -> dict:
        return {"difference": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval of successes / n; n == 0 gives the uninformative [0, 1] around NaN."""
    if n <= 0:
        return Interval(float("nan"), 0.0, 1.0, 0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends: no float dust below 0 / above 1
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Interval(p, low, high, n)


def rate_interval(rate: float, n: int) -> Interval:
    """Wilson interval of a rate stored without its count (summary.json): successes = round(rate * n)."""
    return wilson(min(n, max(0, round(rate * n))), n)


# --- exact binomial pieces (log space: m may be thousands of prompts) -------------------------------------


def _log_pmf(k: int, m: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == m else -math.inf
    return math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) + k * math.log(p) + (m - k) * math.log1p(-p)


def binomial_cdf(k: int, m: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(m, p)."""
    if k < 0:
        return 0.0
    if k >= m:
        return 1.0
    return min(1.0, sum(math.exp(_log_pmf(i, m, p)) for i in range(k + 1)))


def _solve_increasing(f, target: float) -> float:
    """The p in [0, 1] with f(p) = target, f increasing; bisection to ~1e-12."""
    lo, hi = 0.0, 1.0
    for _ in range(45):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, m: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Exact interval of a binomial proportion: P(X >= k; low) = P(X <= k; high) = alpha / 2."""
    if m <= 0:
        return 0.0, 1.0
    low = 0.0 if k == 0 else _solve_increasing(lambda p: 1.0 - binomial_cdf(k - 1, m, p), alpha / 2)
    high = 1.0 if k == m else _solve_increasing(lambda p: -binomial_cdf(k, m, p), -alpha / 2)
    return low, high


def mcnemar_p(fixed: int, broken: int) -> float:
    """Exact two-sided McNemar p-value: P(a split at least this lopsided) under Binomial(fixed + broken, 1/2)."""
    n, k = fixed + broken, min(fixed, broken)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


# --- differences ---------------------------------------------------------------------------------------------


def paired_difference(fixed: int, broken: int, n: int) -> Interval:
    """Interval of pass_rate(after) - pass_rate(before) on n shared prompts: Agresti-Min (module docstring)."""
    if n <= 0:
        return Interval(float("nan"), -1.0, 1.0, 0)
    if fixed + broken > n or fixed < 0 or broken < 0:
        raise ValueError(f"fixed {fixed} + broken {broken} must be counts within n = {n}")
    up, down, cells = fixed + 0.5, broken + 0.5, n + 2  # 1/2 added to each of the four cells
    centre = (up - down) / cells
    half = Z95 * math.sqrt((up + down) - (up - down) ** 2 / cells) / cells
    return Interval((fixed - broken) / n, max(-1.0, centre - half), min(1.0, centre + half), n)


def paired_counts(before: Sequence[bool], after: Sequence[bool]) -> dict:
    """Prompts `after` passes and `before` fails (fixed), the reverse (broken), McNemar's p and the
    interval of the difference in pass rate (after - before)."""
    if len(before) != len(after):
        raise ValueError(f"paired lists differ in length: {len(before)} vs {len(after)}")
    fixed = sum(1 for b, a in zip(before, after) if a and not b)
    broken = sum(1 for b, a in zip(before, after) if b and not a)
    diff = paired_difference(fixed, broken, len(before))
    return {"fixed": fixed, "broken": broken, "p_value": mcnemar_p(fixed, broken), **diff.as_difference()}


def unpaired_difference(before: Interval, after: Interval) -> Interval:
    """Newcombe's hybrid score interval of after.estimate - before.estimate from their Wilson intervals."""
    if before.n <= 0 or after.n <= 0:
        return Interval(float("nan"), -1.0, 1.0, 0)
    d = after.estimate - before.estimate
    low = d - math.sqrt((after.estimate - after.low) ** 2 + (before.high - before.estimate) ** 2)
    high = d + math.sqrt((after.high - after.estimate) ** 2 + (before.estimate - before.low) ** 2)
    return Interval(d, max(-1.0, low), min(1.0, high), min(before.n, after.n))


def _from_dict(found: dict | None, first: str) -> Interval | None:
    if not isinstance(found, dict):
        return None
    values = [found.get(k) for k in (first, "low", "high", "n")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return Interval(float(values[0]), float(values[1]), float(values[2]), int(values[3]))


def rate_from_dict(found: dict | None) -> Interval | None:
    """An Interval back from summary.json's {"rate", "low", "high", "n"}; None if absent or incomplete."""
    return _from_dict(found, "rate")


def difference_from_dict(found: dict | None) -> Interval | None:
    """An Interval back from summary.json's {"difference", "low", "high", "n"}; None if absent or incomplete."""
    return _from_dict(found, "difference")


# --- the rule, in words --------------------------------------------------------------------------------------


def verdict(diff: Interval) -> str:
    """"better" only when the interval lies above 0, "worse" only below, else "within noise"."""
    if diff.low > 0:
        return BETTER
    if diff.high < 0:
        return WORSE
    return WITHIN_NOISE


def points(diff: Interval) -> str:
    """'+6.7 pts [+1.3, +11.3]': a difference of rates and its interval, in percentage points."""
    def signed(x: float) -> str:
        return f"{100 * x + 0.0:+.1f}".replace("-0.0", "+0.0")  # no "-0.0" for a rounded zero

    return f"{signed(diff.estimate)} pts [{signed(diff.low)}, {signed(diff.high)}]"


def percent(rate: Interval, digits: int = 1) -> str:
    """'39.0% [33.6–44.6]': a rate and its interval."""
    if math.isnan(rate.estimate):
        return "—"
    return f"{rate.estimate:.{digits}%} [{100 * rate.low:.{digits}f}–{100 * rate.high:.{digits}f}]"
