"""The report's tables as DataFrames: metric pivots with ratios, slopes, crossovers, answers.

Every function takes the tidy results of `run_folder.read_results` and returns a small
DataFrame (or a dict of them per setting) ready to render; nothing here reads or writes files.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.files.columns import REFERENCE_CEILINGS
from harness.report.analysis import crossover, loglog_slope, pareto_front
from harness.report.folder import EXACT_PATHS, SETTING

ERR_LIMIT = 0.1  # the "good enough" relative error of the answers section (runs without row_cos)
COS_LIMIT = 0.995  # the "good enough" mean row cosine: a row error of 0.1, sqrt(2 - 2 cos)


def criterion(df: pd.DataFrame) -> tuple[str, str]:
    """(column, text) of the answers' accuracy test: row_cos >= COS_LIMIT when the run has
    row_cos (every run since it was added), else rel_err < ERR_LIMIT."""
    if "row_cos" in df.columns and ok_rows(df)["row_cos"].notna().any():
        return "row_cos", f"row_cos ≥ {COS_LIMIT}"
    return "rel_err", f"rel_err < {ERR_LIMIT}"


def accurate(rows: pd.DataFrame, column: str) -> pd.Series:
    return rows["row_cos"] >= COS_LIMIT if column == "row_cos" else rows["rel_err"] < ERR_LIMIT


def fmt_num(x) -> str:
    """Compact number: 3 significant digits, no exponent below 1e5."""
    if x is None or not np.isfinite(x):
        return "–"
    ax = abs(x)
    if ax >= 1e5 or (0 < ax < 1e-3):
        return f"{x:.2e}"
    if ax >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def fmt_err(x) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.2e}"


def label_order(df: pd.DataFrame) -> list[str]:
    """Exact paths first, then the rest, each alphabetical."""
    firsts = df.drop_duplicates("label")
    key = {r.label: (r.family != "exact", r.label) for r in firsts.itertuples()}
    return sorted(key, key=key.get)


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


# Rows whose error columns are measured against their own float64 recurrence (err_ref)
# never share a table, a plot or an answer with rows measured against softmax.
OWN_REFERENCE = ("Gated linear recurrences (family recurrent) approximate no softmax: their "
                 "rel_err and row_cos are against their own float64 sequential recurrence "
                 "(err_ref = recurrence), so they are left out of the answers and of the "
                 "error tables and plots against exact attention, and have their own below.")


def against_softmax(df: pd.DataFrame) -> pd.DataFrame:
    """The rows whose error is against exact softmax attention (err_ref = softmax)."""
    return df[df["err_ref"] == "softmax"] if "err_ref" in df.columns else df


def ratio(a, b, digits: int | None = 1) -> str:
    """a / b to `digits` decimals (None: fmt_num's figures), "–" where either is missing or
    b is zero."""
    if a is None or b is None or pd.isna(a) or pd.isna(b) or not b:
        return "–"
    return fmt_num(a / b) if digits is None else f"{a / b:.{digits}f}"


SOFTMAX_REFS = ("softmax", "own_softmax")


def softmax_like(rows):
    """Whether a row's error is against a softmax, so that row_cos >= COS_LIMIT makes it
    accurate: exact attention over its q, k, v (err_ref softmax) or the exact softmax of
    its own definition (own_softmax: mla's latent keys and values, as a grouped cache's).
    Not a recurrence's (against its own float64 form: that says nothing of recall). A
    DataFrame gives a boolean Series, one row (a Series) a bool; no err_ref reads as
    softmax, as folder.py reads a run written before the column."""
    if isinstance(rows, pd.DataFrame):
        if "err_ref" not in rows.columns:
            return pd.Series(True, index=rows.index)
        return rows["err_ref"].isin(SOFTMAX_REFS)
    return rows.get("err_ref", "softmax") in SOFTMAX_REFS


def against_own(df: pd.DataFrame) -> pd.DataFrame:
    """The rows whose error is against the variant's own float64 form (a recurrence); not
    those with no reference (err_ref empty: a layer pattern's decode row)."""
    if "err_ref" not in df.columns:
        return df.iloc[:0]
    return df[df["err_ref"].notna() & (df["err_ref"] != "softmax")]


def own_words(df: pd.DataFrame) -> str:
    """What the rows of `against_own` are measured against, in words: a recurrence's
    float64 form, and where an `own_softmax` row is among them, that too."""
    own = set(against_own(df)["err_ref"]) if "err_ref" in df.columns else set()
    if "own_softmax" in own:
        return ("each variant's own float64 form (a recurrence's sequential form; "
                "the exact softmax of its own definition, err_ref own_softmax)")
    return "each variant's own float64 recurrence"


def metric_pivot(group: pd.DataFrame, metric: str, fmt=fmt_num) -> pd.DataFrame:
    """label x seq_len cells: the metric where ok, the status (oom, skipped, ...) where not."""
    cells = [fmt(v) if s == "ok" else s for v, s in zip(group[metric], group["status"])]
    g = group.assign(cell=cells)
    wide = g.pivot(index="label", columns="seq_len", values="cell").fillna("")
    wide = wide.reindex([lb for lb in label_order(group) if lb in wide.index])
    wide.columns = [f"N={int(n)}" for n in wide.columns]
    return wide.rename_axis("variant").reset_index()


def _reference(group: pd.DataFrame, ref: str, metric: str) -> pd.Series:
    r = ok_rows(group)
    r = r[r["variant"] == ref]
    return r.groupby("seq_len")[metric].first()


def ratio_pivot(group: pd.DataFrame, metric: str) -> pd.DataFrame:
    """label x seq_len cells `a / b`: the metric over sdpa's and over standard's, same setting."""
    refs = {ref: _reference(group, ref, metric) for ref in EXACT_PATHS}
    ok = ok_rows(group)

    def cell(row):
        parts = []
        for ref in EXACT_PATHS:
            base = refs[ref].get(row["seq_len"], np.nan)
            parts.append(fmt_num(row[metric] / base) if base and np.isfinite(base) else "–")
        return " / ".join(parts)

    cells = ok.assign(cell=[cell(r) for _, r in ok.iterrows()] if len(ok) else [])
    if cells.empty:
        return pd.DataFrame()
    wide = cells.pivot(index="label", columns="seq_len", values="cell").fillna("")
    wide = wide.reindex([lb for lb in label_order(group) if lb in wide.index])
    wide.columns = [f"N={int(n)}" for n in wide.columns]
    return wide.rename_axis(f"variant (× {' / × '.join(EXACT_PATHS)})").reset_index()


def slopes(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Log-log slope of the metric over each label's ok lengths, per setting (long form)."""
    rows = []
    for (label, setting), g in ok_rows(df).groupby(["label", "setting"]):
        first = g.iloc[0]
        rows.append({"label": label, "setting": setting, "pass": first["pass"],
                     "causal": first["causal"], "input": first["input"],
                     "slope": loglog_slope(g["seq_len"], g[metric]), "lengths": len(g)})
    return pd.DataFrame(rows)


def slope_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per label: time and memory exponents, median over inputs, one column per pass/causal."""
    out = None
    for metric, name in (("time_ms", "time"), ("peak_mem_mib", "memory")):
        s = slopes(df, metric)
        if s.empty:
            continue
        s["col"] = [f"{name} N^k: {p}{' causal' if c else ''}"
                    for p, c in zip(s["pass"], s["causal"])]
        med = s.dropna(subset=["slope"]).groupby(["label", "col"])["slope"].median()
        wide = (med.unstack("col").map(lambda v: "–" if pd.isna(v) else f"{v:.2f}")
                if len(med) else pd.DataFrame())
        out = wide if out is None else out.join(wide, how="outer")
    if out is None or out.empty:
        return pd.DataFrame()
    out = out.reindex([lb for lb in label_order(df) if lb in out.index]).fillna("–")
    out.columns.name = None  # the unstacked level's name would render as a stray "col" column
    return out.rename_axis("variant").reset_index()


def crossover_table(group: pd.DataFrame) -> pd.DataFrame:
    """Per label: from which N it is faster / lighter than each exact path, in one setting."""
    ok = ok_rows(group)
    rows = []
    for label in label_order(ok):
        mine = ok[ok["label"] == label].set_index("seq_len")
        row = {"variant": label}
        for ref in EXACT_PATHS:
            theirs = ok[ok["variant"] == ref].groupby("seq_len").first()
            if theirs.empty or (mine["variant"] == ref).any():
                continue
            common = mine.index.intersection(theirs.index)
            for metric, word in (("time_ms", "faster"), ("peak_mem_mib", "lighter")):
                c = crossover(common, mine.loc[common, metric], theirs.loc[common, metric])
                row[f"{word} than {ref} from N"] = c.text()
        if len(row) > 1:
            rows.append(row)
    return pd.DataFrame(rows)


def common_max_length(group: pd.DataFrame) -> int | None:
    """Largest seq_len at which every label of the group has a row (any status)."""
    per_label = group.groupby("label")["seq_len"].apply(set)
    common = set.intersection(*per_label) if len(per_label) else set()
    return int(max(common)) if common else None


def answer_lengths(group: pd.DataFrame) -> list[int]:
    """The largest common N, plus 16384 and 4096 when measured (lengths where no case ran
    ok, e.g. above a captured model's positions, are left out)."""
    group = group[group["seq_len"].isin(ok_rows(group)["seq_len"])]
    lengths = set(group["seq_len"].astype(int))
    out = [n for n in (common_max_length(group),) if n is not None]
    out += [n for n in (16384, 4096) if n in lengths and n not in out]
    return out


def is_exact(rows: pd.DataFrame) -> pd.Series:
    """Whether each row's setting is exact attention at its length: the `exact` column the
    run recorded (an exact path, or a window or layout covering every pair); for a run
    without it, the exact family alone."""
    fallback = rows["family"] == "exact"
    if "exact" not in rows.columns:
        return fallback
    return rows["exact"].where(rows["exact"].notna(), fallback).astype(bool)


def exact_label(row) -> str:
    """The label, marked where an approximate variant's setting is exact at this length."""
    marked = row.get("exact")
    if row["family"] != "exact" and marked is not None and not pd.isna(marked) and bool(marked):
        return f"{row['label']} [exact at N={int(row['seq_len'])}]"
    return row["label"]


def time_noise(a, b) -> float:
    """How far apart two rows' median times (ms) may be by noise alone: the sum of their
    IQRs, or, where the run timed rounds, of their spreads between rounds (the larger)."""
    noise = sum(r["time_ms_iqr"] for r in (a, b) if np.isfinite(r.get("time_ms_iqr", np.nan)))
    spreads = [r.get("time_ms_spread", np.nan) for r in (a, b)]
    if all(s is not None and np.isfinite(s) for s in spreads):
        noise = max(noise, spreads[0] * a["time_ms"] + spreads[1] * b["time_ms"])
    return float(noise)


def fastest_accurate(df: pd.DataFrame, extra_cols: list[str]) -> pd.DataFrame:
    """Per setting and answer length: the fastest path passing `criterion`, and (runs
    with row_cos) the most accurate approximate variant, for the trade-off.

    A setting exact at that length (`is_exact`) is an exact path, never the approximate
    answer. The fastest accurate approximate path is the answer only where it beats the
    fastest exact path by more than `time_noise`; otherwise the answer is that exact
    path and the row says "no faster approximate path".
    """
    column, text = criterion(df)
    rows = []
    for _, group in df.groupby("setting", sort=False):
        first = group.iloc[0]
        for n in answer_lengths(group):
            at_n = ok_rows(group)
            # The top-k oracle bounds the others at its budget; it is never an answer.
            at_n = at_n[(at_n["seq_len"] == n) & ~at_n["variant"].isin(REFERENCE_CEILINGS)]
            exact = is_exact(at_n)
            cand = at_n[accurate(at_n, column) & ~exact]
            exact_rows = at_n[exact]
            sdpa = _reference(group, "sdpa", "time_ms").get(n, np.nan)
            row = {c: first[c] for c in extra_cols} | {"N": n}
            ref = exact_rows.loc[exact_rows["time_ms"].idxmin()] if len(exact_rows) else None
            fast = cand.loc[cand["time_ms"].idxmin()] if len(cand) else None
            best, verdict = ref, "no faster approximate path"
            if fast is not None and ref is None:
                best, verdict = fast, "no exact path measured here"
            elif fast is not None:
                noise = time_noise(fast, ref)
                ratio = (f"{fmt_num(fast['time_ms'] / ref['time_ms'])} ± "
                         f"{fmt_num(noise / ref['time_ms'])} × {exact_label(ref)}")
                if ref["time_ms"] - fast["time_ms"] > noise:
                    best, verdict = fast, ratio
                else:
                    verdict += f" ({fast['label']}: {ratio})"
            elif ref is not None:
                verdict += f" (no approximate path has {text})"
            if best is None:
                row |= {f"fastest with {text}": "none measured ok"}
            else:
                row |= {f"fastest with {text}": exact_label(best),
                        "time_ms": fmt_num(best["time_ms"]), "rel_err": fmt_err(best["rel_err"])}
                if column == "row_cos":
                    row["row_cos"] = f"{best['row_cos']:.4f}"
                row["× sdpa time"] = fmt_num(best["time_ms"] / sdpa)
                row["approximate against exact (± spread)"] = verdict
            approx = at_n[~exact & at_n[column].notna()]
            if column == "row_cos" and not approx.empty:
                top = approx.loc[approx["row_cos"].idxmax()]
                row |= {"most accurate approximate": top["label"],
                        "its row_cos": f"{top['row_cos']:.4f}",
                        "its × sdpa time": fmt_num(top["time_ms"] / sdpa)}
            rows.append(row)
    return pd.DataFrame(rows)


def error_axis(df: pd.DataFrame) -> tuple[pd.DataFrame, str, str]:
    """(df with the error column, its name, its axis label) the Pareto front is taken on:
    1 - row_cos when the run has row_cos (the answers' criterion), else rel_err."""
    if criterion(df)[0] == "row_cos":
        # Below float32 rounding (~1e-7) a difference in cosine is not one of accuracy:
        # exact paths tie, and the faster one alone is on the front.
        return df.assign(row_err=(1 - df["row_cos"]).clip(lower=1e-6)), "row_err", "1 - row_cos"
    return df, "rel_err", "relative error"


def pareto_table(df: pd.DataFrame, n: int) -> pd.DataFrame:
    """The Pareto front (time vs error_axis) at length n per input, fastest first."""
    df, err, _ = error_axis(df)
    rows = []
    for inp, g in ok_rows(df[df["seq_len"] == n]).groupby("input"):
        g = g[np.isfinite(g["time_ms"]) & np.isfinite(g[err])]
        for _, r in g[pareto_front(g["time_ms"], g[err])].sort_values("time_ms").iterrows():
            row = {"input": inp, "variant": r["label"], "time_ms": fmt_num(r["time_ms"]),
                   "rel_err": fmt_err(r["rel_err"])}
            if err == "row_err":
                row["row_cos"] = f"{r['row_cos']:.4f}"
            rows.append(row)
    return pd.DataFrame(rows)


def matmul_rates(meta: dict) -> dict[str, float]:
    """"device dtype" -> the matmul GFLOP/s meta.json records for it (runs before per-dtype
    rates recorded the CPU's float32 rate alone)."""
    rates = dict(meta.get("matmul_gflops") or {})
    if meta.get("matmul_fp32_gflops") and "cpu float32" not in rates:
        rates["cpu float32"] = meta["matmul_fp32_gflops"]
    return {k: float(v) for k, v in rates.items() if v}


def matmul_note(meta: dict) -> str:
    """How each matmul rate was measured: the median of the samples taken during the run
    (start, before each later round, end) and their range, or the single rate of a folder
    written before samples were kept."""
    rates, samples = matmul_rates(meta), meta.get("matmul_samples") or []
    parts = []
    for key, rate in rates.items():
        seen = [s["rates"][key] for s in samples if s["rates"].get(key)]
        if len(seen) > 1:
            parts.append(f"{key} {rate:.0f} GFLOP/s (median of {len(seen)} samples taken "
                         f"during the run, {min(seen):.0f} to {max(seen):.0f})")
        else:
            parts.append(f"{key} {rate:.0f} GFLOP/s (measured once, at the start)")
    return "; ".join(parts)


# A case below this share of the matmul rate is flagged: it runs well under the machine.
SLOW_SHARE = 0.5


def gflops_table(df: pd.DataFrame, rates: dict[str, float] | float | None) -> pd.DataFrame:
    """Best achieved GFLOP/s per label, pass, device and dtype, and its share of the matmul
    rate measured on that device in that dtype (`matmul_rates`; a number: the CPU's
    float32 rate), flagged "below half" under `SLOW_SHARE`."""
    if not isinstance(rates, dict):
        rates = {"cpu float32": rates} if rates else {}
    ok = ok_rows(df)
    ok = ok[np.isfinite(ok["gflops_per_s"])]
    keys = ["label", "pass", "device", "dtype"]
    best = ok.loc[ok.groupby(keys)["gflops_per_s"].idxmax()] if len(ok) else ok
    several = ok[["device", "dtype"]].drop_duplicates().shape[0] > 1
    rows = []
    for _, r in best.iterrows():
        row = {"variant": r["label"], "pass": r["pass"]}
        if several:
            row["device dtype"] = f"{r['device']} {r['dtype']}"
        row |= {"at N": int(r["seq_len"]), "GFLOP/s": fmt_num(r["gflops_per_s"])}
        rate = rates.get(f"{r['device']} {r['dtype']}")
        if rates:
            row["% of matmul"] = f"{100 * r['gflops_per_s'] / rate:.0f}%" if rate else "–"
            row["flag"] = "below half" if rate and r["gflops_per_s"] < SLOW_SHARE * rate else ""
        rows.append(row)
    order = {lb: i for i, lb in enumerate(label_order(df))}
    return pd.DataFrame(rows).sort_values("variant", key=lambda s: s.map(order)) if rows \
        else pd.DataFrame()


def status_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every case that is not ok, grouped by its reason, with the lengths it covers."""
    bad = df[df["status"] != "ok"]
    if bad.empty:
        return pd.DataFrame()
    keys = ["label"] + SETTING + ["status", "reason"]
    rows = []
    for k, g in bad.groupby(keys, sort=False):
        row = dict(zip(keys, k))
        row["seq_len"] = ", ".join(str(int(n)) for n in sorted(g["seq_len"]))
        rows.append(row)
    out = pd.DataFrame(rows).rename(columns={"label": "variant"})
    return out[["variant", "status", "seq_len"] + SETTING + ["reason"]]
