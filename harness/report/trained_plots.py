"""Figures of trained rows (train.csv; seaborn on the shared canvas, `canvas.py`): held-out
accuracy against length or pairs, the frontier of accuracy against state, accuracy against
forward time, and a stack's accuracy against its share of attention layers. The training
curves are curves.py's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd

from harness.report.canvas import (DPI, adjust, grid_size_px, legend, new_figure, save, styles,
                                   ticks_125)


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
    palette, dashes, markers = styles(df)
    w, h = grid_size_px(len(models), len(forms))
    fig = new_figure(w / DPI, h / DPI)
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
    adjust(fig, len(models), len(forms))
    chance = "chance (a model that reads nothing)"
    legend(fig, {**palette, chance: "black"}, len(forms), {**dashes, chance: (1, 1.5)},
            {**markers, chance: ""})
    return save(fig, path)


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
    palette, _, _ = styles(data.drop_duplicates("line"))
    marker, dash = _line_marks(palette)
    w, h = grid_size_px(1, 1)
    fig = new_figure(w / DPI, h / DPI)
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
    adjust(fig, 1, 1)
    chance, line09 = "chance (a model that reads nothing)", f"accuracy {bar:g}"
    legend(fig, {**palette, chance: "black", line09: "grey"}, 1,
            {**dash, chance: (1, 1.5), line09: (4, 2)},
            {**marker, chance: "", line09: ""})
    return save(fig, path)


def steps_plot(df: pd.DataFrame, title: str, path: Path) -> Path:
    """One task setting's sample efficiency: the steps to 0.9 accuracy (`steps_0_9`, a
    cell's median over seeds) against state bytes, log-log, one line per variant (`line`)
    through its sizes; a censored cell (median beyond the budget: inf) drawn hollow at
    its `budget`, outside the lines. df: one setting's cells."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    data = df.dropna(subset=["state_bytes"]).sort_values("state_bytes")
    palette, _, _ = styles(data.drop_duplicates("line"))
    marker, dash = _line_marks(palette)
    w, h = grid_size_px(1, 1)
    fig = new_figure(w / DPI, h / DPI)
    ax = fig.subplots(1, 1)
    for line, sub in data.groupby("line", sort=False):
        censored = sub["steps_0_9"] == float("inf")
        done = sub[~censored].groupby("state_bytes", as_index=False)["steps_0_9"].min()
        colour = palette[line]
        ax.plot(done["state_bytes"], done["steps_0_9"], color=colour, linewidth=1.2,
                linestyle=(0, dash[line]) if dash[line] else "-", marker=marker[line],
                markersize=4)
        ax.scatter(sub.loc[censored, "state_bytes"], sub.loc[censored, "budget"], s=18,
                   facecolors="white", edgecolors=colour, marker=marker[line], zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda v, _: f"{v / 1024:g} KiB" if v >= 1024 else f"{v:g} B"))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.set_xlabel("state per example (bytes, float32; log)")
    ax.set_ylabel("steps to 0.9 (median; hollow: > budget)")
    ax.grid(True, alpha=0.3)
    adjust(fig, 1, 1)
    legend(fig, palette, 1, dash, marker)
    return save(fig, path)


def accuracy_time_plot(df: pd.DataFrame, path: Path) -> Path:
    """Held-out accuracy against forward time_ms (from the same folder's results.csv) at
    the same N: one panel per trained (seq_len, causal), one marker per `line`."""
    import seaborn as sns

    panels = sorted(set(zip(df["seq_len"], df["causal"])), key=lambda p: (not p[1], p[0]))
    palette, _, markers = styles(df)
    w, h = grid_size_px(1, len(panels))
    fig = new_figure(w / DPI, h / DPI)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (n, causal) in zip(axes, panels):
        sub = df[(df["seq_len"] == n) & (df["causal"] == causal)]
        sns.scatterplot(data=sub, x="time_ms", y="accuracy", hue="line", style="line",
                        palette=palette, markers=markers, legend=False, ax=ax, s=30)
        ax.set_xscale("log")
        ticks_125(ax.xaxis)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"N = {n} · {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("forward time (ms, results.csv)")
        ax.set_ylabel("held-out accuracy")
        ax.grid(True, alpha=0.3)
    adjust(fig, 1, len(panels))
    legend(fig, palette, len(panels), markers=markers)
    return save(fig, path)


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
    fig = new_figure(w / DPI, h / DPI)
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
    adjust(fig, 1, 1)
    chance, line09, only = "chance (a model that reads nothing)", f"accuracy {bar:g}", \
        "attention only"
    legend(fig, {**colours, **({only: "black"} if len(pure) else {}), chance: "black",
                  line09: "grey"}, 1, {**dash, only: "", chance: (1, 1.5), line09: (4, 2)},
            {**marker, only: "*", chance: "", line09: ""})
    return fig


def share_plot(df: pd.DataFrame, title: str, path: Path, bar: float = 0.9) -> Path:
    """share_figure written to `path` (PNG)."""
    return save(share_figure(df, title, bar), path)
