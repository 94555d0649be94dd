"""The training protocol (issue 34): runs that go on until they settle, seeds, the race of
learning rates, the estimate's probe, and the protocol presets' plans.

Planted bugs these catch (each planted and seen failing): the settling window counted in
evaluations, or as the last two evaluations (`rising`'s), or without the run at least
twice the window; a plateau on which the held-out loss still falls called settled; a run that settles not stopping, or one that reaches early_stop marked
unsettled; a paused run that reshuffles its batches when continued (a race that is not
one long run); a later seed's held-out set drawn from its own seed, or its training set
overlapping the held-out set, or seeds sharing initial weights or batch order; the probe
timing the warm-up or a rate of another cell; a protocol preset whose plan outgrows 90
minutes on two workers, or with fewer than two seeds. The race: tests/test_train_race.py.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from harness.train import estimate, runner, stops, trainer
from harness.train import matrix as tm
from harness.train.matrix import TrainConfig
from harness.train.model import RecallModel

MQAR2 = json.dumps({"num_kv_pairs": 2, "power_a": 0.01, "random_non_queries": False},
                   sort_keys=True)


def _config(*, max_steps=40, eval_every=5, settle_window=10, lrs=(1e-2,), seeds=(3,),
            seed=None, race_steps=0, early_stop=0.99) -> TrainConfig:
    return TrainConfig("mqar", MQAR2, "sdpa", "{}", 16, 16, True, 16, 1, 1, False, tuple(lrs),
                       8, max_steps, 0.1, 0.1, eval_every, early_stop, 64, 40,
                       seeds[0] if seed is None else seed, "cpu", 1, 60.0, 0, tuple(seeds),
                       settle_window, 0.02, race_steps)


def _history(accs, every=50):
    return [[every * (i + 1), a] for i, a in enumerate(accs)]


# -- the settling rule ---------------------------------------------------------------------

W = 400  # the window, in steps; evaluations every 50


def _plateau_then(after):
    """MQAR-like: chance to step 600, a jump to 0.3 at 650, the plateau, then `after`
    from step 1050 (the plateau 650..1000: 350 steps, shorter than the window)."""
    return _history([0.03] * 12 + [0.3] * 8 + after)


def test_a_plateau_shorter_than_the_window_then_a_rise_is_not_settled_during_it():
    h = _plateau_then([0.6, 0.9, 0.95])
    during = [s for s, _ in h if 650 <= s <= 1000]
    for step in during:  # the window still holds the jump into the plateau
        upto = [e for e in h if e[0] <= step]
        assert trainer.settled(upto, W, 0.02, 0.99) is False, step
    assert trainer.settled(h, W, 0.02, 0.99) is False  # rising at the end


def test_a_run_flat_for_longer_than_the_window_has_settled():
    h = _plateau_then([0.3, 0.3])  # flat from 650 to 1100
    assert trainer.settled([e for e in h if e[0] <= 1000], W, 0.02, 0.99) is False
    assert trainer.settled([e for e in h if e[0] <= 1050], W, 0.02, 0.99) is True
    noisy = _history([0.5, 0.51, 0.49, 0.5, 0.515, 0.5, 0.495, 0.51, 0.5, 0.505,
                      0.5, 0.49, 0.51, 0.5, 0.505, 0.5, 0.5])  # 850 steps, wobbles < 0.02
    assert trainer.settled(noisy, W, 0.02, 0.99) is True


def test_settling_needs_a_run_twice_the_window_and_early_stop_settles():
    flat = _history([0.1] * 15)  # flat from the first evaluation, 750 steps < 2 W
    assert trainer.settled(flat, W, 0.02, 0.99) is False
    assert trainer.settled(_history([0.1] * 16), W, 0.02, 0.99) is True  # 800 = 2 W
    assert trainer.settled(_history([0.2, 0.995]), W, 0.02, 0.99) is True
    assert trainer.settled([], W, 0.02, 0.99) is False


def test_a_plateau_on_which_the_held_out_loss_still_falls_has_not_settled():
    """Measured here (train-cpu's gla at 2 heads, lr 3.2e-3): held-out accuracy flat at
    0.14-0.155 from step 300 to 1,000 while the held-out loss fell from 2.47 (step 400) to
    2.27 (800). Flat accuracy with the loss still falling goes on; with a flat or rising
    loss (a model that memorises its training set) it has settled."""
    h = _history([0.14] * 20)  # steps 50 .. 1000
    falling = [[s, 2.5 - s / 2000] for s, _ in h]  # 2.2 at 600, 2.0 at 1000: 9% over W
    assert trainer.settled(h, W, 0.02, 0.99, falling) is False
    flat = [[s, 2.3 + 0.01 * (i % 2)] for i, (s, _) in enumerate(h)]
    assert trainer.settled(h, W, 0.02, 0.99, flat) is True
    overfit = [[s, 2.0 + s / 2000] for s, _ in h]
    assert trainer.settled(h, W, 0.02, 0.99, overfit) is True
    assert trainer.settled(h, W, 0.02, 0.99, [[s, None] for s, _ in h]) is True  # unknown


def _scripted(monkeypatch, accuracies):
    it = iter(accuracies)
    monkeypatch.setattr(trainer, "evaluate", lambda *a: (next(it), None))  # no loss


def test_a_run_stops_when_settled_and_says_so(monkeypatch):
    """Evaluations every 5 steps, window 10: flat from the first (above the plateau of 2
    pairs, 0.5, by more than the margin), settled at step 20."""
    _scripted(monkeypatch, [0.8] * 8)
    r = trainer.train(_config(), 1e-3)
    assert (r["stopped"], r["settled"], r["steps_run"]) == ("settled", True, 20)
    _scripted(monkeypatch, [0.1 * i for i in range(1, 10)])  # climbing to the cap; test
    r = trainer.train(_config(), 1e-3)
    assert (r["stopped"], r["settled"], r["steps_run"]) == ("cap", False, 40)
    _scripted(monkeypatch, [0.5, 0.995, 0.99])
    r = trainer.train(_config(), 1e-3)
    assert (r["stopped"], r["settled"], r["steps_run"]) == ("early_stop", True, 10)


def test_a_run_continued_in_segments_is_one_run():
    """The race pauses and continues runs, with other runs in between: the numbers must be
    those of one uninterrupted run."""
    cfg = _config(max_steps=30, settle_window=100)
    whole = trainer.Run(cfg, 3e-3).advance(30)
    a, other = trainer.Run(cfg, 3e-3), trainer.Run(cfg, 1e-2)
    a.advance(10)
    other.advance(20)
    a.advance(20)
    parts = a.advance(30)
    assert parts["history"] == whole["history"] and parts["final_loss"] == whole["final_loss"]
    assert parts["held_out_loss"] == whole["held_out_loss"]
    assert parts["steps_run"] == 30


# -- seeds ---------------------------------------------------------------------------------

def test_seeds_differ_in_initialisation_and_data_order_but_share_the_held_out_set():
    first, later = _config(seeds=(3, 5)), _config(seeds=(3, 5), seed=5)
    assert first.cell_id == later.cell_id and first.config_id != later.config_id
    assert first.first_seed and not later.first_seed
    (x0, _), _, (t0, y0) = trainer.datasets(first)
    (x1, _), _, (t1, y1) = trainer.datasets(later)
    assert torch.equal(t0, t1) and torch.equal(y0, y1)  # one held-out set
    assert not torch.equal(x0, x1)  # another training set
    held = {tuple(r) for r in t1.tolist()}
    assert not any(tuple(r) in held for r in x1.tolist())  # still disjoint from it
    w0 = trainer.build_model(first).state_dict()
    w1 = trainer.build_model(later).state_dict()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    r0, r1 = trainer.Run(first, 1e-3), trainer.Run(later, 1e-3)
    assert not torch.equal(r0.perm, r1.perm)
    # alone, seed 5 is a configuration of its own, with its own held-out set
    *_, (t5, _) = trainer.datasets(_config(seeds=(5,)))
    assert not torch.equal(t5, t1)


def test_a_seed_list_expands_to_one_configuration_per_seed_of_each_cell(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('variants = ["sdpa", "linear"]\nseq_lens = [16]\nnum_kv_pairs = 2\n'
                    'vocab_size = 16\nseed = [4, 2]\n')
    _, configs = tm.load(str(path))
    assert [(c.variant, c.seed) for c in configs] == [("sdpa", 4), ("sdpa", 2),
                                                      ("linear", 4), ("linear", 2)]
    assert {c.seeds for c in configs} == {(4, 2)}
    assert [len(g) for g in runner.cells(configs)] == [2, 2]
    path.write_text('variants = ["sdpa"]\nseed = [1, 1]\n')
    with pytest.raises(Exception, match="distinct"):
        tm.load(str(path))


def test_each_rows_runs_are_kept_as_they_went_in_train_curves(tmp_path):
    """train_curves.jsonl holds every rate's held-out accuracy and loss at each evaluation
    (planted: curves left out of the row, or one rate's written for another)."""
    from harness.train.store import TrainStore
    cfg = _config(lrs=(1e-2, 3e-3), max_steps=20, eval_every=5)
    runs = [(lr, trainer.Run(cfg, lr).advance(20), 1.0) for lr in cfg.lrs]
    store = TrainStore(tmp_path)
    store.open()
    store.append({"config_id": cfg.config_id, "variant": "sdpa", "seed": cfg.seed,
                  **runner.combine(cfg, runs)})
    store.close()
    got = store.curves()[cfg.config_id]
    assert (tmp_path / "train_curves.jsonl").exists() and got["seed"] == cfg.seed
    assert [r["lr"] for r in got["runs"]] == [1e-2, 3e-3]
    for (lr, result, _), kept in zip(runs, got["runs"]):
        assert kept["history"] == result["history"] and [s for s, _ in kept["history"]] == \
            [5, 10, 15, 20]
        assert kept["held_out_loss"] == result["held_out_loss"]
        assert kept["steps_run"] == 20 and kept["stopped"] == result["stopped"]
    assert runs[0][1]["held_out_loss"] != runs[1][1]["held_out_loss"]


# -- the estimate --------------------------------------------------------------------------

def test_the_probe_times_the_configurations_own_step(monkeypatch):
    """A model made 40 ms slower a step, and 300 ms slower in its warm-up steps: the probe
    sees the 40, and the estimate is steps x that (plus evaluations and the worker's
    start)."""
    forward = RecallModel.forward
    calls = []

    def slow(self, *a, **k):
        calls.append(self.training)
        if self.training:
            time.sleep(0.3 if len(calls) <= estimate.PROBE_WARMUP else 0.04)
        return forward(self, *a, **k)

    monkeypatch.setattr(RecallModel, "forward", slow)
    estimate._PROBED.clear()
    cfg = _config(lrs=(1e-3, 3e-3), max_steps=200, race_steps=50)
    step = estimate.probe(cfg)
    assert 0.04 <= step < 0.25
    assert calls.count(True) == estimate.PROBE_WARMUP + estimate.PROBE_STEPS
    assert not any(c is False for c in calls)  # no held-out evaluation in the probe
    (c, seconds, why), = estimate.plan_seconds([cfg], lambda c, m: estimate.probe(c),
                                               runner.skip_reasons)
    steps = estimate.planned_steps(cfg)
    assert not why and steps * step < seconds < steps * step * 1.5 + estimate.WORKER_S
    estimate._PROBED.clear()


# -- the protocol presets ------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["train-cpu", "mad-cpu", "hybrid-cpu", "state-cpu",
                                    "lm-cpu"])
