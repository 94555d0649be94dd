"""The answers table cannot be won by a degenerate setting or by noise.

- A setting exact at its length (the run's `exact` column: a window or block layout that
  covers every pair) is an exact path: never the approximate answer nor the "most
  accurate approximate", and it is marked [exact at N].
- An approximate path is the answer only where the fastest exact path is slower by more
  than the two times' spread (IQRs, or spreads between rounds); otherwise the row says
  "no faster approximate path".
- A results folder written before the `exact` and `state_mib` columns still reports.
"""

import json

import pandas as pd

from harness.report import tables as T
from harness.report.build import write_report
from harness.report.folder import load_run
from report_synth import row, write_run

COL = "fastest with row_cos ≥ 0.995"
VERDICT = "approximate against exact (± spread)"


def _rows(sparse_time, sparse_iqr, exact_sparse=False, spread=None):
    """N = 512: sdpa 10 ms (IQR 0.5), standard 30 ms, block_sparse(block_size=128) (exact
    at 512 when told) and sliding_window(window=64) (approximate, accurate) at given times."""
    extra = {} if spread is None else {"time_ms_spread": spread}
    rows = [row("sdpa", 512, time_ms=10.0, time_ms_iqr=0.5, row_cos=1.0, exact=True, **extra),
            row("standard", 512, time_ms=30.0, time_ms_iqr=1.0, row_cos=1.0, exact=True, **extra),
            row("sliding_window", 512, time_ms=sparse_time, time_ms_iqr=sparse_iqr,
                row_cos=0.999, params=json.dumps({"window": 64}), exact=False, **extra),
            row("sliding_window", 512, time_ms=7.0, time_ms_iqr=0.1, row_cos=1.0,
                params=json.dumps({"window": 511}), exact=True, **extra),
            row("performer", 512, time_ms=1.0, time_ms_iqr=0.1, row_cos=0.6, exact=False,
                **extra)]
    return rows


def _answer(tmp_path, rows):
    df, _ = load_run(write_run(tmp_path / "run", rows))
    table = T.fastest_accurate(df, ["input"])
    assert len(table) == 1
    return table.iloc[0]


def test_a_setting_exact_at_its_length_is_an_exact_path(tmp_path):
    # sliding_window(window=511) covers every pair at N = 512 and is the fastest of all
    # accurate rows: it is the exact path the others are held against, not an answer.
    a = _answer(tmp_path, _rows(sparse_time=9.9, sparse_iqr=0.5))
    assert a[COL] == "sliding_window(window=511) [exact at N=512]", a
    assert a[VERDICT].startswith("no faster approximate path (sliding_window(window=64):")
    # the most accurate approximate is not the exact-at-N setting (row_cos 1.0)
    assert a["most accurate approximate"] == "sliding_window(window=64)"


def test_a_difference_within_the_spread_is_no_answer(tmp_path):
    # 9.4 against 10 ms, IQRs 0.5 + 0.5: within the noise.
    rows = [r for r in _rows(sparse_time=9.4, sparse_iqr=0.5)
            if json.loads(r["params"]).get("window") != 511]
    a = _answer(tmp_path, rows)
    assert a[COL] == "sdpa", a
    assert a[VERDICT] == ("no faster approximate path (sliding_window(window=64): "
                          "0.94 ± 0.1 × sdpa)"), a


def test_a_difference_beyond_the_spread_is_the_answer(tmp_path):
    rows = [r for r in _rows(sparse_time=5.0, sparse_iqr=0.2)
            if json.loads(r["params"]).get("window") != 511]
    a = _answer(tmp_path, rows)
    assert a[COL] == "sliding_window(window=64)", a
    assert a[VERDICT] == "0.5 ± 0.07 × sdpa" and a["× sdpa time"] == "0.5", a


