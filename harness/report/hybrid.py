"""The report's "Recall against the share of attention layers" section and its Answers line:
held-out recall of layer-pattern stacks (train.csv's `family` hybrid) against the fraction
of their layers that are full softmax attention, one line per linear mixer.

Reads train.csv's `attention_layers` (how many of a model's layers are exact attention)
and `mixer` (its other layers' mixers, "+"-joined; empty for attention only), on every
row, plain mixers' too: a file without them, or without a stack, has no section. A cell is
one configuration over its seeds, read as every trained section reads it
(harness.report.cells: median accuracy, min-max range, the marks ° not settled and §
seed-sensitive); a cell that did not settle is drawn hollow and kept out of the answers
and the order. At each share the line's point is the mixer's best settled cell there (its
best unsettled one where none settled).
Wang et al. 2025 ("A Systematic Analysis of Hybrid Linear Attention", arXiv:2507.06457)
report that recall rises sharply with the share of attention below 3:1 and that a linear
mixer's standalone rank does not predict its rank in a hybrid: `order_sentence` checks the
second on the run's own cells.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pandas as pd

from harness.report import frontier, trained_plots
from harness.report.cells import (answerable, cells, footnote, known_false, protocol,
                                  range_text, tied)
from harness.report.run import Run

TITLE = "Recall against the share of attention layers"
HYBRID = "hybrid"  # the `family` of a layer pattern's rows
RECALL = 0.9
COLUMNS = ("attention_layers", "mixer")


def stack_rows(tr: pd.DataFrame | None) -> pd.DataFrame | None:
    """The ok rows that carry the hybrid columns, of the task settings where a stack
    trained, with `share` (attention_layers / layers), `mixer` ("" for attention only) and
    `task_setting`; None when the file has no such columns or no stack."""
    if tr is None or not set(COLUMNS) <= set(tr.columns) or not (tr["family"] == HYBRID).any():
        return None
    ok = tr[(tr["status"] == "ok") & tr["attention_layers"].notna()]
    ok = ok.assign(mixer=ok["mixer"].fillna("").astype(str),
                   attention_layers=ok["attention_layers"].astype(int),
                   share=ok["attention_layers"] / ok["layers"],
                   task_setting=[frontier.task_setting_name(r) for _, r in ok.iterrows()])
    stacked = set(ok.loc[ok["family"] == HYBRID, "task_setting"])
    ok = ok[ok["task_setting"].isin(stacked)]
    return None if ok.empty else ok


def points(c: pd.DataFrame) -> pd.DataFrame:
    """Per task setting, mixer and share: the best settled cell (the best unsettled one
    where none settled), with `hollow` saying it did not settle."""
    ranked = c.assign(hollow=[known_false(v) for v in c["settled"]]).sort_values(
        ["hollow", "accuracy"], ascending=[True, False], kind="stable")
    return ranked.drop_duplicates(["task_setting", "mixer", "share"]).sort_values(
        ["task_setting", "mixer", "share"]).reset_index(drop=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def _share(s: float) -> str:
    """`1/4 (3:1)`: the share, and the ratio of other layers to attention layers."""
    if s in (0, 1):
        return "0 (no attention)" if s == 0 else "1 (attention only)"
    f = Fraction(s).limit_denominator(64)
    return f"{f} ({f.denominator - f.numerator}:{f.numerator})"


def _mixer_name(m: str, c) -> str:
    return m if m else f"attention only ({c['variant']})"


def share_table(p: pd.DataFrame) -> pd.DataFrame:
    """One task setting's points: mixer x share of attention layers -> median [min–max]."""
    shares = sorted(p["share"].unique())
    rows = []
    for m in sorted(p["mixer"].unique(), key=lambda m: (m == "", m)):
        g = p[p["mixer"] == m].set_index("share")
        row = {"mixer": _mixer_name(m, g.iloc[0])}
        for s in shares:
            row[f"share {_share(s)}"] = range_text(g.loc[s]) if s in g.index else "–"
        rows.append(row)
    return pd.DataFrame(rows)


