"""Training to recall, inside the suite in seconds: a tiny MQAR setting (N = 32, 4 pairs,
vocabulary 32) where sdpa reaches 0.99 held-out accuracy in under 100 steps, and a sliding
window that sees no other position stays near chance on it.

Planted bugs: a model or trainer that cannot learn recall (no short convolution, a broken
schedule, labels misaligned with the scored positions) fails the first test; a window
that ignores its width, a convolution or a data generator that leaks the answer fails the
second; an unseeded initialisation or batch order fails the third.
"""

from __future__ import annotations

import json

import pytest

from harness.train.matrix import TrainConfig
from harness.train.trainer import train

N, PAIRS, VOCAB = 32, 4, 32
CHANCE = 1 / (VOCAB // 2)


def _config(variant="sdpa", params=None, causal=True, seed=0, max_steps=150) -> TrainConfig:
    return TrainConfig("mqar", json.dumps({"num_kv_pairs": PAIRS, "power_a": 0.01,
                                           "random_non_queries": False}, sort_keys=True),
                       variant, json.dumps(params or {}, sort_keys=True), N, VOCAB, causal,
                       32, 1, 2, False, (1e-2,), 32, max_steps, 0.1, 0.1, 10, 0.99, 2000, 200,
                       seed, "cpu", 1, 120.0, 0)


@pytest.fixture(scope="module")
def sdpa_run():
    return train(_config(), 1e-2)


def test_sdpa_learns_to_recall_in_under_a_hundred_steps(sdpa_run):
    r = sdpa_run
    assert r["status"] == "ok" and r["accuracy"] >= 0.99
    assert r["steps_to_0_9"] is not None and r["steps_to_0_9"] <= r["steps"] < 150
    assert r["steps_run"] == r["steps"]  # stopped early at the first 0.99
    assert r["history"][0][1] < 0.5  # it learned: the first evaluation was far from it


def test_same_seed_same_threads_same_accuracy(sdpa_run):
    again = train(_config(), 1e-2)
    assert again["history"] == sdpa_run["history"]
    assert again["final_loss"] == sdpa_run["final_loss"]


@pytest.mark.parametrize("causal,window", [(True, 0), (False, 1)])
def test_a_window_shorter_than_every_key_to_query_distance_stays_near_chance(causal, window):
    """A query's pair is at least one position back (causal) and nothing after it holds its
    answer (non-causal, window 1: the query's neighbours are filler or the pairs' end)."""
    r = train(_config("sliding_window", {"window": window}, causal=causal, max_steps=100), 1e-2)
    assert r["status"] == "ok" and r["steps_run"] == 100
    assert r["accuracy"] < CHANCE + 0.1, r["history"]
