"""Two references never share a table, a plot or an answer: rows whose error is against
their own float64 recurrence (err_ref = recurrence) stay out of the answers and of the
error tables against exact attention, and get tables of their own; a folder written
before the column reads as softmax."""

import pandas as pd

from harness.report.build import write_report
from harness.report.folder import load_run
from report_synth import row, write_run

COL = "fastest with row_cos ≥ 0.995"


def _rows(err_ref=True):
    """Causal N = 512 and 1024: sdpa, and a recurrence ten times faster whose row_cos
    against its own recurrence is 1 (it would win the answer if it were counted)."""
    out = []
    for n in (512, 1024):
        out.append(row("sdpa", n, causal=True, time_ms=10.0 * n / 512, row_cos=1.0,
                       exact=True, **({"err_ref": "softmax"} if err_ref else {})))
        if err_ref:
            r = row("sdpa", n, causal=True, time_ms=1.0 * n / 512, row_cos=1.0, exact=False,
                    family="recurrent", params='{"chunk": 64}', rel_err=3.3e-7,
                    err_ref="recurrence")
            out.append(r | {"variant": "retention"})
    return out


def test_a_recurrence_is_never_the_answer_and_has_its_own_error_tables(tmp_path):
    folder = write_run(tmp_path / "run", _rows())
    md = write_report(folder).read_text()
    answers = md.split("## Answers", 1)[1].split("\n## ", 1)[0]
    table = [line for line in answers.splitlines() if line.startswith("| forward ")]
    assert table and all("sdpa" in line and "retention" not in line for line in table)
    assert "approximate no softmax" in answers  # and the report says why
    by_length = md.split("## Time, memory and error by length", 1)[1].split("\n## ", 1)[0]
    softmax = by_length.split("rel_err against float64 exact attention", 1)[1].split(
        "rel_err against each variant's own", 1)[0]
    own = by_length.split("rel_err against each variant's own float64 recurrence", 1)[1]
    assert "retention" not in softmax and "sdpa" in softmax
    assert "retention" in own.split("row_cos against", 1)[0]
    assert "sdpa" not in own.split("row_cos against", 1)[0]
    assert (folder / "plots" / "error_recurrence_vs_length.png").is_file()


def test_a_folder_without_err_ref_reads_as_softmax(tmp_path):
    folder = write_run(tmp_path / "old", _rows(err_ref=False))
    assert "err_ref" not in pd.read_csv(folder / "results.csv").columns
    df, _ = load_run(folder)
    assert set(df["err_ref"]) == {"softmax"}
    assert "own float64 recurrence" not in write_report(folder).read_text()
