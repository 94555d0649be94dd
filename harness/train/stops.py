"""How much of its planned steps a configuration trains: the estimate's share of them.

The plan (harness.train.estimate.planned_steps) counts every rung of the race and every
later seed to max_steps; runs that reach early_stop or settle stop sooner, so the plan is
the most a sweep can take. What it does take depends on the variant and the task: on MQAR
at N = 64 sdpa stops at early_stop within a rung or two, a recurrence on its plateau runs to
the cap. The estimate takes the share of the planned steps that committed reference runs of
each variant trained (the steps of every rate's run, train_curves.jsonl, over the steps
their plans counted), and 1 (the plan) for a variant they did not train:

    python -m harness.train.stops results/train-cpu > harness/train/stops.json

A layer pattern takes its own share where the runs trained it, else its first mixer's.
The shares are a calibration of this suite's protocol (the race, settling, early_stop) on
the reference settings: a new task or budget stops elsewhere, and the recorded estimate
beside the wall time (train_meta.json) says how far off it was.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

from harness.files import TRAIN_CSV, TRAIN_META
from harness.files.curves import TRAIN_CURVES, read_curves
from harness.measure import stack
from harness.train import estimate
from harness.train import matrix as tm
from harness.train.matrix import TrainConfig

CALIBRATION = Path(__file__).with_name("stops.json")
_LOADED: dict = {}


def measure(folders: list[str]) -> dict:
    """{"from": the folders, "share": {variant: steps trained / steps planned}, "steps":
    {variant: [trained, planned]}} over the ok rows of the folders' sweeps."""
    trained: dict[str, int] = defaultdict(int)
    planned: dict[str, int] = defaultdict(int)
    for folder in folders:
        folder = Path(folder)
        meta = json.loads((folder / TRAIN_META).read_text())
        configs = {c.config_id: c for c in tm.expand(meta["matrix"])}
        curves = read_curves(folder / TRAIN_CURVES)
        with open(folder / TRAIN_CSV, newline="") as f:
            for row in csv.DictReader(f):
                c = configs.get(row["config_id"])
                if row["status"] != "ok" or c is None or row["config_id"] not in curves:
                    continue
                runs = curves[row["config_id"]]["runs"]
                trained[c.variant] += sum(r["steps_run"] or 0 for r in runs)
                planned[c.variant] += estimate.planned_steps(c)
    return {"from": [str(f) for f in folders],
            "command": "python -m harness.train.stops " + " ".join(map(str, folders)),
            "share": {v: round(trained[v] / planned[v], 4) for v in sorted(planned)},
            "steps": {v: [trained[v], planned[v]] for v in sorted(planned)}}


def share(config: TrainConfig, calibration: dict | None = None) -> float:
    """The share of its planned steps the configuration is expected to train: its
    variant's in the calibration, a pattern's first mixer's, else 1 (the plan)."""
    if calibration is None:
        if not _LOADED:
            _LOADED.update(json.loads(CALIBRATION.read_text()) if CALIBRATION.exists()
                           else {"share": {}})
        calibration = _LOADED
    shares = calibration.get("share", {})
    if config.variant in shares:
        return shares[config.variant]
    if stack.is_pattern(config.variant):
        first = stack.layers_of(config.variant, config.layers)[0]
        if first in shares:
            return shares[first]
    return 1.0


def main(argv: list[str] | None = None) -> int:
    folders = (sys.argv[1:] if argv is None else argv)
    if not folders:
        print("usage: python -m harness.train.stops RESULTS_FOLDER [...]", file=sys.stderr)
        return 2
    print(json.dumps(measure(folders), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
