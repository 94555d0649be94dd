"""The report's "Error per layer on captured inputs" section (captured.layer_tables)."""

from __future__ import annotations

from harness.report import captured as RC
from harness.report import tables as T
from harness.report.run import Run

TITLE = "Error per layer on captured inputs"


def blocks(run: Run) -> list[tuple]:
    tables = RC.layer_tables(T.against_softmax(run.df))
    out: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "rel_err of each variant on each model layer's own q, k, v (layers "
              "differ: attention sharpens or spreads with depth), then over all "
              "layers, and the mean row cosine." if tables else
              "No captured inputs in this run (inputs = [\"minilm\"] adds them).")]
    for title, table in tables:
        out += [("h", 3, title), ("table", table)]
    return out
