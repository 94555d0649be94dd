"""The report's Model drift section: with a benchmark run, and from model.csv alone."""

import csv
import json

from harness.drift.store import COLUMNS
from harness.report.build import write_report
from report_synth import synthetic_rows, write_run


def _model_csv(folder):
    base = {"model": "minilm", "family": "x", "device": "cpu", "dtype": "float32",
            "seq_len": 512, "windows": 2, "causal": False, "threads": 2, "seed": 0}
    rows = [{**base, "variant": "sdpa", "params": "{}", "status": "ok", "emb_cos": 1.0,
             "hidden_rel_err": 1e-7, "time_ms": 100.0, "peak_mem_mib": 20.0},
            {**base, "variant": "performer", "params": json.dumps({"num_features": 64}),
             "status": "ok", "emb_cos": 0.61234567, "hidden_rel_err": 0.8, "time_ms": 150.0,
             "peak_mem_mib": 30.0},
            {**base, "variant": "linformer", "params": "{}", "status": "skipped",
             "reason": "linformer k=256 exceeds N"}]
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "model.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def test_drift_section_follows_the_answers(tmp_path):
    folder = write_run(tmp_path / "both", synthetic_rows((1024, 2048)))
    _model_csv(folder)
    md = write_report(folder).read_text()
    assert md.index("## Answers") < md.index("## Model drift") < md.index("## Empirical")
    drift = md[md.index("## Model drift"):md.index("## Empirical")]
    assert "### minilm, N = 512, windows: 2" in drift
    perf = next(line for line in drift.splitlines() if line.startswith("| performer"))
    assert [c.strip() for c in perf.split("|")[1:-1]] == ["performer", "0.612346", "0.8",
                                                         "150", "1.5", "30"]
    assert "linformer k=256 exceeds N" in drift
    assert "<h2>Model drift</h2>" in (folder / "report.html").read_text()


def test_report_of_model_drift_alone(tmp_path):
    folder = tmp_path / "alone"
    _model_csv(folder)
    md = write_report(folder).read_text()
    assert "## Model drift" in md and "| sdpa " in md and "## Answers" not in md
