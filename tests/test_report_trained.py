"""The report's "Quality when trained" section and `compare` on train.csv, from synthetic
sweeps whose answers are known by construction.

At every trained N, nystrom (accuracy 0.95) has the fastest training step among the
variants above 0.9 (sliding_window's is faster but it reaches only 0.3); by forward time
(tests/report_synth.py: sdpa 1e-6 N^2 ms, nystrom 3e-3 N ms) sdpa wins at N = 512 and
nystrom at N = 8192. Planted bugs: an answer that ignores the 0.9 bar, takes the slowest,
or times a variant at another N; a table that drops a status; compare that misses an
accuracy drop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import run_bench
from harness.errors import UsageError
from harness.report.build import write_report
from harness.report.compare import compare_trained
from harness.report.trained import answer_table, forward_times, read_train
import report_synth

TASK = json.dumps({"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False},
                  sort_keys=True)
# variant: (params, accuracy, step_ms)
SWEEP = {"sdpa": ({}, 1.0, 30.0), "standard": ({}, 1.0, 20.0),
         "nystrom": ({"landmarks": 64}, 0.95, 10.0),
         "sliding_window": ({"window": 256}, 0.3, 5.0),
         "performer": ({"features": 128, "redraw": False}, 0.1, 12.0)}


def _row(variant, n, acc=None, status="ok", reason=""):
    params, a, step = SWEEP.get(variant, ({}, None, None))
    ok = status == "ok"
    return {"config_id": f"{variant}-{n}", "task": "mqar", "task_params": TASK,
            "variant": variant, "family": "x", "params": json.dumps(params, sort_keys=True),
            "seq_len": n, "num_kv_pairs": 8, "vocab_size": 64, "causal": False, "d_model": 64,
            "layers": 1, "heads": 2, "mlp": False, "batch": 64, "max_steps": 400,
            "device": "cpu", "status": status, "reason": reason,
            "accuracy": (a if acc is None else acc) if ok else None,
            "best_lr": 0.003 if ok else None, "lr_accuracy": "{}", "steps": 100 if ok else None,
            "time_to_best_s": 1.0 if ok else None, "steps_to_0_9": 100 if ok else None,
            "step_ms": step if ok else None, "train_s": 5.0, "final_loss": 0.1 if ok else None,
            "n_params": 1000 if ok else None, "state_size": None, "chance": 1 / 32,
            "reach": 0.25 if variant == "sliding_window" else None, "seed": 0,
            "threads": 1}


def _sweep(folder: Path, rows=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = rows or ([_row(v, n) for n in (512, 8192) for v in SWEEP]
                    + [_row("linformer", 512, status="skipped", reason="linformer k too big")])
    return report_synth.write_train(folder, rows)


def test_the_answer_is_the_fastest_step_above_the_bar_at_each_setting(tmp_path):
    tr = read_train(_sweep(tmp_path / "s") / "train.csv")
    table = answer_table(tr, forward_times(tr, None))
    assert list(table["fastest training step reaching 0.9"]) == ["nystrom", "nystrom"]
    assert list(table["step_ms"]) == ["10", "10"]


def test_a_sweep_alone_gets_a_report_with_the_section(tmp_path):
    folder = _sweep(tmp_path / "alone")
    md = write_report(folder).read_text()
    assert md.index("## Answers") < md.index("## Quality when trained")
    assert "| nystrom" in md and "0.950" in md and "linformer k too big" in md
    for name in ("trained_accuracy_vs_length", "trained_accuracy_vs_pairs"):
        assert (folder / "plots" / f"{name}.png").stat().st_size > 1000
    assert "Accuracy against forward time" not in md  # no results.csv here
    assert "## Training environment" in md


def test_with_timings_in_the_folder_accuracy_meets_forward_time_at_the_same_n(tmp_path):
    folder = tmp_path / "both"
    report_synth.write_run(folder, report_synth.synthetic_rows())
    _sweep(folder)
    tr = read_train(folder / "train.csv")
    from harness.report.folder import load_run

    timed = forward_times(tr, load_run(folder)[0])
    t = {(r["variant"], r["seq_len"]): r["time_ms"] for _, r in timed.iterrows()}
    assert t[("nystrom", 8192)] == pytest.approx(3e-3 * 8192)
    assert t[("sdpa", 512)] == pytest.approx(1e-6 * 512 ** 2)
    table = answer_table(tr, timed)
    assert list(table["fastest forward reaching 0.9"]) == ["sdpa", "nystrom"]
    md = write_report(folder).read_text()
    answers = md[md.index("## Answers"):md.index("## Quality when trained")]
    assert "Fastest variant with" in answers and "learned to recall" in answers
    assert "\n### Accuracy against forward time" in md
    assert (folder / "plots" / "trained_accuracy_vs_time.png").exists()


def test_a_train_csv_that_breaks_the_contract_is_refused(tmp_path):
    folder = _sweep(tmp_path / "bad", [_row("sdpa", 512, status="fine")])
    with pytest.raises(UsageError, match="unknown status"):
        read_train(folder / "train.csv")
    (folder / "train.csv").write_text("variant,accuracy\nsdpa,1\n")
    with pytest.raises(UsageError, match="lacks column"):
        read_train(folder / "train.csv")


def test_compare_flags_an_accuracy_drop_and_a_configuration_that_stopped(tmp_path, capsys):
    a = _sweep(tmp_path / "a")
    rows = [_row(v, n, acc=0.5 if v == "nystrom" and n == 512 else None,
                 status="timeout" if v == "sdpa" and n == 8192 else "ok")
            for n in (512, 8192) for v in SWEEP]
    b = _sweep(tmp_path / "b", rows)
    cmp = compare_trained(read_train(a / "train.csv"), read_train(b / "train.csv"))
    flagged = {(r["label_a"], r["setting_a"].split()[1]): r["change"]
               for _, r in cmp.joined.iterrows() if r["change"]}
    assert flagged == {("nystrom", "N=512"): "regression (accuracy -0.450)",
                       ("sdpa", "N=8192"): "regression (now timeout)"}
    assert list(cmp.only_a["variant"]) == ["linformer"]
    assert run_bench.main(["compare", str(a), str(b), "--fail-on-regression"]) == 1
    out = capsys.readouterr().out
    assert "trained quality" in out and "2 regression(s)" in out
