"""A trained configuration over its seeds, as the report reads it: a cell (`cells`), its
median accuracy and range over the seeds, whether it settled, whether its seeds disagree,
the marks that say so, and the cells an answer may use (`answerable`).

Marks: ° not settled (a seed's winning run neither reached early_stop nor settled:
train.csv's `settled`), § seed-sensitive (its seeds differ by more than SEED_SPREAD),
† the winning run was still rising at its end, ‡ its learning rate was at an end of the
sweep (train.csv's `rising`, `lr_at_edge`).
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

SEED_SPREAD = 0.2  # a cell whose seeds' accuracies differ by more is seed-sensitive
TIE = 0.02  # one seed each: closer than this is a tie (the margin's floor, train/outcome.py)
TASK_SETTING = ["task", "task_params", "seq_len", "vocab_size", "causal"]
# A cell: a trained row's configuration but for its seed.
CELL = ["variant", "params", *TASK_SETTING, "num_kv_pairs", "d_model", "layers", "heads",
        "mlp"]
UNSETTLED, SENSITIVE, RISING, EDGE = "°", "§", "†", "‡"


def marks(row) -> str:
    """° not settled, § seed-sensitive, † still rising, ‡ the winning rate at an end of the
    sweep."""
    return (UNSETTLED if str(row.get("settled")) == "False" else "") + \
        (SENSITIVE if row.get("seed_sensitive") is True else "") + \
        (RISING if str(row.get("rising")) == "True" else "") + \
        (EDGE if str(row.get("lr_at_edge")) == "True" else "")


def _all(values):
    """True when every value is True, False when one is False, None when none is known."""
    known = [v for v in values if v is not None and not pd.isna(v)]
    if any(not v for v in known):
        return False
    return True if known and len(known) == len(values) else None


def known_false(v) -> bool:
    """True for a flag that is False (numpy's too); None and empty are unknown."""
    return v is not None and not pd.isna(v) and not bool(v)


def _any(values):
    known = [v for v in values if v is not None and not pd.isna(v)]
    return None if not known else any(bool(v) for v in known)


def cells(tr: pd.DataFrame) -> pd.DataFrame:
    """One row per cell of the ok rows: the first seed's row (its rate, its sweep) with
    `accuracy` the median over the cell's seeds, `acc_min`, `acc_max`, `seeds` (how many),
    `settled` (every seed's winning run settled; None when the file does not say),
    `rising` and `lr_at_edge` (any seed's), `seed_sensitive` (more than one seed, and
    their accuracies more than SEED_SPREAD apart), step_ms the median."""
    ok = tr[tr["status"] == "ok"]
    if ok.empty:
        return ok.assign(acc_min=[], acc_max=[], seeds=[], seed_sensitive=[])
    rows = []
    for _, g in ok.sort_values("seed", kind="stable").groupby(CELL, sort=False,
                                                               dropna=False):
        first = g.iloc[0].to_dict()
        acc = g["accuracy"]
        rows.append({**first, "accuracy": float(acc.median()), "acc_min": float(acc.min()),
                     "acc_max": float(acc.max()), "seeds": len(g),
                     "settled": _all(list(g["settled"])), "rising": _any(list(g["rising"])),
                     "lr_at_edge": _any(list(g["lr_at_edge"])),
                     "seed_sensitive": len(g) > 1  # beyond float rounding of the difference
                     and acc.max() - acc.min() > SEED_SPREAD + 1e-9,
                     "step_ms": float(g["step_ms"].median()),
                     "steps_0_9": steps_median(g["steps_to_0_9"]),
                     "budget": float(g["max_steps"].max())})
    order = {k: i for i, k in enumerate(ok["config_id"])}
    out = pd.DataFrame(rows).sort_values("config_id", key=lambda c: c.map(order),
                                         kind="stable").reset_index(drop=True)
    for col in ("settled", "rising", "lr_at_edge", "seed_sensitive"):  # True, False, None
        out[col] = pd.Series([None if v is None else bool(v) for v in out[col]],
                             dtype=object)
    return out


def protocol(tr: pd.DataFrame) -> bool:
    """Whether the rows carry an `outcome` (issue 49's protocol): the report's parts that
    read it appear only then, so an older folder's report stays as it was."""
    return "outcome" in tr and tr["outcome"].notna().any()


def steps_median(values) -> float:
    """The median over seeds of the steps to 0.9, a run that never reached it (empty)
    counted as beyond any budget (inf): censored, not missing."""
    return float(statistics.median([math.inf if pd.isna(v) else float(v) for v in values]))


def steps_text(row) -> str:
    """`350`, or `> 3000` where the median is censored (beyond the budget)."""
    v = row["steps_0_9"]
    return f"> {int(row['budget'])}" if math.isinf(v) else f"{int(v)}"


def tied(best, rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose accuracy is inside `best`'s seeds' spread: their ranges over seeds
    overlap (a cell of one seed: within TIE of the other's range). An answer names these
    with its winner, not a winner among them."""
    lo = rows["acc_min"] - (rows["seeds"] == 1) * TIE
    hi = rows["acc_max"] + (rows["seeds"] == 1) * TIE
    blo = best["acc_min"] - (best["seeds"] == 1) * TIE
    bhi = best["acc_max"] + (best["seeds"] == 1) * TIE
    return rows[(lo <= bhi) & (hi >= blo)]


def answerable(cell_rows: pd.DataFrame) -> pd.DataFrame:
    """The cells an answer or an ordering may use: all but those known not to have
    settled (a file from before `settled` existed keeps every cell)."""
    keep = pd.Series([not known_false(v) for v in cell_rows["settled"]],
                     index=cell_rows.index, dtype=bool)  # a mask even when empty: a bare
    return cell_rows[keep]                                # [] would select no columns


def range_text(row) -> str:
    """`0.512 [0.40–0.62]` for a cell of several seeds, else the accuracy; with marks."""
    text = f"{row['accuracy']:.3f}"
    if row.get("seeds", 1) > 1:
        text += f" [{row['acc_min']:.3f}–{row['acc_max']:.3f}]"
    return text + marks(row)


def footnote(rows: pd.DataFrame) -> list[tuple]:
    """The paragraph that explains the marks, when a row carries one."""
    rising = (rows["rising"].astype(str) == "True").any()  # True, False or empty
    edge = (rows["lr_at_edge"].astype(str) == "True").any()
    unsettled = (rows["settled"].astype(str) == "False").any()
    sensitive = "seed_sensitive" in rows and (rows["seed_sensitive"] == True).any()  # noqa: E712
    parts = []
    if unsettled:
        parts.append(f"{UNSETTLED}: not settled: a seed's winning run ended at its step cap "
                     "still gaining (it neither reached early_stop nor went a settling "
                     "window without gain)" + (
                         ", or still on its plateau (`not_learned`: censored, not a level)"
                         if protocol(rows) else "") +
                     ": drawn hollow, and kept out of the answers and orderings")
    if sensitive:
        parts.append(f"{SENSITIVE}: seed-sensitive: the cell's seeds differ by more than "
                     f"{SEED_SPREAD:g} in accuracy")
    if rising:
        parts.append(f"{RISING}: the winning run was still rising when its step budget ran "
                     "out (its last held-out accuracy beat every evaluation before its last "
                     "two by more than 0.01, and it did not reach early_stop): more steps "
                     "might score higher")
    if edge:
        parts.append(f"{EDGE}: the winning learning rate is the smallest or the largest of "
                     "the rates swept and the run did not reach early_stop: a rate outside "
                     "the sweep might score higher")
    return [("p", "; ".join(parts) + ".")] if parts else []


def unsettled_note(tr: pd.DataFrame) -> list[tuple]:
    """How many trained cells (and rows) had not settled, when any."""
    c = cells(tr)
    bad = c[[known_false(v) for v in c["settled"]]]
    if bad.empty:
        return []
    ok = tr[tr["status"] == "ok"]
    rows = ok[ok["settled"].astype(str) == "False"]
    return [("p", f"{len(bad)} of {len(c)} trained cells had not settled ({len(rows)} of "
                  f"{len(ok)} rows: a winning run that ended at its step cap still gaining): "
                  "their points are hollow, and they are left out of the answers and of "
                  "every ordering below.")]
