"""The report's "Crossover lengths" section: per setting, the length from which each variant
stays faster and lighter than each exact path (tables.crossover_table)."""

from __future__ import annotations

from harness.report import tables as T
from harness.report.run import Run

TITLE = "Crossover lengths"


def blocks(run: Run) -> list[tuple]:
    out: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "Smallest N from which the variant stays faster (lighter) than each exact "
              "path, interpolated in log-log space between measured lengths. "
              "\"always\": at every measured length; \"beyond range (> N)\": not yet at "
              "the largest measured length.")]
    for setting, g in run.df.groupby("setting", sort=False):
        table = T.crossover_table(g)
        if not table.empty:
            out += [("h", 3, setting), ("table", table)]
    return out