def test_the_protocol_presets_plan_within_90_minutes_on_two_workers(preset):
    _, configs = tm.load(preset)
    # step costs from the preset's quiet reference run (estimate.reference_steps)
    step = estimate.reference_steps(f"results/{preset}")

    # The estimate (the share of the plan the reference runs trained, harness/train/stops.py),
    # not the ceiling: since issue 49 the race cuts nothing on the plateau or on a tie, and
    # its worst case, every rate and one beyond to the cap on every seed, is 2-6 times
    # the 90 minutes (docs/training.md).
    # On two workers as the sweep schedules its cells (estimate.wall_seconds), not the sum
    # over two: a long cell last runs while the other worker waits.
    costs = estimate.plan_seconds(configs, step, runner.skip_reasons, stops.share)
    minutes = estimate.wall_seconds(costs, tm.sweep_workers(preset)) / 60
    assert tm.sweep_workers(preset) == 2 and minutes <= 90, minutes
    assert {len(c.seeds) for c in configs} == {2}
    for g in runner.cells(configs):
        assert len(g) == 2 and g[0].first_seed
    if preset in ("state-cpu", "lm-cpu"):  # two rates, their own caps (tests/test_train_lm.py)
        return
    assert len(configs[0].lrs) == 4
    # the caps: several times the 400-500 steps the reference runs stopped at
    assert min(c.max_steps * c.batch for c in configs) >= 30_000
    assert all(2 * c.settle_window <= c.max_steps for c in configs)


