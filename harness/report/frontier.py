"""Trained quality read as the recall studies read it: accuracy against state, per task.

From train.csv rows (harness.report.trained.read_train): the frontier of each task setting
(Zoology, Arora et al. 2023, Fig. 2; Based, Arora et al. 2024): held-out accuracy against
`state_bytes`, one line per variant over its sizes (window, features, landmarks, block
size, the model's heads and width); the smallest state reaching 0.9 per setting; and, when
the run trained more than one task, a MAD-style mean per variant (Poli et al. 2024): per
task the mean over its settings of the variant's best accuracy, then the mean over tasks.

A task setting is the task with its parameters, N, vocabulary and causal or not: the model
(d_model, layers, heads) is one of a variant's sizes there, as Zoology's model width is.
It reads cells (harness.report.cells: a configuration over its seeds, its median accuracy
and range, the marks): a cell that has not settled is drawn hollow and kept out of every
answer and ordering here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from harness.report import trained_plots
from harness.report.cells import (answerable, cells, footnote, known_false, marks, protocol,
                                  range_text, steps_text, tied, unsettled_note)

RECALL = 0.9
_MODEL = {"d_model": "d", "layers": "L", "heads": "H"}


def task_setting_name(row) -> str:
    """`mqar N=64 P=8 V=64 causal`: the task setting without the model."""
    pairs = f" P={int(row['num_kv_pairs'])}" if pd.notna(row["num_kv_pairs"]) else ""
    return (f"{row['task']} N={int(row['seq_len'])}{pairs} V={int(row['vocab_size'])} "
            f"{'causal' if row['causal'] else 'non-causal'}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def with_sizes(tr: pd.DataFrame) -> pd.DataFrame:
    """tr with `task_setting` and `size`: the variant's parameters and model fields that take
    more than one value among that variant's rows of the same task setting (empty when it
    has one configuration there)."""
    df = tr.assign(task_setting=[task_setting_name(r) for _, r in tr.iterrows()])
    sizes = pd.Series("", index=df.index)
    for _, g in df.groupby(["task_setting", "variant"], sort=False):
        params = [json.loads(p) for p in g["params"]]
        keys = sorted({k for p in params for k in p})
        vary = [k for k in keys if len({json.dumps(p.get(k)) for p in params}) > 1]
        model = [c for c in _MODEL if g[c].nunique() > 1]
        for (i, r), p in zip(g.iterrows(), params):
            parts = [f"{k}={p.get(k)}" for k in vary] + [f"{_MODEL[c]}={int(r[c])}"
                                                         for c in model]
            sizes[i] = " ".join(parts)
    return df.assign(size=sizes)


def task_settings(df: pd.DataFrame) -> list[str]:
    """df's `task_setting` names in the report's order: causal first, then by task, N,
    pairs."""
    first = df.drop_duplicates("task_setting")
    key = {r.task_setting: (not r.causal, r.task, r.seq_len,
                            -1 if pd.isna(r.num_kv_pairs) else r.num_kv_pairs, r.vocab_size)
           for r in first.itertuples()}
    return sorted(key, key=key.get)


def _frontier_rows(tr: pd.DataFrame) -> pd.DataFrame:
    """The cells with a state, with task_setting and size."""
    ok = tr[(tr["status"] == "ok") & tr["state_bytes"].notna()]
    c = cells(ok)
    return with_sizes(c) if len(c) else c.assign(task_setting=[], size=[])


def _bytes(v) -> str:
    return f"{int(v):,}"


def smallest_state_table(tr: pd.DataFrame) -> pd.DataFrame:
    """Per task setting: the settled cell with the least state_bytes whose median over
    seeds reaches RECALL held-out accuracy (of equal states, the more accurate), its
    variant, size and accuracy; "none reached 0.9" with the best settled there otherwise,
    "no settled cell" when there is none."""
    every = _frontier_rows(tr)
    df = answerable(every)
    rows = []
    for s in task_settings(every):
        g = df[df["task_setting"] == s]
        if g.empty:
            rows.append({"task setting": s, "smallest state reaching 0.9": "no settled cell"})
            continue
        good = g[g["accuracy"] >= RECALL].sort_values(["state_bytes", "accuracy"],
                                                      ascending=[True, False], kind="stable")
        if good.empty:
            b = g.loc[g["accuracy"].idxmax()]
            best = " ".join(x for x in (b["variant"], b["size"], range_text(b)) if x)
            rows.append({"task setting": s,
                         "smallest state reaching 0.9": f"none reached 0.9 (best: {best})"})
            continue
        r = good.iloc[0]
        name = r["variant"]
        if protocol(tr):  # of equal states, no winner inside the seeds' spread
            same = tied(r, good[good["state_bytes"] == r["state_bytes"]])
            if len(same) > 1:
                name = ", ".join(dict.fromkeys(same["variant"])) + " (tied)"
        rows.append({"task setting": s, "smallest state reaching 0.9": name,
                     "size": r["size"] or "–", "state bytes": _bytes(r["state_bytes"]),
                     "accuracy": range_text(r)})
    return pd.DataFrame(rows)


def frontier_table(tr: pd.DataFrame, setting: str) -> pd.DataFrame:
    """One task setting's frontier in numbers: per variant and size, the state in bytes,
    the held-out accuracy (the median over seeds, their min-max, marked), the seeds, the
    first seed's winning rate and the rates swept."""
    df = _frontier_rows(tr)
    g = df[df["task_setting"] == setting].sort_values(["variant", "state_bytes", "size"])
    out = pd.DataFrame({"variant": g["variant"], "size": g["size"].replace("", "–"),
                        "state bytes": g["state_bytes"].map(_bytes),
                        "accuracy (median [min–max])": [range_text(r)
                                                        for _, r in g.iterrows()],
                        "seeds": g["seeds"].map(str),
                        "best lr": g["best_lr"].map(lambda v: f"{v:g}"),
                        "lrs swept": g["lrs"].fillna("–")})
    if protocol(tr):
        out["steps to 0.9 (median)"] = [steps_text(r) for _, r in g.iterrows()]
        out["outcomes"] = [", ".join(sorted(set(tr.loc[_of_cell(tr, r), "outcome"].dropna())))
                           for _, r in g.iterrows()]
    return out


