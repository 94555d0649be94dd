"""Synthetic recall tasks: the generators and a small registry of them, as variants have one.

A task turns (num_examples, seq_len, vocab_size, seed, its own parameters) into
`(inputs, labels)`, LongTensors of shape (num_examples, seq_len): `labels` is -100 (ignored
by the loss and the accuracy) except at the positions the model is scored on. A task
states whether a non-causal mixer may be trained on it (no label can be read from the
positions after it) and what is wrong with a setting before anything is generated.

    mqar   multi-query associative recall (Zoology, Arora et al. 2023)

Adding a task: a generator, a `problems` check and one `register(Task(...))` line here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

IGNORE = -100  # the label of a position that is not scored (torch's cross_entropy default)


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task: its generator, its parameters with defaults, its checks."""
    name: str
    summary: str
    paper: str
    params: dict  # parameter -> default (besides seq_len, vocab_size)
    # (num_examples, seq_len, vocab_size, **params, seed=...) -> (inputs, labels)
    generate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (seq_len, vocab_size, **params) -> what is wrong with this setting (empty: nothing)
    problems: Callable[..., list[str]]
    # (seq_len, vocab_size, **params) -> the accuracy of a model that reads nothing
    chance: Callable[..., float]
    # (inputs, labels) -> for each scored position, the position where its answer was
    # written (MQAR: the value after the first occurrence of the queried key); -1 elsewhere
    answer_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    non_causal_ok: bool  # True: no answer is in the input after its scored position


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def names() -> list[str]:
    return list(_TASKS)


def get(name: str) -> Task:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(_TASKS)}")
    return _TASKS[name]


# -- MQAR ------------------------------------------------------------------------------------
def mqar_problems(seq_len: int, vocab_size: int, num_kv_pairs: int, power_a: float = 0.01,
                  random_non_queries: bool = False) -> list[str]:
    """What makes an MQAR setting impossible (empty when it can be generated)."""
    out = []
    if num_kv_pairs < 1:
        out.append(f"mqar: num_kv_pairs must be >= 1, got {num_kv_pairs}")
        return out
    if 4 * num_kv_pairs > seq_len:  # 2 P tokens of pairs, then P query slots 2 apart
        out.append(f"mqar: {num_kv_pairs} pairs do not fit in seq_len={seq_len} (the pairs "
                   f"take 2 x pairs tokens and their queries another 2 x pairs: "
                   f"seq_len >= {4 * num_kv_pairs})")
    half = vocab_size // 2
    if half - 1 < num_kv_pairs or vocab_size - half < num_kv_pairs:
        out.append(f"mqar: vocab_size={vocab_size} is too small for {num_kv_pairs} distinct "
                   f"keys in [1, {half}) and values in [{half}, {vocab_size}): vocab_size >= "
                   f"{2 * num_kv_pairs + 2}")  # which leaves a filler token for random_non_queries
    if not (isinstance(power_a, (int, float)) and 0 < power_a <= 1):
        out.append(f"mqar: power_a must be in (0, 1], got {power_a!r}")
    return out


