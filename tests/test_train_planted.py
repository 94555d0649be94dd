"""The trainer's and the sweep's measurements against hand-computed answers: the schedule,
the held-out accuracy, what a run reports from its evaluations, and how a sweep picks
its rate. Scripted evaluations stand in for a model's (the trainer's loop runs for real
on a tiny model), so every reported number has a known answer.

Planted bugs these catch (issue 25, item 5): held-out accuracy measured on the training
set; accuracy over every position instead of the scored ones; steps_to_0_9 off (the best
step, the step after, a strict > 0.9); the held-out set drawn from the training seed; the best accuracy or its step not the best
evaluation's; an early stop not taken or taken below early_stop; the warm-up off by one
or the cosine not reaching 0 at max_steps; best_lr chosen by training loss or by the
last rate; the sweep going on after a rate reached early_stop.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from harness.train import runner as train_runner
from harness.train import tasks, trainer
from harness.train.matrix import TrainConfig
from harness.train.tasks import IGNORE


def _config(max_steps=30, eval_every=5, early_stop=0.99, lrs=(1e-2,)) -> TrainConfig:
    return TrainConfig("mqar", json.dumps({"num_kv_pairs": 2, "power_a": 0.01,
                                           "random_non_queries": False}, sort_keys=True),
                       "sdpa", "{}", 16, 16, True, 16, 1, 1, False, tuple(lrs), 8, max_steps,
                       0.1, 0.1, eval_every, early_stop, 64, 40, 3, "cpu", 1, 60.0, 0)


# -- the schedule ------------------------------------------------------------------------

def test_schedule_is_linear_warm_up_then_cosine_to_zero():
    """max_steps = 100, warmup = 0.1: steps 0..9 ramp (s + 1) / 10, then
    0.5 (1 + cos(pi (s - 10) / 90)): 1 at step 10, 1/2 at step 55, 0 at step 100."""
    f = [trainer.schedule(s, 100, 0.1) for s in range(101)]
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.5)
    assert f[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # decays monotonically
    assert trainer.schedule(0, 100, 0.0) == pytest.approx(1.0)  # no warm-up: full rate


# -- held-out accuracy -------------------------------------------------------------------

class _Oracle(torch.nn.Module):
    """Predicts each scored position's label from a table, wrongly in the examples listed;
    model(x, where) -> logits at the scored positions, as RecallModel's."""

    def __init__(self, inputs, labels, wrong, vocab):
        super().__init__()
        self.table = {tuple(r): lab for r, lab in zip(inputs.tolist(), labels.tolist())}
        self.wrong, self.vocab = set(wrong), vocab
        self.rows = [tuple(r) for r in inputs.tolist()]

    def forward(self, x, where):
        out = []
        for row, w in zip(x.tolist(), where.tolist()):
            lab = self.table[tuple(row)]
            bad = self.rows.index(tuple(row)) in self.wrong
            for j, scored in enumerate(w):
                if scored:
                    out.append((lab[j] + 1) % self.vocab if bad else lab[j])
        return torch.nn.functional.one_hot(torch.tensor(out), self.vocab).float()


def test_accuracy_is_the_share_of_scored_positions_predicted_right():
    """600 examples (three evaluation batches), every 4th predicted wrong: 3/4 of the
    scored positions, whatever the unscored ones hold."""
    *_, (x, y) = trainer.datasets(_config())
    x, y = torch.cat([x] * 15), torch.cat([y] * 15)  # 600 rows
    x[:, -1] = torch.arange(600) + 100  # rows distinct (the last position is never scored)
    wrong = range(0, 600, 4)
    scored = (y != IGNORE).sum(1)
    want = 1 - float(scored[list(wrong)].sum()) / float(scored.sum())
    got = trainer.accuracy(_Oracle(x, y, wrong, 128), x, y, torch.device("cpu"))
    assert got == pytest.approx(want) and got == pytest.approx(0.75)


# -- what a run reports from its evaluations -----------------------------------------------

def _scripted(monkeypatch, accuracies):
    """Replace the held-out evaluation by a script; record what it was given."""
    seen = []

    def evaluate(model, inputs, labels, device):
        seen.append((inputs, labels))
        return accuracies[len(seen) - 1], None  # no held-out loss: accuracy alone

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    return seen


def test_a_run_reports_its_best_evaluation_and_its_first_at_0_9(monkeypatch):
    """Evaluations at steps 5, 10, ..., 30 read 0.3, 0.92, 0.85, 0.97, 0.96, 0.5: the best
    is 0.97 at step 20, 0.9 was first reached at step 10; no early stop (0.99). Once the
    run has ended, the test set is scored once (0.95), at the weights of step 20."""
    seen = _scripted(monkeypatch, [0.3, 0.92, 0.85, 0.97, 0.96, 0.5, 0.95])
    kept = []
    load = trainer.RecallModel.load_state_dict
    monkeypatch.setattr(trainer.RecallModel, "load_state_dict",
                        lambda self, sd: kept.append(sd) or load(self, sd))
    r = trainer.train(_config(), 1e-2)
    assert r["status"] == "ok", r
    assert r["history"] == [[5, 0.3], [10, 0.92], [15, 0.85], [20, 0.97], [25, 0.96], [30, 0.5]]
    assert r["accuracy"] == 0.97 and r["steps"] == 20 and r["steps_to_0_9"] == 10
    assert r["steps_run"] == 30 and r["test_accuracy"] == 0.95
    # every evaluation was on the validation set, then one on the test set; never on the
    # training set
    (train_x, _), (val_x, val_y), (test_x, test_y) = trainer.datasets(_config())
    assert len(seen) == 7
    for inputs, labels in seen[:6]:
        assert torch.equal(inputs, val_x) and torch.equal(labels, val_y)
        assert not torch.equal(inputs[:len(train_x)], train_x[:len(inputs)])
    assert torch.equal(seen[6][0], test_x) and torch.equal(seen[6][1], test_y)
    # the test set was scored at the weights the best validation (step 20) kept
    assert len(kept) == 1 and not all(
        torch.equal(kept[0][k], v) for k, v in trainer.build_model(_config()).state_dict().items())


