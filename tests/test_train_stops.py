"""The estimate's share of the planned steps (harness.train.stops): measured from a sweep's
train_curves.jsonl over every rate's run, looked up per variant, applied by the plan.

Planted bugs these catch: the share counted from the winning run alone (train.csv's
steps_run), a pattern not falling back to its first mixer, an unknown variant taken below
the plan's ceiling, a share that the plan does not apply (or applies to the worker's start).
"""

from __future__ import annotations

import csv
import json

import pytest

from harness.train import estimate, runner, stops
from harness.train import matrix as tm

RAW = {"task": "mqar", "seq_lens": [16], "num_kv_pairs": 2, "vocab_size": 16, "d_model": 16,
       "heads": 1, "lrs": [1e-2, 3e-3, 1e-3, 3e-4], "batch": 16, "max_steps": 400,
       "race_steps": 50, "settle_window": 100, "eval_every": 50, "seed": [0, 1],
       "variants": ["sdpa", "gla"]}


def _folder(tmp_path, steps: dict[tuple[str, int], list[int]]):
    """A sweep folder of RAW whose (variant, seed) rows ran rates for `steps` each."""
    matrix = tm.normalise(RAW)
    configs = tm.expand(matrix)
    (tmp_path / "train_meta.json").write_text(json.dumps({"matrix": matrix}))
    with open(tmp_path / "train.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["config_id", "status", "steps_run"])
        w.writeheader()
        with open(tmp_path / "train_curves.jsonl", "w") as cf:
            for c in configs:
                ran = steps[(c.variant, c.seed)]
                w.writerow({"config_id": c.config_id, "status": "ok", "steps_run": max(ran)})
                cf.write(json.dumps({"config_id": c.config_id, "runs": [
                    {"lr": lr, "steps_run": s} for lr, s in zip(c.lrs, ran)]}) + "\n")
    return configs


def test_the_share_counts_every_rates_run_over_the_plan(tmp_path):
    # sdpa: its first rate reached early_stop at step 100 (the race over), its second seed
    # at 150; gla: the race's longest course (all four to 50, two to 100, one to the cap
    # 400), its second seed stopped (settled) at 300
    steps = {("sdpa", 0): [100], ("sdpa", 1): [150],
             ("gla", 0): [400, 100, 50, 50], ("gla", 1): [300]}
    configs = _folder(tmp_path, steps)
    got = stops.measure([str(tmp_path)])
    plan = {v: sum(estimate.planned_steps(c) for c in configs if c.variant == v)
            for v in ("sdpa", "gla")}
    assert plan["gla"] == 4 * 50 + 2 * 50 + 300 + 400  # the race's longest course + seed 1
    assert got["steps"]["sdpa"] == [250, plan["sdpa"]]
    assert got["share"]["gla"] == pytest.approx(900 / plan["gla"], abs=1e-4)
    assert got["share"]["sdpa"] < 0.3 < got["share"]["gla"] <= 1.0


def test_a_variant_takes_its_share_a_pattern_its_first_mixers_an_unknown_one_the_plan():
    cal = {"share": {"gla": 0.8, "sdpa": 0.2}}
    configs = tm.expand(tm.normalise(
        {**RAW, "layers": 2, "variants": ["sdpa", "gla+sdpa", "mamba2", "sdpa+gla"]}))
    shares = {c.variant: stops.share(c, cal) for c in configs}
    assert shares == {"sdpa": 0.2, "gla+sdpa": 0.8, "mamba2": 1.0, "sdpa+gla": 0.2}


def test_the_plan_trains_the_share_of_its_steps():
    c = tm.expand(tm.normalise({**RAW, "variants": ["gla"], "seed": 0}))[0]
    full, = estimate.plan_seconds([c], lambda c, m: 0.01, runner.skip_reasons)
    half, = estimate.plan_seconds([c], lambda c, m: 0.01, runner.skip_reasons,
                                  lambda c: 0.5)
    assert half[1] - estimate.WORKER_S == pytest.approx((full[1] - estimate.WORKER_S) / 2,
                                                         rel=0.02)
