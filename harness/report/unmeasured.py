"""The report's "Cases not measured" section: every case of results.csv that did not run
(skipped, oom, timeout, error, nonfinite), with its reason."""

from __future__ import annotations

from harness.report import tables as T
from harness.report.run import Run

TITLE = "Cases not measured"


def blocks(run: Run) -> list[tuple]:
    if run.results is None:
        return []
    status = T.status_table(run.rows)
    return [("h", 2, TITLE),
            ("p", "Every skipped, oom, timeout, error and nonfinite case, with its reason."
                  if not status.empty else "None: every case ran."), ("table", status)]
