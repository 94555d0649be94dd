"""A sharded training sweep (`train --executor local|slurm --shards N`) writes the rows a
serial sweep writes: the same configurations in the same order, each trained once, with the
same accuracies (same seeds, one thread); a rerun trains nothing again.

The engine's own behaviour for a sweep: a job scancelled while the command waits is
resubmitted by that command (Slurm); a configuration that kills its job every time becomes
an error row after the retries (local); a requeued job skips what a newer job holds.

Planted bugs: a configuration in two shards or in none, a merge out of the matrix's order,
a shard that trains with other settings than the serial worker (the accuracies differ),
shards' curves left out of train_curves.jsonl or their busy samples out of the records;
resubmission off in the waiting command (the scancel and killer tests), retries miscounted
(the killer's reason and job count), a requeued shard that trains a newer job's
configuration (the requeue test)."""

from __future__ import annotations

import csv
import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import run_bench
from harness.cluster import engine, shards, trained
from harness.cluster.shards import TRAIN as files
from harness.files import TRAIN_COLUMNS
from harness.files.curves import TRAIN_CURVES
from harness.measure.worker import EXTRA_ENV
from harness.train import matrix as tm
from test_sharded import FAKES, needs_slurm

TINY = """
task = "mqar"
variants = ["sdpa", "linear", "linformer", "performer"]
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
"""
SAME = ["config_id", "variant", "status", "reason", "accuracy", "steps", "final_loss"]


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _train(cfg: Path, out: Path, run_id: str, *extra: str) -> int:
    return run_bench.main(["train", "--config", str(cfg), "--results-dir", str(out),
                           "--run-id", run_id, *extra])


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    d = tmp_path_factory.mktemp("train-sharded")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY)
    assert _train(cfg, d, "serial") == 0
    return cfg, d, _rows(d / "serial" / "train.csv")


def _same_as_serial(rows: list[dict], folder: Path, jobs: int) -> None:
    got = _rows(folder / "train.csv")
    assert [{k: r[k] for k in SAME} for r in got] == [{k: r[k] for k in SAME} for r in rows]
    assert [r["status"] for r in got] == ["ok", "ok", "skipped", "ok"]
    ids = Counter(r["config_id"] for i in files.shard_indices(folder)
                  for r in _rows(files.shard_csv(folder, i)))
    assert set(ids.values()) == {1} and len(ids) == len(rows)  # each trained once
    meta = json.loads((folder / "train_meta.json").read_text())
    assert sorted(r["shard"] for r in meta["shards"]) == list(range(jobs))
    assert all(r["busy"] and "other_cores" in r["busy"][0] for r in meta["shards"])
    # the curves of every trained row, merged beside train.csv in its order, as serial
    serial_curves = (folder.parent / "serial" / TRAIN_CURVES).read_text().splitlines()
    curves = (folder / TRAIN_CURVES).read_text().splitlines()
    assert [json.loads(c)["config_id"] for c in curves] == [
        r["config_id"] for r in got if r["status"] == "ok"]
    parsed = [json.loads(c) for c in curves]
    assert all(run["history"] for c in parsed for run in c["runs"])
    assert [[(r["lr"], r["steps_run"], r["history"]) for r in c["runs"]] for c in parsed] == [
        [(r["lr"], r["steps_run"], r["history"]) for r in json.loads(c)["runs"]]
        for c in serial_curves]
    assert (folder / "report.md").is_file()


def test_local_two_shards_match_serial(serial):
    cfg, d, rows = serial
    assert _train(cfg, d, "local", "--executor", "local", "--shards", "2") == 0
    _same_as_serial(rows, d / "local", jobs=2)
    before = (d / "local" / "train.csv").read_bytes()
    assert _train(cfg, d, "local", "--executor", "local", "--shards", "2") == 0
    assert (d / "local" / "train.csv").read_bytes() == before
    assert len(files.read_jobs(d / "local")) == 2  # nothing submitted the second time


@needs_slurm
def test_slurm_two_shards_match_serial(serial):
    cfg, d, rows = serial
    assert _train(cfg, d, "slurm", "--executor", "slurm", "--shards", "2") == 0
    _same_as_serial(rows, d / "slurm", jobs=2)
    assert [j["executor"] for j in files.read_jobs(d / "slurm")] == ["slurm", "slurm"]