def answer_table(c: pd.DataFrame) -> pd.DataFrame:
    """Per task setting: the fewest attention layers (the smallest share, then the fewest
    layers) at which a settled cell's median reaches RECALL, its mixer and variant; "none"
    with the best settled cell where none does."""
    rows = []
    for s in frontier.task_settings(c):
        g = answerable(c[c["task_setting"] == s])
        good = g[g["accuracy"] >= RECALL].sort_values(
            ["share", "attention_layers", "accuracy"], ascending=[True, True, False],
            kind="stable")
        row = {"task setting": s}
        if len(good):
            r = good.iloc[0]
            name = r["variant"]
            if protocol(c):  # of equal shares, no winner inside the seeds' spread
                same = tied(r, good[(good["share"] == r["share"])
                                    & (good["attention_layers"] == r["attention_layers"])])
                if len(same) > 1:
                    name = ", ".join(dict.fromkeys(same["variant"])) + " (tied)"
            row |= {"fewest attention layers reaching 0.9":
                    f"{int(r['attention_layers'])} of {int(r['layers'])}",
                    "mixer": _mixer_name(r["mixer"], r), "variant": name,
                    "accuracy": range_text(r)}
        elif len(g):
            b = g.loc[g["accuracy"].idxmax()]
            row["fewest attention layers reaching 0.9"] = (
                f"none (best: {b['variant']} {range_text(b)})")
        else:
            row["fewest attention layers reaching 0.9"] = "none (no settled cell)"
        rows.append(row)
    return pd.DataFrame(rows)


def _ranking(accs: dict[str, float]) -> str:
    names = sorted(accs, key=lambda m: -accs[m])
    text = f"{names[0]} {accs[names[0]]:.3f}"
    for a, b in zip(names, names[1:]):
        text += f" {'=' if accs[a] == accs[b] else '>'} {b} {accs[b]:.3f}"
    return text


def order_sentence(p: pd.DataFrame) -> str:
    """Whether the linear mixers' order alone (share 0) is their order at 3:1 (share 1/4),
    from one task setting's settled points; pairs tied at either share do not count."""
    settled = p[~p["hollow"] & (p["mixer"] != "")]
    alone = settled[settled["share"] == 0].set_index("mixer")["accuracy"]
    at31 = settled[settled["share"] == 0.25].set_index("mixer")["accuracy"]
    both = [m for m in alone.index if m in at31.index]
    if len(both) < 2:
        return ("Fewer than two mixers have settled cells both alone and at 3:1 here: no "
                "order to compare.")
    a, h = alone[both].to_dict(), at31[both].to_dict()
    flips = [(x, y) for i, x in enumerate(both) for y in both[i + 1:]
             if (a[x] - a[y]) * (h[x] - h[y]) < 0]
    said = f"The mixers alone rank {_ranking(a)}; at 3:1 {_ranking(h)}: "
    if not flips:
        return said + ("the order alone is their order at 3:1 (Wang et al. 2025, "
                       "arXiv:2507.06457, found standalone rank did not predict hybrid rank).")
    swaps = ", ".join(f"{x} and {y}" for x, y in flips)
    return said + (f"the order alone is not their order at 3:1 ({swaps} swap), as Wang et al. "
                   "2025 (arXiv:2507.06457) report: standalone rank does not predict hybrid "
                   "rank.")


def answer_blocks(tr: pd.DataFrame | None) -> list[tuple]:
    """The Answers line: per task setting, the fewest attention layers that reach 0.9."""
    rows = stack_rows(tr)
    if rows is None:
        return []
    return [("p", f"Fewest full-attention layers at which a stack's held-out accuracy (the "
                  f"median over its seeds, settled cells only) reaches {RECALL}, per task "
                  "setting, with its mixer:"),
            ("table", answer_table(cells(rows)))]


def blocks(run: Run) -> list[tuple]:
    rows = stack_rows(run.train)
    if rows is None:
        return []
    c = cells(rows)
    p = points(c)
    pdir = Path(run.dir) / "plots"
    out: list[tuple] = [
        ("h", 2, TITLE),
        ("p", "Layer patterns (a stack such as three layers of a linear mixer, then one of "
              "full attention, repeated to the model's layers) against the share of their "
              "layers that are full softmax attention (x from 0, none, through 1/4 for 3:1 "
              "and 1/2 for 1:1 to 1, attention only), held-out accuracy the median over a "
              "cell's seeds, bars from the lowest seed to the highest; one line per mixer "
              "through its best cell at each share, the "
              "attention-only model joining every line at 1; hollow: not settled. Wang et "
              "al. 2025 (arXiv:2507.06457) found recall rising sharply with the share of "
              "attention, above all below 3:1. The stacks' points on the frontier of "
              "accuracy against state (Quality when trained) sit at their total state, the "
              "sum of their layers'.")]
    for s in frontier.task_settings(p):
        g = p[p["task_setting"] == s]
        out += [("h", 3, s),
                ("img", trained_plots.share_plot(g, s, pdir / f"hybrid_share_{_slug(s)}.png",
                                         RECALL), f"accuracy against the share of attention: {s}"),
                ("table", share_table(g)),
                ("p", order_sentence(g))]
    return out + footnote(c)
