"""The report's "Variant settings" section: each label with its variant's full parameters."""

from __future__ import annotations

from harness.report import captured as RC
from harness.report.run import Run

TITLE = "Variant settings"


def blocks(run: Run) -> list[tuple]:
    if run.results is None:
        return []
    return [("h", 2, TITLE),
            ("p", "Labels name only the parameters that tell a variant's settings in this "
                  "run apart; here is each one in full."), ("table", RC.settings_table(run.rows))]