def test_exactly_0_9_counts_and_the_run_stops_at_early_stop(monkeypatch):
    _scripted(monkeypatch, [0.5, 0.9, 0.99, 0.2, 0.2, 0.2])
    r = trainer.train(_config(), 1e-2)
    assert r["steps_to_0_9"] == 10 and r["accuracy"] == 0.99 and r["steps"] == 15
    assert r["steps_run"] == 15 and len(r["history"]) == 3  # stopped at the 0.99


def test_never_reaching_0_9_is_none_and_the_last_step_is_evaluated(monkeypatch):
    """max_steps = 27, eval_every = 5: evaluations at 5, ..., 25 and at step 27."""
    _scripted(monkeypatch, [0.1, 0.2, 0.3, 0.4, 0.89, 0.6, 0.8])  # the last: the test
    r = trainer.train(_config(max_steps=27), 1e-2)
    assert r["steps_to_0_9"] is None and r["accuracy"] == 0.89 and r["steps"] == 25
    assert [s for s, _ in r["history"]] == [5, 10, 15, 20, 25, 27]
    assert r["steps_run"] == 27 and math.isfinite(r["final_loss"])


# -- the sweep picks its rate by held-out accuracy ------------------------------------------

def _ok(acc, loss):
    return {"status": "ok", "reason": "", "accuracy": acc, "steps": 10, "step_ms": 1.0,
            "final_loss": loss, "steps_to_0_9": None, "time_to_best_s": 1.0, "n_params": 5}


def test_best_lr_is_the_rate_with_the_best_held_out_accuracy_not_the_lowest_loss():
    cfg = _config(lrs=(1e-3, 3e-3, 1e-2))
    row = train_runner.combine(cfg, [(1e-3, _ok(0.6, 0.05), 1.0), (3e-3, _ok(0.9, 0.8), 1.0),
                                     (1e-2, _ok(0.7, 0.01), 1.0)])
    assert row["best_lr"] == 3e-3 and row["accuracy"] == 0.9 and row["final_loss"] == 0.8
    ties = train_runner.combine(cfg, [(1e-3, _ok(0.8, 0.5), 1.0), (3e-3, _ok(0.8, 0.1), 1.0)])
    assert ties["best_lr"] == 1e-3  # the first of equals


class _Sweeper:
    def __init__(self, accuracies):
        self.accuracies, self.lrs = accuracies, []

    def run(self, config, lr, until=None):  # each run ends at its first budget
        self.lrs.append(lr)
        return {**_ok(self.accuracies[len(self.lrs) - 1], 0.1), "stopped": "cap"}, 2.0


def test_the_sweep_stops_at_the_first_rate_that_reaches_early_stop():
    cfg = _config(lrs=(1e-3, 3e-3, 1e-2, 3e-2), early_stop=0.95)
    s = _Sweeper([0.5, 0.95, 0.99, 0.99])
    row = train_runner.train_config(cfg, s)
    assert s.lrs == [1e-3, 3e-3]  # 0.95 >= early_stop: the later rates are not run
    assert row["status"] == "ok" and row["best_lr"] == 3e-3 and row["accuracy"] == 0.95
    assert row["train_s"] == 4.0 and "not run" in row["reason"]
    s = _Sweeper([0.5, 0.94, 0.6, 0.7])
    row = train_runner.train_config(cfg, s)
    assert s.lrs == [1e-3, 3e-3, 1e-2, 3e-2] and row["best_lr"] == 3e-3


def test_the_held_out_set_is_an_independent_draw():
    """trainer's docstring: training set from seed 2 s, held-out from 2 s + 1. Drawn from
    one seed, the held-out examples repeat the training examples' keys (the first draws of
    one generator) even where their values differ, so no held-out example may share its
    ordered keys with a training example (8 of 31 keys: a chance collision ~1e-11)."""
    cfg = dataclasses.replace(_config(), task_params=json.dumps(
        {"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False}, sort_keys=True),
        seq_len=64, vocab_size=64, train_examples=500, test_examples=200)
    (train_x, _), _, (test_x, test_y) = trainer.datasets(cfg)
    train_keys = {tuple(r) for r in train_x[:, 0:16:2].tolist()}
    assert not any(tuple(r) in train_keys for r in test_x[:, 0:16:2].tolist())
    want_x, want_y = tasks.mqar(200, 64, 64, 8, seed=2 * cfg.seed + 1)
    assert torch.equal(test_x, want_x) and torch.equal(test_y, want_y)
