"""The report's "Quality on text" and "State tracking" sections (issue 50), each only where
train.csv holds such rows.

Quality on text reads the rows scored in bits per byte (the `lm` task; harness.report.run
keeps them as `run.text`): a cell is a configuration over its seeds (median, min-max range;
harness.report.cells), ° a cell that did not settle. Per corpus setting: the table of test
bits per byte with the floors (the train unigram and bigram, the mixer `none`), the recall
hits and other bytes, the step time and the state; the extrapolation table (2N, 4N); bits
per byte against state and against step time (the quality-cost frontier); the validation
curves against steps (train_curves.jsonl); hits and other bytes as paired bars. Its answers:
the best bits per byte at each state size (cells whose seeds' ranges overlap the best's are
named as ties), the fastest step within 2% of sdpa's bits per byte, and whether the recall
order (the folder's accuracy rows on a recall task) and the text order agree (Spearman's
rank correlation over the mixers that ran both).

State tracking reads the rows of the state tasks (parity, mod_sum, permutations): test
accuracy against the trained length per mixer, a table (medians over seeds) and a plot (one
panel per task: every seed a point, the median a line, chance and plateau as horizontal
lines, accuracy on a fixed 0-1 axis; `state_plot_data` is what it draws), and which mixers
track each task to the longest length (a settled median of at least 0.9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from harness.files.curves import curves_path, read_curves  # noqa: E402
from harness.files import TRAIN_CSV  # noqa: E402
from harness.report import canvas  # noqa: E402

TEXT_TITLE = "Quality on text"
STATE_TITLE = "State tracking"
STATE_TASKS = ("parity", "mod_sum", "permutations")
RECALL_TASKS = ("mqar", "selective_copying", "noisy_recall", "fuzzy_recall")
TRACKS = 0.9  # the accuracy at which a mixer "tracks" a state task at a length
WITHIN = 0.02  # "within 2% of sdpa's bits per byte"
FLOOR = "none"


def _known_false(v) -> bool:
    return v is not None and not pd.isna(v) and str(v).strip().lower() in ("false", "0")


def _corpus(task_params) -> str:
    try:
        return json.loads(task_params).get("corpus", "")
    except (TypeError, ValueError):
        return ""


def text_cells(text: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration over its seeds: medians, the bits-per-byte range, whether
    every seed settled; `setting` names the corpus, N and the model."""
    ok = text[text["status"] == "ok"].copy()
    if ok.empty:
        return ok
    ok["corpus"] = ok["task_params"].map(_corpus)
    ok["text_setting"] = [f"{c} N={int(n)} · {m}" for c, n, m in
                          zip(ok["corpus"], ok["seq_len"], ok["model"])]
    num = ["bits_per_byte", "val_bits_per_byte", "unigram_bpb", "bigram_bpb", "hit_bpb",
           "other_bpb", "hit_share", "bpb_2n", "bpb_4n", "step_ms", "state_bytes"]
    rows = []
    for (setting, label), g in ok.groupby(["text_setting", "label"], sort=False):
        r = {"text_setting": setting, "label": label, "variant": g["variant"].iloc[0],
             "family": g["family"].iloc[0], "seeds": len(g),
             "low": g["bits_per_byte"].min(), "high": g["bits_per_byte"].max(),
             "settled": not any(_known_false(v) for v in g["settled"])}
        r.update({c: g[c].median() for c in num})
        rows.append(r)
    return pd.DataFrame(rows)


def _bpb(r) -> str:
    if pd.isna(r["bits_per_byte"]):
        return "–"
    text = f"{r['bits_per_byte']:.3f}"
    if r["seeds"] > 1:
        text += f" [{r['low']:.3f}-{r['high']:.3f}]"
    return text + ("" if r["settled"] else "°")


def _num(v, fmt=".3f") -> str:
    return "–" if v is None or pd.isna(v) else format(v, fmt)


