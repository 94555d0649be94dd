"""`run_bench.py train` end to end on tiny settings: every outcome is a row and the sweep
goes on, a non-causal variant asked for causal is a `skipped` row with its own reason, a
rerun resumes, and bad input is one line and exit status 2 before anything is written.

Planted bugs: a worker failure that ends the sweep or loses the row (the mixed sweep); a
skip reason of the harness's own making instead of the variant's (the skip); a rerun that
trains finished configurations again or drops a row (resume); a check that runs after the
folder was made (bad input leaves no folder)."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import pytest
import torch

import run_bench
import variants
from harness.measure.worker import EXTRA_ENV, import_extra
from harness.train.matrix import TrainConfig
from harness.train.runner import combine

REPO = Path(__file__).resolve().parent.parent
FAKES = os.pathsep.join(str(REPO / "tests" / f) for f in ("harness_fakes.py", "train_fakes.py"))
import_extra(FAKES)

BASE = """
task = "mqar"
seq_lens = [16]
num_kv_pairs = 2
vocab_size = 16
d_model = 16
heads = 1
lrs = [1e-2]
batch = 16
max_steps = 20
eval_every = 10
train_examples = 200
test_examples = 40
threads = 1
timeout_s = 60
"""
MIXED = BASE + """
[[groups]]
variants = ["sdpa", "linformer", "_test_nan", "_test_raises"]

[[groups]]
variants = {_test_sleeps = [{seconds = 60.0}]}
timeout_s = 4