def test_dry_run_splits_the_shards(serial, capsys):
    cfg, _, _ = serial
    assert run_bench.main(["train", "--config", str(cfg), "--dry-run", "--executor", "local",
                           "--shards", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 configurations; 1 skipped as declared unsupported; 3 to train")
    assert "shard 0:" in out and "shard 1:" in out and "skip x1: linformer" in out


def test_two_workers_write_the_rows_one_does(serial, tmp_path):
    cfg, _, rows = serial
    assert _train(cfg, tmp_path, "w2", "--workers", "2") == 0
    got = {r["config_id"]: {k: r[k] for k in SAME} for r in _rows(tmp_path / "w2" / "train.csv")}
    assert got == {r["config_id"]: {k: r[k] for k in SAME} for r in rows}
    meta = json.loads((tmp_path / "w2" / "train_meta.json").read_text())
    assert meta["sessions"][-1]["workers"] == 2


def test_workers_with_an_executor_is_refused(serial, capsys):
    cfg, d, _ = serial
    assert _train(cfg, d, "x", "--executor", "local", "--shards", "2", "--workers", "2") == 2
    assert "--workers is for a sweep on this machine" in capsys.readouterr().err
    assert not (d / "x").exists()


# Configurations that train for over a second each (the variant sleeps in each of its 26
# calls, 20 steps and two evaluations of 3 batches: no speed of this machine's own decides
# when a job is cancelled), three per shard: the cancel, sent at shard 0's first row, comes
# at least 2.6 s before its last. Short enough that shard 1 is done about when the two
# resubmitted jobs start, so that neither waits for a core.
SLOW = TINY.replace('variants = ["sdpa", "linear", "linformer", "performer"]', """
variants = {_test_sleeps = [{seconds = 0.050}, {seconds = 0.055}, {seconds = 0.060},
                            {seconds = 0.065}, {seconds = 0.070}, {seconds = 0.075}]}
causal = false""")


def _each_once(folder: Path, planned: list[str]) -> None:
    """train.csv: every planned configuration once, in the matrix's order, none an error;
    and no configuration trained twice over all shard files."""
    rows = _rows(folder / "train.csv")
    assert [r["config_id"] for r in rows] == planned
    assert {r["status"] for r in rows} == {"ok"}
    ids = Counter(r["config_id"] for i in files.shard_indices(folder)
                  for r in _rows(files.shard_csv(folder, i)))
    assert ids == Counter(planned)


@needs_slurm
@pytest.mark.timeout(240)
def test_slurm_scancel_while_the_command_waits_is_resubmitted_by_it(tmp_path, monkeypatch):
    monkeypatch.setenv(EXTRA_ENV, FAKES)  # the jobs inherit it and register the fakes
    monkeypatch.setattr(engine, "SCHEDULER_POLL_S", 1.0)  # a test need not spare squeue
    cfg = tmp_path / "slow.toml"
    cfg.write_text(SLOW)
    folder = tmp_path / "t"
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(_train(
        cfg, tmp_path, "t", "--executor", "slurm", "--shards", "2")))
    waiting.start()  # the command that submits and waits; the test is the user beside it
    deadline = time.monotonic() + 120
    while not (files.read_jobs(folder) and files.shard_csv(folder, 0).is_file()
               and shards.read_rows(files.shard_csv(folder, 0))):
        assert time.monotonic() < deadline and waiting.is_alive(), "shard 0 wrote no row"
        time.sleep(0.1)
    a = files.read_jobs(folder)[0]
    subprocess.run(["scancel", a["job_id"]], check=True)
    waiting.join(180)
    assert got == [0]
    done_before = len(_rows(files.shard_csv(folder, a["shard"])))
    assert 1 <= done_before < len(a["configs"]), "the cancel came after shard 0 had finished"
    _each_once(folder, [c.config_id for c in tm.load(str(cfg))[1]])
    jobs = files.read_jobs(folder)
    assert jobs[0]["state"] in ("CANCELLED", "COMPLETING") and "state" not in jobs[1]
    left = [c for c in a["configs"] if c not in
            {r["config_id"] for r in _rows(files.shard_csv(folder, a["shard"]))}]
    assert sorted(c for j in jobs[2:] for c in j["configs"]) == sorted(left)  # only the rest


KILLER = TINY.replace('variants = ["sdpa", "linear", "linformer", "performer"]',
                      'variants = ["sdpa", "linear"]') + """
[[groups]]

[[groups]]
variants = {_test_kills_job = [{kill_at = 16}]}
causal = false
"""


@pytest.mark.timeout(240)
def test_local_configuration_that_kills_its_job_becomes_an_error_row(tmp_path, monkeypatch):
    monkeypatch.setenv(EXTRA_ENV, FAKES)
    cfg = tmp_path / "killer.toml"
    cfg.write_text(KILLER)
    assert _train(cfg, tmp_path, "k", "--executor", "local", "--shards", "2",
                  "--max-retries", "1") == 0  # every configuration has a row: exit 0
    folder = tmp_path / "k"
    rows = _rows(folder / "train.csv")
    assert [r["config_id"] for r in rows] == [c.config_id for c in tm.load(str(cfg))[1]]
    dead = [r for r in rows if r["variant"] == "_test_kills_job"]
    assert [r["status"] for r in dead] == ["error"]
    assert "while training it, each of the 2 times it ran (1 + --max-retries 1)" in \
        dead[0]["reason"]
    assert "shards/train-" in dead[0]["reason"] and "_log.err" in dead[0]["reason"]
    assert [r["status"] for r in rows if r is not dead[0]] == ["ok", "ok"]
    assert list(rows[0]) == list(TRAIN_COLUMNS)  # train.csv's columns, as a serial sweep's
    jobs = files.read_jobs(folder)
    # two shards, then the killer once more (it dies again), then nothing: no loop
    assert len(jobs) == 3 and jobs[-1]["configs"] == [dead[0]["config_id"]]
    assert [j["state"] for j in jobs if j.get("state")] == ["KILLED", "KILLED"]


def test_a_requeued_training_job_leaves_alone_what_a_newer_job_holds(serial, tmp_path,
                                                                     monkeypatch):
    """Shard 0's job ended, its second configuration went to shard 2, then Slurm ran shard
    0 again (a requeue): it trains only what it still holds."""
    cfg, _, _ = serial
    monkeypatch.setattr(trained.TrainShardStore, "stop_on_signals", lambda self: None)
    configs = [c for c in tm.load(str(cfg))[1] if c.variant in ("sdpa", "linear")]
    a, b = (c.config_id for c in configs)
    files.write_jobs(tmp_path, [{"shard": 0, "job_id": "1_0", "executor": "slurm",
                                 "configs": [a, b]},
                                {"shard": 2, "job_id": "3_0", "executor": "slurm",
                                 "configs": [b]}])
    assert trained.train_shard(str(tmp_path), 0, configs, "slurm") == {"ok": 1}
    assert [r["config_id"] for r in _rows(files.shard_csv(tmp_path, 0))] == [a]
