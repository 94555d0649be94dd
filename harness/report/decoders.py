"""The Answers' decode lines: the fastest decoder at each context, and, where the folder
also holds train.csv, the fastest among variants whose trained recall reached 0.9."""

from __future__ import annotations

import pandas as pd

from harness.files.columns import EXACT_PATHS
from harness.report import tables as T


def fastest_table(dec: pd.DataFrame) -> pd.DataFrame:
    """The fastest decoder at each context (per setting), beside the exact path's time."""
    ok = T.ok_rows(dec)
    rows = []
    for (setting, n), g in ok.groupby(["setting", "seq_len"], sort=True):
        best = g.loc[g["time_ms"].idxmin()]
        exact = g[g["variant"].isin(EXACT_PATHS)]
        ex = exact.loc[exact["time_ms"].idxmin()] if not exact.empty else None
        rows.append({"setting": setting, "context": int(n), "fastest decoder": best["label"],
                     "ms / token": T.fmt_num(best["time_ms"]),
                     "state MiB": T.fmt_num(best.get("decode_state_mib")),
                     "exact path": "–" if ex is None else ex["label"],
                     "its ms / token": "–" if ex is None else T.fmt_num(ex["time_ms"]),
                     "× faster": "–" if ex is None else f"{ex['time_ms'] / best['time_ms']:.1f}"})
    return pd.DataFrame(rows)


def recalling(train: pd.DataFrame | None, reach: float = 0.9) -> set[str]:
    """Variants (by name) with a trained configuration whose held-out accuracy reached
    `reach` in the folder's train.csv."""
    if train is None or train.empty:
        return set()
    ok = train[(train["status"] == "ok") & (train["accuracy"] >= reach)]
    return set(ok["variant"])


def blocks(dec: pd.DataFrame, train: pd.DataFrame | None = None) -> list[tuple]:
    """The lines as report blocks; [] without decode rows."""
    table = fastest_table(dec)
    if table.empty:
        return []
    out = [("h", 3, "Fastest decoder at each context"),
           ("p", "Pass decode, median time per generated token; any variant with a "
                 "decoding form, exact or not (their row_cos is in Generation)."),
           ("table", table)]
    if train is not None:
        good = recalling(train)
        table = fastest_table(dec[dec["variant"].isin(good)])
        out += [("h", 3, "Fastest decoder whose trained recall reaches 0.9"),
                ("p", "Among the variants with a configuration in this folder's train.csv "
                      "at held-out accuracy >= 0.9 (" + (", ".join(sorted(good)) or "none")
                      + "); the decode row may be another setting of the variant.")]
        out.append(("table", table) if not table.empty else
                   ("p", "None of them has a decode row here."))
    return out
