"""Outcomes (issue 49, item 1): the plateau a task declares, the margin, the settling rule
that never stops a run on its plateau, and each outcome from a planted run.

Planted bugs these catch (each planted and seen failing): the settling rule without the
plateau's floor (a run flat at 1 / pairs, its held-out loss flat, stops "settled"); the
floor read two-sided (|best - plateau| <= margin: a run flat at chance, below the plateau,
settles); the floor blocking every flat run (one flat well above the plateau never
settles); MQAR's plateau taken as chance; a variant of limited reach given the task's
plateau unweighted; the margin without its 0.02 floor or its three standard errors; an
outcome ladder in the wrong order (a diverged run called learned, a plateau run partial).
"""

from __future__ import annotations

import json
import math

import pytest

from harness.train import outcome, rows, tasks, trainer
from harness.train.matrix import TrainConfig


def _config(pairs=2, vocab=16, max_steps=60, settle_window=10, eval_every=5) -> TrainConfig:
    params = json.dumps({"num_kv_pairs": pairs, "power_a": 0.01,
                         "random_non_queries": False}, sort_keys=True)
    return TrainConfig("mqar", params, "sdpa", "{}", 16, vocab, True, 16, 1, 1, False,
                       (1e-2,), 8, max_steps, 0.1, 0.1, eval_every, 0.99, 64, 40, 3, "cpu",
                       1, 60.0, 0, (3,), settle_window, 0.02, 0)


def _scripted(monkeypatch, acc, loss):
    """Every evaluation reads (acc, loss(i)) at its i-th call."""
    calls = iter(range(10_000))
    monkeypatch.setattr(trainer, "evaluate", lambda *a: (acc, loss(next(calls))))


def _history(accs, every=50):
    return [[every * (i + 1), a] for i, a in enumerate(accs)]


# -- the plateau and the margin ------------------------------------------------------------

def test_mqar_plateau_is_one_over_pairs_and_never_below_chance():
    task = tasks.get("mqar")
    assert task.plateau(64, 64, num_kv_pairs=8) == pytest.approx(1 / 8)
    assert task.chance(64, 64, num_kv_pairs=8) == pytest.approx(1 / 32)
    below = tasks.Task("t", "", "", {}, None, None, lambda n, v: 0.1, None, True,
                       in_context_guess=lambda n, v: 0.05)  # a guess worse than chance
    assert below.plateau(8, 8) == 0.1
    for name in ("selective_copying", "noisy_recall", "fuzzy_recall"):
        t = tasks.get(name)
        p = {**t.params}
        assert t.plateau(32, 33, **p) >= t.chance(32, 33, **p)


def test_a_variant_of_limited_reach_weights_the_plateau_by_its_reach():
    assert outcome.plateau(0.125, 1 / 32, None) == 0.125
    assert outcome.plateau(0.125, 1 / 32, 1.0) == 0.125
    assert outcome.plateau(0.125, 1 / 32, 0.4) == pytest.approx(0.4 * 0.125 + 0.6 / 32)
    assert outcome.ceiling(1 / 32, 0.4) == pytest.approx(0.4 + 0.6 / 32)


def test_the_margin_is_three_standard_errors_at_least_two_points():
    # 500 examples x 8 queries at 0.5: SE 0.0079, three of them 0.0237
    assert outcome.margin(0.5, 4000) == pytest.approx(3 * math.sqrt(0.25 / 4000))
    assert outcome.margin(0.125, 4000) == 0.02  # 3 SE = 0.0157: the floor
    assert outcome.margin(0.5, 80) == pytest.approx(3 * math.sqrt(0.25 / 80))
    assert outcome.margin(0.5, None) == 0.02


# -- the settling rule on the plateau ------------------------------------------------------

def test_a_run_flat_on_its_plateau_does_not_settle(monkeypatch):
    """MQAR with 2 pairs: flat at 1 / pairs = 0.5, the held-out loss falling by less than
    the settling margin: the old rule stopped it "settled" at step 20; it runs to its cap,
    not learned."""
    cfg = _config()
    _scripted(monkeypatch, 0.5, lambda i: 2.0 - 1e-4 * i)
    r = trainer.train(cfg, 1e-3)
    assert (r["stopped"], r["settled"], r["steps_run"]) == ("cap", False, 60)
    assert r["plateau"] == 0.5 and r["val_scored"] == 80  # 40 examples x 2 queries
    assert rows.run_outcome(cfg, r) == "not_learned"
    h = _history([0.5] * 20)
    flat = [[s, 2.0] for s, _ in h]
    assert trainer.settled(h, 400, 0.02, 0.99, flat) is True  # the rule without its floor
    assert trainer.settled(h, 400, 0.02, 0.99, flat, floor=0.5 + 0.02) is False


