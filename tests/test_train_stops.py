"""The estimate's share of the planned steps (harness.train.stops): measured from a sweep's
train_curves.jsonl over every rate's run, looked up per variant, applied by the plan.

Planted bugs these catch: the share counted from the winning run alone (train.csv's
steps_run), a capped run kept at the reference's cap when the cap is raised (or an early
stop scaled with it), a race's cut run not scaled with the first budget, a pattern not
falling back to its first mixer, an unknown variant taken below the plan's ceiling, a share
that the plan does not apply (or applies to the worker's start).
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
    """A sweep folder of RAW whose (variant, seed) rows ran rates for `steps` each: a run
    of the cap stopped there, the others of the race's rungs were cut, a row's last run
    stopped early (early_stop or settled) below the cap."""
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
                why = ["cap" if s == c.max_steps else None for s in ran]
                if why[0] is None:
                    why[0] = "early_stop"
                cf.write(json.dumps({"config_id": c.config_id, "runs": [
                    {"lr": lr, "steps_run": s, "stopped": w}
                    for lr, s, w in zip(c.lrs, ran, why)]}) + "\n")
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
    assert plan["gla"] == (4 + 1) * 400 + 4 * 400  # the race's worst case, both seeds
    assert got["share"]["sdpa"] == pytest.approx(250 / plan["sdpa"], abs=1e-4)
    assert got["share"]["gla"] == pytest.approx(900 / plan["gla"], abs=1e-4)
    assert got["share"]["sdpa"] < 0.1 < got["share"]["gla"] <= 1.0
    assert got["runs"]["gla"] == {"first": {"rows": 1, "rungs": 4.0, "stopped": 0, "capped": 1},
                                  "later": {"rows": 1, "rungs": 0.0, "stopped": 300,
                                            "capped": 0}}
    # at the reference's own plan the counts give back the steps it trained
    for c in configs:
        want = sum(steps[(c.variant, c.seed)])
        assert stops.expected_steps(c, got["runs"][c.variant]) == pytest.approx(want)


def test_a_raised_cap_stretches_the_capped_runs_only_and_a_rung_scales_with_the_budget(tmp_path):
    steps = {("sdpa", 0): [100], ("sdpa", 1): [150],
             ("gla", 0): [400, 100, 50, 50], ("gla", 1): [300]}
    _folder(tmp_path, steps)
    cal = stops.measure([str(tmp_path)])
    big = {c.seed: c for c in tm.expand(tm.normalise(
        {**RAW, "variants": ["gla"], "max_steps": 800, "race_steps": 100}))}
    # seed 0: its rungs (4 first budgets) at 100 steps each, its capped run to 800
    assert stops.expected_steps(big[0], cal["runs"]["gla"]) == 4 * 100 + 800
    # seed 1 settled at 300: it stops there again
    assert stops.expected_steps(big[1], cal["runs"]["gla"]) == 300
    assert stops.share(big[1], cal) == pytest.approx(300 / (4 * 800))


def test_a_variant_takes_its_share_a_pattern_its_first_mixers_an_unknown_one_the_plan():
    configs = [c for c in tm.expand(tm.normalise(
        {**RAW, "layers": 2, "variants": ["sdpa", "gla+sdpa", "mamba2", "sdpa+gla"]}))
        if not c.first_seed]
    later = estimate.planned_steps(configs[0])  # a later seed's plan
    cal = {"runs": {v: {"later": {"rows": 1, "rungs": 0, "stopped": share * later,
                                  "capped": 0}} for v, share in (("gla", 0.8), ("sdpa", 0.2))}}
    shares = {c.variant: stops.share(c, cal) for c in configs}
    assert shares == pytest.approx({"sdpa": 0.2, "gla+sdpa": 0.8, "mamba2": 1.0,
                                    "sdpa+gla": 0.2})


def test_the_plan_trains_the_share_of_its_steps():
    c = tm.expand(tm.normalise({**RAW, "variants": ["gla"], "seed": 0}))[0]
    full, = estimate.plan_seconds([c], lambda c, m: 0.01, runner.skip_reasons)
    half, = estimate.plan_seconds([c], lambda c, m: 0.01, runner.skip_reasons,
                                  lambda c: 0.5)
    assert half[1] - estimate.WORKER_S == pytest.approx((full[1] - estimate.WORKER_S) / 2,
                                                         rel=0.02)
