"""Three splits (issue 49, item 4): train, validation (picks the rate, stops the run) and
test (the reported number), disjoint for every task and every seed of a cell.

Planted bugs these catch (each planted and seen failing): the validation set not avoiding
the test set; redraws that repeat the first draw (seeds 2^40 apart: torch keeps a seed's
low 32 bits only), so a setting of few distinct examples cannot be split or is topped up
with copies; val_examples hashed into every configuration's id (the ids of earlier sweeps
change).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.train import tasks, trainer
from harness.train.matrix import TrainConfig

SETTINGS = [("mqar", 16, 16, {"num_kv_pairs": 2}),
            ("mqar", 12, 8, {"num_kv_pairs": 2}),  # 864 distinct examples: sets collide
            ("selective_copying", 16, 16, {"num_tokens": 2}),
            ("noisy_recall", 16, 12, {"noise_vocab_size": 4, "frac_noise": 0.2}),
            ("fuzzy_recall", 16, 16, {"key_len": 2, "value_len": 2})]


def _config(task, N, V, p, seed=0, seeds=(0,), val_examples=0, test_examples=60):
    return TrainConfig(task, json.dumps({**tasks.get(task).params, **p}, sort_keys=True),
                       "sdpa", "{}", N, V, True, 16, 1, 1, False, (1e-2,), 8, 20, 0.1, 0.1,
                       5, 0.99, 400, test_examples, seed, "cpu", 1, 60.0, 0, seeds, 1000,
                       0.02, 0, val_examples)


def _rows(x):
    return [tuple(r) for r in x.tolist()]


@pytest.mark.parametrize("task,N,V,p", SETTINGS, ids=[f"{s[0]}-{s[1]}" for s in SETTINGS])
def test_the_test_split_shares_no_example_with_train_or_validation(task, N, V, p):
    for seed in (0, 1):  # the cell's first seed, then a later one
        cfg = _config(task, N, V, p, seed=seed, seeds=(0, 1), val_examples=80)
        (xtr, _), (xva, yva), (xte, yte) = trainer.datasets(cfg)
        assert (len(xtr), len(xva), len(xte)) == (400, 80, 60) and len(yva) == 80
        train, val, test = set(_rows(xtr)), set(_rows(xva)), set(_rows(xte))
        assert not test & train and not test & val and not val & train, seed
    # every seed is validated and tested on the first seed's sets
    first = trainer.datasets(_config(task, N, V, p, seeds=(0, 1), val_examples=80))
    later = trainer.datasets(_config(task, N, V, p, seed=1, seeds=(0, 1), val_examples=80))
    assert _rows(first[1][0]) == _rows(later[1][0]) and _rows(first[2][0]) == _rows(later[2][0])
    assert _rows(first[0][0]) != _rows(later[0][0])


def test_the_test_set_is_the_held_out_draw_of_before_and_validation_defaults_to_its_size():
    """The test set is what the single held-out set was (seed 2 s + 1, avoiding the
    training set), so an old folder's numbers stay comparable with new test numbers."""
    cfg = _config("mqar", 64, 64, {"num_kv_pairs": 8}, seed=3, seeds=(3,))
    (_, _), (xva, _), (xte, yte) = trainer.datasets(cfg)
    want_x, want_y = tasks.mqar(60, 64, 64, 8, seed=7)
    assert _rows(xte) == _rows(want_x) and _rows(yte) == _rows(want_y)
    assert len(xva) == 60 and cfg.validation_examples == 60


def test_redraws_give_new_examples_not_copies():
    """A setting of few distinct examples: MQAR N = 8, V = 8, 2 pairs. The held-out sets
    are topped up from redraws; a redraw on the same 32 low seed bits repeated the first
    draw, and its examples came in again as copies."""
    train, _, (x, _) = tasks.split("mqar", 20, 30, seed=0, seq_len=8, vocab_size=8,
                                   num_kv_pairs=2, val_examples=30)
    first = set(_rows(tasks.mqar(30, 8, 8, 2, seed=1)[0])) - set(_rows(train[0]))
    assert len(x) == 30 and len(set(_rows(x))) > len(first)  # redraws added new ones


def test_val_examples_enters_the_id_only_away_from_its_default():
    cfg = _config("mqar", 16, 16, {"num_kv_pairs": 2})
    same = dataclasses.replace(cfg, val_examples=cfg.test_examples)
    assert cfg.config_id == same.config_id and cfg.cell_id == same.cell_id
    other = dataclasses.replace(cfg, val_examples=100)
    assert other.config_id != cfg.config_id and other.cell_id != cfg.cell_id