def text_table(c: pd.DataFrame) -> pd.DataFrame:
    """Per cell: test bits per byte (median [range]), the gap to `none`, hits and other
    bytes, the hits' share, step time and state."""
    floor = c[c["variant"] == FLOOR].set_index("text_setting")["bits_per_byte"]
    out = []
    for _, r in c.sort_values(["text_setting", "bits_per_byte"]).iterrows():
        base = floor.get(r["text_setting"])
        out.append({"setting": r["text_setting"], "variant": r["label"],
                    "bits_per_byte": _bpb(r),
                    "below none": "–" if base is None or r["variant"] == FLOOR
                    else _num(base - r["bits_per_byte"]),
                    "recall hits": _num(r["hit_bpb"]), "other bytes": _num(r["other_bpb"]),
                    "hit share": _num(r["hit_share"]), "step_ms": _num(r["step_ms"], ".3g"),
                    "state bytes": "–" if pd.isna(r["state_bytes"])
                    else str(int(r["state_bytes"]))})
    return pd.DataFrame(out)


def floors_table(c: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for s, g in c.groupby("text_setting", sort=False):
        none = g[g["variant"] == FLOOR]
        rows.append({"setting": s, "unigram_bpb": _num(g["unigram_bpb"].iloc[0]),
                     "bigram_bpb": _num(g["bigram_bpb"].iloc[0]),
                     "none (conv + MLP)": _bpb(none.iloc[0]) if len(none) else "not trained"})
    return pd.DataFrame(rows)


def extrapolation_table(c: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([{"setting": r["text_setting"], "variant": r["label"],
                          "N": _num(r["bits_per_byte"]), "2N": _num(r["bpb_2n"]),
                          "4N": _num(r["bpb_4n"])} for _, r in c.iterrows()])


def best_by_state(c: pd.DataFrame) -> pd.DataFrame:
    """Per setting and state size (bytes): the best settled cell, and the cells whose seeds'
    range overlaps the best's (ties)."""
    rows = []
    ok = c[c["settled"] & c["state_bytes"].notna()]
    for (s, state), g in ok.groupby(["text_setting", "state_bytes"], sort=True):
        g = g.sort_values("bits_per_byte")
        best = g.iloc[0]
        ties = [r["label"] for _, r in g.iloc[1:].iterrows() if r["low"] <= best["high"]]
        rows.append({"setting": s, "state bytes": str(int(state)), "best": best["label"],
                     "bits_per_byte": _bpb(best), "tied within the seeds' range":
                     ", ".join(ties) or "–"})
    return pd.DataFrame(rows)


def fastest_near_sdpa(c: pd.DataFrame) -> pd.DataFrame:
    """Per setting: the fastest median training step among settled cells whose bits per
    byte is within 2% of sdpa's."""
    rows = []
    for s, g in c.groupby("text_setting", sort=False):
        sdpa = g[g["variant"] == "sdpa"]
        if sdpa.empty:
            continue
        ref = sdpa["bits_per_byte"].iloc[0]
        near = g[g["settled"] & (g["bits_per_byte"] <= ref * (1 + WITHIN))
                 & g["step_ms"].notna()]
        if near.empty:
            rows.append({"setting": s, "fastest within 2% of sdpa": "none settled",
                         "sdpa bits_per_byte": _num(ref)})
            continue
        f = near.loc[near["step_ms"].idxmin()]
        rows.append({"setting": s, "fastest within 2% of sdpa": f["label"],
                     "its bits_per_byte": _bpb(f), "sdpa bits_per_byte": _num(ref),
                     "step_ms": _num(f["step_ms"], ".3g"),
                     "sdpa step_ms": _num(sdpa["step_ms"].iloc[0], ".3g")})
    return pd.DataFrame(rows)


def rank_agreement(c: pd.DataFrame, train: pd.DataFrame | None) -> str | None:
    """Spearman's rank correlation between the text order (lower bits per byte first) and
    the recall order (higher accuracy first) over the mixers that ran both; None when
    fewer than three did."""
    if train is None or c.empty:
        return None
    recall = train[(train["status"] == "ok") & train["task"].isin(RECALL_TASKS)]
    if recall.empty:
        return None
    acc = recall.groupby("variant")["accuracy"].median()
    bpb = c.groupby("variant")["bits_per_byte"].min()
    both = sorted(set(acc.index) & set(bpb.index) - {FLOOR})
    if len(both) < 3:
        return None
    a = (-acc[both]).rank()
    b = bpb[both].rank()
    rho = a.corr(b, method="pearson")  # Pearson of ranks: Spearman's rho
    verdict = "agree" if rho >= 0.5 else "disagree" if rho <= 0 else "agree weakly"
    return (f"Recall order against text order over {len(both)} mixers that ran both "
            f"({', '.join(both)}): Spearman's rho {rho:.2f}: they {verdict} "
            "(recall: the median accuracy over this folder's recall rows; text: the best "
            "median bits per byte).")


def _plot(c, x, xlabel, path: Path, log=True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, g in c.groupby("text_setting", sort=False):
        g = g[g[x].notna()]
        for _, r in g.iterrows():
            ax.errorbar([r[x]], [r["bits_per_byte"]],
                        yerr=[[r["bits_per_byte"] - r["low"]], [r["high"] - r["bits_per_byte"]]],
                        fmt="o" if r["settled"] else "o", mfc=None if r["settled"] else "none",
                        capsize=3)
            ax.annotate(r["label"], (r[x], r["bits_per_byte"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    if log:
        ax.set_xscale("symlog" if (c[x] == 0).any() else "log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test bits per byte (lower is better)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(c, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    g = c.sort_values("bits_per_byte")
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(g)), 4))
    xs = range(len(g))
    ax.bar([i - 0.2 for i in xs], g["hit_bpb"], width=0.4, label="recall hits")
    ax.bar([i + 0.2 for i in xs], g["other_bpb"], width=0.4, label="other bytes")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(g["label"] + " · " + g["text_setting"].str.split(" · ").str[0],
                       rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("test bits per byte")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curves_plot(text: pd.DataFrame, run_dir: Path, path: Path) -> Path | None:
    """Validation bits per byte against steps, each row's winning rate (train_curves.jsonl)."""
    lines = read_curves(curves_path(Path(run_dir) / TRAIN_CSV))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for _, r in text[text["status"] == "ok"].iterrows():
        runs = (lines.get(r["config_id"]) or {}).get("runs") or []
        best = [x for x in runs if x.get("lr") == r["best_lr"]]
        if not best or not best[0].get("history"):
            continue
        h = best[0]["history"]
        ax.plot([s for s, _ in h], [v for _, v in h], lw=1,
                label=f"{r['label']} s{int(r['seed'])}")
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def text_blocks(text: pd.DataFrame | None, train: pd.DataFrame | None,
                run_dir: Path) -> list[tuple]:
    """The "Quality on text" section; [] without bits-per-byte rows."""
    if text is None or text.empty:
        return []
    c = text_cells(text)
    out: list[tuple] = [
        ("h", 2, TEXT_TITLE),
        ("p", "Byte-level language models (vocabulary 256), one per mixer, trained on the "
              "train split of a corpus and scored on its test split at the kept checkpoint: "
              "bits per byte = the summed cross-entropy over every predicted test byte / "
              "ln 2 / bytes, lower is better; the median over seeds with their range, ° a "
              "seed that had not settled. The floors: the train split's add-one unigram and "
              "bigram on the same bytes, and the mixer `none` (the same block with the "
              "mixer's output zeroed: its short convolution and MLP alone), trained under "
              "the same protocol. Recall hits: bytes whose 7-gram occurred earlier in the "
              "window and at most 100 times in train (Zoology's split, at byte level).")]
    if c.empty:
        return out + [("p", "No lm configuration trained ok.")]
    pdir = Path(run_dir) / "plots"
    out += [("table", floors_table(c)), ("table", text_table(c)),
            ("img", _plot(c, "state_bytes", "state per example (bytes, float32)",
                          pdir / "text_bpb_vs_state.png"), "bits per byte against state"),
            ("img", _plot(c, "step_ms", "median training step (ms)",
                          pdir / "text_bpb_vs_step.png"), "bits per byte against step time")]
    curve = _curves_plot(text, run_dir, pdir / "text_validation_curves.png")
    if curve is not None:
        out.append(("img", curve, "validation bits per byte against steps"))
    if c["hit_bpb"].notna().any():
        out.append(("img", _bars(c, pdir / "text_hits_other.png"),
                    "bits per byte on recall hits and other bytes"))
    out += [("h", 3, "Length extrapolation"),
            ("p", "The test split tiled at the trained length N and at 2N and 4N, where every "
                  "mixer of the model takes that length (– elsewhere):"),
            ("table", extrapolation_table(c))]
    return out + answer_blocks(text, train)


def answer_blocks(text: pd.DataFrame | None, train: pd.DataFrame | None) -> list[tuple]:
    if text is None or text.empty:
        return []
    c = text_cells(text)
    if c.empty:
        return []
    out = [("h", 3, "Answers on text")]
    best = best_by_state(c)
    if not best.empty:
        out += [("p", "The best bits per byte at each state size (settled cells; cells whose "
                      "seeds' range overlaps the best's are named as ties):"),
                ("table", best)]
    near = fastest_near_sdpa(c)
    if not near.empty:
        out += [("p", "The fastest training step within 2% of sdpa's bits per byte:"),
                ("table", near)]
    agree = rank_agreement(c, train)
    if agree:
        out.append(("p", agree))
    return out


# -- state tracking --------------------------------------------------------------------------
def state_rows(train: pd.DataFrame | None) -> pd.DataFrame | None:
    if train is None:
        return None
    rows = train[train["task"].isin(STATE_TASKS) & (train["status"] == "ok")]
    return None if rows.empty else rows


def state_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Mixer x (task, N): the median test accuracy over seeds, ° where a seed had not
    settled."""
    cells = []
    for (task, label, n), g in rows.groupby(["task", "label", "seq_len"], sort=True):
        acc = g["accuracy"].median()
        mark = "" if not any(_known_false(v) for v in g["settled"]) else "°"
        cells.append({"task": task, "variant": label, "N": int(n),
                      "cell": f"{acc:.3f}{mark}", "acc": acc, "settled": mark == ""})
    c = pd.DataFrame(cells)
    wide = c.pivot_table(index="variant", columns=["task", "N"], values="cell",
                         aggfunc="first").fillna("–")
    wide.columns = [f"{t} N={n}" for t, n in wide.columns]
    return wide.reset_index(), c


def longest_tracked(c: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for task, g in c.groupby("task", sort=True):
        longest = {}
        for _, r in g.iterrows():
            if r["settled"] and r["acc"] >= TRACKS:
                longest[r["variant"]] = max(longest.get(r["variant"], 0), r["N"])
        top = max(longest.values()) if longest else None
        rows.append({"task": task, "longest length tracked (≥ 0.9, settled)":
                     "none" if top is None else str(top),
                     "mixers there": "–" if top is None else ", ".join(
                         sorted(v for v, n in longest.items() if n == top))})
    return pd.DataFrame(rows)


@dataclass
class StateFacet:
    """What one task's panel of the state plot is drawn from: every seed's test accuracy
    as its own point (`seeds`: label, N, seed, accuracy), the median over seeds as the line
    (`medians`: label, N, accuracy), the task's declared chance and plateau (the plateau
    drawn only where it differs from chance), and the y limits, fixed at (0, 1) so that a
    task near chance is not zoomed into its noise."""
    task: str
    seeds: pd.DataFrame
    medians: pd.DataFrame
    chance: float | None
    plateau: float | None
    ylim: tuple[float, float] = (0.0, 1.0)


def _declared(g: pd.DataFrame, col: str) -> float | None:
    v = pd.to_numeric(g[col], errors="coerce").dropna() if col in g else pd.Series([], dtype=float)
    return None if v.empty else float(v.iloc[0])


def state_plot_data(rows: pd.DataFrame) -> list[StateFacet]:
    """One facet per state task, in name order: the data the state plot draws."""
    facets = []
    for task, g in rows.groupby("task", sort=True):
        seeds = (g[["label", "seq_len", "seed", "accuracy"]]
                 .rename(columns={"seq_len": "N"})
                 .astype({"N": int, "accuracy": float})
                 .sort_values(["label", "N", "seed"]).reset_index(drop=True))
        medians = (seeds.groupby(["label", "N"], sort=True)["accuracy"].median()
                   .reset_index())
        chance, plateau = _declared(g, "chance"), _declared(g, "plateau")
        if plateau is not None and chance is not None and abs(plateau - chance) < 1e-12:
            plateau = None  # the same line as chance
        facets.append(StateFacet(task, seeds, medians, chance, plateau))
    return facets


def draw_state_plot(facets: list[StateFacet], path: Path) -> Path:
    return canvas.save(state_figure(facets), path)


def state_figure(facets: list[StateFacet]):
    """Accuracy against the trained length, one panel per task: each seed a small point
    (spread a little along x per mixer so that equal seeds stay visible), the median over
    seeds a line with a marker, chance a dashed grey line (the plateau, where declared
    apart from chance, dotted), y from 0 to 1."""
    labels = sorted({lb for f in facets for lb in f.seeds["label"]})
    palette, _, _ = canvas.styles(pd.DataFrame({"line": labels, "variant": labels}))
    ncols = len(facets)
    fig = canvas.new_figure(canvas.PANEL_IN[0] * ncols + canvas.LEGEND_IN, canvas.PANEL_IN[1])
    canvas.adjust(fig, 1, ncols)
    spread = {lb: 2 ** (0.12 * (i - (len(labels) - 1) / 2) / max(len(labels), 1))
              for i, lb in enumerate(labels)}
    for i, f in enumerate(facets):
        ax = fig.add_subplot(1, ncols, i + 1)
        for lb, g in f.medians.groupby("label", sort=True):
            ax.plot(g["N"] * spread[lb], g["accuracy"], color=palette[lb], marker="o",
                    markersize=4, linewidth=1.2)
        for lb, g in f.seeds.groupby("label", sort=True):
            ax.scatter(g["N"] * spread[lb], g["accuracy"], color=palette[lb], s=10,
                       alpha=0.55, marker="x", linewidths=0.8)
        if f.chance is not None:
            ax.axhline(f.chance, color="grey", linestyle="--", linewidth=0.9)
            ax.annotate("chance", (0.01, f.chance), xycoords=("axes fraction", "data"),
                        fontsize=6, color="grey", va="bottom")
        if f.plateau is not None:
            ax.axhline(f.plateau, color="grey", linestyle=":", linewidth=0.9)
        ax.set_xscale("log", base=2)
        lengths = sorted(f.seeds["N"].unique())
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlim(min(lengths) / 1.4, max(lengths) * 1.4)
        ax.set_ylim(*f.ylim)
        ax.set_title(f.task, fontsize=9)
        ax.set_xlabel("trained length N", fontsize=8)
        ax.set_ylabel("test accuracy", fontsize=8)
        ax.grid(alpha=0.3)
    canvas.legend(fig, palette, ncols)
    return fig


def state_blocks(train: pd.DataFrame | None, run_dir: Path) -> list[tuple]:
    """The "State tracking" section; [] without state-task rows."""
    rows = state_rows(train)
    if rows is None:
        return []
    wide, c = state_table(rows)
    path = draw_state_plot(state_plot_data(rows),
                           Path(run_dir) / "plots" / "state_accuracy_vs_length.png")
    chance = rows.groupby("task")["chance"].first()
    return [("h", 2, STATE_TITLE),
            ("p", "Running parity, running sums modulo m and the word problem of S_k, scored "
                  "at every position from 4 on (beyond the short convolution); test "
                  "accuracy, the median over seeds, ° not settled. Chance: "
                  + ", ".join(f"{t} {v:.3f}" for t, v in chance.items())
                  + ". A diagonal decay with positive entries (mamba2, gla) or a delta rule "
                    "with beta in (0, 1) cannot track parity; beta in (0, 2) can (Grazzi "
                    "et al. 2024, arXiv:2411.12537)."),
            ("table", wide),
            ("p", "The plot draws every seed as its own cross and the median over seeds as "
                  "the line, chance dashed (a plateau declared apart from chance dotted), "
                  "accuracy from 0 to 1 on every task."),
            ("img", path, "state-task accuracy against length"),
            ("p", "Which mixers track each task to the longest trained length:"),
            ("table", longest_tracked(c))]
