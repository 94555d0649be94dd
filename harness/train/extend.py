"""`train --extend-to STEPS`: a folder's `not_learned` and `partial` rows trained on to a
larger cap, each from its winning run's checkpoint from before its decay
(harness.train.trainer.Run.extend: the run the larger cap would have trained).

Each row is updated in place (its config_id kept, `max_steps` the new cap), the row it
replaces appended to train_history.csv first, its runs' curves appended to
train_curves.jsonl (the last line of a config_id is its own). Rows already at the new cap
are done: the same command again resumes. Serial, in a training worker process, as the
sweep's runs.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections import Counter
from pathlib import Path

from harness.errors import UsageError
from harness.files import TRAIN_COLUMNS, TRAIN_CSV, CsvLog
from harness.train import matrix as tm
from harness.train.rows import combine
from harness.train.runner import CHECKPOINTS, Sweeper
from harness.train.schedule import is_wsd
from harness.train.store import TrainStore
from harness.train.worker import checkpoint_path

HISTORY = "train_history.csv"  # the rows an extension replaced, as they were
EXTENDED = ("not_learned", "partial")


def plan(folder: Path, steps: int) -> list[tuple[dict, tm.TrainConfig]]:
    """The rows to extend and their configurations; UsageError (exit 2) when the folder
    holds no sweep, or a row cannot be extended to `steps`."""
    store = TrainStore(folder)
    if not (folder / TRAIN_CSV).is_file() or not store.meta_path.is_file():
        raise UsageError(f"{folder} holds no training sweep (train.csv, train_meta.json) "
                         "to extend")
    if steps < 1:
        raise UsageError(f"--extend-to must be a positive number of steps, got {steps}")
    configs = {c.config_id: c for c in tm.expand(store.read_meta()["matrix"])}
    todo, problems = [], []
    for row in store.rows():
        if row.get("outcome") not in EXTENDED or int(row["max_steps"]) == steps:
            continue
        c = configs.get(row["config_id"])
        if c is None:
            problems.append(f"{row['config_id']}: not in the folder's matrix")
        elif not is_wsd(c.warmup):
            problems.append(f"{row['config_id']}: trained with a cosine schedule over its "
                            "cap (warmup a fraction): its runs cannot be continued")
        elif int(row["max_steps"]) > steps:
            problems.append(f"{row['config_id']}: its cap {row['max_steps']} is above "
                            f"{steps}")
        elif not checkpoint_path(folder / CHECKPOINTS, c, float(row["best_lr"])).is_file():
            problems.append(f"{row['config_id']}: no checkpoint of its run at lr="
                            f"{float(row['best_lr']):g} in {folder / CHECKPOINTS}")
        else:
            todo.append((row, c))
    if problems:
        raise UsageError(f"cannot extend {len(problems)} row(s) to {steps} steps: "
                         + "; ".join(problems[:3]) + (" ..." if len(problems) > 3 else ""))
    return todo


def extend(folder: Path, steps: int, sweeper: Sweeper | None = None) -> Counter:
    """Extend the folder's rows (`plan`) to `steps`; counts the new rows by outcome."""
    folder = Path(folder)
    todo = plan(folder, steps)
    sweeper = sweeper or Sweeper(folder / "train_worker.log", folder / CHECKPOINTS)
    counts: Counter = Counter()
    try:
        for old, config in todo:
            lr = float(old["best_lr"])
            longer = dataclasses.replace(config, max_steps=steps)
            got, wall = sweeper.run(longer, lr, extend=checkpoint_path(
                folder / CHECKPOINTS, config, lr))
            row = {**old, **combine(longer, [(lr, got, wall)]), "config_id": old["config_id"],
                   "max_steps": steps, "lrs": old["lrs"], "lr_at_edge": old["lr_at_edge"],
                   "reason": f"extended from a cap of {old['max_steps']} to {steps} steps"}
            replace(folder, old, row)
            counts[row.get("outcome")] += 1
    finally:
        sweeper.close()
    return counts


def replace(folder: Path, old: dict, row: dict) -> None:
    """Row `old` of train.csv replaced by `row` in place: `old` appended to
    train_history.csv, then train.csv rewritten in one rename, then the curves."""
    history = CsvLog(folder / HISTORY, TRAIN_COLUMNS)
    history.open()
    history.append(old)
    history.close()
    path = folder / TRAIN_CSV
    rows = CsvLog(path, TRAIN_COLUMNS).rows(cut=True)
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=TRAIN_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(_cells(row) if r["config_id"] == old["config_id"] else r)
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(out.getvalue())
    os.replace(tmp, path)
    with open(TrainStore(folder).curves_path, "a") as f:
        f.write(json.dumps({"config_id": old["config_id"], "variant": old["variant"],
                            "seed": old["seed"], "runs": row["curves"]}) + "\n")


def _cells(row: dict) -> dict:
    """A row as CsvLog writes it (None empty, floats by repr)."""
    return {c: "" if row.get(c) is None else repr(v) if isinstance(v := row.get(c), float)
            else v for c in TRAIN_COLUMNS}
