"""Pure functions on measured numbers: log-log slope, crossover length, Pareto front, change flags.

No I/O and no plotting here, so each answer can be checked on synthetic data whose answer is
known (tests/test_report_analysis.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

EXTRAPOLATE_MAX = 64  # how far past the largest length a crossover is extrapolated


def loglog_slope(n: Sequence[float], y: Sequence[float]) -> float | None:
    """Least-squares slope of log y against log n: the empirical exponent (y ~ c * n^slope).

    Only positive, finite pairs count; None when fewer than two distinct lengths remain.
    """
    n, y = np.asarray(n, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(n) & np.isfinite(y) & (n > 0) & (y > 0)
    n, y = n[keep], y[keep]
    if len(np.unique(n)) < 2:
        return None
    slope, _ = np.polyfit(np.log(n), np.log(y), 1)
    return float(slope)


@dataclasses.dataclass(frozen=True)
class Crossover:
    """Where a variant starts beating a reference. kind: always | at | beyond | none."""
    kind: str
    n: float | None = None      # the crossing length (kind "at"), or an extrapolation ("beyond")
    n_min: float | None = None  # the measured range
    n_max: float | None = None

    def text(self) -> str:
        if self.kind == "none":
            return "n/a"
        if self.kind == "always":
            return f"always (≤ {self.n_min:g})"
        if self.kind == "at":
            return f"{self.n:,.0f}"
        if self.n is not None:
            return f"beyond range (> {self.n_max:g}; extrapolated ~{self.n:,.0f})"
        return f"beyond range (> {self.n_max:g})"


def crossover(n: Sequence[float], a: Sequence[float], b: Sequence[float]) -> Crossover:
    """Smallest length from which `a` stays below `b` (a faster or lighter than b).

    n are the lengths where both were measured. Between the last length where a >= b and
    the next, log(a/b) is interpolated linearly in log n, so two power laws crossing at
    N* give exactly N*. "always": a < b at every measured length. "beyond": a >= b at the
    largest length; when the last two lengths show the gap closing, the log-log line
    through them is extrapolated to where it would cross (if within EXTRAPOLATE_MAX x).
    """
    n, a, b = (np.asarray(x, dtype=float) for x in (n, a, b))
    keep = np.isfinite(n) & np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    n, a, b = n[keep], a[keep], b[keep]
    if len(n) == 0:
        return Crossover("none")
    order = np.argsort(n)
    n, d = n[order], np.log(a[order]) - np.log(b[order])  # d < 0: a is below b
    lo, hi = float(n[0]), float(n[-1])
    if d[-1] >= 0:
        if len(n) >= 2 and d[-2] - d[-1] > 1e-9:
            x0, x1 = math.log(n[-2]), math.log(n[-1])
            x = x1 + d[-1] * (x1 - x0) / (d[-2] - d[-1])
            # Farther than 64x the range end, a two-point extrapolation says nothing.
            if x - x1 <= math.log(EXTRAPOLATE_MAX):
                return Crossover("beyond", math.exp(x), lo, hi)
        return Crossover("beyond", None, lo, hi)
    i = len(d) - 1  # first index of the final run where a < b
    while i > 0 and d[i - 1] < 0:
        i -= 1
    if i == 0:
        return Crossover("always", None, lo, hi)
    x0, x1 = math.log(n[i - 1]), math.log(n[i])
    t = d[i - 1] / (d[i - 1] - d[i])
    return Crossover("at", math.exp(x0 + t * (x1 - x0)), lo, hi)


def pareto_front(cost: Sequence[float], err: Sequence[float]) -> np.ndarray:
    """Bool mask of points no other point beats on both cost and error (lower is better).

    A point is dominated if another has cost <= and err <= with one strictly lower;
    exact duplicates both stay on the front.
    """
    c, e = np.asarray(cost, dtype=float), np.asarray(err, dtype=float)
    on = np.ones(len(c), dtype=bool)
    for i in range(len(c)):
        worse = (c <= c[i]) & (e <= e[i]) & ((c < c[i]) | (e < e[i]))
        on[i] = not worse.any()
    return on


def classify_change(a: float, a_iqr: float, b: float, b_iqr: float,
                    threshold: float = 0.10) -> str:
    """"regression" / "improvement" / "" for a median moving from a to b (lower is better).

    Flagged only if the change exceeds BOTH the relative threshold (|b - a| > threshold * a)
    and the noise of the two runs (|b - a| > iqr_a + iqr_b); a missing IQR counts as 0.
    """
    if not (np.isfinite(a) and np.isfinite(b)) or a <= 0:
        return ""
    noise = sum(x for x in (a_iqr, b_iqr) if np.isfinite(x))
    delta = b - a
    if abs(delta) <= threshold * a or abs(delta) <= noise:
        return ""
    return "regression" if delta > 0 else "improvement"
