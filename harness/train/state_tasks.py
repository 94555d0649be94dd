"""State tracking tasks: running parity, running sum modulo m, and the word problem of S_k.

Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues"
(https://arxiv.org/abs/2411.12537): a diagonal decay with positive entries cannot track
parity, a delta rule whose transition has eigenvalues in (-1, 1] can. Merrill et al. 2024,
"The Illusion of State in State-Space Models" (https://arxiv.org/abs/2404.08819): the word
problem of S5 (not solvable) needs depth growing with the length in such models; S3's
(solvable) does not.

Each generator: (num_examples, seq_len, vocab_size, its parameter, *, seed) -> (inputs,
labels), LongTensors (num_examples, seq_len), the same for the same arguments. The input at
t is a group element x_t drawn uniformly; the label at t is the state after it, the
product x_t ... x_1 x_0 (parity and mod_sum: the sum of x_0 .. x_t modulo m), scored at
every t >= SCORED_FROM (five elements or more: beyond the model's kernel-3 convolution),
-100 before. The state is uniform at every t and independent of any proper subset of the
inputs, so a model that tracks nothing scores 1 / |group| however much it reads: chance
and plateau are both that. Tokens are the elements' indices, from 0 (no filler).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

IGNORE = -100
SCORED_FROM = 4  # the first scored position: its state sums five inputs, the convolution sees 3
GROUPS = {"S3": 3, "S4": 4, "S5": 5}  # the symmetric groups `permutations` knows, by degree


def _common_problems(task: str, seq_len: int, vocab_size: int, alphabet: int) -> list[str]:
    out = []
    if seq_len < SCORED_FROM + 1:
        out.append(f"{task}: seq_len={seq_len} leaves no scored position (scored from "
                   f"position {SCORED_FROM}: seq_len >= {SCORED_FROM + 1})")
    if vocab_size < alphabet:
        out.append(f"{task}: vocab_size={vocab_size} is smaller than its {alphabet} symbols "
                   f"(vocab_size >= {alphabet})")
    return out


def _scored(states: torch.Tensor) -> torch.Tensor:
    labels = states.clone()
    labels[:, :SCORED_FROM] = IGNORE
    return labels


# -- parity and mod_sum ------------------------------------------------------------------------
def mod_sum_problems(seq_len: int, vocab_size: int, m: int = 3) -> list[str]:
    if not isinstance(m, int) or isinstance(m, bool) or m < 2:
        return [f"mod_sum: m must be an integer >= 2, got {m!r}"]
    return _common_problems("mod_sum", seq_len, vocab_size, m)


def mod_sum(num_examples: int, seq_len: int, vocab_size: int, m: int = 3, *,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs uniform over [0, m); the label at t >= 4 is (x_0 + ... + x_t) mod m."""
    problems = mod_sum_problems(seq_len, vocab_size, m)
    if problems:
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, m, (num_examples, seq_len), generator=g)
    return inputs, _scored(inputs.cumsum(dim=1) % m)


def parity_problems(seq_len: int, vocab_size: int) -> list[str]:
    return _common_problems("parity", seq_len, vocab_size, 2)


def parity(num_examples: int, seq_len: int, vocab_size: int, *,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits uniform over {0, 1}; the label at t >= 4 is the parity of x_0 .. x_t."""
    problems = parity_problems(seq_len, vocab_size)
    if problems:
        raise ValueError("; ".join(problems))
    return mod_sum(num_examples, seq_len, vocab_size, 2, seed=seed)


# -- the word problem of S_k ----------------------------------------------------------------
def elements(group: str) -> list[tuple[int, ...]]:
    """The group's elements as permutations of range(k) (p maps i to p[i]), in the order of
    itertools.permutations: element i is token i, the identity token 0."""
    return list(itertools.permutations(range(GROUPS[group])))


def composition(group: str) -> torch.Tensor:
    """(k!, k!) table: [a, b] = the token of a after b, i -> a[b[i]]."""
    elems = elements(group)
    index = {p: i for i, p in enumerate(elems)}
    return torch.tensor([[index[tuple(a[i] for i in b)] for b in elems] for a in elems])


def permutations_problems(seq_len: int, vocab_size: int, group: str = "S5") -> list[str]:
    if group not in GROUPS:
        return [f"permutations: group must be one of {', '.join(GROUPS)}, got {group!r}"]
    return _common_problems("permutations", seq_len, vocab_size,
                            math.factorial(GROUPS[group]))


def permutations(num_examples: int, seq_len: int, vocab_size: int, group: str = "S5", *,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs uniform over the group's elements; the label at t >= 4 is the product
    x_t ... x_1 x_0 (x_0 applied first): state_t = x_t after state_{t-1}."""
    problems = permutations_problems(seq_len, vocab_size, group)
    if problems:
        raise ValueError("; ".join(problems))
    table = composition(group)
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, len(table), (num_examples, seq_len), generator=g)
    states = torch.empty_like(inputs)
    states[:, 0] = inputs[:, 0]
    for t in range(1, seq_len):
        states[:, t] = table[inputs[:, t], states[:, t - 1]]
    return inputs, _scored(states)


# -- chance, plateau, and the records tasks.register takes -------------------------------------
def group_size(task: str, **params) -> int:
    if task == "parity":
        return 2
    if task == "mod_sum":
        return params.get("m", 3)
    return math.factorial(GROUPS[params.get("group", "S5")])


def no_answer_position(inputs: torch.Tensor, labels: torch.Tensor, **_) -> torch.Tensor:
    """-1 everywhere: a state depends on every earlier input, no single position holds it."""
    return torch.full_like(inputs, -1)


def specs() -> list[dict]:
    """The three tasks as tasks.Task's keyword arguments, with `metric` and `plateau` (the
    fields issue 49 adds) beside them: `register_into` passes those Task declares."""
    out = []
    for name, summary, paper, params, generate, problems in (
            ("parity", "running parity of a bit string, scored from position 4",
             "https://arxiv.org/abs/2411.12537", {}, parity, parity_problems),
            ("mod_sum", "running sum modulo m of digits in [0, m), scored from position 4",
             "https://arxiv.org/abs/2411.12537", {"m": 3}, mod_sum, mod_sum_problems),
            ("permutations", "the word problem of S3 or S5: the running product of "
             "permutations, scored from position 4", "https://arxiv.org/abs/2404.08819",
             {"group": "S5"}, permutations, permutations_problems)):
        def chance(seq_len, vocab_size, _task=name, **p):
            return 1.0 / group_size(_task, **p)
        out.append(dict(
            name=name, summary=summary, paper=paper, params=params,
            generate=lambda n, seq_len, vocab_size, *, seed=0, _gen=generate, **p: _gen(
                n, seq_len, vocab_size, seed=seed, **p),
            problems=problems, chance=chance, plateau=chance, answer_at=no_answer_position,
            non_causal_ok=True,  # a label is a state, never an input token
            metric="accuracy"))
    return out


def register_into(register, task_class, records: list[dict]) -> None:
    """register(task_class(**record)) for each record, with the fields task_class declares;
    a record's `plateau` goes to its `declared_plateau` (tasks.Task's `plateau` is the
    method that reads it)."""
    fields = {f.name for f in dataclasses.fields(task_class)}
    for record in records:
        record = dict(record)
        if "plateau" in record and "declared_plateau" in fields:
            record["declared_plateau"] = record.pop("plateau")
        register(task_class(**{k: v for k, v in record.items() if k in fields}))
