"""The report's "Pareto front: error against time" section: per primary view (captured
inputs first, then synthetic), the front's plot and a table at the largest length and at
N = 16384 and 4096 when measured."""

from __future__ import annotations

import pandas as pd

from harness.report import captured as RC
from harness.report import plots
from harness.report import tables as T
from harness.report.run import Run

TITLE = "Pareto front: error against time"


def lengths(view: pd.DataFrame) -> list[int]:
    """The largest length of the view, and 16384 and 4096 where measured."""
    measured = sorted(set(view["seq_len"].astype(int)))
    wanted = [measured[-1]] + [n for n in (16384, 4096) if n in measured]
    return sorted(set(wanted))


def blocks(run: Run) -> list[tuple]:
    out: list[tuple] = [("h", 2, TITLE)]
    for v in run.views:  # captured inputs first
        ns = lengths(v)
        kind = "captured" if v["input"].isin(RC.captured_inputs(run.df)).all() else "synthetic"
        name = "pareto_captured.png" if kind == "captured" else "pareto.png"
        errv, err, ylabel = T.error_axis(v)
        path = plots.pareto_plot(errv, ns, run.dir / "plots" / name, err, ylabel)
        out += [("h", 3, f"{kind} inputs"),
                ("p", f"Setting: {v.iloc[0]['setting'].split(' · ', 1)[0]} · "
                      f"{v.iloc[0]['setting'].rsplit(' · ', 1)[1]}, non-causal where "
                      "measured. The front: no other variant is both faster and more "
                      "accurate."), ("img", path, f"error against time, {kind} inputs")]
        for n in ns:
            out += [("h", 4, f"N = {n}"), ("table", T.pareto_table(v, n))]
    return out