def _distinct(g: torch.Generator, n: int, k: int, low: int, high: int) -> torch.Tensor:
    """(n, k) integers from [low, high), distinct within each row, uniformly drawn."""
    out = torch.empty(n, k, dtype=torch.long)
    chunk = max(1, (1 << 22) // max(high - low, 1))  # ~16 MiB of random numbers at a time
    for s in range(0, n, chunk):
        r = torch.rand(min(chunk, n - s), high - low, generator=g)
        out[s:s + chunk] = r.topk(k, dim=1).indices + low  # the k largest: a uniform k-subset
    return out


def mqar(num_examples: int, seq_len: int, vocab_size: int, num_kv_pairs: int, *,
         power_a: float = 0.01, random_non_queries: bool = False,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query associative recall, Zoology's MQAR: (inputs, labels), each (n, seq_len).

    Arora, Eyuboglu et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
    Language Models" (https://arxiv.org/abs/2312.04927), Sec. 3, and its generator
    `multiquery_ar` (https://github.com/HazyResearch/zoology, zoology/data/multiquery_ar.py),
    whose semantics this follows (the code is our own):

    - P = num_kv_pairs keys, distinct, from [1, vocab_size // 2); P values, distinct, from
      [vocab_size // 2, vocab_size); laid out `k1 v1 k2 v2 ...` from position 0.
    - Each key is queried once after the pairs: query slot g (0 <= g < (seq_len - 2P) // 2)
      sits at position 2P + 2g, the P slots drawn without replacement with probability
      proportional to power_a * (g + 1) ** (power_a - 1) (a power law: near slots likely).
    - `labels` is -100 everywhere but at a query, where it is the queried key's value: the
      model predicts the value while reading its key (Zoology's shifted next token).
    - Every other position holds the filler token 0; with random_non_queries, a token drawn
      uniformly from those that are neither 0 nor a key or value of that example. (Zoology
      draws from the whole vocabulary; excluding the example's values keeps the rule below,
      excluding its keys keeps every occurrence of a key after the pairs a scored query.)
    - So no value is in the input after its query (nor anywhere after the pairs): a
      non-causal mixer can be trained on it without reading the answer.

    The same arguments give the same tensors (a torch.Generator seeded with `seed`).
    ValueError when the setting cannot be generated (mqar_problems).
    """
    problems = mqar_problems(seq_len, vocab_size, num_kv_pairs, power_a, random_non_queries)
    if problems:
        raise ValueError("; ".join(problems))
    g = torch.Generator().manual_seed(seed)
    n, P, half = num_examples, num_kv_pairs, vocab_size // 2
    keys = _distinct(g, n, P, 1, half)  # (n, P)
    values = _distinct(g, n, P, half, vocab_size)  # (n, P)
    slots = (seq_len - 2 * P) // 2
    weight = power_a * torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial(weight.expand(n, slots).contiguous(), P, replacement=False,
                             generator=g)  # (n, P): the query slot of key i
    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    inputs[:, 0:2 * P:2] = keys
    inputs[:, 1:2 * P:2] = values
    where = 2 * P + 2 * gaps  # (n, P) query positions
    inputs.scatter_(1, where, keys)
    labels.scatter_(1, where, values)
    if random_non_queries:
        filler = inputs == 0
        filler[:, :2 * P] = False
        # Uniform over [1, vocab) minus the example's 2P pair tokens: draw an index among the
        # allowed tokens, then step it past each excluded token at or below it, in order.
        t = torch.randint(0, vocab_size - 1 - 2 * P, (n, seq_len), generator=g) + 1
        excluded = torch.cat([keys, values], dim=1).sort(dim=1).values  # (n, 2P) ascending
        for j in range(2 * P):
            t += (t >= excluded[:, j:j + 1]).long()
        inputs = torch.where(filler, t, inputs)
    return inputs, labels


def mqar_answer_at(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(n, N): at each query, the position of its key's value in the pairs; -1 elsewhere."""
    scored = labels != IGNORE
    first = torch.full_like(inputs, -1)
    for e in range(len(inputs)):  # first occurrence of each token, then that position + 1
        row, seen = inputs[e].tolist(), {}
        for i, tok in enumerate(row):
            seen.setdefault(tok, i)
        first[e] = torch.tensor([seen[t] + 1 for t in row])
    return torch.where(scored, first, torch.full_like(first, -1))


def mqar_chance(seq_len: int, vocab_size: int, num_kv_pairs: int, **_) -> float:
    """Accuracy of a model that reads nothing but the query's own position: the best it can
    do is a uniform guess among the vocab_size - vocab_size // 2 values."""
    return 1.0 / (vocab_size - vocab_size // 2)


register(Task(
    name="mqar",
    summary="multi-query associative recall: P key-value pairs, then each key queried once",
    paper="https://arxiv.org/abs/2312.04927",
    params={"num_kv_pairs": 8, "power_a": 0.01, "random_non_queries": False},
    generate=lambda num_examples, seq_len, vocab_size, *, seed=0, **p: mqar(
        num_examples, seq_len, vocab_size, seed=seed, **p),
    problems=mqar_problems,
    chance=mqar_chance,
    answer_at=mqar_answer_at,
    non_causal_ok=True,
))