# -- denormals -----------------------------------------------------------------------------

def _flushes() -> bool:
    """Whether this thread flushes denormals now: 1e-300 * 1e-23 is a float64 denormal."""
    return (torch.tensor([1e-300], dtype=torch.float64) * 1e-23).item() == 0.0


def test_training_steps_flush_denormals_and_the_default_comes_back(monkeypatch):
    """Planted: the trainer's loop outside `flushed_denormals` (the steps see denormals),
    or a mode left on after the run (the caller's arithmetic changes)."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode (torch.set_flush_denormal: False)")
    seen, step = [], trainer.Run._one_step
    monkeypatch.setattr(trainer.Run, "_one_step", lambda self: (seen.append(_flushes()),
                                                                step(self))[1])
    assert not _flushes()
    trainer.Run(_config(max_steps=3, eval_every=3), 1e-3).advance(3)
    assert seen == [True] * 3 and not _flushes()


def test_the_step_timer_steps_as_the_trainer_does(monkeypatch):
    """tools/step_ratios times the trainer's step: denormals flushed there too."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode (torch.set_flush_denormal: False)")
    from tools import step_ratios
    seen, loss = [], step_ratios.F.cross_entropy
    monkeypatch.setattr(step_ratios.F, "cross_entropy",
                        lambda *a, **k: (seen.append(_flushes()), loss(*a, **k))[1])
    step_ratios.step_fn("sdpa", {}, 32)()
    assert seen == [True] and not _flushes()