def _of_cell(tr: pd.DataFrame, cell) -> pd.Series:
    """The rows (every seed) of a cell."""
    from harness.report.cells import CELL

    keep = pd.Series(True, index=tr.index)
    for c in CELL:
        keep &= (tr[c] == cell[c]) | (tr[c].isna() & pd.isna(cell[c]))
    return keep


def frontier_blocks(tr: pd.DataFrame, pdir: Path) -> list[tuple]:
    """The frontier: a plot per task setting, with its numbers."""
    df = _frontier_rows(tr)
    if df.empty:
        return []
    blocks: list[tuple] = [
        ("h", 3, "Accuracy against state size"),
        ("p", "The recall studies' frontier (Zoology, Arora et al. 2023; Based, Arora et al. "
              "2024): held-out accuracy against the state a model keeps per example, in "
              "bytes (float32: layers x heads x the variant's state_size(N, D) x 4 bytes; a "
              "key-value cache 2 N D a head, a window 2 (w + 1) D, a linear or recurrent "
              "state about D^2, Linformer 2 k D, Nyström 2 m D), log x-axis. One line per "
              "variant through its sizes (window, features, landmarks, block size, heads or "
              "width), at each state its best accuracy: the median over the cell's seeds, a "
              "bar from the lowest seed to the highest; a hollow marker: the cell had not "
              "settled (its number ranks nothing). A variant is better where its line sits "
              "higher at the same state." + (
                  " With outcomes (issue 49), a second plot: the steps to 0.9 accuracy, the "
                  "median over the cell's seeds, a run that never reached it counted beyond "
                  "its budget (censored: drawn hollow at the budget, '> budget' in the "
                  "table)." if protocol(tr) else "")), *unsettled_note(tr)]
    for s in task_settings(df):
        g = df[df["task_setting"] == s].assign(
            line=lambda d: d["variant"], hollow=lambda d: [
                known_false(v) or ((v is None or pd.isna(v)) and r is not None
                                   and not pd.isna(r) and bool(r))
                for v, r in zip(d["settled"], d["rising"])])
        blocks += [("img", trained_plots.frontier_plot(g, s, pdir / f"trained_frontier_{_slug(s)}.png",
                                               RECALL), f"accuracy against state: {s}")]
        if protocol(tr):
            blocks.append(("img", trained_plots.steps_plot(
                g, s, pdir / f"trained_steps_{_slug(s)}.png"), f"steps to 0.9 against state: {s}"))
        blocks.append(("table", frontier_table(tr, s)))
    return blocks + footnote(df)


def best_per_setting(tr: pd.DataFrame) -> pd.DataFrame:
    """(variant, task, task_setting) -> its best held-out accuracy (median over seeds) over
    its settled cells there (sizes, models); settings where it has none are absent."""
    c = answerable(cells(tr))
    if c.empty:
        return pd.DataFrame(columns=["variant", "task", "task_setting", "accuracy"])
    df = with_sizes(c)
    return df.groupby(["variant", "task", "task_setting"], as_index=False)["accuracy"].max()


def task_table(tr: pd.DataFrame) -> pd.DataFrame:
    """Variant x task: the mean over the task's settings of the variant's best accuracy at
    each, then `MAD-style mean` over tasks; `tasks` counts the tasks it has a score on (a
    mean over fewer tasks than the run trained is not comparable)."""
    best = best_per_setting(tr)
    per_task = best.groupby(["variant", "task"])["accuracy"].mean().unstack("task")
    tasks = sorted(tr["task"].unique())
    per_task = per_task.reindex(columns=tasks)
    out = per_task.map(lambda v: "–" if pd.isna(v) else f"{v:.3f}")
    out["MAD-style mean"] = per_task.mean(axis=1).map(lambda v: f"{v:.3f}")
    out["tasks"] = per_task.notna().sum(axis=1).map(lambda n: f"{n} of {len(tasks)}")
    order = per_task.mean(axis=1).sort_values(ascending=False, kind="stable").index
    return out.loc[order].rename_axis("variant").reset_index()


def task_blocks(tr: pd.DataFrame) -> list[tuple]:
    """Accuracy per task and the MAD-style mean per variant, when the run has several
    tasks."""
    if tr["task"].nunique() < 2 or not (tr["status"] == "ok").any():
        return []
    return [("h", 3, "Accuracy per task"),
            ("p", "Per variant and task: the mean over the task's settings of the variant's "
                  "best held-out accuracy at each (the best over its settled cells there, "
                  "each the median over its seeds); "
                  "the MAD-style mean is the mean over tasks (MAD, Poli et al. 2024, whose "
                  "mean over six synthetic tasks tracked the ranking at scale)."),
            ("table", task_table(tr))]
