"""The report's "Scaling plots" section: time, memory and error against N, one line per
variant setting; a recurrence's error against its own float64 form on a plot of its own."""

from __future__ import annotations

from harness.report import plots
from harness.report import tables as T
from harness.report.run import Run, with_lines

TITLE = "Scaling plots"


def blocks(run: Run) -> list[tuple]:
    ok = with_lines(T.ok_rows(run.df))
    out: list[tuple] = [("h", 2, TITLE)]
    if ok.empty:
        return out
    pdir = run.dir / "plots"
    for metric, ylabel, band, name in (
            ("time_ms", "time (ms), band: IQR", "time_ms_iqr", "time"),
            ("peak_mem_mib", "peak memory of a call (MiB);\n× dotted: state kept", None,
             "memory"),
            ("rel_err", "relative error", None, "error")):
        rows = T.against_softmax(ok) if metric == "rel_err" else ok
        if rows.empty:
            continue
        path = plots.scaling_plot(rows, metric, ylabel, pdir / f"{name}_vs_length.png", band,
                                  also="state_mib" if metric == "peak_mem_mib" else None)
        out.append(("img", path, f"{name} against sequence length"))
    own = T.against_own(ok)
    if not own.empty:  # a plot of its own: another reference, never on the same axes
        path = plots.scaling_plot(own, "rel_err", "relative error against\nits own float64 "
                                  "recurrence", pdir / "error_recurrence_vs_length.png")
        out.append(("img", path, "error against its own recurrence, by length"))
    return out
