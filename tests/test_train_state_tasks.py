"""The state tasks (parity, mod_sum, permutations) against plain Python loops over each
sequence, and their records as tasks.Task takes them.

Planted bugs these catch: a label that is the state before its input, or x_t alone, or
the sum without the modulo (the loop); permutations composed in the other order, a
product applied x_t first (the loop, S3 and S5 are not abelian); a position before 4
scored, or position 4 not scored (the scored mask); an unseeded draw (same seed, same
data); an impossible setting generated anyway (the problems); chance of the wrong group
(the records).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from harness.train import state_tasks, tasks, text_windows
from harness.train.state_tasks import IGNORE, mod_sum, parity, permutations

SETTINGS = [(5, 2), (17, 3), (64, 8)]  # (seq_len, vocab_size >= the alphabet)


def _loop_sums(row: list[int], m: int) -> list[int]:
    out, total = [], 0
    for x in row:
        total = (total + x) % m
        out.append(total)
    return out


def _scored_only(states: list[int]) -> list[int]:
    return [IGNORE if t < 4 else s for t, s in enumerate(states)]


@pytest.mark.parametrize("N,V", SETTINGS)
def test_parity_labels_are_the_running_parity_from_position_4(N, V):
    x, y = parity(50, N, V, seed=1)
    assert x.shape == y.shape == (50, N)
    for row, lab in zip(x.tolist(), y.tolist()):
        assert set(row) <= {0, 1}
        assert lab == _scored_only(_loop_sums(row, 2))


@pytest.mark.parametrize("m", [2, 3, 5])
def test_mod_sum_labels_are_the_running_sum_modulo_m(m):
    x, y = mod_sum(50, 23, 8, m, seed=2)
    for row, lab in zip(x.tolist(), y.tolist()):
        assert all(0 <= v < m for v in row)
        assert lab == _scored_only(_loop_sums(row, m))


@pytest.mark.parametrize("group,k", [("S3", 3), ("S5", 5)])
def test_permutation_labels_are_the_running_product_x_t_after_the_rest(group, k):
    elems = list(itertools.permutations(range(k)))  # token i is elems[i]
    x, y = permutations(30, 12, 128, group, seed=3)
    for row, lab in zip(x.tolist(), y.tolist()):
        state = tuple(range(k))  # identity
        states = []
        for tok in row:
            p = elems[tok]
            state = tuple(p[state[i]] for i in range(k))  # apply the earlier product, then p
            states.append(elems.index(state))
        assert lab == _scored_only(states)


def test_the_same_seed_gives_the_same_data_and_another_seed_other_data():
    for gen, args in ((parity, ()), (mod_sum, (3,)), (permutations, ("S3",))):
        a, b, c = (gen(20, 16, 8, *args, seed=s) for s in (7, 7, 8))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0], c[0])


def test_states_are_near_uniform_so_chance_is_one_over_the_group():
    _, y = mod_sum(4000, 8, 8, 3, seed=4)
    share = torch.bincount(y[:, 4:].flatten(), minlength=3).double() / y[:, 4:].numel()
    assert (share - 1 / 3).abs().max() < 0.02


@pytest.mark.parametrize("call,needle", [
    (lambda: state_tasks.mod_sum_problems(16, 8, m=1), "m must be an integer >= 2"),
    (lambda: state_tasks.mod_sum_problems(16, 8, m=2.5), "m must be an integer >= 2"),
    (lambda: state_tasks.mod_sum_problems(16, 4, m=5), "vocab_size=4 is smaller than its 5"),
    (lambda: state_tasks.parity_problems(4, 2), "seq_len=4 leaves no scored position"),
    (lambda: state_tasks.parity_problems(8, 1), "vocab_size=1 is smaller than its 2"),
    (lambda: state_tasks.permutations_problems(16, 64, "S5"), "smaller than its 120"),
    (lambda: state_tasks.permutations_problems(16, 64, "S7"), "group must be one of"),
])
def test_an_impossible_setting_is_a_problem(call, needle):
    problems = call()
    assert problems and needle in problems[0], problems


def test_a_possible_setting_has_no_problem_and_the_generators_refuse_impossible_ones():
    assert state_tasks.parity_problems(5, 2) == []
    assert state_tasks.mod_sum_problems(5, 3, 3) == []
    assert state_tasks.permutations_problems(5, 6, "S3") == []
    with pytest.raises(ValueError, match="scored position"):
        parity(2, 4, 2)
    with pytest.raises(ValueError, match="m must be"):
        mod_sum(2, 8, 8, 1)


def test_the_records_register_as_tasks_and_generate_what_the_generators_do():
    registry: dict[str, tasks.Task] = {}
    records = state_tasks.specs() + [text_windows.lm_spec()]
    state_tasks.register_into(lambda t: registry.setdefault(t.name, t), tasks.Task, records)
    assert list(registry) == ["parity", "mod_sum", "permutations", "lm"]
    chance = {n: registry[n].chance(16, 128, **registry[n].params) for n in registry}
    assert chance == {"parity": 0.5, "mod_sum": 1 / 3, "permutations": 1 / math.factorial(5),
                      "lm": 1 / 256}
    assert state_tasks.specs()[1]["plateau"](16, 8, m=5) == 0.2
    x, y = registry["mod_sum"].generate(10, 16, 8, seed=5, m=4)
    assert torch.equal(x, mod_sum(10, 16, 8, 4, seed=5)[0])
    assert torch.equal(y, mod_sum(10, 16, 8, 4, seed=5)[1])
    x, y = registry["permutations"].generate(10, 16, 8, seed=5, group="S3")
    assert torch.equal(y, permutations(10, 16, 8, "S3", seed=5)[1])
    assert (registry["parity"].answer_at(x, y) == -1).all()
    assert registry["lm"].problems(64, 256, corpus="python-docs") == []
    assert "vocab_size must be 256" in registry["lm"].problems(64, 128)[0]
