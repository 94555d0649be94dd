"""MAD's tasks (selective_copying, noisy_recall, fuzzy_recall) checked against their
definitions by code that does not share the generators': a walk over each sequence that
re-derives every label from the input by the task's rule.

Planted bugs these catch: a label naming the wrong copied token or an off-by-one output
(the copying walk); a recall label taken from the wrong occurrence or left on a key seen
for the first time (the recall walks); a noise token scored or made an answer (noise);
an unseeded draw (same seed); held-out examples equal to training ones (disjoint, through
the trainer); an impossible setting generated anyway (problems); a wrong chance level; a
generator whose layout no model can learn or a label readable without the needed
positions (sdpa learns it, a blind window does not).
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from harness.train import tasks
from harness.train.matrix import TrainConfig
from harness.train.tasks import IGNORE

SC, NR, FR = "selective_copying", "noisy_recall", "fuzzy_recall"
# (task, seq_len, vocab_size, params): the quick settings and some odd ones
SETTINGS = [
    (SC, 32, 16, {"num_tokens": 2}), (SC, 37, 6, {"num_tokens": 9}), (SC, 10, 4, {"num_tokens": 4}),
    (NR, 32, 33, {"noise_vocab_size": 16, "frac_noise": 0.2}),
    (NR, 41, 12, {"noise_vocab_size": 3, "frac_noise": 0.6}),
    (NR, 16, 8, {"noise_vocab_size": 0, "frac_noise": 0.0}),
    (FR, 32, 16, {"key_len": 2, "value_len": 2}), (FR, 50, 16, {"key_len": 3, "value_len": 3}),
    (FR, 23, 9, {"key_len": 1, "value_len": 4}),
]


def _gen(task, N, V, params, n=200, seed=0):
    return tasks.get(task).generate(n, seq_len=N, vocab_size=V, seed=seed, **params)


# -- the definitions, re-derived ------------------------------------------------------------
def _copy_labels(row: list[int], V: int) -> tuple[list[int], list[int]]:
    """Selective copying by its rule: the non-blank tokens before the separator (V - 1),
    in order, are the labels of the positions after it; (labels, where each came from)."""
    sep = row.index(V - 1)
    data = [(i, t) for i, t in enumerate(row[:sep]) if t != 0]
    labels = [IGNORE] * (sep + 1) + [t for _, t in data]
    at = [-1] * (sep + 1) + [i for i, _ in data]
    return labels, at


@pytest.mark.parametrize("task,N,V,p", [s for s in SETTINGS if s[0] == SC])
def test_selective_copying_labels_are_the_non_blanks_in_order(task, N, V, p):
    x, y = _gen(task, N, V, p)
    at = tasks.get(task).answer_at(x, y, **p)
    T = p["num_tokens"]
    for row, lab, a in zip(x.tolist(), y.tolist(), at.tolist()):
        assert row.count(V - 1) == 1 and row.index(V - 1) == N - T - 1  # one separator
        assert all(t == 0 for t in row[N - T:])  # the outputs are blanks
        assert all(0 <= t < V - 1 for t in row[:N - T - 1])
        labels, where = _copy_labels(row, V)
        assert lab == labels and a == where
        assert sum(t != 0 for t in row[:N - T - 1]) == T < N - T - 1  # some blanks among them


def _recall_walk(row: list[int], lab: list[int], K: int, W: int, is_key, is_value):
    """Recall by its rule, from the tokens alone: a run of K key tokens then W value
    tokens is a pair; a pair whose key occurred in an earlier pair is scored from the key's
    last token to the value's second-to-last, each with the next token, and that value is
    the one the key had before. Returns the expected labels, the nearest earlier answer
    positions, and how many pairs were seen."""
    want, at, seen = [IGNORE] * len(row), [-1] * len(row), {}
    i, pairs = 0, 0
    while i < len(row):
        span = row[i:i + K + W]
        if len(span) == K + W and all(map(is_key, span[:K])) and all(map(is_value, span[K:])):
            key, value = tuple(span[:K]), span[K:]
            if key in seen:
                before, where = seen[key]
                assert value == before, f"key {key} had value {before}, now {value}"
                for s in range(W):
                    want[i + K - 1 + s] = row[i + K + s]
                    at[i + K - 1 + s] = where + s
            seen[key] = (value, i + K)
            i, pairs = i + K + W, pairs + 1
        else:
            i += 1
    return want, at, pairs


@pytest.mark.parametrize("task,N,V,p", [s for s in SETTINGS if s[0] == NR])
def test_noisy_recall_labels_follow_the_rule_and_noise_carries_nothing(task, N, V, p):
    x, y = _gen(task, N, V, p)
    at = tasks.get(task).answer_at(x, y, **p)
    z = V - p["noise_vocab_size"]  # noise tokens: z and above
    h = (z - 1) // 2
    noisy = 0
    for row, lab, a in zip(x.tolist(), y.tolist(), at.tolist()):
        want, where, pairs = _recall_walk(row, lab, 1, 1, lambda t: 1 <= t <= h,
                                          lambda t: h < t < z)
        assert lab == want and a == where
        assert pairs * 2 + sum(t >= z for t in row) + row.count(0) == N  # nothing else
        assert row.count(0) == N % 2 and (N % 2 == 0 or row[0] == 0)  # the odd one leads
        assert want[-2] != IGNORE  # the last pair is a query
        noise = {i for i, t in enumerate(row) if t >= z}
        noisy += len(noise)
        assert all(lab[i] == IGNORE for i in noise)  # never scored ...
        assert all(t < z for t in lab if t != IGNORE)  # ... never an answer ...
        assert not noise & {j for j in a if j >= 0}  # ... never where an answer sits
    if p["frac_noise"]:
        share = noisy / (len(x) * N)
        assert abs(share - p["frac_noise"]) < 0.1, share  # about frac_noise of the slots
    else:
        assert noisy == 0


@pytest.mark.parametrize("task,N,V,p", [s for s in SETTINGS if s[0] == FR])
def test_fuzzy_recall_labels_are_the_value_span_of_the_repeated_key_span(task, N, V, p):
    x, y = _gen(task, N, V, p)
    K, W = p["key_len"], p["value_len"]
    at = tasks.get(task).answer_at(x, y, **p)
    h = (V - 1) // 2
    for row, lab, a in zip(x.tolist(), y.tolist(), at.tolist()):
        want, where, pairs = _recall_walk(row, lab, K, W, lambda t: 1 <= t <= h,
                                          lambda t: t > h)
        assert lab == want and a == where
        assert pairs == N // (K + W) and row[:N - pairs * (K + W)] == [0] * (N % (K + W))
        assert lab[N - W - 1:N - 1] != [IGNORE] * W  # the last pair repeats a key
        for i in range(N % (K + W), N, K + W):  # distinct tokens within each span
            assert len(set(row[i:i + K])) == K and len(set(row[i + K:i + K + W])) == W


@pytest.mark.parametrize("task,N,V,p", SETTINGS)
def test_answer_at_points_at_the_label_token_before_its_position(task, N, V, p):
    x, y = _gen(task, N, V, p)
    at = tasks.get(task).answer_at(x, y, **p)
    assert torch.equal(at >= 0, y != IGNORE)
    rows, cols = (at >= 0).nonzero(as_tuple=True)
    assert torch.equal(x[rows, at[rows, cols]], y[rows, cols])
    assert bool((at[rows, cols] < cols).all())  # written before it is asked for


@pytest.mark.parametrize("task,non_causal", [(SC, True), (NR, False), (FR, False)])
def test_non_causal_ok_says_whether_an_answer_follows_its_position(task, non_causal):
    """The flag against the data: does some scored label appear in the input after its
    position (that a non-causal mixer could read)?"""
    N, V, p = next((N, V, p) for t, N, V, p in SETTINGS if t == task)
    x, y = _gen(task, N, V, p)
    leaks = any(label in row[i + 1:] for row, lab in zip(x.tolist(), y.tolist())
                for i, label in enumerate(lab) if label != IGNORE)
    assert tasks.get(task).non_causal_ok is non_causal and leaks is not non_causal


@pytest.mark.parametrize("task,N,V,p", SETTINGS)
def test_the_same_seed_gives_the_same_data_another_seed_other_data(task, N, V, p):
    a, b, c = _gen(task, N, V, p, seed=5), _gen(task, N, V, p, seed=5), _gen(task, N, V, p, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def _config(task, N, V, p, *, variant="sdpa", vparams=None, layers=2, seed=0,
            train_examples=4000, test_examples=300, max_steps=600) -> TrainConfig:
    return TrainConfig(task, json.dumps({**tasks.get(task).params, **p}, sort_keys=True),
                       variant, json.dumps(vparams or {}, sort_keys=True), N, V, True, 64,
                       layers, 2, False, (3e-3,), 64, max_steps, 0.1, 0.1, 50, 0.97,
                       train_examples, test_examples, seed, "cpu", 1, 60.0, 0)


@pytest.mark.parametrize("task,N,V,p", [*[s for s in SETTINGS if s[1] > 10],  # 12 examples
                                        ("mqar", 16, 10, {"num_kv_pairs": 2})])
def test_train_and_held_out_sets_are_disjoint(task, N, V, p):
    from harness.train.trainer import datasets

    (xtr, _), _, (xte, yte) = datasets(_config(task, N, V, p, train_examples=3000,
                                            test_examples=500))
    train_rows = {tuple(r) for r in xtr.tolist()}
    assert len(xte) == len(yte) == 500
    assert not any(tuple(r) in train_rows for r in xte.tolist())
    from harness.train import trainer

    trainer._DATA.clear()  # drawn again, not the cached sets
    (xte2, _) = datasets(_config(task, N, V, p, train_examples=3000, test_examples=500))[2]
    assert torch.equal(xte, xte2)


def test_a_setting_too_small_to_split_is_refused():
    """Selective copying with 2 tokens from 2 values in 6 positions has 3 x 4 examples."""
    with pytest.raises(ValueError, match="too few distinct examples"):
        tasks.split(SC, 100, 10, seed=0, seq_len=6, vocab_size=4, num_tokens=2)


@pytest.mark.parametrize("task,N,V,p,words", [
    (SC, 9, 16, {"num_tokens": 4}, "do not fit in seq_len=9"),
    (SC, 32, 3, {"num_tokens": 2}, "vocab_size=3 is too small"),
    (SC, 32, 16, {"num_tokens": 0}, "num_tokens must be >= 1"),
    (NR, 32, 33, {"noise_vocab_size": 16, "frac_noise": 1.0}, "frac_noise must be in [0, 1)"),
    (NR, 32, 33, {"noise_vocab_size": 0, "frac_noise": 0.2}, "noise_vocab_size must be >= 1"),
    (NR, 32, 18, {"noise_vocab_size": 16, "frac_noise": 0.2}, "vocab_size=18 leaves no key"),
    (NR, 3, 33, {"noise_vocab_size": 16, "frac_noise": 0.2}, "seq_len=3 is too short"),
    (FR, 32, 6, {"key_len": 3, "value_len": 2}, "vocab_size=6 is too small"),
    (FR, 7, 16, {"key_len": 2, "value_len": 2}, "seq_len=7 does not hold"),
    (FR, 32, 16, {"key_len": 0, "value_len": 2}, "must be >= 1"),
])
def test_impossible_settings_are_refused_in_one_line(task, N, V, p, words):
    problems = tasks.get(task).problems(N, V, **p)
    assert any(words in m for m in problems) and all("\n" not in m for m in problems)
    with pytest.raises(ValueError, match=re.escape(words)):
        _gen(task, N, V, p, n=2)


@pytest.mark.parametrize("task,N,V,p", [
    (SC, 8, 4, {"num_tokens": 3}), (NR, 4, 19, {"noise_vocab_size": 16, "frac_noise": 0.5}),
    (FR, 8, 5, {"key_len": 2, "value_len": 2})])
def test_the_bounds_themselves_are_allowed(task, N, V, p):
    assert tasks.get(task).problems(N, V, **p) == []
    _gen(task, N, V, p, n=3)


def test_chance_levels():
    assert tasks.get(SC).chance(32, 16, num_tokens=2) == pytest.approx(1 / 14)
    # 33 tokens: 0, keys 1..8, values 9..16, noise 17..32
    assert tasks.get(NR).chance(32, 33, noise_vocab_size=16, frac_noise=0.2) == pytest.approx(1 / 8)
    # 16 tokens: 0, keys 1..7, values 8..15: the first value token 1/8, the second 1/7
    assert tasks.get(FR).chance(32, 16, key_len=2, value_len=2) == pytest.approx((1 / 8 + 1 / 7) / 2)


def test_a_model_guessing_uniformly_scores_chance():
    """Chance against the data: the accuracy of the guess the chance level describes."""
    g = torch.Generator().manual_seed(0)
    for task, N, V, p in SETTINGS[:1] + SETTINGS[3:4]:
        _, y = _gen(task, N, V, p, n=4000)
        scored = y[y != IGNORE]
        lo, hi = int(scored.min()), int(scored.max())  # the answer tokens
        guess = torch.randint(lo, hi + 1, scored.shape, generator=g)
        acc = float((guess == scored).float().mean())
        assert acc == pytest.approx(tasks.get(task).chance(N, V, **p), abs=0.02)


def test_the_registry_and_the_matrix_know_the_tasks():
    from harness.train import matrix

    assert {SC, NR, FR} <= set(tasks.names())
    raw = {"variants": ["sdpa"], "groups": [
        {"task": SC, "seq_lens": 32, "vocab_size": 16, "num_tokens": 3},
        {"task": NR, "seq_lens": 32, "vocab_size": 33, "frac_noise": [0.2, 0.4]},
        {"task": FR, "seq_lens": 32, "vocab_size": 16, "key_len": 2, "value_len": 3}]}
    configs = matrix.expand(matrix.normalise(raw))
    got = [(c.task, c.task_param_dict) for c in configs]
    assert got == [(SC, {"num_tokens": 3}),
                   (NR, {"frac_noise": 0.2, "noise_vocab_size": 16}),
                   (NR, {"frac_noise": 0.4, "noise_vocab_size": 16}),
                   (FR, {"key_len": 2, "value_len": 3})]
    with pytest.raises(Exception, match="no non-causal form"):
        matrix.normalise({"task": NR, "causal": False, "vocab_size": 33})


def test_train_task_on_the_command_line_narrows_the_matrix(capsys):
    import argparse

    from harness.cli.train import add_train_args, overrides_from
    from harness.errors import UsageError
    from harness.train import matrix

    p = argparse.ArgumentParser()
    add_train_args(p)
    args = p.parse_args(["--preset", "mad-cpu", "--task", f"{NR},{SC}"])
    _, configs = matrix.load("mad-cpu", overrides_from(args))
    assert configs and {c.task for c in configs} == {NR, SC}
    for bad, words in [("nope", "unknown task 'nope'"), ("mqar,nope", "unknown task")]:
        with pytest.raises(UsageError, match=words):
            matrix.load("mad-cpu", overrides_from(p.parse_args(["--task", bad])))
    with pytest.raises(UsageError, match="not in this matrix"):
        matrix.load("train-quick", overrides_from(p.parse_args(["--task", FR])))


def test_the_mad_preset_trains_every_task_at_its_defaults():
    from harness.train import matrix

    _, configs = matrix.load("mad-cpu")
    assert {c.task for c in configs} >= {"mqar", SC, NR, FR}
    assert all(c.layers == 2 and len(c.lrs) >= 4 and c.threads == 1 for c in configs)
    assert matrix.sweep_workers("mad-cpu") == 2


# -- training -------------------------------------------------------------------------------
QUICK = [(SC, 16, 16, {"num_tokens": 2}),
         (NR, 32, 33, {"noise_vocab_size": 16, "frac_noise": 0.2}),
         (FR, 32, 16, {"key_len": 2, "value_len": 2})]


@pytest.mark.parametrize("task,N,V,p", QUICK)
def test_sdpa_learns_each_task_and_a_blind_window_does_not(task, N, V, p):
    from harness.train.trainer import train

    t0 = time.perf_counter()
    r = train(_config(task, N, V, p, max_steps=800), 3e-3)
    assert r["status"] == "ok" and r["accuracy"] >= 0.95, r["history"]
    assert time.perf_counter() - t0 < 60
    # One layer, a window of 1 (|i - j| <= 1: causal, the query and the one before), after
    # the kernel-3 convolution: position i reads tokens i - 3 .. i. Only answers that close
    # (an earlier copy of the value in the pair just before) are readable, the rest is a
    # guess.
    from harness.train.trainer import datasets

    blind = train(_config(task, N, V, p, variant="sliding_window", vparams={"window": 1},
                          layers=1, max_steps=200), 3e-3)
    *_, (x, y) = datasets(_config(task, N, V, p))
    at = tasks.get(task).answer_at(x, y, **p)
    rows, cols = (at >= 0).nonzero(as_tuple=True)
    near = float((cols - at[rows, cols] <= 3).float().mean())
    chance = tasks.get(task).chance(N, V, **p)
    assert near < 0.4  # noisy recall, 8 keys in 16 slots: a third repeat the slot before
    assert blind["accuracy"] <= near + (1 - near) * chance + 0.05, (blind["accuracy"], near)
    assert blind["accuracy"] < 0.55 < r["accuracy"]
