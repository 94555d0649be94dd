"""The attention-map grid: exact attention's weights on one head, then each variant's, and
beside each its |difference| from exact, on one shared logarithmic colour scale.

Reads <run>/maps.npz (harness.files.MAPS; written after a run or by `attnbench maps`),
never computes: the maps, their differences (taken at full resolution when they were
made) and each variant's row cosine are in the file. Negative weights (Linformer's
Gaussian projection, Nyström's pseudo-inverse) are drawn by magnitude; the title then
gives the share of the map's absolute mass that is negative.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from harness.files import MAPS

PANEL_IN = 2.3      # one heatmap, inches
PAIRS_PER_ROW = 3   # (map, |difference|) pairs per row of the grid
DPI = 80
VMIN, VMAX = 1e-6, 1.0  # the shared colour scale (weights and differences)


def load(path: Path) -> tuple[dict, dict]:
    """(meta, arrays) of a maps.npz."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files if k != "meta"}
        meta = json.loads(str(f["meta"]))
    return meta, arrays


def describe(meta: dict) -> str:
    """Which head, input and length the maps are of, in words."""
    where = (f"layer {meta['layer']}, head {meta['head']} of the captured `{meta['input']}` "
             "inputs" if meta.get("layer") is not None else
             f"the synthetic `{meta['input']}` input (one head)")
    return (f"{where} at N = {meta['seq_len']}, "
            f"{'causal' if meta['causal'] else 'non-causal'}")


def grid_size_px(n_variants: int) -> tuple[int, int]:
    """(width, height) in pixels of the grid for n_variants drawn variants."""
    rows = math.ceil((n_variants + 1) / PAIRS_PER_ROW)
    return (round(2 * PAIRS_PER_ROW * PANEL_IN * DPI), round((rows * (PANEL_IN + 0.45) + 0.3) * DPI))


def draw(meta: dict, arrays: dict, path: Path) -> Path:
    """The grid as a PNG: exact first (the colour bar beside it), then (map, |map - exact|)
    per variant, PAIRS_PER_ROW pairs a row, titled with the label and the row cosine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    import matplotlib

    drawn = [r for r in meta["variants"] if r["status"] == "ok"]
    w, h = grid_size_px(len(drawn))
    fig = Figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    rows = math.ceil((len(drawn) + 1) / PAIRS_PER_ROW)
    axes = fig.subplots(rows, 2 * PAIRS_PER_ROW, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    cmap = matplotlib.colormaps["magma"].with_extremes(under="black", bad="black")
    norm = LogNorm(VMIN, VMAX)
    n = meta["seq_len"]
    extent = (0, n, n, 0)  # axes in tokens, whatever the stored resolution

    def show(ax, data, title):
        ax.set_axis_on()
        img = ax.imshow(np.abs(data.astype(np.float32)), cmap=cmap, norm=norm,
                        extent=extent, interpolation="antialiased")
        ax.set_title(title, fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        return img

    img = show(axes[0][0], arrays["exact"], "exact attention (float64)")
    bar = fig.colorbar(img, ax=axes[0][1], fraction=0.5, aspect=12)
    bar.set_label("weight, |difference|", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    for i, rec in enumerate(drawn, start=1):
        r, c = divmod(i, PAIRS_PER_ROW)
        neg = f", {rec['neg_mass']:.0%} of |mass| < 0" if rec["neg_mass"] > 0.005 else ""
        label = _wrap(rec["label"])
        show(axes[r][2 * c], arrays[rec["map"]], f"{label}\nrow cos {rec['row_cos']:.4f}{neg}")
        show(axes[r][2 * c + 1], arrays[rec["diff"]], "|difference| from exact")
    fig.suptitle(f"Attention weights, {describe(meta)}", fontsize=9)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.75 / (h / DPI),
                        wspace=0.08, hspace=0.45)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_palette(fig, path)
    return path


def _save_palette(fig, path: Path) -> None:
    """The figure as a 256-colour palette PNG: the colour map has 256 colours, so this
    loses nothing visible and takes about a third of an RGB PNG's bytes (370 KB against
    960 KB for the quick preset's grid)."""
    from PIL import Image

    fig.canvas.draw()
    rgb = Image.frombuffer("RGBA", fig.canvas.get_width_height(),
                           fig.canvas.buffer_rgba()).convert("RGB")
    rgb.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, format="png", optimize=True)


def _wrap(label: str, width: int = 34) -> str:
    """A label on at most two lines, cut at a parameter boundary."""
    if len(label) <= width:
        return label
    cut = label.rfind(", ", 0, width)
    head, tail = (label[:cut + 1], label[cut + 2:]) if cut > 0 else (label[:width], label[width:])
    return head + "\n" + (tail if len(tail) <= width else tail[:width - 1] + "…")


def _sci(x: float) -> str:
    """1e-06 -> '1e-6'."""
    mantissa, _, exp = f"{x:.0e}".partition("e")
    return f"{mantissa}e{int(exp)}" if int(exp) else mantissa


INTRO = ("Exact attention's weights, then each variant's (the map it implies: its "
         "`weights(q, k)`, whose product with v is its output), and beside each the "
         "absolute difference from exact, all on one logarithmic colour scale from "
         f"{_sci(VMIN)} (black: below) to {_sci(VMAX)}. Titles give the mean row cosine of the "
         "variant's output to exact attention's on this head. Maps are block means at "
         "most 256 x 256 (2 x 2 tokens at N = 512); negative weights are drawn by magnitude.")


def maps_blocks(run_dir: Path) -> list[tuple]:
    """The report's "Attention maps" section: the grid drawn into plots/, or a line saying
    why there is none."""
    path = Path(run_dir) / MAPS
    blocks: list[tuple] = [("h", 2, "Attention maps")]
    if not path.is_file():
        return blocks + [("p", f"No {MAPS} in this run folder (`run` writes it after the "
                               "run's last case; `attnbench maps` draws any head).")]
    meta, arrays = load(path)
    png = draw(meta, arrays, Path(run_dir) / "plots" / "attention_maps.png")
    skipped = [f"{r['label']}: {r['reason']}" for r in meta["variants"] if r["status"] != "ok"]
    about = describe(meta)
    blocks += [("p", f"{about[0].upper()}{about[1:]}. {INTRO}"),
               ("img", png, f"attention maps, {describe(meta)}")]
    if skipped:
        blocks.append(("p", "No map: " + "; ".join(skipped) + "."))
    return blocks
