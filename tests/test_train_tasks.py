"""MQAR, checked against its definition by code that does not share the generator's: a
walk over each sequence with a dictionary of what it has seen.

Planted bugs these catch: keys or values from the wrong half or repeated in an example
(disjoint halves); a label shifted by one or naming the wrong pair's value (the walk); the
value written after its query, Zoology's unshifted layout (answer after query); the
held-out set drawn from the training seed (train and test differ); an unseeded draw (same
seed, same data); power_a ignored (the gap distribution); a setting that cannot fit
generated anyway (the errors).
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.train import tasks
from harness.train.matrix import TrainConfig
from harness.train.tasks import IGNORE, mqar, mqar_problems
from harness.train.trainer import datasets

SETTINGS = [  # (seq_len, vocab_size, pairs, random_non_queries)
    (16, 12, 2, False), (64, 64, 8, False), (64, 64, 8, True), (101, 40, 12, True),
    (256, 8192, 64, False)]


def _pairs(row: list[int], P: int) -> tuple[list[int], list[int]]:
    return row[0:2 * P:2], row[1:2 * P:2]


@pytest.mark.parametrize("N,V,P,rnq", SETTINGS)
def test_keys_and_values_come_from_disjoint_halves(N, V, P, rnq):
    x, _ = mqar(200, N, V, P, random_non_queries=rnq, seed=3)
    for row in x.tolist():
        keys, values = _pairs(row, P)
        assert all(1 <= k < V // 2 for k in keys) and len(set(keys)) == P
        assert all(V // 2 <= v < V for v in values) and len(set(values)) == P


@pytest.mark.parametrize("N,V,P,rnq", SETTINGS)
def test_every_label_is_the_value_of_an_earlier_key_each_key_once(N, V, P, rnq):
    x, y = mqar(200, N, V, P, random_non_queries=rnq, seed=5)
    for row, lab in zip(x.tolist(), y.tolist()):
        seen: dict[int, int] = {}  # token -> the token that followed its first occurrence
        queried = []
        for i, (tok, label) in enumerate(zip(row, lab)):
            if label != IGNORE:
                assert tok in seen, f"position {i}: {tok} was not seen before its query"
                assert label == seen[tok], f"position {i}: label {label}, pair says {seen[tok]}"
                queried.append(tok)
            if tok not in seen and i + 1 < len(row):
                seen[tok] = row[i + 1]
        keys, _ = _pairs(row, P)
        assert sorted(queried) == sorted(keys)  # every key queried, once
        assert sum(t in keys for t in row[2 * P:]) == P  # no unscored repeat of a key


@pytest.mark.parametrize("N,V,P,rnq", SETTINGS)
def test_the_answer_never_appears_after_its_query(N, V, P, rnq):
    x, y = mqar(200, N, V, P, random_non_queries=rnq, seed=7)
    for row, lab in zip(x.tolist(), y.tolist()):
        for i, label in enumerate(lab):
            if label != IGNORE:
                assert label not in row[i:], f"the answer {label} is in the input after {i}"
        if not rnq:
            scored = {i for i, label in enumerate(lab) if label != IGNORE}
            assert all(t == 0 for i, t in enumerate(row[2 * P:], 2 * P) if i not in scored)


def _config(seed: int) -> TrainConfig:
    return TrainConfig("mqar", json.dumps({"num_kv_pairs": 8, "power_a": 0.01,
                                           "random_non_queries": False}, sort_keys=True),
                       "sdpa", "{}", 64, 64, True, 32, 1, 2, False, (3e-3,), 32, 10, 0.1, 0.1,
                       5, 0.99, 2000, 300, seed, "cpu", 1, 60.0, 0)


def test_train_and_held_out_sets_differ():
    (xtr, _), _, (xte, _) = datasets(_config(0))
    train_rows = {tuple(r) for r in xtr.tolist()}
    assert len(xte) == 300 and not any(tuple(r) in train_rows for r in xte.tolist())


def test_the_same_seed_gives_the_same_data_another_seed_other_data():
    a, b = mqar(50, 64, 64, 8, seed=11), mqar(50, 64, 64, 8, seed=11)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = mqar(50, 64, 64, 8, seed=12)
    assert not torch.equal(a[0], c[0])
    (x0, _), *_ = datasets(_config(0))
    (x1, _), *_ = datasets(_config(1))
    assert not torch.equal(x0, x1)


def test_power_a_puts_queries_near_the_pairs():
    """Zoology's power law: with power_a = 0.01 near query slots are much likelier than
    under power_a = 1 (uniform slots)."""
    def mean_slot(a):
        _, y = mqar(2000, 256, 256, 8, power_a=a, seed=0)
        where = (y != IGNORE).nonzero()[:, 1].float()
        return float(((where - 16) / 2).mean())
    uniform, skewed = mean_slot(1.0), mean_slot(0.01)
    assert abs(uniform - (120 - 1) / 2) < 5  # slots 0..119, drawn 8 without replacement
    assert skewed < 0.6 * uniform


@pytest.mark.parametrize("N,V,P,words", [
    (30, 64, 8, "do not fit in seq_len=30"),
    (64, 17, 8, "vocab_size=17 is too small"),
])
def test_impossible_settings_are_refused(N, V, P, words):
    assert any(words in p for p in mqar_problems(N, V, P))
    with pytest.raises(ValueError, match=words):
        mqar(4, N, V, P)
    assert mqar_problems(4 * P, 2 * P + 2, P) == []  # the bounds themselves are allowed


def test_random_fillers_are_never_a_pair_token_nor_zero():
    """V = 2 P + 2 leaves exactly one token that is neither 0, a key nor a value."""
    x, y = mqar(50, 32, 18, 8, random_non_queries=True, seed=2)
    for row, lab in zip(x.tolist(), y.tolist()):
        (left,) = set(range(1, 18)) - set(row[:16])
        fillers = [t for t, label in zip(row[16:], lab[16:]) if label == IGNORE]
        assert fillers and set(fillers) == {left}


def test_the_registry_knows_mqar_and_refuses_duplicates():
    task = tasks.get("mqar")
    assert task.non_causal_ok and task.params["num_kv_pairs"] == 8
    assert task.chance(64, 64, num_kv_pairs=8) == pytest.approx(1 / 32)
    with pytest.raises(ValueError, match="already registered"):
        tasks.register(task)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.get("nope")


def test_answer_at_points_at_the_value_of_the_queried_key():
    x, y = mqar(100, 64, 64, 8, seed=4)
    at = tasks.get("mqar").answer_at(x, y)
    assert torch.equal(at >= 0, y != IGNORE)
    rows, cols = (at >= 0).nonzero(as_tuple=True)
    assert torch.equal(x[rows, at[rows, cols]], y[rows, cols])  # the answer's own token
    assert torch.equal(x[rows, at[rows, cols] - 1], x[rows, cols])  # right after the key
