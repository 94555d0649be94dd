"""The report's "Recall against the share of attention layers" section and its Answers line,
from synthetic train.csv frames of layer-pattern stacks (report_synth.hybrid_row) whose
answers are known by construction.

Planted bugs each test was seen to catch: a point at the mean of the seeds, the range from
the first seed, x the attention layers' count (not over layers), unsettled points drawn
filled; the answer taken from an unsettled cell, from the best seed instead of the median,
or at the most accurate share instead of the fewest attention layers; the order compared at
1/2 instead of 3:1, a flip read as agreement, or an unsettled cell ranked; the section from
a file without the columns (a KeyError) or with only plain mixers; the section placed
before the trained one; the frontier dropping the hybrid rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import report_synth as S
from harness.report import frontier, hybrid, trained_plots
from harness.report import run as report_run
from harness.report.build import write_report

SETTING = "mqar N=128 P=16 V=128 causal"


def _folder(tmp_path: Path, rows, hybrid_cols: bool = True) -> Path:
    return S.write_train(tmp_path / "sweep", rows, S.hybrid_columns(hybrid_cols))


def _seeds(spec, accs, **over):
    return [S.hybrid_row(spec, a, seed, **over) for seed, a in enumerate(accs)]


def _gids(ax) -> dict:
    return {a.get_gid(): a for a in [*ax.collections, *ax.lines] if a.get_gid()}


def test_the_share_plot_draws_each_cells_median_and_its_seeds_range(tmp_path, monkeypatch):
    rows = (_seeds("gla", (0.10, 0.20, 0.60)) + _seeds("gla*3+sdpa", (0.70, 0.90, 0.95))
            + _seeds("gla+sdpa", (0.95, 0.97, 0.99), settled=False)
            + _seeds("sdpa", (1.0, 0.98, 0.99)))
    run = report_run.read(_folder(tmp_path, rows))
    drawn = []
    real = trained_plots.share_plot
    monkeypatch.setattr(trained_plots, "share_plot", lambda df, *a: drawn.append(df) or real(df, *a))
    blocks = hybrid.blocks(run)
    assert [b[2] for b in blocks if b[0] == "h"] == [hybrid.TITLE, SETTING]
    (df,) = drawn
    ax = trained_plots.share_figure(df, SETTING).axes[0]
    art = _gids(ax)
    # gla: medians 0.2 (not the mean 0.3) at 0 and 0.9 at 1/4, filled; 1/2 unsettled, hollow
    close = np.testing.assert_allclose
    close(art["gla:filled"].get_offsets(), [[0, 0.2], [0.25, 0.9]])
    close(art["gla:hollow"].get_offsets(), [[0.5, 0.97]])
    bars = sorted(np.asarray(s).ravel().tolist() for s in art["gla:range"].get_segments())
    close(bars, [[0, 0.1, 0, 0.6], [0.25, 0.7, 0.25, 0.95], [0.5, 0.95, 0.5, 0.99]])
    close(art[":filled"].get_offsets(), [[1.0, 0.99]])
    line = next(ln for ln in ax.lines if len(ln.get_xdata()) == 4)  # gla's, to attention only
    assert list(line.get_xdata()) == [0, 0.25, 0.5, 1.0]
    assert list(line.get_ydata()) == pytest.approx([0.2, 0.9, 0.97, 0.99])
    png = next(b for b in blocks if b[0] == "img")[1]
    assert png.stat().st_size > 1000
    table = next(b[1] for b in blocks if b[0] == "table")
    gla = table[table["mixer"] == "gla"].iloc[0]
    assert gla["share 0 (no attention)"] == "0.200 [0.100–0.600]§"  # spread 0.5 > 0.2
    assert gla["share 1/4 (3:1)"] == "0.900 [0.700–0.950]§"
    assert gla["share 1/2 (1:1)"] == "0.970 [0.950–0.990]°"


def _answer(tmp_path, rows) -> dict:
    run = report_run.read(_folder(tmp_path, rows))
    table = hybrid.answer_blocks(run.train)[1][1]
    return {r["task setting"]: r for _, r in table.iterrows()}


def test_the_answer_is_the_fewest_attention_layers_whose_settled_median_reaches_0_9(tmp_path):
    rows = (_seeds("gla", (0.95, 0.96), settled=False)  # 0 attention layers, not settled
            + _seeds("mamba2", (0.95, 0.5, 0.5))  # its best seed reaches, its median not
            + _seeds("gated_deltanet*3+sdpa", (0.91, 0.93))  # 1 of 4: the answer
            + _seeds("gla+sdpa", (0.99, 1.0))  # 2 of 4, more accurate
            + _seeds("sdpa", (1.0, 1.0))
            + _seeds("gla*3+sdpa", (0.2, 0.3), seq_len=64, pairs=8)
            + _seeds("gla", (0.1, 0.1), seq_len=64, pairs=8))
    got = _answer(tmp_path, rows)
    first = got[SETTING]
    assert first["fewest attention layers reaching 0.9"] == "1 of 4"
    assert (first["mixer"], first["variant"]) == ("gated_deltanet", "gated_deltanet*3+sdpa")
    assert first["accuracy"] == "0.920 [0.910–0.930]"
    assert got["mqar N=64 P=8 V=64 causal"]["fewest attention layers reaching 0.9"] == \
        "none (best: gla*3+sdpa 0.250 [0.200–0.300])"


def test_the_answer_can_be_attention_only_and_says_none_without_a_settled_cell(tmp_path):
    rows = (_seeds("gla*3+sdpa", (0.5, 0.6)) + _seeds("sdpa", (0.95, 0.97))
            + _seeds("gla*3+sdpa", (0.95, 0.97), seq_len=64, pairs=8, settled=False))
    got = _answer(tmp_path, rows)
    assert got[SETTING]["fewest attention layers reaching 0.9"] == "4 of 4"
    assert got[SETTING]["mixer"] == "attention only (sdpa)"
    assert got["mqar N=64 P=8 V=64 causal"]["fewest attention layers reaching 0.9"] == \
        "none (no settled cell)"


def _order(tmp_path, accs: dict, rows=()) -> str:
    """accs: mixer -> (alone, at 3:1, at 1:1), two seeds each a hair apart."""
    rows = list(rows)
    for m, (a0, a1, a2) in accs.items():
        for spec, a in ((m, a0), (f"{m}*3+sdpa", a1), (f"{m}+sdpa", a2)):
            rows += _seeds(spec, (a - 0.01, a + 0.01))
    run = report_run.read(_folder(tmp_path, rows))
    return next(b[1] for b in hybrid.blocks(run) if b[0] == "p" and "rank" in b[1])


def test_the_order_sentence_says_when_the_standalone_order_flips_at_3_to_1(tmp_path):
    # alone: mamba2 > gla > gated_deltanet; at 3:1 gated_deltanet first; at 1:1 as alone
    text = _order(tmp_path, {"gated_deltanet": (0.10, 0.95, 0.5), "gla": (0.15, 0.70, 0.6),
                             "mamba2": (0.20, 0.80, 0.7)})
    assert "the order alone is not their order at 3:1" in text
    assert "gated_deltanet and gla, gated_deltanet and mamba2, gla and mamba2 swap" not in text
    assert "gated_deltanet and gla, gated_deltanet and mamba2 swap" in text
    assert "at 3:1 gated_deltanet 0.950 > mamba2 0.800 > gla 0.700" in text


def test_the_order_sentence_says_when_it_holds(tmp_path):
    # the same order alone and at 3:1; at 1:1 it flips, which the sentence must not read;
    # linear would flip at 3:1, but its 3:1 cell has not settled
    unsettled = (_seeds("linear", (0.5, 0.5)) + _seeds("linear*3+sdpa", (0.1, 0.1),
                                                        settled=False))
    text = _order(tmp_path, {"gated_deltanet": (0.30, 0.95, 0.5), "gla": (0.15, 0.70, 0.9),
                             "mamba2": (0.20, 0.80, 0.7)}, unsettled)
    assert "the order alone is their order at 3:1" in text and "linear" not in text
    assert "The mixers alone rank gated_deltanet 0.300 > mamba2 0.200 > gla 0.150" in text


def test_an_older_train_csv_or_one_without_a_stack_renders_without_the_section(tmp_path):
    old = S.write_train(tmp_path / "old", [S.hybrid_row(v, 0.9, hybrid=False)
                                           for v in ("gla", "sdpa")], S.hybrid_columns(False))
    plain = S.write_train(tmp_path / "plain", [S.hybrid_row(v, 0.9) for v in ("gla", "sdpa")],
                          S.hybrid_columns())
    for folder in (old, plain):
        md = write_report(folder).read_text()
        assert "## Quality when trained" in md
        assert hybrid.TITLE not in md and "Fewest full-attention layers" not in md
        assert not list((folder / "plots").glob("hybrid_share_*"))


def test_the_section_follows_the_trained_one_and_answers_in_the_answers(tmp_path):
    rows = [S.hybrid_row(v, a) for v, a in (("gla", 0.2), ("gla*3+sdpa", 0.93), ("sdpa", 1.0))]
    rows += [S.hybrid_row(v, 0.5, seq_len=64, pairs=8) for v in ("gla", "sdpa")]  # no stack
    folder = _folder(tmp_path, rows)
    md = write_report(folder).read_text()
    heads = [ln[3:] for ln in md.splitlines() if ln.startswith("## ")]
    assert heads[heads.index("Quality when trained") + 1] == hybrid.TITLE
    answers = md[md.index("## Answers"):md.index("## Quality when trained")]
    assert "Fewest full-attention layers" in answers and "| 1 of 4" in answers
    section = md[md.index(f"## {hybrid.TITLE}"):md.index("## Training environment")]
    assert "N=64" not in section and "N=64" not in answers.split("Fewest full-attention")[1]
    assert (folder / "plots" / f"hybrid_share_{SETTING.replace(' ', '_').replace('=', '_')}"
            ".png").is_file()


def test_the_frontier_draws_a_stack_at_its_total_state(tmp_path, monkeypatch):
    rows = [S.hybrid_row(v, 0.5) for v in ("gated_deltanet", "gated_deltanet*3+sdpa", "sdpa")]
    run = report_run.read(_folder(tmp_path, rows))
    drawn = []
    monkeypatch.setattr(trained_plots, "frontier_plot", lambda df, *a: drawn.append(df) or a[1])
    frontier.frontier_blocks(run.train, tmp_path / "plots")
    (df,) = drawn
    state = dict(zip(df["variant"], df["state_bytes"]))
    n, d, heads = 128, 32, 2  # 3 recurrent states D^2 and one cache 2 N D, per head
    assert state["gated_deltanet*3+sdpa"] == 4 * heads * (3 * d * d + 2 * n * d)
    assert state["sdpa"] == 4 * heads * 4 * 2 * n * d


def test_the_section_marks_and_explains_each_mark_once(tmp_path):
    # one rule for a cell's marks and their footnote (harness.report.cells): an unsettled,
    # seed-sensitive cell reads `°§` once, and each mark's paragraph appears once
    rows = (_seeds("gla", (0.10, 0.60), settled=False) + _seeds("gla*3+sdpa", (0.9, 0.95))
            + _seeds("sdpa", (1.0, 1.0)))
    blocks = hybrid.blocks(report_run.read(_folder(tmp_path, rows)))
    table = next(b[1] for b in blocks if b[0] == "table")
    gla = table[table["mixer"] == "gla"].iloc[0]
    assert gla["share 0 (no attention)"] == "0.350 [0.100–0.600]°§"
    text = " ".join(b[1] for b in blocks if b[0] == "p")
    assert text.count("°: not settled") == 1 and text.count("§: seed-sensitive") == 1
