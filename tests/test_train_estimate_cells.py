"""The estimate per cell (harness.train.stops: a cell's own reference runs before its
variant's pooled over settings) and on two workers as the sweep schedules its cells
(harness.train.estimate.wall_seconds).

Planted bugs these catch (each planted and seen failing): `share` looking up the variant's
pooled counts only (the cell's ignored), a cell key blind to the setting, heads or settling
window, an unknown cell not falling back to its variant; the wall time as the sum over the
workers, or with a cell's seeds spread over both workers.
"""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from harness.train import estimate, stops
from harness.train import matrix as tm

RAW = {"task": "mqar", "seq_lens": [16, 32], "num_kv_pairs": 2, "vocab_size": 16,
       "d_model": 16, "heads": 1, "lrs": [1e-2, 3e-3], "batch": 16, "max_steps": 400,
       "race_steps": 50, "settle_window": 100, "eval_every": 50, "seed": [0, 1],
       "variants": ["gla"]}


def _folder(tmp_path, steps):
    """A sweep of RAW whose rows ran `steps[seq_len]` (one run per rate, each to the cap
    where it equals max_steps, else stopped early there), both seeds alike."""
    matrix = tm.normalise(RAW)
    configs = tm.expand(matrix)
    (tmp_path / "train_meta.json").write_text(json.dumps({"matrix": matrix}))
    with open(tmp_path / "train.csv", "w", newline="") as f, \
            open(tmp_path / "train_curves.jsonl", "w") as cf:
        w = csv.DictWriter(f, ["config_id", "status", "steps_run"])
        w.writeheader()
        for c in configs:
            ran = steps[c.seq_len]
            w.writerow({"config_id": c.config_id, "status": "ok", "steps_run": max(ran)})
            cf.write(json.dumps({"config_id": c.config_id, "runs": [
                {"lr": lr, "steps_run": s, "stopped": "cap" if s == c.max_steps else "settled"}
                for lr, s in zip(c.lrs, ran)]}) + "\n")
    return configs


def test_a_cell_takes_its_own_runs_before_its_variants_pooled_over_settings(tmp_path):
    # N = 16: both rates settle at 100 steps; N = 32: both run to the cap (400)
    configs = _folder(tmp_path, {16: [100, 100], 32: [400, 400]})
    cal = stops.measure([str(tmp_path)])
    for c in configs:  # each cell gives back the steps it trained
        want = 200 if c.seq_len == 16 else 800
        assert stops.share(c, cal) * estimate.planned_steps(c) == pytest.approx(want)
    # pooled, the variant's mean over both settings: 500 for each
    pooled = {"runs": cal["runs"]}
    assert stops.share(configs[-1], pooled) * estimate.planned_steps(configs[-1]) == \
        pytest.approx(500)
    # the cap raised: the N = 32 cell's capped runs stretch with it, N = 16's do not
    for c in configs:
        big = dataclasses.replace(c, max_steps=800)
        want = 200 if c.seq_len == 16 else 1600
        assert stops.share(big, cal) * estimate.planned_steps(big) == pytest.approx(want)
    # a cell the runs did not train (another setting, heads, settling window) falls back to
    # the variant's counts over every setting
    c = configs[-1]
    for other in (dataclasses.replace(c, seq_len=64), dataclasses.replace(c, heads=2),
                  dataclasses.replace(c, settle_window=200)):
        assert stops.cell_key(other) != stops.cell_key(c)
        assert stops.share(other, cal) == pytest.approx(stops.share(other, pooled))


def _costs(cells: list[list[float]]):
    """plan_seconds's list for cells of the given seconds per seed, in order."""
    base = tm.expand(tm.normalise({**RAW, "seq_lens": [16]}))[0]
    out = []
    for i, seeds in enumerate(cells):
        for j, seconds in enumerate(seeds):
            c = dataclasses.replace(base, d_model=16 + i, seed=j, seeds=(0, 1))
            out.append((c, seconds, []))
    return out


def test_the_wall_time_schedules_cells_in_order_on_the_first_free_worker():
    # four short cells, then a long one: it runs last on one worker, the other idle
    costs = _costs([[1, 1]] * 4 + [[5, 5]])
    assert estimate.wall_seconds(costs, 2) == 14  # 2 + 2 + 10, not (8 + 10) / 2
    assert estimate.wall_seconds(_costs([[5, 5]] + [[1, 1]] * 4), 2) == 10
    assert estimate.wall_seconds(costs, 1) == 18
    # a cell's seeds run one after the other on one worker
    assert estimate.wall_seconds(_costs([[5, 5], [1, 1]]), 2) == 10
