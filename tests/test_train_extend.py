"""`train --extend-to STEPS` end to end (issue 49, item 2): a folder's not_learned and
partial rows continued from their checkpoints to a larger cap, in place, the old rows in
train_history.csv; bad input one line, exit 2, nothing touched.

Bugs these catch: an extension whose history is not the larger cap's (continued from the
decayed end, or a checkpoint without its optimiser or generators; test_train_schedule.py
holds Run.extend itself); the old row lost (no train_history.csv) or appended beside the
new one; a second run extending again; a cap below the rows' accepted; checkpoints of
the rates that lost left behind. (A run restarted from step 0 gives the same numbers: the
runs are deterministic; only its cost tells it.)
"""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

import run_bench
from harness.train import matrix as tm
from harness.train import trainer

TINY = """
task = "mqar"
variants = ["sdpa", "linear"]
seq_lens = [16]
num_kv_pairs = 2
vocab_size = 16
d_model = 16
heads = 1
lrs = [1e-2, 3e-3]
batch = 8
max_steps = 40
race_steps = 10
warmup = 5
eval_every = 10
train_examples = 64
test_examples = 40
threads = 1
timeout_s = 60
"""


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extend")
    (tmp / "tiny.toml").write_text(TINY)
    mp = pytest.MonkeyPatch()
    mp.setattr("harness.train.estimate.probe_all", lambda configs, *a, **k: {})
    try:
        assert run_bench.main(["train", "--config", str(tmp / "tiny.toml"), "--results-dir",
                               str(tmp), "--run-id", "a"]) == 0
    finally:
        mp.undo()
    folder = tmp / "a"
    before = _rows(folder / "train.csv")
    checkpoints = sorted(p.name for p in (folder / "checkpoints").iterdir())
    argv = ["train", "--results-dir", str(tmp), "--run-id", "a", "--extend-to", "80"]
    assert run_bench.main(argv) == 0
    return folder, before, checkpoints, argv


def test_the_rows_are_continued_in_place_and_the_old_ones_kept(extended):
    folder, before, checkpoints, _ = extended
    assert {r["outcome"] for r in before} <= {"not_learned", "partial"}  # 40 steps: too few
    # one checkpoint per row: its winning rate's (the others' removed)
    assert checkpoints == sorted(f"{r['config_id']}-lr{float(r['best_lr']):g}.pt"
                                 for r in before)
    after = _rows(folder / "train.csv")
    assert [r["config_id"] for r in after] == [r["config_id"] for r in before]
    assert all(r["max_steps"] == "80" and int(r["steps_run"]) > 40 for r in after)
    assert _rows(folder / "train_history.csv") == before
    assert all("extended from a cap of 40 to 80" in r["reason"] for r in after)


def test_an_extended_run_is_the_run_of_the_larger_cap(extended):
    folder, before, _, _ = extended
    meta = json.loads((folder / "train_meta.json").read_text())
    configs = {c.config_id: c for c in tm.expand(meta["matrix"])}
    lines = [json.loads(x) for x in (folder / "train_curves.jsonl").read_text().splitlines()]
    row = before[0]
    last = [x for x in lines if x["config_id"] == row["config_id"]][-1]
    lr = float(row["best_lr"])
    run, = [r for r in last["runs"] if r["lr"] == lr]
    longer = dataclasses.replace(configs[row["config_id"]], max_steps=80)
    fresh = trainer.Run(longer, lr).advance(80)
    assert [s for s, _ in run["held_out_loss"]] == [s for s, _ in fresh["held_out_loss"]]
    for (_, a), (_, b) in zip(run["held_out_loss"], fresh["held_out_loss"]):
        assert a == pytest.approx(b, abs=1e-6)


def test_the_same_command_again_extends_nothing(extended, capsys):
    folder, _, _, argv = extended
    data = (folder / "train.csv").read_bytes()
    assert run_bench.main(argv) == 0
    assert "extended 0 row(s)" in capsys.readouterr().out
    assert (folder / "train.csv").read_bytes() == data


@pytest.mark.parametrize("extra,words", [
    (["--extend-to", "60"], "above 60"),
    (["--extend-to", "x"], "--extend-to: expected int"),
    (["--extend-to", "100", "--preset", "train-quick"], "the folder's own matrix"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_touched(extended, capsys, extra, words):
    folder, _, _, argv = extended
    data = (folder / "train.csv").read_bytes()
    rc = run_bench.main(argv[:5] + extra)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert (folder / "train.csv").read_bytes() == data
    assert run_bench.main(["train", "--results-dir", str(folder.parent), "--run-id", "nope",
                           "--extend-to", "90"]) == 2
