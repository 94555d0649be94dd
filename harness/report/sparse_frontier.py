"""The report's "Sparse Frontier" section: the sparse selectors at equal budgets (issue 53;
Nawrot et al. 2025, "The Sparse Frontier", arXiv:2504.17768), from the rows of a run with
`selection = true` (the `sparse-frontier` preset): those with a `mass` column measured.

Per setting (input, N, causal): a table of every selector (the variants with a mass: moba,
quest, dsa, block_sparse, the topk oracle, ...) at each budget, with the share of exact
attention's mass its selected keys hold (`mass`), the output's row cosine to exact
attention (`row_cos`), the selection's own time (`select_ms`, included in the call's
`time_ms`) and the call's time against sdpa's at the same setting. A row's budget is the
nearest of the matrix's `budgets` to its keys_per_query / N (the run sets each selector's
budget parameter to the value whose mean keys per query is closest to budget x N); a folder
without them shows the measured fraction. A figure: missed mass (1 - mass) and error
(1 - row_cos) against the budget, and error against time with the selection's time drawn
apart (hollow markers). The answers: per setting and budget, the selector with the highest
row_cos (topk, the oracle with an O(N^2) selection, excluded: a ceiling, not an answer;
its row stays in the table), and whether any selector beats moba at equal time: a row
at most as slow as one of moba's rows in the same setting with a higher row_cos.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from harness.files.columns import EXACT_PATHS, REFERENCE_CEILINGS
from harness.report import canvas
from harness.report import tables as T
from harness.report.run import Run

TITLE = "Sparse Frontier"
BASELINE = "moba"  # the routed selector the question is asked against
# row_cos leads at most this small are ties: inputs whose selection holds every weighted
# key (local) give 1.0000 to every selector, and a lead in the sixth digit is no answer.
TIE = 1e-3


def frontier_rows(df: pd.DataFrame) -> pd.DataFrame:
    """ok forward rows against softmax that measured a mass; empty when none did."""
    if df.empty or "mass" not in df.columns:
        return df.iloc[:0]
    rows = T.against_softmax(T.ok_rows(df))
    rows = rows[(rows["pass"] == "forward") & pd.to_numeric(rows["mass"], errors="coerce").notna()]
    num = {c: pd.to_numeric(rows[c], errors="coerce") if c in rows.columns else np.nan
           for c in ("select_ms", "select_flops", "select_bytes")}  # the last two: later
    return rows.assign(mass=pd.to_numeric(rows["mass"]), **num)


def matrix_budgets(meta: dict) -> list[float]:
    """The budgets the run's matrix asked for (any group), ascending; [] without."""
    groups = (meta.get("matrix") or {}).get("groups") or []
    return sorted({float(b) for g in groups for b in (g.get("budgets") or []) if b})


def nominal_budget(fraction: float, budgets: list[float]) -> float:
    """The budget of `budgets` nearest to a measured keys_per_query / N (in log), or the
    fraction itself to three figures where the matrix gave none."""
    if not budgets:
        return float(f"{fraction:.3g}")
    return min(budgets, key=lambda b: abs(math.log(fraction / b)))


def _varying(rows: pd.DataFrame) -> list[str]:
    """A variant's parameters that differ between its rows: what the budget set."""
    params = [json.loads(p) for p in rows["params"]]
    keys = sorted({k for p in params for k in p})
    return [k for k in keys if len({json.dumps(p.get(k)) for p in params}) > 1]


def frontier_table(rows: pd.DataFrame, sdpa: pd.DataFrame, budgets: list[float]) -> pd.DataFrame:
    """One setting's rows: selector, budget, the setting the budget chose, keys per query,
    mass, row_cos, select_ms, time_ms and time over sdpa's (numbers, not text)."""
    base = sdpa["time_ms"].median() if len(sdpa) else np.nan
    out = []
    for variant, g in rows.groupby("variant", sort=False):
        vary = _varying(g)
        for _, r in g.iterrows():
            p = json.loads(r["params"])
            frac = r["keys_per_query"] / r["seq_len"]
            fixed = ", ".join(f"{k}={v}" for k, v in sorted(p.items()) if k not in vary)
            out.append({"selector": variant, "line": f"{variant}({fixed})", "fraction": frac,
                        "budget": nominal_budget(frac, budgets),
                        "setting": ", ".join(f"{k}={p[k]}" for k in vary) or "–",
                        "keys_per_query": r["keys_per_query"], "mass": r["mass"],
                        "row_cos": r["row_cos"], "select_ms": r["select_ms"],
                        "select_flops": r["select_flops"], "select_bytes": r["select_bytes"],
                        "time_ms": r["time_ms"], "x_sdpa": r["time_ms"] / base,
                        "ceiling": variant in REFERENCE_CEILINGS})
    t = pd.DataFrame(out)
    return t.sort_values(["budget", "selector"], kind="stable").reset_index(drop=True)


