"""The report's "Implementations" section: one algorithm, several implementations.

A family (the `family` column) may hold several implementations of one algorithm with
the same parameters: ours (`sliding_window`) beside a library's (`sliding_window_flex`,
`sliding_window_sdpa_mask`, ...). Per family, parameter setting and run setting with more
than one implementation measured, forward pass: the median time by N of each, and which
is fastest from which N on. Reads the results table only.
"""

from __future__ import annotations

import pandas as pd

from harness.report import tables as T


def fastest_from(pivot: pd.DataFrame) -> str:
    """'X is fastest from N = n on (...)' for a variant x N pivot of times.

    At each N the fastest among the implementations measured there (one that could not
    run, e.g. refused by the memory guard, is no candidate; the text says where).
    """
    pivot = pivot.dropna(axis=1, how="all")
    if pivot.empty:
        return "no length was measured."
    best = pivot.idxmin(axis=0)  # N -> fastest variant measured at N
    lengths = list(best.index)
    winner = best.iloc[-1]
    start = len(lengths) - 1
    while start > 0 and best.iloc[start - 1] == winner:
        start -= 1
    if start == len(lengths) - 1 and start:
        text = f"{winner} is fastest at the largest length, N = {lengths[-1]}"
    else:
        text = f"{winner} is fastest from N = {lengths[start]} on (to N = {lengths[-1]})"
    runs: list[list] = []  # [variant, first N, last N] of each stretch one variant led
    for n, v in zip(lengths[:start], best.iloc[:start]):
        if runs and runs[-1][0] == v:
            runs[-1][2] = n
        else:
            runs.append([v, n, n])
    if runs:
        text += "; before that: " + ", ".join(
            f"{v} at N = {a}" if a == b else f"{v} from N = {a} to {b}" for v, a, b in runs)
    missing = [n for n in lengths if pivot[n].isna().any()]
    if missing:
        text += f"; not every implementation ran at N = {', '.join(map(str, missing))}"
    return text + "."


def implementation_groups(df: pd.DataFrame):
    """Yield (family, params, setting, pivot variant x N of median time_ms, compile_ms by
    variant) for each forward group with more than one implementation measured."""
    ok = T.ok_rows(df)
    ok = ok[ok["pass"] == "forward"]
    for (family, params, setting), g in ok.groupby(["family", "params", "setting"], sort=False):
        if g["variant"].nunique() < 2:
            continue
        pivot = g.pivot_table(index="variant", columns="seq_len", values="time_ms",
                              aggfunc="median")
        comp = None
        if "compile_ms" in g:  # results written before the column existed lack it
            comp = pd.to_numeric(g["compile_ms"], errors="coerce").groupby(g["variant"]).max()
        yield family, params, setting, pivot, comp


def implementations_blocks(df: pd.DataFrame) -> list[tuple]:
    """The section as report blocks (see harness.report.build.build_blocks)."""
    blocks: list[tuple] = [
        ("h", 2, "Implementations"),
        ("p", "One algorithm, several implementations (ours and library kernels, same "
              "parameters): forward median time (ms) by N, and which is fastest from which "
              "N. compile_ms: the largest one-time compile/preparation a case of it paid "
              "before timing (not in time_ms); – where it prepares nothing.")]
    found = False
    for family, params, setting, pivot, comp in implementation_groups(df):
        found = True
        table = pivot.map(lambda x: "–" if pd.isna(x) else f"{x:.3g}")
        table.columns = [f"N={n}" for n in table.columns]
        if comp is not None:
            table["compile_ms"] = [("–" if pd.isna(comp.get(v)) else f"{comp.get(v):.0f}")
                                   for v in table.index]
        blocks += [("h", 3, f"{family} {params} · {setting}"),
                   ("p", fastest_from(pivot)),
                   ("table", table.reset_index())]
    if not found:
        blocks.append(("p", "No family has more than one implementation measured in this run."))
    return blocks
