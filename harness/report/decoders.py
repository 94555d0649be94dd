"""The Answers' decode lines: the fastest accurate decoder at each context, the
recurrences beside the exact decoder (decode_recurrences.py), and, where the folder holds
train.csv, the fastest among variants whose trained recall reached 0.9.

Accurate, for a decoder: an exact path (results.csv `exact`); an approximation whose
generated tokens reach row_cos >= COS_LIMIT against float64 exact causal attention
(err_ref softmax), or against the exact softmax of its own definition (own_softmax: mla;
tables.softmax_like); a recurrence (err_ref recurrence: its row_cos is against its own
float64 form, which says nothing of recall) only where train.csv shows it recalls: one
without a measured recall is listed beside the exact decoder, never named. As in the
forward Answers, a decoder that is not exact is named only where it beats the fastest exact
path by more than the two times' spread (tables.time_noise). Beside each "× faster", how far
that exact path is from its read bound in the same run (generation.bound_ms): a slow
baseline makes every "× faster" larger.

Where the run's matrix names a served baseline ([baseline] in its TOML: decode-served's
grouped-query cache), `served_blocks` adds the answer against it: per context the fastest
decoder that qualifies, every decoder's ratio against the baseline, its state and its
roofline bound. A folder without one renders as before.
"""

from __future__ import annotations

import pandas as pd

from harness.report import decode_recurrences, generation
from harness.report import tables as T
from harness.report.folder import GROUPING, layer_name

RECALL = 0.9  # the trained held-out accuracy a recurrence must reach to be named


def recall_of(train: pd.DataFrame | None, reach: float = RECALL) -> dict[str, float]:
    """Variant (by name) -> its best held-out accuracy in the folder's train.csv, for the
    variants with an ok configuration that reached `reach`."""
    if train is None or train.empty:
        return {}
    ok = train[(train["status"] == "ok") & (train["accuracy"] >= reach)]
    return ok.groupby("variant")["accuracy"].max().to_dict()


def _accuracy(row, recall: dict[str, float], by_recall: bool) -> str:
    if by_recall or (not T.softmax_like(row) and row["variant"] in recall):
        return f"trained recall {recall[row['variant']]:.3f}"
    cos = row.get("row_cos")
    own = " (own softmax)" if row["err_ref"] == "own_softmax" else ""
    return "–" if cos is None or pd.isna(cos) else f"row_cos {cos:.4f}{own}"


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
        softmax = T.softmax_like(ok)
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
                 f"{T.COS_LIMIT} against float64 exact causal attention"
                 + (" (an own_softmax row, as mla's: against the exact softmax of its own "
                    "keys and values)" if (dec["err_ref"] == "own_softmax").any() else "")
                 + ", and the recurrences "
                 f"whose trained recall in this folder reaches {RECALL} (a recurrence's "
                 "row_cos is against its own float64 form, not exact attention: the "
                 "Generation section). One that is not exact is named only where it beats "
                 "the fastest exact path by more than the two times' spread. exact's time / "
                 "read bound: that exact path's time per token over the time to move its "
                 "cache (decode_read_mib) at the read rate measured in this run (1 is the "
                 "memory's limit; above it, every × faster is larger by as much)."
                 + ("" if read_gbps else " This run's meta.json has no read rate: –.")),
           ("table", table)]
    out += decode_recurrences.blocks(
        dec, None if train is None else recall_of(train, float("-inf")), RECALL)
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


# -- the served baseline (a matrix's [baseline] table: decode-served) -------------------

def baseline_rows(dec: pd.DataFrame, baseline: dict) -> pd.Series:
    """Which decode rows are the matrix's named baseline: its variant, its full params and
    its heads and widths (an empty grouping column is the default)."""
    hit = (dec["variant"] == baseline["variant"]) & (dec["params"] == baseline["params"])
    for col in GROUPING:
        want = baseline.get(col)
        hit &= dec[col].isna() if want is None else (dec[col] == want)
    return hit


def _qualifies(rows: pd.DataFrame, recall: dict[str, float]) -> pd.Series:
    """The decoders the served answer may name: an exact path, an approximation whose
    generated tokens reach row_cos >= COS_LIMIT against exact attention, a recurrence whose
    trained recall in the folder reaches RECALL (its row_cos is against itself). An
    `own_softmax` row (mla) is a softmax over keys and values of its own definition: its
    row_cos against that float64 softmax counts as a grouped cache's does."""
    softmax = T.softmax_like(rows)
    cos = rows["row_cos"] if "row_cos" in rows else pd.Series(float("nan"), index=rows.index)
    return T.is_exact(rows) | (softmax & (cos >= T.COS_LIMIT)) | \
        (~softmax & rows["variant"].isin(recall))


def _accuracy_cell(row, recall: dict[str, float]) -> str:
    if not T.softmax_like(row):
        return (f"trained recall {recall[row['variant']]:.3f}" if row["variant"] in recall
                else "own reference (recurrence)")
    cos = row.get("row_cos")
    own = " (own softmax)" if row["err_ref"] == "own_softmax" else ""
    return "–" if cos is None or pd.isna(cos) else f"row_cos {cos:.4f}{own}"


def _status_cell(row) -> str:
    return "ok" if row["status"] == "ok" else f"{row['status']}: {row['reason']}"


