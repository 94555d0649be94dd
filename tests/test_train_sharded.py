"""A sharded training sweep (`train --executor local|slurm --shards N`) writes the rows a
serial sweep writes: the same configurations in the same order, each trained once, with the
same accuracies (same seeds, one thread); a rerun trains nothing again.

Planted bugs: a configuration in two shards or in none, a merge out of the matrix's order,
a shard that trains with other settings than the serial worker (the accuracies differ)."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

import run_bench
from harness.cluster import trained
from test_sharded import needs_slurm

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
    ids = Counter(r["config_id"] for i in trained.shard_indices(folder)
                  for r in _rows(trained.shard_csv(folder, i)))
    assert set(ids.values()) == {1} and len(ids) == len(rows)  # each trained once
    meta = json.loads((folder / "train_meta.json").read_text())
    assert sorted(r["shard"] for r in meta["shards"]) == list(range(jobs))
    assert (folder / "report.md").is_file()


def test_local_two_shards_match_serial(serial):
    cfg, d, rows = serial
    assert _train(cfg, d, "local", "--executor", "local", "--shards", "2") == 0
    _same_as_serial(rows, d / "local", jobs=2)
    before = (d / "local" / "train.csv").read_bytes()
    assert _train(cfg, d, "local", "--executor", "local", "--shards", "2") == 0
    assert (d / "local" / "train.csv").read_bytes() == before
    assert len(trained.read_jobs(d / "local")) == 2  # nothing submitted the second time


@needs_slurm
def test_slurm_two_shards_match_serial(serial):
    cfg, d, rows = serial
    assert _train(cfg, d, "slurm", "--executor", "slurm", "--shards", "2") == 0
    _same_as_serial(rows, d / "slurm", jobs=2)
    assert [j["executor"] for j in trained.read_jobs(d / "slurm")] == ["slurm", "slurm"]


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
