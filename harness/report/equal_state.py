"""The trained Answers' "best at equal state": at each state size where two or more variants
were trained in the same task setting, which one recalls best.

The frontier (frontier.py) draws accuracy against state; this reads it at one state size at
a time, as a person choosing a recurrence asks it: at the bytes I can keep per example, which
variant learns best? Per task setting (task, N, pairs, vocabulary, causal or not) and
`state_bytes`, over the settled cells (cells.answerable: each a configuration over its
seeds), each variant's best cell there; the one with the highest median held-out accuracy is
the answer, unless another's range over seeds overlaps its own (cells.tied: a cell of one
seed counts TIE either side): then no winner is named, the tied set is ("tie: gla, mamba2").
"""

from __future__ import annotations

import pandas as pd

from harness.report.cells import TIE, answerable, range_text, tied
from harness.report.frontier import _bytes, _frontier_rows, task_settings

TITLE = "Best at equal state"


def _name(rows: pd.DataFrame) -> str:
    names = list(dict.fromkeys(rows["variant"]))
    return names[0] if len(names) == 1 else "tie: " + ", ".join(names)


def table(tr: pd.DataFrame) -> pd.DataFrame:
    """Per task setting and state size at which two or more variants trained: the best (or
    the tied set) of their settled cells, its size and accuracy (median [min–max] over
    seeds, each named one's), the best variant outside it, and how many variants settled
    there; fewer than two settled: the one that did, or none, and no ranking."""
    every = _frontier_rows(tr)
    rows = []
    for s in task_settings(every):
        for state, at in every[every["task_setting"] == s].groupby("state_bytes", sort=True):
            trained = at["variant"].nunique()
            if trained < 2:
                continue
            # each variant's best settled cell at this state (of its sizes and models there)
            best = (answerable(at).sort_values("accuracy", ascending=False, kind="stable")
                    .drop_duplicates("variant").reset_index(drop=True))
            row = {"task setting": s, "state bytes": _bytes(state),
                   "variants settled": f"{len(best)} of {trained}"}
            if len(best) < 2:
                only = "" if best.empty else f"only {best.iloc[0]['variant']} settled: "
                rows.append(row | {"best at this state": only + "none ranked",
                                   "size": "–" if best.empty else best.iloc[0]["size"] or "–",
                                   "accuracy (median [min–max])": "–" if best.empty
                                   else range_text(best.iloc[0]), "next best": "–"})
                continue
            named = tied(best.iloc[0], best)
            rest = best[~best.index.isin(named.index)]
            nxt = rest.iloc[0] if len(rest) else None
            rows.append(row | {"best at this state": _name(named),
                               "size": "; ".join(z or "–" for z in named["size"]),
                               "accuracy (median [min–max])": "; ".join(
                                   range_text(r) for _, r in named.iterrows()),
                               "next best": "–" if nxt is None
                               else f"{nxt['variant']} {range_text(nxt)}"})
    return pd.DataFrame(rows)


def blocks(tr: pd.DataFrame) -> list[tuple]:
    """The paragraph and the table; [] where no state size has two variants trained."""
    t = table(tr)
    if t.empty:
        return []
    return [("p", f"{TITLE}: at each state size (bytes per example, float32) where two or "
                  "more variants trained in the same task setting, of those whose cells "
                  "settled (fewer than two: none is ranked), the variant with the best "
                  "held-out accuracy (the median over its seeds; of a "
                  "variant's sizes at that state, its best), with the seeds' range. Where "
                  "another's range overlaps the best's (a cell of one seed: within "
                  f"{TIE:g} of it), its lead is inside the seeds' spread: the tied set is named "
                  "(\"tie: ...\"), no winner. next best: the best variant outside it."),
            ("table", t)]
