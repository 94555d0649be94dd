"""The report's "Time, memory and error by length" section: per setting, variant x N tables
of time, memory and error, and their ratios to the exact paths."""

from __future__ import annotations

from harness.report import tables as T
from harness.report.run import Run

TITLE = "Time, memory and error by length"


def blocks(run: Run) -> list[tuple]:
    out: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "Cells hold the median where the case ran, else its status. Ratio tables "
              "hold the value over sdpa's / over standard's in the same setting.")]
    for setting, g in run.df.groupby("setting", sort=False):
        out += [("h", 3, setting),
                ("p", "time_ms"), ("table", T.metric_pivot(g, "time_ms")),
                ("p", "time ratio"), ("table", T.ratio_pivot(g, "time_ms")),
                ("p", "peak_mem_mib"), ("table", T.metric_pivot(g, "peak_mem_mib")),
                ("p", "memory ratio"), ("table", T.ratio_pivot(g, "peak_mem_mib"))]
        if (T.ok_rows(g)["state_mib"] > 0.5).any():  # a variant keeps a mask or features
            out += [("p", "state_mib (kept between calls, beside each call's peak)"),
                    ("table", T.metric_pivot(g, "state_mib"))]
        for rows, ref in ((T.against_softmax(g), "float64 exact attention"),
                          (T.against_own(g), T.own_words(g))):
            if rows.empty:
                continue
            out += [("p", f"rel_err against {ref}"),
                    ("table", T.metric_pivot(rows, "rel_err", T.fmt_err))]
            if "row_cos" in rows.columns and rows["row_cos"].notna().any():
                out += [("p", f"row_cos against {ref}"),
                        ("table", T.metric_pivot(rows, "row_cos", lambda x: f"{x:.4f}"))]
    return out