def winners(t: pd.DataFrame) -> pd.DataFrame:
    """Per budget: the selector with the highest row_cos (the oracle excluded), its mass,
    and the one with the highest mass where that is another. Selectors within TIE of the
    best row_cos tie: "best row_cos" names them all ("tie: a, b"), best first."""
    rows = []
    for b, g in t[~t["ceiling"]].groupby("budget", sort=True):
        best = g.loc[g["row_cos"].idxmax()]
        most = g.loc[g["mass"].idxmax()]
        tied = g[g["row_cos"] >= best["row_cos"] - TIE].sort_values(
            "row_cos", ascending=False, kind="stable")["selector"].tolist()
        name = best["selector"] if len(tied) == 1 else "tie: " + ", ".join(tied)
        rows.append({"budget": b, "best row_cos": name,
                     "row_cos": best["row_cos"], "its mass": best["mass"],
                     "most mass": most["selector"]})
    return pd.DataFrame(rows)


def beats_baseline(t: pd.DataFrame) -> list[tuple]:
    """(selector row, moba row) pairs where the selector takes at most the moba row's time
    and a row_cos higher by more than TIE: it beats moba at equal time. The oracle
    excluded."""
    mob = t[t["selector"] == BASELINE]
    out = []
    for _, r in t[(t["selector"] != BASELINE) & ~t["ceiling"]].iterrows():
        slower = mob[(mob["time_ms"] >= r["time_ms"]) & (mob["row_cos"] < r["row_cos"] - TIE)]
        if len(slower):
            m = slower.loc[slower["row_cos"].idxmax()]
            out.append((r, m))
    return out


def _si(x) -> str:
    """A count in SI prefixes to three figures (12.3k, 4.19M); – for none (a fixed
    pattern computes nothing to select, a run before the columns)."""
    if x is None or not np.isfinite(x):
        return "–"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _fmt(t: pd.DataFrame) -> pd.DataFrame:
    f = t.copy()
    f["selector"] = [s + (" (oracle)" if c else "") for s, c in zip(f["selector"], f["ceiling"])]
    f["budget"] = [f"{b:.3g} N" for b in f["budget"]]
    f["keys_per_query"] = [f"{x:.1f}" for x in f["keys_per_query"]]
    for c in ("mass", "row_cos"):
        f[c] = [f"{x:.4f}" for x in f[c]]
    for c in ("select_ms", "time_ms"):
        f[c] = [T.fmt_num(x) if pd.notna(x) else "–" for x in f[c]]
    for c in ("select_flops", "select_bytes"):
        f[c] = [_si(x) for x in f[c]]
    f["x_sdpa"] = [f"{x:.2f}" if pd.notna(x) else "–" for x in f["x_sdpa"]]
    return f.drop(columns=["ceiling", "line", "fraction"]).rename(columns={
        "keys_per_query": "keys / query", "select_ms": "selection ms",
        "select_flops": "selection FLOPs / query", "select_bytes": "selection bytes / query",
        "time_ms": "time ms",
        "x_sdpa": "x sdpa"})