def test_spread_between_rounds_widens_the_noise(tmp_path):
    # IQRs say 5 ms is clearly faster; rounds that differ by 60% say it is not.
    rows = [r for r in _rows(sparse_time=5.0, sparse_iqr=0.2, spread=0.6)
            if json.loads(r["params"]).get("window") != 511]
    assert _answer(tmp_path, rows)[COL] == "sdpa"


def test_a_folder_without_the_new_columns_still_reports(tmp_path):
    rows = _rows(sparse_time=5.0, sparse_iqr=0.2)
    for r in rows:
        del r["exact"]
    folder = write_run(tmp_path / "old", rows)
    assert "exact" not in pd.read_csv(folder / "results.csv").columns
    md = write_report(folder).read_text()
    assert "predates the `exact` column" in md
    # only the exact family counts as exact then: window=511 reads as an approximation
    a = _answer(tmp_path / "again", rows)
    assert a[COL] == "sliding_window(window=64)", a
    assert a["most accurate approximate"] == "sliding_window(window=511)", a


def test_state_is_tabled_and_plotted_beside_the_peak(tmp_path):
    rows = [row(v, n, time_ms=1.0, exact=v == "sdpa", state_mib=(n * n / 2**20 if v ==
                "standard" else 0.0)) for v in ("sdpa", "standard") for n in (1024, 2048)]
    folder = write_run(tmp_path / "state", rows)
    md = write_report(folder).read_text()
    table = md[md.index("state_mib (kept between calls"):].split("\n\n")[1]
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in table.splitlines()[2:]}
    assert cells == {"sdpa": ["0", "0"], "standard": ["1", "4"]}, table


def test_gflops_are_set_against_the_rate_of_their_device_and_dtype():
    rows = pd.DataFrame([
        {"label": "sdpa", "pass": "forward", "device": "cuda", "dtype": "bfloat16",
         "seq_len": 4096, "gflops_per_s": 400_000.0, "status": "ok", "family": "exact"},
        {"label": "sdpa", "pass": "forward", "device": "cpu", "dtype": "float32",
         "seq_len": 4096, "gflops_per_s": 100.0, "status": "ok", "family": "exact"}])
    rates = T.matmul_rates({"matmul_fp32_gflops": 200.0,
                            "matmul_gflops": {"cuda bfloat16": 800_000.0}})
    assert rates == {"cuda bfloat16": 800_000.0, "cpu float32": 200.0}
    table = T.gflops_table(rows, rates).set_index("device dtype")
    assert table.loc["cuda bfloat16", "% of matmul"] == "50%"
    assert table.loc["cpu float32", "% of matmul"] == "50%"
    # a CUDA row without a rate of its own is not set against the CPU's
    table = T.gflops_table(rows, {"cpu float32": 200.0}).set_index("device dtype")
    assert table.loc["cuda bfloat16", "% of matmul"] == "–"


def test_gflops_below_half_the_matmul_rate_are_flagged_against_the_runs_samples():
    rows = pd.DataFrame([
        {"label": lb, "pass": "forward", "device": "cpu", "dtype": "float32",
         "seq_len": 4096, "gflops_per_s": g, "status": "ok", "family": "exact"}
        for lb, g in (("sdpa", 100.0), ("standard", 98.0))])
    # the rate of the run: the median of its samples (100, 198, 300), not the first one
    meta = {"matmul_fp32_gflops": 100.0, "matmul_gflops": {"cpu float32": 198.0},
            "matmul_samples": [{"at": a, "rates": {"cpu float32": g}} for a, g in
                               (("start", 100.0), ("before round 2", 300.0), ("end", 198.0))]}
    table = T.gflops_table(rows, T.matmul_rates(meta)).set_index("variant")
    assert table.loc["sdpa", "flag"] == "" and table.loc["standard", "flag"] == "below half"
    note = T.matmul_note(meta)
    assert note.startswith("cpu float32 198 GFLOP/s") and "3 samples" in note
    assert "100 to 300" in note
    assert "measured once" in T.matmul_note({"matmul_fp32_gflops": 100.0})
