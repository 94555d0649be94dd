"""The report's view of captured inputs (harness.models.capture): which inputs they are, putting
them first, their error per layer, and the label -> parameters key.

Captured inputs are told apart by the data alone: their ok rows carry `layer_rel_err`
(a JSON list, one rel_err per model layer, layer 0 first).
"""

from __future__ import annotations

import json

import pandas as pd

from harness.report import tables as T

WHY_CRITERION = (
    "Why the row cosine and not rel_err alone: rel_err = ||o - o_ref||_F / ||o_ref||_F is "
    "misleading when o_ref is near zero, as it is for the near-uniform attention of i.i.d. "
    "inputs (each reference row is a mean of nearly all value rows, of norm about "
    "sqrt(D / N)): there a small absolute error reads as a rel_err of 1 to 10, and the "
    "largest rows dominate it. row_cos, the mean over query rows of the cosine between o's "
    "row and o_ref's, weighs every row alike and is bounded; for a row error e it is about "
    f"1 - e^2 / 2, so {T.COS_LIMIT} means rows within about 0.1 of the reference.")


def captured_inputs(df: pd.DataFrame) -> list[str]:
    """Inputs whose ok rows carry per-layer errors (captured from a model), in row order."""
    if "layer_rel_err" not in df.columns:
        return []
    has = df["layer_rel_err"].notna() & (df["layer_rel_err"].astype(str).str.strip() != "")
    return list(dict.fromkeys(df.loc[has, "input"]))


def captured_first(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of captured inputs first (stable), so sections grouped by setting lead with them."""
    cap = df["input"].isin(captured_inputs(df))
    return pd.concat([df[cap], df[~cap]]).reset_index(drop=True)


def layer_tables(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Per captured setting and length: label x layer rel_err, then the whole case's rel_err
    and row_cos. Forward rows only (a forward_backward case's error is its forward's)."""
    out = []
    inputs = captured_inputs(df)
    ok = T.ok_rows(df[df["input"].isin(inputs)])
    if (ok["pass"] == "forward").any():
        ok = ok[ok["pass"] == "forward"]
    order = T.label_order(ok) if len(ok) else []
    for (setting, n), g in ok.groupby(["setting", "seq_len"], sort=False):
        rows = []
        for _, r in g.sort_values("label", key=lambda s: s.map(order.index)).iterrows():
            layers = json.loads(r["layer_rel_err"])
            row = {"variant": r["label"]} | {f"layer {i}": T.fmt_err(x)
                                             for i, x in enumerate(layers)}
            row |= {"all layers": T.fmt_err(r["rel_err"]), "row_cos": _cos(r.get("row_cos"))}
            rows.append(row)
        out.append((f"{setting.split(' · ', 1)[1]} · N = {int(n)}", pd.DataFrame(rows)))
    return out


def _cos(x) -> str:
    return "–" if x is None or pd.isna(x) else f"{x:.4f}"


def settings_table(df: pd.DataFrame) -> pd.DataFrame:
    """Each label with its variant's full parameters (labels name only what varies)."""
    firsts = df.drop_duplicates("label")
    order = T.label_order(df)
    rows = [{"label": r.label, "variant": r.variant,
             "parameters": ", ".join(f"{k}={v}" for k, v in json.loads(r.params).items()) or "–"}
            for r in firsts.itertuples()]
    return pd.DataFrame(rows).sort_values("label", key=lambda s: s.map(order.index))
