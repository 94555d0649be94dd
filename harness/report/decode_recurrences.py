"""The decode Answers' recurrences: each recurrence's decoder beside the exact decoder at
each context, with its recall where the folder measured it.

A recurrence's decode row (err_ref recurrence) has a row_cos against its own float64 form:
that says whether the decoder computes its own algorithm, not whether it recalls. So the
fastest-decoder answer (decoders.fastest_table) names one only where the folder's
train.csv shows it recalls; this table lists every one of them, so that a folder without
train.csv still shows what a recurrence costs per token and in memory beside the exact
path: its time per token, its state, and both against the fastest exact path there, marked
"recall not measured in this run" where train.csv has no trained row of it (or there is no
train.csv), else with its best held-out accuracy there.
"""

from __future__ import annotations

import pandas as pd

from harness.report import tables as T

NOT_MEASURED = "recall not measured in this run"


def recurrence_rows(dec: pd.DataFrame) -> pd.DataFrame:
    """The ok decode rows whose error is against their own recurrence: not a softmax's
    (tables.softmax_like), and not a row with no reference (a layer pattern's)."""
    own = T.against_own(T.ok_rows(dec))
    return own[~T.softmax_like(own)]


def recall_cell(variant: str, recall: dict[str, float] | None, reach: float) -> str:
    """`trained recall 0.950`, marked where below `reach`, or NOT_MEASURED where `recall`
    (variant -> best held-out accuracy in train.csv; None: no train.csv) lacks it."""
    if not recall or variant not in recall:
        return NOT_MEASURED
    acc = recall[variant]
    return f"trained recall {acc:.3f}" + ("" if acc >= reach else f" (below {reach})")


def table(dec: pd.DataFrame, recall: dict[str, float] | None, reach: float) -> pd.DataFrame:
    """Per setting and context, one row per recurrence decoder: its recall (recall_cell),
    its ms per token and state MiB, the fastest exact path's there, and the exact path's
    over the recurrence's (× faster, × smaller state); – where no exact path ran ok."""
    ok = T.ok_rows(dec)
    rec = recurrence_rows(dec)
    rows = []
    for (setting, n), g in rec.groupby(["setting", "seq_len"], sort=True):
        at = ok[(ok["setting"] == setting) & (ok["seq_len"] == n)]
        exact = at[T.is_exact(at)]
        ex = exact.loc[exact["time_ms"].idxmin()] if not exact.empty else None
        ex_ms = None if ex is None else ex["time_ms"]
        ex_mib = None if ex is None else ex.get("decode_state_mib")
        for _, r in g.sort_values("label", kind="stable").iterrows():
            mib = r.get("decode_state_mib")
            rows.append({"setting": setting, "context": int(n), "recurrence": r["label"],
                         "recall": recall_cell(r["variant"], recall, reach),
                         "ms / token": T.fmt_num(r["time_ms"]),
                         "state MiB": T.fmt_num(mib),
                         "exact path": "–" if ex is None else ex["label"],
                         "its ms / token": T.fmt_num(ex_ms),
                         "its state MiB": T.fmt_num(ex_mib),
                         "× faster than exact": T.ratio(ex_ms, r["time_ms"], 1),
                         "× smaller state": T.ratio(ex_mib, mib, None)})
    return pd.DataFrame(rows)


def blocks(dec: pd.DataFrame, recall: dict[str, float] | None, reach: float) -> list[tuple]:
    """The heading, what the table says, and the table; [] without a recurrence's row."""
    t = table(dec, recall, reach)
    if t.empty:
        return []
    where = ("this folder has no train.csv: each is marked \"" + NOT_MEASURED + "\""
             if recall is None else
             "recall: the variant's best held-out accuracy in this folder's train.csv "
             "(another setting of the variant, maybe), or \"" + NOT_MEASURED + "\" where "
             "it has none")
    return [("h", 3, "Recurrences beside the exact decoder"),
            ("p", "Each recurrence's decoder at each context, beside the fastest exact path "
                  "there: time per generated token, the state it keeps (MiB, one layer), "
                  "and the exact path's time and state over its own (× faster than exact, "
                  "× smaller state). A recurrence's row_cos is against its own float64 "
                  "form, which says nothing of recall, so the table above names one only "
                  f"where its trained recall reaches {reach}; {where}."),
            ("table", t)]