[[groups]]
variants = ["_test_train_exits", "linear"]
"""


def _rows(folder: Path) -> list[dict]:
    with (folder / "train.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _main(argv, monkeypatch) -> int:
    monkeypatch.setenv(EXTRA_ENV, FAKES)
    return run_bench.main(argv)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    config = tmp / "mixed.toml"
    config.write_text(MIXED)
    argv = ["train", "--config", str(config), "--results-dir", str(tmp), "--run-id", "m"]
    mp = pytest.MonkeyPatch()
    # The plan's probe has its own tests (test_train_protocol); here it would time out on
    # _test_sleeps and respawn after _test_train_exits before the sweep meets them again
    # (16 s of this fixture's 30): every step is planned at the FLOP model instead.
    mp.setattr("harness.train.estimate.probe_all", lambda configs, *a, **k: {})
    try:
        assert _main(argv, mp) == 0
    finally:
        mp.undo()
    return tmp / "m", argv


def test_every_outcome_is_a_row_and_the_sweep_goes_on(mixed):
    folder, _ = mixed
    rows = {r["variant"]: r for r in _rows(folder)}
    assert list(rows) == ["sdpa", "linformer", "_test_nan", "_test_raises", "_test_sleeps",
                          "_test_train_exits", "linear"]
    assert rows["sdpa"]["status"] == "ok" and 0 <= float(rows["sdpa"]["accuracy"]) <= 1
    assert rows["sdpa"]["best_lr"] == "0.01" and int(rows["sdpa"]["n_params"]) > 0
    assert rows["_test_nan"]["status"] == "nonfinite"
    assert "training loss is nan at step 1" in rows["_test_nan"]["reason"]
    assert rows["_test_raises"]["status"] == "error"
    assert "deliberate failure in _test_raises" in rows["_test_raises"]["reason"]
    assert rows["_test_sleeps"]["status"] == "timeout"
    assert "timeout_s=4" in rows["_test_sleeps"]["reason"]
    assert rows["_test_train_exits"]["status"] == "error"
    assert "exited with status 7" in rows["_test_train_exits"]["reason"]
    assert rows["linear"]["status"] == "ok"  # a fresh worker after the crash
    assert (folder / "report.md").read_text().count("Quality when trained") == 1


def test_a_mode_the_variant_cannot_do_is_skipped_with_its_own_reason(mixed):
    folder, _ = mixed
    row = next(r for r in _rows(folder) if r["variant"] == "linformer")
    own = variants.build("linformer").unsupported_reasons(
        device="cpu", dtype=torch.float32, causal=True, seq_len=16, head_dim=16, backward=True)
    assert row["status"] == "skipped" and row["reason"] == "; ".join(own)
    assert "non-causal only" in row["reason"]


def test_a_rerun_resumes(mixed, monkeypatch, capsys):
    folder, argv = mixed
    before = (folder / "train.csv").read_bytes()
    assert _main(argv, monkeypatch) == 0
    assert (folder / "train.csv").read_bytes() == before  # nothing trained again
    assert "(7 done earlier)" in capsys.readouterr().out
    lines = before.splitlines(keepends=True)
    (folder / "train.csv").write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # killed mid-row
    assert _main(argv, monkeypatch) == 0
    rows = _rows(folder)
    assert [r["variant"] for r in rows][-1] == "linear" and len(rows) == 7
    after = (folder / "train.csv").read_bytes().splitlines(keepends=True)
    assert after[:-1] == lines[:-1]  # the finished rows untouched


def _cfg(lrs=(1e-3, 3e-3, 1e-2)) -> TrainConfig:
    return TrainConfig("mqar", "{}", "sdpa", "{}", 16, 16, True, 16, 1, 1, False, lrs, 8, 10,
                       0.1, 0.1, 5, 0.99, 100, 20, 0, "cpu", 1, 10.0, 0)


def _ok(acc):
    return {"status": "ok", "reason": "", "accuracy": acc, "steps": 10, "step_ms": 1.0}


def test_the_sweep_reports_the_best_rate_and_every_failure():
    row = combine(_cfg(), [(1e-3, _ok(0.4), 1.0), (3e-3, {"status": "nonfinite",
                                                          "reason": "loss nan"}, 2.0),
                           (1e-2, _ok(0.7), 3.0)])
    assert row["status"] == "ok" and row["accuracy"] == 0.7 and row["best_lr"] == 1e-2
    assert row["train_s"] == 6.0 and "lr=0.003: nonfinite: loss nan" in row["reason"]
    assert row["lr_accuracy"] == '{"0.001": 0.4, "0.003": "nonfinite", "0.01": 0.7}'
    stopped = combine(_cfg(), [(1e-3, _ok(0.995), 1.0)])
    assert "lr=0.003, 0.01 not run: lr=0.001 reached early_stop=0.99" in stopped["reason"]
    failed = combine(_cfg((1e-3, 1e-2)), [(1e-3, {"status": "nonfinite", "reason": "a"}, 1.0),
                                          (1e-2, {"status": "error", "reason": "b"}, 1.0)])
    assert failed["status"] == "error" and "accuracy" not in failed


@pytest.mark.parametrize("toml,words", [
    ('task = "nope"', "unknown task 'nope'"),
    ('variants = ["nope"]', "unknown variant 'nope'"),
    ('variants = ["sliding_window"]\nparams = {sliding_window = [{widow = 3}]}',
     "unknown parameter(s) 'widow'"),
    ("colour = 1", "unknown key 'colour'"),
    ("num_kv_pairs = 8", "8 pairs do not fit in seq_len=16"),
    ("vocab_size = 8\nnum_kv_pairs = 4", "vocab_size=8 is too small"),
    ('num_kv_pairs = "x"', "'num_kv_pairs' must be a int"),
    ("heads = 3", "d_model=16 is not a multiple of heads=3"),
    ("lrs = [0.0]", "'lrs' must be a non-empty list of positive numbers"),
    ("seq_lens = [16", "malformed TOML"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch,
                                                            toml, words):
    keys = {line.split(" = ")[0] for line in toml.splitlines() if " = " in line}
    body = [line for line in BASE.splitlines() if line.split(" = ")[0] not in keys]
    if "variants" not in keys:
        body.append('variants = ["sdpa"]')
    config = tmp_path / "bad.toml"
    config.write_text("\n".join(body + [toml]) + "\n")
    out = tmp_path / "results"
    rc = _main(["train", "--config", str(config), "--results-dir", str(out)], monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not out.exists()


def test_an_unknown_variant_flag_and_another_matrix_in_the_folder_are_refused(
        mixed, tmp_path, capsys, monkeypatch):
    folder, argv = mixed
    before = (folder / "train.csv").read_bytes()
    assert _main(argv + ["--variants", "nope"], monkeypatch) == 2
    assert "unknown variant 'nope'" in capsys.readouterr().err
    assert _main(argv + ["--variants", "sdpa"], monkeypatch) == 2  # a narrower matrix
    assert "different matrix" in capsys.readouterr().err
    assert (folder / "train.csv").read_bytes() == before


@pytest.mark.parametrize("command,preset,words", [
    ("train", "quick", "is a benchmark matrix (for `attnbench run`)"),
    ("run", "train-quick", "is a training matrix (for `attnbench train`)")])
def test_a_preset_of_the_other_command_is_named_as_such(command, preset, words, capsys):
    assert run_bench.main([command, "--preset", preset, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err


def test_train_meta_records_the_estimate_beside_the_wall_time(mixed):
    """The plan's estimate (probed steps, harness.train.estimate) of the session, and its
    wall time: a positive number each, the estimate more than the workers' start alone."""
    import json

    from harness.train import estimate

    folder, _ = mixed
    session = json.loads((folder / "train_meta.json").read_text())["sessions"][0]
    assert session["wall_s"] > 0
    assert session["estimate_s"] > estimate.WORKER_S


