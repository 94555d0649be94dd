"""Figures of benchmark rows (seaborn on the shared canvas, `canvas.py`): scaling against
length, the error-vs-time Pareto front, GFLOP/s, error against the budget of keys.

Each function takes the tidy results (`run_folder.read_results`) and writes one PNG.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from harness.report.analysis import pareto_front
from harness.report.canvas import (DPI, adjust, grid_size_px, legend, log_axes, new_figure,
                                   save, styles, ticks_125)


def scaling_plot(df: pd.DataFrame, metric: str, ylabel: str, path: Path,
                 band: str | None = None, also: str | None = None) -> Path:
    """`metric` against seq_len, log-log, one line per `line`, faceted (pass, causal) x input.

    df must hold ok rows with `line` and `variant` columns. Colour is the variant, dash and
    marker its setting; a panel with no data is left blank. `band` names a spread column
    (time_ms_iqr) drawn as median +- spread/2 around each line. `also` names a second
    column of the same unit (state_mib beside peak_mem_mib) drawn thin and dotted, with x
    markers, in each line's colour, where it is above 0.5.
    """
    import seaborn as sns

    data = df[np.isfinite(df[metric]) & (df[metric] > 0)]
    rows = sorted(set(zip(df["pass"], df["causal"])), key=lambda pc: (pc[1], pc[0]))
    inputs = sorted(df["input"].unique())
    palette, dashes, markers = styles(df)
    w, h = grid_size_px(len(rows), len(inputs))
    fig = new_figure(w / DPI, h / DPI)
    axes = fig.subplots(len(rows), len(inputs), squeeze=False, sharex=True)
    for r, (p, causal) in enumerate(rows):
        for c, inp in enumerate(inputs):
            ax = axes[r][c]
            sub = data[(data["pass"] == p) & (data["causal"] == causal)
                       & (data["input"] == inp)].sort_values("seq_len")
            if sub.empty:
                ax.set_axis_off()
                continue
            sns.lineplot(data=sub, x="seq_len", y=metric, hue="line", style="line",
                         palette=palette, dashes=dashes, markers=markers, markersize=4,
                         legend=False, ax=ax, errorbar=None)
            if band is not None:
                for line, g in sub.groupby("line"):
                    spread = g[band].fillna(0).to_numpy() / 2
                    lo = np.maximum(g[metric].to_numpy() - spread, g[metric].to_numpy() * 1e-3)
                    ax.fill_between(g["seq_len"], lo, g[metric] + spread,
                                    color=palette[line], alpha=0.25, linewidth=0)
            if also is not None and also in sub.columns:
                for line, g in sub[sub[also] > 0.5].groupby("line"):
                    ax.plot(g["seq_len"], g[also], color=palette[line], linestyle=":",
                            linewidth=0.9, marker="x", markersize=4)
            log_axes(ax, 2)
            ax.set_title(f"{p} · {inp}{' · causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel if c == 0 else "")
            ax.grid(True, which="major", alpha=0.3)
    adjust(fig, len(rows), len(inputs))
    legend(fig, palette, len(inputs), dashes, markers)
    return save(fig, path)


def pareto_plot(df: pd.DataFrame, lengths: list[int], path: Path, err: str = "rel_err",
                ylabel: str = "relative error") -> Path:
    """An error column (rel_err unless told) against time_ms at the given lengths (rows) per
    input (columns).

    df: ok rows of one pass/shape with a `line` column. The Pareto front (no other point
    both faster and more accurate) is joined by a step line and labelled.
    """
    import seaborn as sns

    inputs = sorted(df["input"].unique())
    palette, _, markers = styles(df)
    w, h = grid_size_px(len(lengths), len(inputs))
    fig = new_figure(w / DPI, h / DPI)
    axes = fig.subplots(len(lengths), len(inputs), squeeze=False)
    for r, n in enumerate(lengths):
        for c, inp in enumerate(inputs):
            ax = axes[r][c]
            sub = df[(df["seq_len"] == n) & (df["input"] == inp)].copy()
            sub = sub[np.isfinite(sub["time_ms"]) & np.isfinite(sub[err])]
            # Exact paths can reach 0 error; clip so they stay on the log axis.
            sub[err] = sub[err].clip(lower=1e-9)
            if sub.empty:
                ax.set_axis_off()
                continue
            sns.scatterplot(data=sub, x="time_ms", y=err, hue="line", style="line",
                            palette=palette, markers=markers, legend=False, ax=ax, s=25)
            front = sub[pareto_front(sub["time_ms"], sub[err])].sort_values("time_ms")
            ax.step(front["time_ms"], front[err], where="post", color="black",
                    linewidth=0.8, alpha=0.6)
            # Front points often sit side by side at one error level: short labels,
            # alternately above and below, so neighbours do not overprint.
            for i, (_, row) in enumerate(front.iterrows()):
                ax.annotate(_short(row["line"]), (row["time_ms"], row[err]), fontsize=6,
                            xytext=(3, 4 if i % 2 == 0 else -9), textcoords="offset points")
            log_axes(ax)
            ticks_125(ax.xaxis)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_title(f"N = {n} · {inp}", fontsize=9)
            ax.set_xlabel("time (ms)")
            ax.set_ylabel(ylabel if c == 0 else "")
            ax.grid(True, alpha=0.3)
    adjust(fig, len(lengths), len(inputs))
    legend(fig, palette, len(inputs), markers=markers)
    return save(fig, path)


def _short(line: str, width: int = 30) -> str:
    """A plot annotation: the label cut to `width` characters (the legend has it whole)."""
    return line if len(line) <= width else line[:width - 1] + "…"


def gflops_size_px(n_labels: int) -> tuple[int, int]:
    """(width, height) in pixels of the GFLOP/s bar chart for n_labels variants."""
    return (round(8.0 * DPI), round((1.5 + 0.28 * n_labels) * DPI))


def gflops_plot(df: pd.DataFrame, matmul_gflops: float | None, path: Path,
                matmul_label: str = "cpu float32 matmul") -> Path:
    """Best achieved GFLOP/s per line and pass, against a matmul rate measured on the same
    device in the same dtype (`matmul_label` names it)."""
    import seaborn as sns

    data = df[np.isfinite(df["gflops_per_s"])]
    best = data.groupby(["line", "pass"], sort=False, as_index=False)["gflops_per_s"].max()
    lines = list(dict.fromkeys(df["line"]))
    w, h = gflops_size_px(len(lines))
    fig = new_figure(w / DPI, h / DPI)
    ax = fig.subplots()
    if len(best):
        sns.barplot(data=best, y="line", x="gflops_per_s", hue="pass", order=lines, ax=ax)
    if matmul_gflops:
        ax.axvline(matmul_gflops, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"{matmul_label} {matmul_gflops:.0f} GFLOP/s", (matmul_gflops, 1),
                    xytext=(-3, -3), textcoords="offset points", ha="right", va="top",
                    fontsize=7, xycoords=("data", "axes fraction"))
    ax.set_xlabel("achieved GFLOP/s (analytic FLOPs / median time; best over lengths)")
    ax.set_ylabel("")
    ax.set_yticks(ax.get_yticks(), [textwrap.fill(t.get_text(), 36, subsequent_indent="  ")
                                    for t in ax.get_yticklabels()])
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(True, axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.38, right=0.97, bottom=0.6 / (h / DPI), top=1 - 0.3 / (h / DPI))
    return save(fig, path)


def budget_plot(df: pd.DataFrame, path: Path) -> Path:
    """1 - row_cos against the budget (keys_per_query over the keys a query could see: N,
    causal (N + 1) / 2), log-log, one line per variant through its settings; a panel per
    (input, N, causal), three to a row. This is where fixed patterns (a window, a block
    layout) and content-routed selections (top-k blocks, pages, keys) meet.

    df: ok forward rows with row_cos and keys_per_query, errors against softmax. A row
    within 1e-7 of exact is drawn at 1e-7.
    """
    import seaborn as sns
    from matplotlib.ticker import NullLocator

    full = np.where(df["causal"], (df["seq_len"] + 1) / 2, df["seq_len"])
    data = df.assign(budget=df["keys_per_query"] / full,
                     miss=np.maximum(1 - df["row_cos"], 1e-7), line=df["variant"])
    panels = sorted(set(zip(data["input"], data["seq_len"], data["causal"])),
                    key=lambda p: (p[2], p[0], p[1]))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    palette, _, markers = styles(data)
    w, h = grid_size_px(nrows, ncols)
    fig = new_figure(w / DPI, h / DPI)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True).flatten()
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    for i, (ax, (inp, n, causal)) in enumerate(zip(axes, panels)):
        sub = data[(data["input"] == inp) & (data["seq_len"] == n)
                   & (data["causal"] == causal)].sort_values("budget")
        sns.lineplot(data=sub, x="budget", y="miss", hue="line", style="line",
                     palette=palette, dashes=False, markers=markers, markersize=5,
                     legend=False, ax=ax, errorbar=None, sort=False)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_title(f"{inp} · N = {n}{' · causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("keys per query / keys it could see")
        ax.set_ylabel("1 - row cosine" if i % ncols == 0 else "")
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(axis="x", labelbottom=True)
    adjust(fig, nrows, ncols)
    legend(fig, palette, ncols, markers=markers)
    return save(fig, path)
