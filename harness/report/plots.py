"""Report figures (seaborn on matplotlib's Agg canvas): scaling, error-vs-time Pareto, GFLOP/s.

Each function takes the tidy results (`run_folder.read_results`) and writes one PNG. The
figures are built on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot,
so no global backend or figure state is touched and no display is needed.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from harness.report.analysis import pareto_front

PANEL_IN = (4.0, 3.0)  # width, height of one facet, inches
LEGEND_IN = 3.2        # room on the right for the legend, inches
DPI = 100


def grid_size_px(nrows: int, ncols: int) -> tuple[int, int]:
    """(width, height) in pixels of a faceted figure: what the PNG written here measures."""
    return (round((PANEL_IN[0] * ncols + LEGEND_IN) * DPI), round(PANEL_IN[1] * nrows * DPI))


def _new_figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _styles(df: pd.DataFrame) -> tuple[dict, dict, dict]:
    """(palette, dashes, markers) per `line`: one colour per variant (tab10, so colours do
    not repeat before ten variants), one dash pattern and marker per setting within it."""
    import seaborn as sns

    lines = list(dict.fromkeys(df["line"]))
    variant_of = dict(zip(df["line"], df["variant"]))
    variants = list(dict.fromkeys(variant_of[ln] for ln in lines))
    colours = dict(zip(variants, sns.color_palette("tab10" if len(variants) <= 10 else "husl",
                                                   len(variants))))
    dash_cycle = ["", (4, 2), (1, 1.5), (6, 2, 1, 2), (2, 3)]
    marker_cycle = ["o", "s", "^", "D", "v"]
    palette, dashes, markers, seen = {}, {}, {}, {}
    for ln in lines:
        v = variant_of[ln]
        i = seen[v] = seen.get(v, -1) + 1
        palette[ln] = colours[v]
        dashes[ln] = dash_cycle[i % len(dash_cycle)]
        markers[ln] = marker_cycle[i % len(marker_cycle)]
    return palette, dashes, markers


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _adjust(fig, nrows: int, ncols: int) -> None:
    w_in, h_in = PANEL_IN[0] * ncols + LEGEND_IN, PANEL_IN[1] * nrows
    fig.subplots_adjust(left=0.75 / w_in, right=PANEL_IN[0] * ncols / w_in, bottom=0.5 / h_in,
                        top=1 - 0.3 / h_in, hspace=0.45, wspace=0.3)


def _log_axes(ax, xbase: int = 10) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    # Minor log ticks cost most of the drawing time and add little here.
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_locator(NullLocator())


def _ticks_125(axis) -> None:
    """Log ticks at 1, 2 and 5 per decade, so a range under one decade still gets labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _legend(fig, palette: dict, ncols: int, dashes: dict | None = None,
            markers: dict | None = None) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker=(markers or {}).get(name, "o"), markersize=4,
                      linestyle=(0, dashes[name]) if dashes and dashes[name] else
                      ("-" if dashes is not None else "none"))
               for name, c in palette.items()]
    # Labels carry every parameter; wrap them so the legend fits its column.
    names = [textwrap.fill(name, 48, subsequent_indent="  ") for name in palette]
    fig.legend(handles, names, loc="center left", fontsize=7, frameon=False,
               bbox_to_anchor=(PANEL_IN[0] * ncols / (PANEL_IN[0] * ncols + LEGEND_IN), 0.5))


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
    palette, dashes, markers = _styles(df)
    w, h = grid_size_px(len(rows), len(inputs))
    fig = _new_figure(w / DPI, h / DPI)
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
            _log_axes(ax, 2)
            ax.set_title(f"{p} · {inp}{' · causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(ylabel if c == 0 else "")
            ax.grid(True, which="major", alpha=0.3)
    _adjust(fig, len(rows), len(inputs))
    _legend(fig, palette, len(inputs), dashes, markers)
    return _save(fig, path)


def pareto_plot(df: pd.DataFrame, lengths: list[int], path: Path, err: str = "rel_err",
                ylabel: str = "relative error") -> Path:
    """An error column (rel_err unless told) against time_ms at the given lengths (rows) per
    input (columns).

    df: ok rows of one pass/shape with a `line` column. The Pareto front (no other point
    both faster and more accurate) is joined by a step line and labelled.
    """
    import seaborn as sns

    inputs = sorted(df["input"].unique())
    palette, _, markers = _styles(df)
    w, h = grid_size_px(len(lengths), len(inputs))
    fig = _new_figure(w / DPI, h / DPI)
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
            _log_axes(ax)
            _ticks_125(ax.xaxis)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_title(f"N = {n} · {inp}", fontsize=9)
            ax.set_xlabel("time (ms)")
            ax.set_ylabel(ylabel if c == 0 else "")
            ax.grid(True, alpha=0.3)
    _adjust(fig, len(lengths), len(inputs))
    _legend(fig, palette, len(inputs), markers=markers)
    return _save(fig, path)


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
    fig = _new_figure(w / DPI, h / DPI)
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
    return _save(fig, path)


def accuracy_plot(df: pd.DataFrame, x: str, xlabel: str, path: Path) -> Path:
    """Held-out accuracy of trained models against `x` (seq_len or num_kv_pairs), one line
    per `line`, faceted by the model (`model` column: d_model, layers...) in rows and by
    causal in columns; the task's chance level as a dotted black line.

    df: train.csv rows with `line`, `variant`, `model` (a string); accuracy is 0..1, rows
    that did not train are left out. Where several rows share a line and an x (other
    settings differ), the points are their mean.
    """
    import seaborn as sns
    from matplotlib.ticker import NullLocator

    data = df[df["status"] == "ok"]
    models = list(dict.fromkeys(df["model"]))
    forms = sorted(df["causal"].unique(), reverse=True)  # causal first
    palette, dashes, markers = _styles(df)
    w, h = grid_size_px(len(models), len(forms))
    fig = _new_figure(w / DPI, h / DPI)
    axes = fig.subplots(len(models), len(forms), squeeze=False, sharey=True)
    for r, model in enumerate(models):
        for c, causal in enumerate(forms):
            ax = axes[r][c]
            sub = data[(data["model"] == model) & (data["causal"] == causal)]
            if sub.empty:
                ax.set_axis_off()
                continue
            mean = sub.groupby(["line", x], as_index=False)["accuracy"].mean()
            sns.lineplot(data=mean, x=x, y="accuracy", hue="line", style="line",
                         palette=palette, dashes=dashes, markers=markers, markersize=5,
                         legend=False, ax=ax, errorbar=None)
            floor = sub.groupby(x)["chance"].mean()
            ax.plot(floor.index, floor.to_numpy(), color="black", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(sub[x].unique()), [f"{v:g}" for v in sorted(sub[x].unique())])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{model} · {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out accuracy" if c == 0 else "")
            ax.grid(True, alpha=0.3)
    _adjust(fig, len(models), len(forms))
    chance = "chance (a model that reads nothing)"
    _legend(fig, {**palette, chance: "black"}, len(forms), {**dashes, chance: (1, 1.5)},
            {**markers, chance: ""})
    return _save(fig, path)


def _line_marks(names) -> tuple[dict, dict]:
    """A marker and a dash per line name, in order: past ten lines the colours are husl's,
    neighbours alike, so each line is also told apart by its marker and dash."""
    markers, dashes = ["o", "s", "^", "D", "v", "P", "X"], ["", (4, 2), (1, 1.5)]
    names = list(names)
    return ({n: markers[i % len(markers)] for i, n in enumerate(names)},
            {n: dashes[i % len(dashes)] for i, n in enumerate(names)})


def frontier_plot(df: pd.DataFrame, title: str, path: Path, bar: float = 0.9) -> Path:
    """One task setting's frontier (Zoology, Based): held-out accuracy against the state a
    model keeps per example, in bytes, log x-axis; one line per variant (`line`, colour by
    `variant`) through its sizes in order of state, at each state its best accuracy (block
    sizes that keep the same cache share a state); every configuration a marker, hollow
    where `hollow` (it had not settled), with a bar from `acc_min` to `acc_max` (the
    range over its seeds) where those columns are there. The task's chance level dotted
    black, `bar` (the Answers' 0.9) dashed grey.

    df: one setting's points with `line`, `variant`, `state_bytes`, `accuracy` (a cell's
    median over seeds), `hollow` and `chance`; optionally `acc_min`, `acc_max`."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    data = df.dropna(subset=["state_bytes"]).sort_values("state_bytes")
    palette, _, _ = _styles(data.drop_duplicates("line"))
    marker, dash = _line_marks(palette)
    w, h = grid_size_px(1, 1)
    fig = _new_figure(w / DPI, h / DPI)
    ax = fig.subplots(1, 1)
    for line, sub in data.groupby("line", sort=False):
        best = sub.groupby("state_bytes", as_index=False)["accuracy"].max()
        colour = palette[line]
        ax.plot(best["state_bytes"], best["accuracy"], color=colour, linewidth=1.2,
                linestyle=(0, dash[line]) if dash[line] else "-")
        if "acc_min" in sub and (sub["acc_max"] > sub["acc_min"]).any():
            ax.errorbar(sub["state_bytes"], sub["accuracy"],
                        yerr=[sub["accuracy"] - sub["acc_min"], sub["acc_max"] - sub["accuracy"]],
                        fmt="none", ecolor=colour, elinewidth=0.8, capsize=2, zorder=2)
        hollow = sub["hollow"].fillna(False).astype(bool)
        ax.scatter(sub.loc[~hollow, "state_bytes"], sub.loc[~hollow, "accuracy"], s=18,
                   color=colour, marker=marker[line], zorder=3)
        ax.scatter(sub.loc[hollow, "state_bytes"], sub.loc[hollow, "accuracy"], s=18,
                   facecolors="white", edgecolors=colour, marker=marker[line], zorder=3)
    if len(data):
        lo, hi = data["state_bytes"].min(), data["state_bytes"].max()
        ax.plot([lo, hi], [data["chance"].mean()] * 2, color="black", linestyle=":",
                linewidth=1)
        ax.axhline(bar, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda v, _: f"{v / 1024:g} KiB" if v >= 1024 else f"{v:g} B"))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.set_xlabel("state per example (bytes, float32; log)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(True, alpha=0.3)
    _adjust(fig, 1, 1)
    chance, line09 = "chance (a model that reads nothing)", f"accuracy {bar:g}"
    _legend(fig, {**palette, chance: "black", line09: "grey"}, 1,
            {**dash, chance: (1, 1.5), line09: (4, 2)},
            {**marker, chance: "", line09: ""})
    return _save(fig, path)


def accuracy_time_plot(df: pd.DataFrame, path: Path) -> Path:
    """Held-out accuracy against forward time_ms (from the same folder's results.csv) at
    the same N: one panel per trained (seq_len, causal), one marker per `line`."""
    import seaborn as sns

    panels = sorted(set(zip(df["seq_len"], df["causal"])), key=lambda p: (not p[1], p[0]))
    palette, _, markers = _styles(df)
    w, h = grid_size_px(1, len(panels))
    fig = _new_figure(w / DPI, h / DPI)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (n, causal) in zip(axes, panels):
        sub = df[(df["seq_len"] == n) & (df["causal"] == causal)]
        sns.scatterplot(data=sub, x="time_ms", y="accuracy", hue="line", style="line",
                        palette=palette, markers=markers, legend=False, ax=ax, s=30)
        ax.set_xscale("log")
        _ticks_125(ax.xaxis)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"N = {n} · {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("forward time (ms, results.csv)")
        ax.set_ylabel("held-out accuracy")
        ax.grid(True, alpha=0.3)
    _adjust(fig, 1, len(panels))
    _legend(fig, palette, len(panels), markers=markers)
    return _save(fig, path)


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
    palette, _, markers = _styles(data)
    w, h = grid_size_px(nrows, ncols)
    fig = _new_figure(w / DPI, h / DPI)
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
    _adjust(fig, nrows, ncols)
    _legend(fig, palette, ncols, markers=markers)
    return _save(fig, path)


def share_figure(df: pd.DataFrame, title: str, bar: float = 0.9):
    """Held-out accuracy against the share of a model's layers that are full attention
    (0 .. 1), one line per `mixer` through its points in order of share, the rows whose
    mixer is "" (attention only) a black star that ends every line; a bar from `acc_min`
    to `acc_max` (the seeds' range) at each point, hollow markers where `hollow`; chance
    dotted black, `bar` dashed grey. Artists carry gids "<mixer>:filled", ":hollow",
    ":range" (the tests read the points back). Returns the Figure.

    df: one task setting's points with `mixer`, `share`, `accuracy` (the median over a
    cell's seeds), `acc_min`, `acc_max`, `hollow` and `chance`."""
    import seaborn as sns
    from fractions import Fraction

    pure = df[df["mixer"] == ""].sort_values("share")
    lines = sorted(m for m in df["mixer"].unique() if m)
    colours = dict(zip(lines, sns.color_palette("tab10" if len(lines) <= 10 else "husl",
                                                max(len(lines), 1))))
    marker, dash = _line_marks(lines)
    w, h = grid_size_px(1, 1)
    fig = _new_figure(w / DPI, h / DPI)
    ax = fig.subplots(1, 1)

    def draw(sub, name, colour, mark):
        _, _, (bars,) = ax.errorbar(
            sub["share"], sub["accuracy"],
            yerr=[sub["accuracy"] - sub["acc_min"], sub["acc_max"] - sub["accuracy"]],
            fmt="none", ecolor=colour, elinewidth=0.8, capsize=2, zorder=2)
        bars.set_gid(f"{name}:range")
        hollow = sub["hollow"].astype(bool)
        ax.scatter(sub.loc[~hollow, "share"], sub.loc[~hollow, "accuracy"], s=24,
                   color=colour, marker=mark, zorder=3, gid=f"{name}:filled")
        ax.scatter(sub.loc[hollow, "share"], sub.loc[hollow, "accuracy"], s=24,
                   facecolors="white", edgecolors=colour, marker=mark, zorder=3,
                   gid=f"{name}:hollow")

    for m in lines:
        own = df[df["mixer"] == m].sort_values("share")
        joined = pd.concat([own, pure]).sort_values("share")
        ax.plot(joined["share"], joined["accuracy"], color=colours[m], linewidth=1.2,
                linestyle=(0, dash[m]) if dash[m] else "-")
        draw(own, m, colours[m], marker[m])
    if len(pure):
        draw(pure, "", "black", "*")
    ax.axhline(df["chance"].mean(), color="black", linestyle=":", linewidth=1)
    ax.axhline(bar, color="grey", linestyle="--", linewidth=0.8)
    shares = sorted(df["share"].unique())
    ax.set_xticks(shares, [str(Fraction(s).limit_denominator(64)) for s in shares])
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.set_xlabel("share of layers that are full attention")
    ax.set_ylabel("held-out accuracy")
    ax.grid(True, alpha=0.3)
    _adjust(fig, 1, 1)
    chance, line09, only = "chance (a model that reads nothing)", f"accuracy {bar:g}", \
        "attention only"
    _legend(fig, {**colours, **({only: "black"} if len(pure) else {}), chance: "black",
                  line09: "grey"}, 1, {**dash, only: "", chance: (1, 1.5), line09: (4, 2)},
            {**marker, only: "*", chance: "", line09: ""})
    return fig


def share_plot(df: pd.DataFrame, title: str, path: Path, bar: float = 0.9) -> Path:
    """share_figure written to `path` (PNG)."""
    return _save(share_figure(df, title, bar), path)
