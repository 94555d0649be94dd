"""The report's "Achieved GFLOP/s" section: analytic FLOPs over the median time, against the
matmul rate meta.json records for the same device and dtype."""

from __future__ import annotations

from harness.report import plots
from harness.report import tables as T
from harness.report.run import Run, with_lines

TITLE = "Achieved GFLOP/s"


def blocks(run: Run) -> list[tuple]:
    rates = T.matmul_rates(run.meta)
    table = T.gflops_table(run.df, rates)
    slow = int((table["flag"] != "").sum()) if "flag" in table else 0
    out: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "Analytic FLOPs over the median time, best over lengths, set against "
              "the matmul rate measured on the same device in the same dtype: "
              + (T.matmul_note(run.meta) + "." if rates else "not recorded in meta.json.")
              + (f" {slow} of {len(table)} rows run below half of it (flagged)."
                 if rates else "")),
        ("table", table)]
    view = run.view
    if not view.empty:
        key = f"{view.iloc[0]['device']} {view.iloc[0]['dtype']}"
        ok = with_lines(T.ok_rows(run.df))
        out.append(("img", plots.gflops_plot(ok, rates.get(key),
                                             run.dir / "plots" / "gflops.png", f"{key} matmul"),
                    "achieved GFLOP/s"))
    return out
