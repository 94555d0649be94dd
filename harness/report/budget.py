"""The report's "Error against the budget of keys" section: row cosine against the keys a
query attends to, for every sparse row (fixed and content-routed patterns: those with a
keys_per_query that are not exact there); none where the run has no such row."""

from __future__ import annotations

from harness.report import plots
from harness.report import tables as T
from harness.report.run import Run

TITLE = "Error against the budget of keys"


def blocks(run: Run) -> list[tuple]:
    rows = T.against_softmax(T.ok_rows(run.df))
    if "row_cos" not in rows.columns:
        return []
    rows = rows[(rows["pass"] == "forward") & rows["keys_per_query"].notna()
                & rows["row_cos"].notna() & (rows["exact"] != True)]  # noqa: E712
    if rows.empty:
        return []
    path = plots.budget_plot(rows, run.dir / "plots" / "error_vs_budget.png")
    return [("h", 2, TITLE),
            ("p", "Each sparse variant, fixed pattern (a window, a block layout) or routed by "
                  "content (top-k blocks, pages, keys), at the mean number of keys a query "
                  "attends to (results.csv keys_per_query) over the keys it could see; "
                  "forward rows. topk, the oracle, is the ceiling a k-sparse method can reach."),
            ("img", path, "error against the budget of keys")]
