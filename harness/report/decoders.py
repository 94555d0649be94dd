"""The Answers' decode lines: the fastest accurate decoder at each context, and, where the
folder also holds train.csv, the fastest among variants whose trained recall reached 0.9.

Accurate, for a decoder: an exact path (results.csv `exact`); an approximation whose
generated tokens reach row_cos >= COS_LIMIT against float64 exact causal attention
(err_ref softmax); a recurrence (err_ref recurrence: its row_cos is against its own float64
form, which says nothing of recall) only where train.csv shows it recalls. As in the
forward Answers, a decoder that is not exact is named only where it beats the fastest exact
path by more than the two times' spread (tables.time_noise). Beside each "× faster", how far
that exact path is from its read bound in the same run (generation.bound_ms): a slow
baseline makes every "× faster" larger.
"""

from __future__ import annotations

import pandas as pd

from harness.report import generation
from harness.report import tables as T

RECALL = 0.9  # the trained held-out accuracy a recurrence must reach to be named


def recall_of(train: pd.DataFrame | None, reach: float = RECALL) -> dict[str, float]:
    """Variant (by name) -> its best held-out accuracy in the folder's train.csv, for the
    variants with an ok configuration that reached `reach`."""
    if train is None or train.empty:
        return {}
    ok = train[(train["status"] == "ok") & (train["accuracy"] >= reach)]
    return ok.groupby("variant")["accuracy"].max().to_dict()


def _accuracy(row, recall: dict[str, float], by_recall: bool) -> str:
    if by_recall or (row["err_ref"] != "softmax" and row["variant"] in recall):
        return f"trained recall {recall[row['variant']]:.3f}"
    cos = row.get("row_cos")
    return "–" if cos is None or pd.isna(cos) else f"row_cos {cos:.4f}"


def fastest_table(dec: pd.DataFrame, recall: dict[str, float], read_gbps: float | None,
                  by_recall: bool = False) -> pd.DataFrame:
    """Per setting and context: the fastest accurate decoder (by_recall: the fastest of the
    variants in `recall`, whatever their error), beside the fastest exact path and its
    time over its read bound."""
    ok = T.ok_rows(dec)
    ok = ok.assign(bound_ms=generation.bound_ms(ok, read_gbps), exact=T.is_exact(ok))
    if "row_cos" not in ok:  # a run written before the column: no approximation qualifies
        ok = ok.assign(row_cos=float("nan"))
    if by_recall:
        named = ok["variant"].isin(recall)
    else:
        softmax = ok["err_ref"] == "softmax"
        named = (softmax & (ok["row_cos"] >= T.COS_LIMIT)) | (~softmax & ok["variant"].isin(recall))
    rows = []
    for (setting, n), g in ok.groupby(["setting", "seq_len"], sort=True):
        exact = g[g["exact"]]
        ex = exact.loc[exact["time_ms"].idxmin()] if not exact.empty else None
        # by_recall: exact paths that recall compete too
        cand = g[named[g.index] & (by_recall | ~g["exact"])]
        fast = cand.loc[cand["time_ms"].idxmin()] if not cand.empty else None
        if by_recall:
            best, verdict = fast, ""
        elif fast is None:
            best = ex
            verdict = (f"none reaches row_cos ≥ {T.COS_LIMIT}"
                       + (f" (nor a recurrence trained recall ≥ {RECALL})" if recall else ""))
        elif ex is None:
            best, verdict = fast, "no exact path measured here"
        elif ex["time_ms"] - fast["time_ms"] > T.time_noise(fast, ex):
            best, verdict = fast, f"{fast['label']} is faster beyond the spread"
        else:
            best, verdict = ex, (f"none faster beyond the spread ({fast['label']}: "
                                 f"{T.fmt_num(fast['time_ms'])} ms)")
        if best is None:
            continue
        row = {"setting": setting, "context": int(n), "fastest decoder": best["label"],
               "accuracy": _accuracy(best, recall, by_recall),
               "ms / token": T.fmt_num(best["time_ms"]),
               "state MiB": T.fmt_num(best.get("decode_state_mib")),
               "exact path": "–" if ex is None else ex["label"],
               "its ms / token": "–" if ex is None else T.fmt_num(ex["time_ms"]),
               "× faster": "–" if ex is None else f"{ex['time_ms'] / best['time_ms']:.1f}",
               "exact's time / read bound": "–" if ex is None or pd.isna(ex["bound_ms"])
               else f"{ex['time_ms'] / ex['bound_ms']:.2f}"}
        if not by_recall:
            row["approximate decoders"] = verdict
        rows.append(row)
    return pd.DataFrame(rows)


def blocks(dec: pd.DataFrame, train: pd.DataFrame | None = None,
           read_gbps: float | None = None) -> list[tuple]:
    """The lines as report blocks; [] without decode rows."""
    recall = recall_of(train)
    table = fastest_table(dec, recall, read_gbps)
    if table.empty:
        return []
    out = [("h", 3, "Fastest decoder at each context"),
           ("p", "Pass decode, median time per generated token, among the decoders that are "
                 f"exact, the approximations whose generated tokens reach row_cos ≥ "
                 f"{T.COS_LIMIT} against float64 exact causal attention, and the recurrences "
                 f"whose trained recall in this folder reaches {RECALL} (a recurrence's "
                 "row_cos is against its own float64 form, not exact attention: the "
                 "Generation section). One that is not exact is named only where it beats "
                 "the fastest exact path by more than the two times' spread. exact's time / "
                 "read bound: that exact path's time per token over the time to move its "
                 "cache (decode_read_mib) at the read rate measured in this run (1 is the "
                 "memory's limit; above it, every × faster is larger by as much)."
                 + ("" if read_gbps else " This run's meta.json has no read rate: –.")),
           ("table", table)]
    if train is not None:
        table = fastest_table(dec, recall, read_gbps, by_recall=True)
        out += [("h", 3, f"Fastest decoder whose trained recall reaches {RECALL}"),
                ("p", "Among the variants with a configuration in this folder's train.csv "
                      f"at held-out accuracy >= {RECALL} ("
                      + (", ".join(sorted(recall)) or "none")
                      + "); the decode row may be another setting of the variant.")]
        out.append(("table", table) if not table.empty else
                   ("p", "None of them has a decode row here."))
    return out
