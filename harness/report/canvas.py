"""What the report's figures share: the page geometry (a panel's inches, the legend's
room, the dots per inch), a figure on matplotlib's Agg canvas (never pyplot, so no global
backend or figure state is touched and no display is needed), one colour per variant with
a dash and marker per setting, log axes, the legend and the PNG writer. The figures
themselves: plots.py (benchmark rows), trained_plots.py (train.csv rows), curves.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd

PANEL_IN = (4.0, 3.0)  # width, height of one facet, inches
LEGEND_IN = 3.2        # room on the right for the legend, inches
DPI = 100


def grid_size_px(nrows: int, ncols: int) -> tuple[int, int]:
    """(width, height) in pixels of a faceted figure: what the PNG written here measures."""
    return (round((PANEL_IN[0] * ncols + LEGEND_IN) * DPI), round(PANEL_IN[1] * nrows * DPI))


def new_figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def styles(df: pd.DataFrame) -> tuple[dict, dict, dict]:
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


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def adjust(fig, nrows: int, ncols: int) -> None:
    w_in, h_in = PANEL_IN[0] * ncols + LEGEND_IN, PANEL_IN[1] * nrows
    fig.subplots_adjust(left=0.75 / w_in, right=PANEL_IN[0] * ncols / w_in, bottom=0.5 / h_in,
                        top=1 - 0.3 / h_in, hspace=0.45, wspace=0.3)


def log_axes(ax, xbase: int = 10) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    # Minor log ticks cost most of the drawing time and add little here.
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_locator(NullLocator())


def ticks_125(axis) -> None:
    """Log ticks at 1, 2 and 5 per decade, so a range under one decade still gets labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def legend(fig, palette: dict, ncols: int, dashes: dict | None = None,
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
