"""How much of its planned steps a configuration trains: the estimate's share of them.

The plan (harness.train.estimate.planned_steps) counts the race's worst case, every rate
(and one beyond the grid's edge) to max_steps on every seed; runs that reach early_stop or
settle, and rates the race cuts, stop sooner, so the plan is the most a sweep can take.
What it does take depends on the variant and the task: on MQAR at N = 64 sdpa stops at
early_stop within a rung or two, a recurrence on its plateau runs to the cap. The estimate
counts, per cell and per variant, the runs of committed reference sweeps run under the
present protocol (train_curves.jsonl, every rate's run) in three kinds, each scaled as it
scales with the budget:

- a run the race cut trained whole rungs: its steps in units of the race's first budget;
- a run that reached early_stop or settled stopped where it learned: its steps as they are;
- a run that reached the cap would have gone on: one run of the cap, whatever the cap.

A configuration is expected to train the mean of its cell's rows where the runs trained
its cell (`cell_key`: the variant, its parameters, heads, task setting and settling
window), else of its variant's rows over every setting (first seeds, which race, apart from
later seeds), at its own first budget and cap, at most its plan; a variant the runs did not
train, the plan (share 1). The cell first: a variant's rows pooled over settings mix runs
that stop within a few hundred steps (MQAR at N = 64) with runs to the cap on slower steps
(N = 128, or a window too short to read the answers), and their mean undercounts the
latter, where most of the time goes. The folders: every committed run of a protocol
preset, so that each preset's cells are counted from its own run:

    python -m harness.train.stops results/train-cpu results/hybrid-cpu results/mad-cpu \
        results/state-cpu results/lm-cpu > harness/train/stops.json

So a cap raised from 1,000 to 2,000 doubles the capped runs and leaves the early stops
where they were. A layer pattern takes its own counts where the runs trained it, else its
first mixer's. The counts are a calibration of this suite's protocol (the race, settling,
early_stop) on the reference settings: a new task stops elsewhere, and the recorded
estimate beside the wall time (train_meta.json) says how far off it was.
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


def _kind(config: TrainConfig) -> str:
    return "first" if config.first_seed else "later"


def cell_key(config: TrainConfig) -> str:
    """What a cell's runs stop by, readable: the variant and its parameters, the task
    setting, heads, the settling window and the block (not the cap, the race's first budget
    or the rates: the counts scale with the first two)."""
    return (f"{config.label()} H={config.heads} settle={config.settle_window}"
            f"{' mlp' if config.mlp else ''}"
            f"{'' if config.output_layer == 'paper' else ' output=' + config.output_layer}")


def _counts() -> dict:
    return {k: {"rows": 0, "rungs": 0.0, "stopped": 0, "capped": 0}
            for k in ("first", "later")}


def _rounded(counts: dict) -> dict:
    return {k: {**n, "rungs": round(n["rungs"], 4)} for k, n in counts.items()}


def measure(folders: list[str]) -> dict:
    """{"from": the folders, "runs": {variant: {"first" | "later": {"rows", "rungs",
    "stopped", "capped"}}}, "cells": {cell_key: the same}, "share": {variant: steps trained
    / steps planned}} over the ok rows of the folders' sweeps: per kind of row, how many
    rows, the steps of the runs the race cut in first budgets, the steps of the runs that
    stopped early, the runs that reached the cap; per variant over all its cells, and per
    cell. `share` is the reference plans' own, for reading: the estimate takes `cells`,
    else `runs` (`share` below)."""
    runs: dict = defaultdict(_counts)
    cells: dict = defaultdict(_counts)
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
                for kind in (runs[c.variant][_kind(c)], cells[cell_key(c)][_kind(c)]):
                    kind["rows"] += 1
                    for r in curves[row["config_id"]]["runs"]:
                        steps = r.get("steps_run") or 0
                        if r.get("stopped") == "cap":
                            kind["capped"] += 1
                        elif r.get("stopped") is None:
                            kind["rungs"] += steps / c.first_budget
                        else:
                            kind["stopped"] += steps
                trained[c.variant] += sum(r.get("steps_run") or 0
                                          for r in curves[row["config_id"]]["runs"])
                planned[c.variant] += estimate.planned_steps(c)
    return {"from": [str(f) for f in folders],
            "command": "python -m harness.train.stops " + " ".join(map(str, folders)),
            "runs": {v: _rounded(runs[v]) for v in sorted(runs)},
            "cells": {k: _rounded(cells[k]) for k in sorted(cells)},
            "share": {v: round(trained[v] / planned[v], 4) for v in sorted(planned)}}


def expected_steps(config: TrainConfig, counts: dict) -> float | None:
    """The steps a configuration is expected to train from its variant's counts (one
    variant's `runs` of `measure`), at most its plan; None where no row of its kind ran."""
    n = counts.get(_kind(config))
    if not n or not n["rows"]:
        return None
    steps = (n["rungs"] * config.first_budget + n["stopped"]
             + n["capped"] * config.max_steps) / n["rows"]
    return min(steps, estimate.planned_steps(config))


def share(config: TrainConfig, calibration: dict | None = None) -> float:
    """The share of its planned steps the configuration is expected to train: from its
    cell's counts in the calibration, else its variant's, a pattern's first mixer's, else 1
    (the plan)."""
    if calibration is None:
        if not _LOADED:
            _LOADED.update(json.loads(CALIBRATION.read_text()) if CALIBRATION.exists()
                           else {"runs": {}})
        calibration = _LOADED
    cell = calibration.get("cells", {}).get(cell_key(config))
    if cell is not None:
        steps = expected_steps(config, cell)
        if steps is not None:
            return steps / estimate.planned_steps(config)
    runs = calibration.get("runs", {})
    names = [config.variant]
    if stack.is_pattern(config.variant):
        names.append(stack.layers_of(config.variant, config.layers)[0])
    for name in names:
        if name in runs:
            steps = expected_steps(config, runs[name])
            if steps is not None:
                return steps / estimate.planned_steps(config)
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
