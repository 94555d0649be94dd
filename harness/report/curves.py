"""The trained section's "Training curves below 0.9": for each task setting, the best cell of
every variant whose median over its seeds stays below 0.9, each seed's winning run as it
went (held-out accuracy and held-out loss at every evaluation, train_curves.jsonl).

A plateau (MQAR's: accuracy flat while the loss falls) and a run cut at its cap read apart
here; the table gives each run's rate, steps, why it stopped, and its accuracy and loss
at a few steps. A folder without train_curves.jsonl (a sweep from before it existed) has
no such part.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd

from harness.files.curves import TRAIN_CURVES, read_curves
from harness.report import canvas
from harness.report.cells import CELL, cells
from harness.report.frontier import _slug, task_settings, with_sizes

RECALL = 0.9
_SETTING = ("task_setting", "task", "causal", "seq_len", "num_kv_pairs", "vocab_size")
AT_STEPS = 4  # the table's columns: accuracy and loss at this many steps along the run


def below(tr: pd.DataFrame) -> pd.DataFrame:
    """Per task setting and variant, its best cell (median over seeds) when that stays
    below RECALL: the cells' rows, with `task_setting` and `size`."""
    ok = tr[tr["status"] == "ok"]
    if ok.empty:
        return ok
    c = with_sizes(cells(ok))
    best = c.sort_values("accuracy", ascending=False, kind="stable").drop_duplicates(
        ["task_setting", "variant"])
    return best[best["accuracy"] < RECALL]


def winning_runs(tr: pd.DataFrame, best: pd.DataFrame, curves: dict) -> pd.DataFrame:
    """One row per seed of each cell in `best`: its winning rate's run from `curves`
    (rows whose run is not in the file are left out)."""
    ok = tr[tr["status"] == "ok"]
    out = []
    for _, cell in best.iterrows():
        same = (ok[CELL].astype(str) == cell[CELL].astype(str)).all(axis=1)
        for _, row in ok[same].sort_values("seed", kind="stable").iterrows():
            got = curves.get(row["config_id"])
            run = None if got is None else next(
                (r for r in got["runs"] if abs(r["lr"] - float(row["best_lr"]))
                 <= 1e-12 * r["lr"]), None)
            if run is None or not run.get("history"):
                continue
            out.append({**{k: cell[k] for k in _SETTING}, "variant": cell["variant"],
                        "size": cell["size"], "median": cell["accuracy"],
                        "seed": int(row["seed"]), "lr": run["lr"],
                        "steps_run": run["steps_run"], "stopped": run["stopped"],
                        "history": run["history"],
                        "held_out_loss": run.get("held_out_loss") or []})
    return pd.DataFrame(out)


def _at(points: list, n: int) -> list[tuple[int, float]]:
    """n points spread along a run's [[step, value], ...], the last included."""
    if not points:
        return []
    idx = sorted({round(i * (len(points) - 1) / max(n - 1, 1)) for i in range(n)})
    return [(points[i][0], points[i][1]) for i in idx]


def runs_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Each run: its rate, steps, why it stopped, and accuracy / held-out loss along it."""
    def along(r) -> str:
        loss = dict(map(tuple, r["held_out_loss"]))
        return ", ".join(f"{s}: {a:.3f}" + (f" / {loss[s]:.2f}" if s in loss else "")
                         for s, a in _at(r["history"], AT_STEPS))
    return pd.DataFrame({
        "variant": [f"{r.variant} {r.size}".strip() for r in runs.itertuples()],
        "median": runs["median"].map(lambda v: f"{v:.3f}"), "seed": runs["seed"],
        "lr": runs["lr"].map(lambda v: f"{v:g}"), "steps run": runs["steps_run"],
        "stopped": runs["stopped"].fillna("cut by the race"),
        "step: accuracy / held-out loss": [along(r) for _, r in runs.iterrows()]})


def curves_figure(runs: pd.DataFrame, title: str):
    """Two panels, held-out accuracy and held-out loss against the step, one colour per
    cell (variant and size), one dash per seed; artists carry gids "<cell>:<seed>:acc" and
    ":loss" (the tests read the lines back). Returns the Figure."""
    import seaborn as sns

    names = list(dict.fromkeys(f"{r.variant} {r.size}".strip() for r in runs.itertuples()))
    colours = dict(zip(names, sns.color_palette("tab10" if len(names) <= 10 else "husl",
                                                len(names))))
    seeds = sorted(runs["seed"].unique())
    dashes = dict(zip(seeds, ["", (4, 2), (1, 1.5), (6, 2, 1, 2)] * 4))
    w, h = canvas.grid_size_px(1, 2)
    fig = canvas.new_figure(w / canvas.DPI, h / canvas.DPI)
    acc_ax, loss_ax = fig.subplots(1, 2)
    for r in runs.itertuples():
        name = f"{r.variant} {r.size}".strip()
        style = dict(color=colours[name], linewidth=1.1,
                     linestyle=(0, dashes[r.seed]) if dashes[r.seed] else "-")
        acc_ax.plot(*zip(*r.history), gid=f"{name}:{r.seed}:acc", **style)
        if r.held_out_loss:
            loss_ax.plot(*zip(*r.held_out_loss), gid=f"{name}:{r.seed}:loss", **style)
    acc_ax.set_ylim(-0.02, 1.02)
    acc_ax.axhline(RECALL, color="grey", linestyle="--", linewidth=0.8)
    for ax, label in ((acc_ax, "held-out accuracy"), (loss_ax, "held-out loss")):
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(textwrap.fill(title, 80), fontsize=9)
    canvas.adjust(fig, 1, 2)
    canvas.legend(fig, {**colours, **{f"seed {s}": "black" for s in seeds}}, 2,
                  {**{n: "" for n in names}, **{f"seed {s}": dashes[s] for s in seeds}},
                  {**{n: "" for n in names}, **{f"seed {s}": "" for s in seeds}})
    return fig


def curves_plot(runs: pd.DataFrame, title: str, path: Path) -> Path:
    """curves_figure written to `path` (PNG)."""
    return canvas.save(curves_figure(runs, title), path)


def blocks(tr: pd.DataFrame, run_dir: Path) -> list[tuple]:
    """The part's blocks; [] without curves or without a cell below RECALL."""
    curves = read_curves(Path(run_dir) / TRAIN_CURVES)
    if not curves:
        return []
    runs = winning_runs(tr, below(tr), curves)
    if runs.empty:
        return []
    out: list[tuple] = [
        ("h", 3, "Training curves below 0.9"),
        ("p", f"Per task setting, the best cell of each variant whose median over its seeds "
              f"stays below {RECALL:g}: each seed's run at its winning rate, held-out "
              "accuracy (left) and held-out loss (right) at every evaluation (from "
              f"{TRAIN_CURVES}). A flat accuracy over a falling loss is a plateau the run may "
              "still leave; a run that stopped `settled` had stopped gaining on both.")]
    pdir = Path(run_dir) / "plots"
    for setting in task_settings(runs):
        part = runs[runs["task_setting"] == setting]
        path = pdir / f"trained_curves_{_slug(setting)}.png"
        out += [("p", f"**{setting}**"),
                ("img", curves_plot(part, setting, path),
                 f"held-out accuracy and loss against steps, {setting}"),
                ("table", runs_table(part))]
    return out

