"""The report of a synthetic run: every section, the answers it must give, and its images."""

import re
from pathlib import Path

import matplotlib.image
import pytest

from harness.report import canvas, plots
from harness.cli.report import report_dir
from harness.errors import UsageError
from harness.report.build import SECTIONS, write_report
from harness.report.folder import load_run, variant_label
from report_synth import synthetic_rows, write_run

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (1024, 2048, 4096, 16384)


@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory):
    folder = write_run(tmp_path_factory.mktemp("runs") / "syn", synthetic_rows(LENGTHS))
    md = write_report(folder)
    return folder, md.read_text()


def _section(md: str, title: str) -> str:
    start = md.index(f"## {title}\n")
    nxt = md.find("\n## ", start + 1)
    return md[start:nxt if nxt > 0 else None]


def _row(table_text: str, *cells: str, lead: str | None = None) -> str:
    """The first Markdown table row holding all the given cells (and starting with lead)."""
    for line in table_text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if all(c in parts for c in cells) and (lead is None or parts[1:2] == [lead]):
            return line
    raise AssertionError(f"no row with {cells} in:\n{table_text}")


def test_every_section_is_there(synthetic_report):
    folder, md = synthetic_report
    for title in SECTIONS:
        assert f"\n## {title}\n" in md
    html = (folder / "report.html").read_text()
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in html
    assert html.count("src='data:image/png;base64,") == 5  # self-contained: no file links


def test_answers_fastest_accurate_on_local_inputs(synthetic_report):
    _, md = synthetic_report
    answers = _section(md, "Answers")
    # the only accurate fast path on local inputs (one setting per variant: bare labels)
    assert _row(answers, "forward", "local", "16384", "sliding_window")
    assert _row(answers, "forward", "gaussian", "16384", "nystrom")


def test_answers_nystrom_crossover_and_complexity(synthetic_report):
    _, md = synthetic_report
    row = _row(_section(md, "Answers"), lead="nystrom")
    cells = [p.strip() for p in row.split("|")]
    assert "3,000" in cells                      # faster than sdpa from N = 3000, by construction
    assert "1.00" in cells                       # time ~ N^1
    assert "2.00" in _row(_section(md, "Empirical complexity"), "sdpa")
    assert "beyond range (> 16384)" in _row(_section(md, "Crossover lengths"),
                                             "nystrom")


def test_tables_ratios_and_statuses(synthetic_report):
    _, md = synthetic_report
    tables = _section(md, "Time, memory and error by length")
    # standard is 4x sdpa's time at every length, and is its own reference.
    assert re.search(r"\| standard\s+\| 4 / 1\s+\|", tables)
    assert "oom" in tables
    status = _section(md, "Cases not measured")
    row = _row(status, "nystrom", "skipped")
    assert "non-causal only" in row and "1024, 2048, 4096, 16384" in row
    assert "needs 16 GiB" in _row(status, "standard", "oom")
    assert "317" in _section(md, "Achieved GFLOP/s")
    assert "synthetic" in _section(md, "Environment")


def test_plots_are_images_of_the_expected_size(synthetic_report):
    folder, _ = synthetic_report
    expected = {"time_vs_length.png": canvas.grid_size_px(2, 3),
                "memory_vs_length.png": canvas.grid_size_px(2, 3),
                "error_vs_length.png": canvas.grid_size_px(2, 3),
                "pareto.png": canvas.grid_size_px(2, 3),     # N = 4096 and 16384 x 3 inputs
                "gflops.png": plots.gflops_size_px(5)}
    assert sorted(p.name for p in (folder / "plots").iterdir()) == sorted(expected)
    for name, (w, h) in expected.items():
        img = matplotlib.image.imread(folder / "plots" / name)
        assert img.shape[:2] == (h, w), name
        assert img[..., :3].std() > 0.01, name  # not a blank canvas


def test_labels_and_loading(tmp_path):
    assert variant_label("sdpa", "{}") == "sdpa"
    assert variant_label("linformer", '{"share_kv": true, "k": 256.0}') == \
        "linformer(k=256, share_kv=true)"
    folder = write_run(tmp_path / "r", synthetic_rows((512, 1024)))
    df, meta = load_run(folder)
    assert df["causal"].dtype == bool and meta["threads"] == 2


def test_not_a_results_folder(tmp_path):
    with pytest.raises(UsageError, match="not a results folder"):
        load_run(tmp_path)
    with pytest.raises(UsageError, match="not a folder"):
        report_dir(tmp_path / "nope")


def test_missing_columns_are_named(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("rel_err", "time_ms_iqr")}
            for r in synthetic_rows((512,))]
    folder = write_run(tmp_path / "r", rows)
    with pytest.raises(UsageError, match="time_ms_iqr, rel_err"):
        load_run(folder)


def test_a_run_with_no_case_yet(tmp_path):
    folder = write_run(tmp_path / "r", [])
    (folder / "results.csv").write_text(",".join(synthetic_rows((512,))[0]) + "\n")
    with pytest.raises(UsageError, match="no case yet"):
        load_run(folder)


def test_extra_harness_columns_are_fine_and_duplicates_keep_the_last(tmp_path):
    rows = synthetic_rows((512, 1024))
    rows = [r | {"case_id": str(i), "err_rows": 512, "threads": 2, "seed": 0}
            for i, r in enumerate(rows)]
    rows.append(rows[0] | {"time_ms": 99.0})
    df, _ = load_run(write_run(tmp_path / "r", rows))
    assert len(df) == len(rows) - 1
    first = df[df["case_id"] == 0]
    assert first["time_ms"].tolist() == [99.0]


def test_a_run_with_no_ok_case_still_reports(tmp_path):
    rows = [r | {"status": "error", "reason": "boom"} for r in synthetic_rows((512,))]
    for r in rows:
        r.update(time_ms=None, time_ms_iqr=None, peak_mem_mib=None, rel_err=None,
                 gflops_per_s=None)
    md = write_report(write_run(tmp_path / "r", rows)).read_text()
    assert "boom" in _section(md, "Cases not measured")


@pytest.mark.parametrize("case", ["not a folder", "no results files", "missing column",
                                  "no common case"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, case):
    """Through run_bench.main, the path `python run_bench.py report|compare` takes."""
    import run_bench

    good = write_run(tmp_path / "good", synthetic_rows((512,)))
    argv, words = {
        "not a folder": (["report", tmp_path / "nope"], "not a folder"),
        "no results files": (["report", tmp_path], "not a results folder"),
        "missing column": (["report", write_run(tmp_path / "bad", [
            {k: v for k, v in r.items() if k != "flops"} for r in synthetic_rows((512,))])],
            "lacks column(s): flops"),
        "no common case": (["compare", good, write_run(tmp_path / "other",
                                                       synthetic_rows((1024,)))],
                           "no case in common"),
    }[case]
    assert run_bench.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and err.startswith("attnbench: error:")
