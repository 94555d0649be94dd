"""The race of learning rates (issue 49, item 3): no cut on a tie or on the plateau, one
rate beyond the grid's edge at most, every seed running the race's survivors, and a plan
that counts the worst case. Planted curves stand in for the runs.

Planted bugs these catch (each planted and seen failing): the cut of successive halving
(the better half, ties broken by held-out loss: the rate about to rise is cut at the tie);
a cut made while the leader is on its plateau; a margin without its three standard
errors (a rate 0.022 behind at 0.5 on 4,000 positions cut); no rate beyond an edge, or
more than one, or one beyond a winner that reached early_stop; later seeds trained at
the first seed's winner alone; a plan that counts successive halving's rungs, not the
race's worst case.
"""

from __future__ import annotations

import json

import pytest

from harness.train import estimate, race, runner
from harness.train.matrix import TrainConfig

MQAR8 = json.dumps({"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False},
                   sort_keys=True)
PLATEAU, SCORED = 1 / 8, 4000  # MQAR's 8 pairs, 500 validation examples of 8 queries


def _config(lrs, *, max_steps=1200, race_steps=150, seed=0, seeds=(0,)) -> TrainConfig:
    return TrainConfig("mqar", MQAR8, "sdpa", "{}", 64, 64, True, 16, 1, 1, False,
                       tuple(lrs), 8, max_steps, 150, 0.1, 25, 0.99, 64, 40, seed, "cpu", 1,
                       60.0, 0, tuple(seeds), 400, 0.02, race_steps)


class _Planted:
    """Runs that follow planted curves: acc(step) and loss(step) per (seed, lr); a run
    stops at early_stop or at its cap."""

    def __init__(self, curves, every=25):
        self.curves, self.every, self.calls = curves, every, []

    def result(self, config, lr, until):
        acc, loss = self.curves[(config.seed, lr)]
        until = config.max_steps if until is None else until
        steps = list(range(self.every, until + 1, self.every))
        reached = next((s for s in steps if acc(s) >= config.early_stop), None)
        ran = reached or until
        best = max(acc(s) for s in range(self.every, ran + 1, self.every))
        stopped = "early_stop" if reached else ("cap" if until >= config.max_steps else None)
        return {"status": "ok", "reason": "", "accuracy": best, "steps": ran,
                "steps_run": ran, "final_loss": loss(ran), "step_ms": 1.0,
                "held_out_loss": [[ran, loss(ran)]], "stopped": stopped,
                "settled": stopped == "early_stop", "rising": False,
                "plateau": PLATEAU, "val_scored": SCORED}

    def run(self, config, lr, until=None):  # the runner's Sweeper
        self.calls.append((config.seed, lr, until))
        return self.result(config, lr, until), 1.0


def _race(curves, lrs, **kw):
    cfg = _config(lrs, **kw)
    planted = _Planted({(0, lr): c for lr, c in curves.items()})
    ran: dict[float, int] = {}

    def advance(lr, until):
        ran[lr] = until
        return planted.result(cfg, lr, until)

    out = race.race(lrs, advance, first=cfg.first_budget, cap=cfg.max_steps, early_stop=0.99)
    return dict(out), ran


def _rises(at, top=0.995, loss=2.0, low=0.13):
    """On the plateau (`low`) to step `at`, then up 0.004 a step to `top`."""
    return (lambda s: low if s <= at else min(top, low + 0.004 * (s - at)),
            lambda s: loss)


def test_two_rates_tied_on_the_plateau_both_go_past_the_tie():
    """Four rates on the plateau for the first 150 steps; 1e-2 and 3.2e-4 stay there, 1e-3
    rises at step 200 to 0.995 and 3.2e-3 at 250. At the tie 1e-3 has the higher held-out
    loss: successive halving kept the two lowest losses (3.2e-3, 1e-2) and cut it."""
    lrs = (3.2e-3, 1e-2, 3.2e-4, 1e-3)
    curves = {3.2e-3: _rises(250, top=0.9, loss=2.0), 1e-2: _rises(10**6, loss=2.1),
              3.2e-4: _rises(10**6, loss=2.9), 1e-3: _rises(200, loss=3.0)}
    out, ran = _race(curves, lrs)
    assert ran[1e-3] > 150 and out[1e-3]["accuracy"] >= 0.99  # the later one won
    assert all(ran[lr] >= 300 for lr in lrs)  # nobody cut while the leader sat on it
    best = max(out, key=lambda lr: out[lr]["accuracy"])
    assert best == 1e-3
    # the same, 1e-3 below the others (0.09, near chance) while they read 0.14, within
    # the margin of the plateau 1 / 8: nothing is cut before a leader has left it
    curves[1e-3] = _rises(200, low=0.09)
    curves[3.2e-3] = _rises(250, top=0.9, low=0.14)
    out, ran = _race(curves, lrs)
    assert ran[1e-3] > 150 and out[1e-3]["accuracy"] >= 0.99


def test_a_tie_above_the_plateau_is_no_cut_a_clear_gap_is():
    flat = lambda a: (lambda s: a, lambda s: 1.0)  # noqa: E731
    # 0.500 and 0.478 at 4,000 positions: 3 SE = 0.0237 > 0.022: both go on to the cap
    out, ran = _race({1e-3: flat(0.5), 3.2e-3: flat(0.478), 1e-2: flat(0.3),
                      3.2e-4: flat(0.2)}, (1e-3, 3.2e-3, 1e-2, 3.2e-4))
    assert ran[1e-3] == ran[3.2e-3] == 1200 and ran[1e-2] == ran[3.2e-4] == 150
    assert 1e-2 ** 2 / 3.2e-3 not in ran  # a winner inside the grid adds no rate


def test_a_winner_at_the_grids_edge_adds_one_rate_beyond_it():
    flat = lambda a: (lambda s: a, lambda s: 1.0)  # noqa: E731
    lrs = (1e-3, 3.2e-3, 1e-2)
    # the beyond rate: 1e-2 x (1e-2 / 3.2e-3), run to its end; only one even if it wins
    planted = {**{lr: flat(a) for lr, a in zip(lrs, (0.2, 0.4, 0.6))}, 0.031: flat(0.7)}
    out, ran = _race(planted, lrs)
    assert list(ran) == [1e-3, 3.2e-3, 1e-2, 0.031] and ran[0.031] == 1200
    assert out[0.031]["accuracy"] == 0.7
    row = runner.combine(_config(lrs), [(lr, r, 1.0) for lr, r in out.items()])
    assert row["best_lr"] == 0.031 and row["lr_at_edge"] is True
    # at the bottom edge: 1e-3 x (1e-3 / 3.2e-3)
    planted = {**{lr: flat(a) for lr, a in zip(lrs, (0.6, 0.4, 0.2))}, 0.00031: flat(0.1)}
    out, ran = _race(planted, lrs)
    assert 0.00031 in ran
    row = runner.combine(_config(lrs), [(lr, r, 1.0) for lr, r in out.items()])
    assert row["best_lr"] == 1e-3 and row["lr_at_edge"] is False  # bracketed now
    # a winner that reached early_stop adds nothing
    out, ran = _race({1e-3: flat(0.2), 3.2e-3: flat(0.4), 1e-2: _rises(0)}, lrs)
    assert set(ran) == set(lrs)


def test_every_seed_races_the_first_seeds_survivors():
    """Seed 0: 3.2e-3 and 1e-2 stay within the margin of each other to the cap (both
    survive), 1e-3 is cut; seed 1 races those two, and 1e-2 wins there."""
    lrs = (1e-3, 3.2e-3, 1e-2)
    up = lambda a: (lambda s: a + s / 10_000, lambda s: 1.0)  # noqa: E731
    curves = {(0, 1e-3): up(0.2), (0, 3.2e-3): up(0.5), (0, 1e-2): up(0.49),
              (1, 3.2e-3): up(0.4), (1, 1e-2): up(0.6)}
    cfgs = [_config(lrs, seed=s, seeds=(0, 1), max_steps=400, race_steps=100) for s in (0, 1)]
    planted = _Planted(curves)
    rows = list(runner.train_cell(cfgs, planted, {}))
    assert [r["best_lr"] for r in rows] == [3.2e-3, 1e-2]
    assert {lr for s, lr, _ in planted.calls if s == 1} == {3.2e-3, 1e-2}
    # resumed with the first seed's row done (its curves read back): the same survivors
    planted = _Planted(curves)
    again = list(runner.train_cell(cfgs, planted, {cfgs[0].config_id: rows[0]}))
    assert [r["seed"] for r in again] == [1] and again[0]["best_lr"] == 1e-2
    assert runner.survivors({"best_lr": "0.003"}) == [0.003]  # a row without curves


def test_the_plan_counts_the_races_worst_case():
    first = _config((1, 2, 3, 4), max_steps=800, race_steps=100, seeds=(0, 1))
    later = _config((1, 2, 3, 4), max_steps=800, race_steps=100, seed=1, seeds=(0, 1))
    assert estimate.planned_steps(first) == (4 + 1) * 800  # every rate and one beyond
    assert estimate.planned_steps(later) == 4 * 800
    assert estimate.planned_steps(_config((1e-3,), max_steps=400)) == 400
    # what the race runs when nothing is cut: every rate to the cap, then one beyond
    flat = {lr: (lambda s: 0.13, lambda s: 1.0) for lr in (1, 2, 3, 4, 0.5)}
    _, ran = _race(flat, (1, 2, 3, 4), max_steps=800, race_steps=100)
    assert sum(ran.values()) == estimate.planned_steps(first) and 0.5 in ran


@pytest.mark.parametrize("lrs", [(1e-3,), (1e-3, 3e-3)])
def test_one_or_two_rates_race_to_the_cap(lrs):
    flat = {lr: (lambda s: 0.6, lambda s: 1.0) for lr in (*lrs, 0.00033)}
    _, ran = _race(flat, lrs, max_steps=400, race_steps=100)
    assert all(ran[lr] == 400 for lr in lrs)
    assert len(ran) == len(lrs) + (len(lrs) > 1)  # a grid of one has no step to go beyond