def test_the_dry_run_prints_the_wall_time_as_the_sweep_deals_cells(monkeypatch, capsys):
    """Three cells of 60, 10 and 10 min on two workers: 80 min of work, 60 on the clock
    (the long cell's worker), not 80 / 2 = 40. Planted: the work divided by the workers."""
    from types import SimpleNamespace

    from harness.cli import train as cli_train
    cfgs = [SimpleNamespace(cell_id=c, config_id=c, device="cpu") for c in "abc"]
    plan = [(c, m * 60.0, []) for c, m in zip(cfgs, (60, 10, 10))]
    monkeypatch.setattr(cli_train, "estimate_seconds", lambda configs, workers=1: (plan, plan))
    cli_train.plan(cfgs, workers=2)
    out = capsys.readouterr().out
    assert "estimate 80.0 min of work (about 60.0 min on 2 workers)" in out, out


def test_train_meta_keeps_samples_of_other_work_while_training(mixed):
    """Other work on the cores is sampled at the start of a sweep (harness.measure.busy, the
    sweep's own processes taken away) and kept in train_meta.json (planted: the watch not
    started, or its samples left out of the file)."""
    import json

    folder, _ = mixed
    samples = json.loads((folder / "train_meta.json").read_text())["busy"]
    assert samples and all({"other_cores", "own_cores", "at"} <= set(s) for s in samples)
    assert all(0 <= s["other_cores"] <= s["cores"] for s in samples)


def test_the_busy_watch_samples_until_stopped():
    from harness.train.runner import BusyWatch

    samples = []
    watch = BusyWatch(samples, every_s=0.01)
    watch.start()
    while len(samples) < 3:
        time.sleep(0.05)
    watch.stop()
    n = len(samples)
    time.sleep(0.5)
    assert not watch.is_alive() and len(samples) == n


def test_the_busy_watch_reads_five_second_windows_unless_told(monkeypatch):
    """A sweep's samples read 5 s: over 1 s, with both cores training, the tick accounting
    alone moves the reading by up to the 0.05 cores a quiet run is held to (planted: the
    benchmark run's 1 s window kept)."""
    from harness.measure import busy
    from harness.train.runner import BusyWatch

    monkeypatch.delenv(busy.WINDOW_ENV, raising=False)
    assert BusyWatch([]).window_s == 5.0
    monkeypatch.setenv(busy.WINDOW_ENV, "0.2")  # the test suite's
    seen = []
    monkeypatch.setattr(busy, "sample", lambda w, root: seen.append(w) or
                        {"other_cores": 0.0, "cores": 2})
    watch = BusyWatch([], every_s=10.0)
    watch.start()
    watch.stop()
    assert seen == [0.2]
