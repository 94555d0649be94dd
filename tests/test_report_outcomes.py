"""The report of a folder with outcomes (issue 49, item 7): steps to 0.9 as a median over
seeds with the censored runs beyond the budget, a plot of them against state, and answers
that name a tied set instead of a winner inside the seeds' spread; a folder without the
column reports as before.

Planted bugs these catch (each planted and seen failing): a censored seed dropped from
the median (the cell reads 200, not "> 400"); the smallest-state answer picking the more
accurate of two cells whose seeds overlap; the new parts shown for an older folder.
"""

from __future__ import annotations

import report_synth
from harness.report.build import write_report
from harness.report.frontier import frontier_table, smallest_state_table
from harness.report.trained import read_train
from test_train_frontier import _row

SETTING = "mqar N=64 P=8 V=64 causal"


def _seeds(variant, params, state, accs, steps, outcome="learned"):
    """One cell over len(accs) seeds."""
    return [{**_row(variant, params, state, a), "seed": s, "steps_to_0_9": t,
             "config_id": f"{variant}-{params}-{s}", "outcome": outcome, "settled": True}
            for s, (a, t) in enumerate(zip(accs, steps))]


ROWS = [*_seeds("gla", {}, 4096, [0.99, 0.95], [200, 300]),
        *_seeds("mamba2", {}, 4096, [0.992, 0.97], [250, None]),
        *_seeds("sdpa", {}, 65536, [1.0, 1.0], [100, 150]),
        *_seeds("linear", {}, 4224, [0.14, 0.13], [None, None], outcome="not_learned")]


def test_the_smallest_state_names_the_tied_set(tmp_path):
    tr = read_train(report_synth.write_train(tmp_path / "f", ROWS) / "train.csv")
    got = smallest_state_table(tr).set_index("task setting").loc[SETTING]
    assert got["smallest state reaching 0.9"] == "mamba2, gla (tied)"
    # apart by more than the spread: a winner
    apart = [r for r in ROWS if r["variant"] != "gla"] + _seeds("gla", {}, 4096, [0.91, 0.9],
                                                                [200, 300])
    tr = read_train(report_synth.write_train(tmp_path / "g", apart) / "train.csv")
    got = smallest_state_table(tr).set_index("task setting").loc[SETTING]
    assert got["smallest state reaching 0.9"] == "mamba2"


def test_steps_to_0_9_is_a_median_with_the_censored_beyond_the_budget(tmp_path):
    tr = read_train(report_synth.write_train(tmp_path / "f", ROWS) / "train.csv")
    table = frontier_table(tr, SETTING).set_index("variant")
    assert table.loc["gla", "steps to 0.9 (median)"] == "250"
    assert table.loc["mamba2", "steps to 0.9 (median)"] == "> 400"  # one seed censored
    assert table.loc["linear", "steps to 0.9 (median)"] == "> 400"
    assert table.loc["linear", "outcomes"] == "not_learned"


def test_the_report_adds_the_steps_plot_only_with_outcomes(tmp_path):
    folder = report_synth.write_train(tmp_path / "new", ROWS)
    md = write_report(folder).read_text()
    assert "steps to 0.9 against state" in md and "(tied)" in md
    assert list((folder / "plots").glob("trained_steps_*.png"))
    from harness.files import TRAIN_COLUMNS
    old = [c for c in TRAIN_COLUMNS if c not in ("outcome", "plateau", "val_accuracy")]
    folder = report_synth.write_train(tmp_path / "old", ROWS, columns=old)
    md = write_report(folder).read_text()
    assert "steps to 0.9 against state" not in md and "(tied)" not in md
    assert "steps to 0.9 (median)" not in md
    assert not list((folder / "plots").glob("trained_steps_*.png"))


def test_the_fewest_attention_layers_name_the_tied_stacks(tmp_path):
    """mamba2*3+sdpa 0.998 [0.997-0.999] and gated_deltanet*3+sdpa 0.9979 [0.996-0.9998]
    at the same share: hybrid-cpu's Answers picked the first on that 0.0001."""
    from harness.report import hybrid
    from harness.report.cells import cells

    rows = [report_synth.hybrid_row(v, a, s, outcome="learned")
            for v, accs in (("mamba2*3+sdpa", (0.997, 0.999)),
                            ("gated_deltanet*3+sdpa", (0.996, 0.9998)),
                            ("gla*3+sdpa", (0.5, 0.6)))
            for s, a in enumerate(accs)]
    tr = read_train(report_synth.write_train(tmp_path / "h", rows) / "train.csv")
    got = hybrid.answer_table(cells(hybrid.stack_rows(tr))).iloc[0]
    assert got["variant"] == "mamba2*3+sdpa, gated_deltanet*3+sdpa (tied)"
    old = read_train(report_synth.write_train(tmp_path / "o", [
        {k: v for k, v in r.items() if k != "outcome"} for r in rows]) / "train.csv")
    assert hybrid.answer_table(cells(hybrid.stack_rows(old))).iloc[0]["variant"] == \
        "mamba2*3+sdpa"


def test_answerable_keeps_the_columns_of_an_empty_frame():
    """A folder whose every cell is filtered out (or a filter that leaves none) still has
    its columns: a bare `[]` index selected no columns and the next step raised KeyError."""
    import pandas as pd

    from harness.report.cells import answerable
    empty = pd.DataFrame({"variant": pd.Series(dtype=str), "settled": pd.Series(dtype=object)})
    assert list(answerable(empty).columns) == ["variant", "settled"]
    one = pd.DataFrame({"variant": ["gla", "sdpa"], "settled": [False, True]})
    assert answerable(one)["variant"].tolist() == ["sdpa"]
