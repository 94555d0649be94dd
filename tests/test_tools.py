"""tools/step_ratios.py: the interleaved training-step timer the step-time notes quote;
tools/trained_moves.py: how far trained cells moved between two runs."""

import pytest

from tools import step_ratios


def test_step_ratios_prints_a_row_a_length_with_sdpa_at_one(capsys):
    import torch
    threads = torch.get_num_threads()
    assert step_ratios.main(["--seq-lens", "32", "--variants", "retention", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| N | sdpa | retention |" and len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "32" and cells[1].endswith("(1.00x)") and cells[2].endswith("x)")
    assert torch.get_num_threads() == threads  # timed at one thread, the caller's restored


@pytest.mark.parametrize("argv", [["--variants", "nosuch"], ["--seq-lens", "65"],
                                  ["--seq-lens", "x"], ["--rounds", "0"]])
def test_step_ratios_refuses_bad_input_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        step_ratios.main(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_trained_moves_reads_the_figures_docs_training_quotes(capsys):
    """docs/training.md's v5-to-v6 comparison is this command's output."""
    from pathlib import Path

    from tools import trained_moves
    root = Path(__file__).resolve().parents[1] / "results"
    trained_moves.main([str(root / "train-cpu-v5"), str(root / "train-cpu-v6")])
    out = capsys.readouterr().out
    assert "settled in both: 39 cells, median move 0.0009, largest 0.0762" in out
    assert "not: 9 cells, median move 0.0168, largest 0.2895" in out
    docs = " ".join((root.parent / "docs" / "training.md").read_text().split())
    assert "moved at most 0.076" in docs and "median 0.0009" in docs


def test_trained_moves_splits_a_planted_move_by_settling(tmp_path, capsys):
    """A settled cell moved by 0.3 in both seeds is the largest settled move, and listed
    first; an unsettled one moved further stays out of the settled line."""
    from pathlib import Path

    import pandas as pd

    from tools import trained_moves
    run = Path(__file__).resolve().parents[1] / "results" / "train-cpu-v6"
    src = pd.read_csv(run / "train.csv", dtype={"params": str})
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    src.to_csv(tmp_path / "a" / "train.csv", index=False)
    b = src.copy()
    settled = b[(b["variant"] == "sdpa") & (b["seq_len"] == 128)].index
    b.loc[settled, "accuracy"] -= 0.3
    unsettled = b[(b["variant"] == "gla") & (b["heads"] == 8)].index
    assert not b.loc[unsettled, "settled"].any() and b.loc[settled, "settled"].all()
    b.loc[unsettled, "accuracy"] += 0.5
    b.to_csv(tmp_path / "b" / "train.csv", index=False)
    trained_moves.main([str(tmp_path / "a"), str(tmp_path / "b"), "--top", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("settled in both: 39 cells") and out[1].endswith("largest 0.3000")
    assert out[2].startswith("not: 9 cells") and out[2].endswith("largest 0.5000")
    assert out[4].split()[0] == "gla" and out[5].split()[0] == "sdpa"