def _plot(tables: dict, path: Path) -> Path:
    """Three rows of panels, a column per setting: 1 - mass and 1 - row_cos against the
    measured budget (keys per query / N), a line per selector and fixed setting (a block
    size), and 1 - row_cos against time (filled: the call; hollow: its selection alone)."""
    names = sorted({s for t in tables.values() for s in t["selector"]})
    palette, _, _ = canvas.styles(pd.DataFrame({"line": names, "variant": names}))
    ncols, nrows = len(tables), 3
    fig = canvas.new_figure(canvas.PANEL_IN[0] * ncols + canvas.LEGEND_IN,
                            canvas.PANEL_IN[1] * nrows)
    canvas.adjust(fig, nrows, ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for col, (title, t) in enumerate(tables.items()):
        for (s, _), g in t.groupby(["selector", "line"], sort=True):
            g = g.sort_values("fraction")
            c = palette[s]
            axes[0][col].plot(g["fraction"], np.maximum(1 - g["mass"], 1e-7), marker="o",
                              color=c, markersize=4)
            axes[1][col].plot(g["fraction"], np.maximum(1 - g["row_cos"], 1e-7), marker="o",
                              color=c, markersize=4)
            err = np.maximum(1 - g["row_cos"], 1e-7)
            axes[2][col].scatter(g["time_ms"], err, color=c, s=16)
            sel = g["select_ms"].notna()
            axes[2][col].scatter(g.loc[sel, "select_ms"], err[sel], facecolors="none",
                                 edgecolors=c, s=16)
            for (_, r), e in zip(g[sel].iterrows(), err[sel]):
                axes[2][col].plot([r["select_ms"], r["time_ms"]], [e, e], color=c,
                                  linewidth=0.6, alpha=0.5)
        for row, (xl, yl) in enumerate((("budget (keys per query / N)", "1 - mass"),
                                        ("budget (keys per query / N)", "1 - row cosine"),
                                        ("ms (hollow: the selection alone)", "1 - row cosine"))):
            ax = axes[row][col]
            canvas.log_axes(ax, xbase=2 if row < 2 else 10)
            ax.set_title(title, fontsize=8)
            ax.set_xlabel(xl, fontsize=8)
            ax.set_ylabel(yl if col == 0 else "", fontsize=8)
            ax.grid(alpha=0.3)
    canvas.legend(fig, palette, ncols)
    return canvas.save(fig, path)


def blocks(run: Run) -> list[tuple]:
    """The section; [] where the run measured no selection."""
    rows = frontier_rows(run.df)
    if rows.empty:
        return []
    ok = T.against_softmax(T.ok_rows(run.df))
    budgets = matrix_budgets(run.meta)
    out = [("h", 2, TITLE),
           ("p", "Each selector at each budget (the mean keys a query attends to, as a "
                 "fraction of N: the run sets each selector's budget parameter, top_k or "
                 "random_blocks, to the value closest to it), forward. mass: the share of "
                 "exact attention's float64 mass on the keys it selects (1: nothing with "
                 "weight missed); row_cos: its output row's cosine to exact attention's; "
                 "selection ms: the selection alone (gate, indexer, top-k), part of time ms; "
                 "selection FLOPs and bytes / query: the scores it computes to choose, all "
                 "heads, and the bytes of what they read (block statistics, compressed or "
                 "indexer keys, keys; – for a fixed pattern); "
                 "x sdpa: time over sdpa's at the same setting. topk is the oracle (exact "
                 "scores, an O(N^2) selection): a ceiling for any selector at its budget, "
                 "left out of the answers.")]
    tables, answers = {}, []
    settings = sorted(set(zip(rows["input"], rows["seq_len"], rows["causal"])),
                      key=lambda s: (s[0] != "minilm", s[1], s[0]))
    for inp, n, causal in settings:
        at = (ok["input"] == inp) & (ok["seq_len"] == n) & (ok["causal"] == causal) \
            & (ok["pass"] == "forward")
        sdpa = ok[at & ok["variant"].isin(EXACT_PATHS[:1])]
        sub = rows[(rows["input"] == inp) & (rows["seq_len"] == n) & (rows["causal"] == causal)]
        t = frontier_table(sub, sdpa, budgets)
        title = f"{inp} · N = {int(n)}{' · causal' if causal else ''}"
        tables[title] = t
        out += [("h", 3, title), ("table", _fmt(t))]
        w = winners(t)
        if not w.empty:
            answers.append(f"{title}: " + "; ".join(
                f"at {r['budget']:.3g} N {r['best row_cos']} (row_cos {r['row_cos']:.4f}, "
                f"mass {r['its mass']:.4f}"
                + (f"; most mass: {r['most mass']}"
                   if r["most mass"] not in r["best row_cos"].removeprefix("tie: ").split(", ")
                   else "") + ")" for _, r in w.iterrows()) + ".")
        beats = beats_baseline(t)
        if t["selector"].eq(BASELINE).any():
            answers.append(f"{title}: " + (
                "beats moba at equal time: " + "; ".join(
                    f"{r['selector']} at {r['budget']:.3g} N ({T.fmt_num(r['time_ms'])} ms, "
                    f"row_cos {r['row_cos']:.4f}) against moba at {m['budget']:.3g} N "
                    f"({T.fmt_num(m['time_ms'])} ms, {m['row_cos']:.4f})" for r, m in beats)
                if beats else "no selector beats moba at equal time (none is at most as "
                              "slow as a moba setting with a row_cos higher by more than "
                              f"{TIE:g})") + ".")
    path = _plot(tables, run.dir / "plots" / "sparse_frontier.png")
    out += [("img", path, "mass and error against budget and time, per selector"),
            ("h", 3, "Answer"),
            ("p", "Which selector wins at which budget (the highest row_cos; the oracle "
                  f"excluded; selectors within {TIE:g} of it tie), and whether any beats "
                  "moba at equal time (at most a moba row's time with a row_cos higher by "
                  f"more than {TIE:g}, in the same setting). Times are one run's medians: "
                  "read a small lead in time as a tie.")]
    out += [("p", a) for a in answers]
    return out