def test_a_run_flat_at_chance_below_the_plateau_does_not_settle_either(monkeypatch):
    cfg = _config()
    _scripted(monkeypatch, 1 / 8, lambda i: 2.08)  # chance: one of the 8 values
    r = trainer.train(cfg, 1e-3)
    assert (r["stopped"], r["steps_run"]) == ("cap", 60)
    assert rows.run_outcome(cfg, r) == "not_learned"


def test_a_run_flat_clearly_above_its_plateau_settles_partial(monkeypatch):
    cfg = _config()
    _scripted(monkeypatch, 0.8, lambda i: 0.9)  # 0.5 + margin 0.168 < 0.8
    r = trainer.train(cfg, 1e-3)
    assert (r["stopped"], r["steps_run"]) == ("settled", 20)
    assert rows.run_outcome(cfg, r) == "partial"


def test_a_run_whose_test_accuracy_is_on_the_plateau_has_not_learned(monkeypatch):
    """The best validation accuracy is the largest of many evaluations: near the plateau
    its noise clears the margin where the test split, one evaluation of the chosen
    checkpoint, does not (state-cpu's parity rows: 0.54 on validation, 0.51 on test).
    Planted: the outcome from the validation number alone calls it partial."""
    cfg = _config()
    _scripted(monkeypatch, 0.8, lambda i: 0.9)
    r = trainer.train(cfg, 1e-3)
    assert rows.run_outcome(cfg, {**r, "test_accuracy": 0.52}) == "not_learned"  # 0.5 + 0.168
    assert rows.run_outcome(cfg, {**r, "test_accuracy": 0.75}) == "partial"
    assert rows.run_outcome(cfg, r) == "partial"  # no test split: validation decides


# -- each outcome --------------------------------------------------------------------------

def _outcome(accuracy, *, status="ok", reach=None, losses=((100, 2.0),), scored=4000):
    return outcome.outcome(status=status, accuracy=accuracy, early_stop=0.99,
                           plateau_=outcome.plateau(0.125, 1 / 32, reach), chance=1 / 32,
                           reach=reach, scored=scored, held_out_loss=[list(x) for x in losses],
                           vocab_size=64, warmup_steps=50)


def test_each_outcome_from_a_planted_run():
    assert _outcome(0.995) == "learned"
    assert _outcome(0.13) == "not_learned"  # within 0.02 of 1 / 8
    assert _outcome(0.02) == "not_learned"  # below it
    assert _outcome(0.6) == "partial"
    # a window that reads 40% of the answers: its ceiling 0.4 + 0.6 / 32 = 0.419
    assert _outcome(0.41, reach=0.4) == "at_reach"
    assert _outcome(0.3, reach=0.4) == "partial"
    assert _outcome(0.06, reach=0.4) == "not_learned"  # its plateau: 0.069
    assert _outcome(None, status="nonfinite") == "diverged"
    bound = math.log(64) + 1
    assert _outcome(0.995, losses=[(100, bound + 0.1)]) == "diverged"
    assert _outcome(0.6, losses=[(100, float("nan"))]) == "diverged"
    assert _outcome(0.6, losses=[(50, bound + 5), (100, 2.0)]) == "partial"  # in warm-up
    assert _outcome(None, status="timeout") is None


def test_a_row_carries_its_plateau_and_outcome():
    cfg = _config()
    result = {"status": "ok", "reason": "", "accuracy": 0.5, "steps": 60, "steps_run": 60,
              "stopped": "cap", "plateau": 0.5, "val_scored": 80,
              "held_out_loss": [[60, 2.0]]}
    row = rows.combine(cfg, [(1e-2, result, 1.0)])
    assert row["outcome"] == "not_learned"
    assert rows.plateau_of(cfg)[:2] == (0.5, 1 / 8)
    bad = rows.combine(cfg, [(1e-2, {"status": "nonfinite", "reason": "nan"}, 1.0)])
    assert bad["status"] == "nonfinite" and bad["outcome"] == "diverged"