def _by_layer(dec: pd.DataFrame, base: pd.Series) -> pd.DataFrame:
    """The rows keyed by the served layer they decode for: `setting` without the head width,
    so that a decoder of other widths (mla: a rotary query of 64 and a latent of 512; dsa
    in MLA's cache: keys of 576) is set against the baseline of the same query heads,
    batch, dtype and device. A row whose width is not the baseline's names it in its label."""
    if dec["head_dim"].nunique() < 2:
        return dec
    width = dec.loc[base, "head_dim"].iloc[0] if base.any() else None
    layer = [layer_name(r) for _, r in dec.iterrows()]
    other = dec["head_dim"] != width
    label = dec["label"].where(~other, dec["label"] + " D" + dec["head_dim"].astype(int).astype(str))
    return dec.assign(setting=layer, label=label)


def served_tables(dec: pd.DataFrame, meta: dict, recall: dict[str, float]
                  ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(answers, every decoder, the baseline's label) for a folder whose matrix names a
    baseline: per setting and context, the fastest decoder that qualifies (`_qualifies`)
    and its ratio against the baseline and the fastest multi-head exact path; then every
    decoder's time, state, roofline bound and ratio against the baseline."""
    base = baseline_rows(dec, meta["matrix"]["baseline"])
    label = dec.loc[base, "label"].iloc[0] if base.any() else meta["matrix"]["baseline"]["variant"]
    dec = _by_layer(dec, base)
    ok = T.ok_rows(dec)
    bound, which = generation.roofline(ok, meta)
    ok = ok.assign(bound_ms=bound, bound=which, qualifies=_qualifies(ok, recall),
                   is_base=base[ok.index], multi_head=T.is_exact(ok) & ok["kv_heads"].isna())
    answers, every = [], []
    for (setting, n), g in dec.groupby(["setting", "seq_len"], sort=True):
        good = ok[(ok["setting"] == setting) & (ok["seq_len"] == n)]
        b = good[good["is_base"]]
        b_ms = b["time_ms"].iloc[0] if not b.empty else float("nan")
        mh = good[good["multi_head"]]
        mh_ms = mh["time_ms"].min() if not mh.empty else float("nan")
        cand = good[good["qualifies"]]
        if not cand.empty:
            f = cand.loc[cand["time_ms"].idxmin()]
            answers.append({
                "setting": setting, "context": int(n), "fastest decoder": f["label"],
                "accuracy": _accuracy_cell(f, recall), "ms / token": T.fmt_num(f["time_ms"]),
                "state MiB": T.fmt_num(f["decode_state_mib"]),
                "baseline ms / token": T.fmt_num(b_ms),
                "× faster than the baseline": T.ratio(b_ms, f["time_ms"]),
                "multi-head exact ms / token": T.fmt_num(mh_ms),
                "× faster than multi-head": T.ratio(mh_ms, f["time_ms"])})
        for _, r in g.sort_values("label").iterrows():
            o = good.loc[r.name] if r.name in good.index else None
            every.append({
                "setting": setting, "context": int(n), "decoder": r["label"],
                "status": _status_cell(r),
                "ms / token": T.fmt_num(r["time_ms"]) if o is not None else "–",
                "state MiB": T.fmt_num(r.get("decode_state_mib")),
                "roofline bound ms": "–" if o is None else T.fmt_num(o["bound_ms"]),
                "bound": "–" if o is None or pd.isna(o["bound_ms"]) else o["bound"],
                "time / bound": "–" if o is None else T.ratio(o["time_ms"], o["bound_ms"], 2),
                "× faster than the baseline": "–" if o is None else T.ratio(b_ms, o["time_ms"]),
                "accuracy": "–" if o is None else _accuracy_cell(o, recall)})
    answers, every = (pd.DataFrame(t) for t in (answers, every))
    if dec["setting"].nunique() == 1:  # one setting (a served preset's): no column for it
        answers, every = (t.drop(columns="setting", errors="ignore") for t in (answers, every))
    return answers, every, label


def served_blocks(dec: pd.DataFrame, meta: dict, train: pd.DataFrame | None = None
                  ) -> list[tuple]:
    """The Answers' served-baseline lines, where the run's matrix names a baseline
    ([baseline] in its TOML); [] otherwise (every folder before it renders as it did)."""
    if dec.empty or not meta.get("matrix", {}).get("baseline"):
        return []
    recall = recall_of(train)
    answers, every, label = served_tables(dec, meta, recall)
    rates = meta.get("read_bandwidth_gbps")
    return [
        ("h", 3, f"Against the served baseline: {label}"),
        ("p", f"This run's matrix names {label} as its baseline, the cache a served model "
              "keeps: every ratio here is its time per token over the decoder's (above 1: "
              "faster than the baseline), the fastest multi-head exact path's beside it. "
              "Per context, the fastest decoder that is exact, or whose generated tokens "
              f"reach row_cos ≥ {T.COS_LIMIT} against float64 exact causal attention (a "
              "recurrence only where its trained recall in this folder reaches "
              f"{RECALL}: its row_cos is against its own float64 form)."),
        *([] if (baseline_rows(dec, meta["matrix"]["baseline"]) & (dec["status"] == "ok")).any()
          else [("p", f"{label} has no measured row in this run: its ratios read –.")]),
        ("table", answers) if not answers.empty else
        ("p", "No decoder qualifies at any context here."),
        ("p", "Every decoder against the baseline: time per generated token, the state it "
              "keeps (MiB, one layer, in the dtype it stores), its roofline bound (the "
              "larger of the bytes a step moves at the read rate and its FLOPs at the "
              "matmul rate, both measured in this run; bound names the larger: the "
              "Generation section) and its time over that bound"
              + ("." if rates else "; this run's meta.json has no read rate: –.")),
        ("table", every)]
