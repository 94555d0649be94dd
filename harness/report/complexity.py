"""The report's "Empirical complexity" section: each variant's log-log slopes of time and
memory against N (tables.slope_table)."""

from __future__ import annotations

from harness.report import tables as T
from harness.report.run import Run

TITLE = "Empirical complexity"


def blocks(run: Run) -> list[tuple]:
    return [("h", 2, TITLE),
            ("p", "Least-squares slope k of log(metric) against log(N) over each variant's "
                  "ok lengths (time ~ N^k); median over input distributions."),
            ("table", T.slope_table(run.df))]
