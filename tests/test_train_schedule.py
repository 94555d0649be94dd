"""Warmup-stable-decay (issue 49, item 2): a run's first steps do not depend on its cap, a
run continued from its checkpoint is the run the larger cap trains, a run that settles
decays before its test evaluation.

Planted bugs these catch (each planted and seen failing): the decay planned over the
whole cap (cosine: two caps part from the first step); the decay starting a step early or
late; the checkpoint taken after the decay began, or without the optimiser's state, the
batch order or the random state (the continued run parts from the fresh one); a settled
run stopping without its decay; a fraction `warmup` (an earlier folder's) read as steps.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from harness.train import trainer
from harness.train.matrix import TrainConfig
from harness.train.schedule import decay_start, schedule

MQAR2 = json.dumps({"num_kv_pairs": 2, "power_a": 0.01, "random_non_queries": False},
                   sort_keys=True)


def _config(max_steps, warmup=10, settle_window=10_000) -> TrainConfig:
    return TrainConfig("mqar", MQAR2, "sdpa", "{}", 16, 16, True, 16, 1, 1, False, (1e-2,),
                       8, max_steps, warmup, 0.1, 5, 0.99, 64, 40, 3, "cpu", 1, 60.0, 0,
                       (3,), settle_window, 0.02, 0)


def test_the_schedule_warms_up_holds_then_decays_over_the_last_fifth():
    f = [schedule(s, 1000, 150) for s in range(1001)]
    assert f[:150] == pytest.approx([(s + 1) / 150 for s in range(150)])
    assert f[150:801] == [1.0] * 651 and decay_start(1000) == 800
    assert f[900] == pytest.approx(1 - math.sqrt(0.5)) and f[1000] == 0.0
    assert all(a >= b for a, b in zip(f[800:], f[801:]))
    # the first 800 steps of a cap of 1,000 are those of a cap of 3,000
    assert [schedule(s, 3000, 150) for s in range(800)] == f[:800]
    # a fraction (an earlier folder's matrix) keeps its meaning: warm-up, then cosine
    assert schedule(10, 100, 0.1) == pytest.approx(1.0)
    assert schedule(55, 100, 0.1) == pytest.approx(0.5)
    # a settled run's own decay
    assert schedule(300, 1000, 150, (300, 400)) == 1.0
    assert schedule(350, 1000, 150, (300, 400)) == pytest.approx(1 - math.sqrt(0.5))


def _same(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, abs=1e-6)


def test_two_caps_record_the_same_history_up_to_the_smaller_ones_decay():
    short = trainer.Run(_config(50), 1e-2).advance(50)  # decays over [40, 50)
    long = trainer.Run(_config(100), 1e-2).advance(100)  # over [80, 100)
    upto = lambda h, n: [e for e in h if e[0] <= n]  # noqa: E731
    _same(upto(short["held_out_loss"], 40), upto(long["held_out_loss"], 40))
    _same(upto(short["history"], 40), upto(long["history"], 40))
    assert short["held_out_loss"][-1][1] != pytest.approx(long["held_out_loss"][9][1],
                                                          abs=1e-6)  # step 50: it decayed
    cosine = trainer.Run(_config(50, warmup=0.2), 1e-2).advance(50)
    cosine_long = trainer.Run(_config(100, warmup=0.2), 1e-2).advance(100)
    assert cosine["held_out_loss"][1][1] != pytest.approx(cosine_long["held_out_loss"][1][1],
                                                          abs=1e-6)  # cosine: parts at once


def test_a_run_extended_from_its_checkpoint_is_the_run_of_the_larger_cap():
    first = trainer.Run(_config(50), 1e-2)
    first.advance(50)
    assert first.checkpoint["step"] == 40 and first.done
    more = trainer.Run.extend(first.checkpoint, _config(100), 1e-2).advance(100)
    fresh = trainer.Run(_config(100), 1e-2).advance(100)
    _same(more["held_out_loss"], fresh["held_out_loss"])  # through the decay, too
    _same(more["history"], fresh["history"])
    assert more["steps_run"] == fresh["steps_run"] == 100
    assert more["test_accuracy"] == pytest.approx(fresh["test_accuracy"], abs=1e-6)


def test_a_run_that_settles_decays_before_its_test_evaluation(monkeypatch):
    """Flat at 0.8 (above the plateau of 2 pairs, 0.5, by more than the margin): settled
    at step 20 (window 10), then it decays over a quarter of its 20 steps (5, one
    evaluation) at a falling rate, and only then is the test set scored."""
    cfg = _config(200, warmup=5, settle_window=10)
    calls = []
    monkeypatch.setattr(trainer, "evaluate", lambda *a: calls.append(a) or (0.8, 1.0))
    run = trainer.Run(cfg, 1e-2)
    lrs = []
    step = run._one_step

    def spy():
        lrs.append(run.opt.param_groups[0]["lr"])
        step()

    run._one_step = spy
    r = run.advance(200)
    assert (r["stopped"], r["steps_run"], r["settled"]) == ("settled", 25, True)
    assert run.checkpoint["step"] == 20 and run.decay == (20, 25)
    assert lrs[5:20] == [1e-2] * 15 and all(a > b for a, b in zip(lrs[20:], lrs[21:]))
    assert len(calls) == 6 and calls[-1][1] is run.test[0]  # 5 validations, then the test
    old = dataclasses.replace(cfg, warmup=0.05)  # a fraction: the old protocol stops at once
    assert trainer.Run(old, 1e-2).advance(200)["steps_run"] == 20
