"""Synthetic recall tasks: the generators and a small registry of them, as variants have one.

A task turns (num_examples, seq_len, vocab_size, seed, its own parameters) into
`(inputs, labels)`, LongTensors of shape (num_examples, seq_len): `labels` is -100 (ignored
by the loss and the accuracy) except at the positions the model is scored on. A task
states whether a non-causal mixer may be trained on it (no label can be read from the
positions after it) and what is wrong with a setting before anything is generated.

    mqar               multi-query associative recall (Zoology, Arora et al. 2023)
    selective_copying  copy the tokens scattered among blanks (MAD, Poli et al. 2024)
    noisy_recall       in-context recall with noise tokens between the pairs (MAD)
    fuzzy_recall       in-context recall of multi-token values by multi-token keys (MAD)

MAD's generators live in mad_tasks.py. Adding a task: a generator, a `problems` check and
one `register(Task(...))` line here. `split` draws a configuration's training, validation
and test sets, disjoint.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from harness.train import mad_tasks

IGNORE = -100  # the label of a position that is not scored (torch's cross_entropy default)
# A task's metric -> its sign: +1 higher is better, -1 lower is better. The trainer, the race
# and the rows compare runs by the metric's `score`, sign x value (higher is better).
METRICS = {"accuracy": 1, "bits_per_byte": -1}


def score(metric: str, value: float) -> float:
    """A metric's value as a score, higher is better (bits per byte: its negative)."""
    return METRICS[metric] * value


def metric_of(task: str) -> str:
    return get(task).metric


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
    # (inputs, labels, **params) -> for each scored position, the position where its answer
    # was written (MQAR: the value after the first occurrence of the queried key); -1 elsewhere
    answer_at: Callable[..., torch.Tensor]
    non_causal_ok: bool  # True: no answer is in the input after its scored position
    # (seq_len, vocab_size, **params) -> the accuracy of a model that has learned the format
    # and guesses among the context's candidates (harness.train.outcome); None: chance
    in_context_guess: Callable[..., float] | None = None
    # What the race, the early stop, the settling rule and the outcome read: `accuracy`
    # (higher is better) or `bits_per_byte` (lower is better; the `lm` task), METRICS.
    metric: str = "accuracy"
    # (seq_len, vocab_size, **params) -> the plateau, where a task declares it itself (the
    # state tasks: chance); None: max(chance, in_context_guess). A bits_per_byte task's
    # plateau is its data's (the train unigram's bits per byte, trainer.Run), not this.
    declared_plateau: Callable[..., float] | None = None

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"task {self.name!r}: metric must be one of "
                             f"{', '.join(METRICS)}, got {self.metric!r}")

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric] > 0

    def plateau(self, seq_len: int, vocab_size: int, **params) -> float:
        """The accuracy a run sits at before it has learned the task: max(chance, the
        in-context guess), or the task's declared plateau."""
        if self.declared_plateau is not None:
            return self.declared_plateau(seq_len, vocab_size, **params)
        low = self.chance(seq_len, vocab_size, **params)
        if self.in_context_guess is None:
            return low
        return max(low, self.in_context_guess(seq_len, vocab_size, **params))


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


REDRAWS = 20  # held-out redraws before a setting is declared too small to split
# torch's CPU generator keeps a seed's low 32 bits only (seeds 7 and 7 + 2^32 draw the
# same numbers): redraws and the validation set's stream step the seed in those bits.
REDRAW_STEP = 0x9E3779B1  # odd: r x it differs mod 2^32 for every r < 2^32
VAL_STREAM = 0x2545F491  # the validation set's seeds: 2 seed + 1 + VAL_STREAM (+ redraws)

Set = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels)


def split(name: str, train_examples: int, test_examples: int, *, seed: int, seq_len: int,
          vocab_size: int, test_seed: int | None = None, val_examples: int | None = None,
          **params) -> tuple[Set, Set, Set]:
    """A configuration's (train, validation, test) sets, each (inputs, labels), disjoint.

    The training set is drawn with seed 2 seed; the test set with 2 seed + 1, an example
    whose inputs equal a training example's dropped and the set topped up from further
    draws (seeds 2 seed + 1 + REDRAW_STEP r, r = 1, 2, ...); the validation set
    (`val_examples`, default test_examples) likewise from 2 seed + 1 + VAL_STREAM,
    avoiding both. The same
    arguments give the same sets. With another `test_seed` (a cell's later seeds), the
    validation and test sets are exactly those `seed=test_seed` gives, and the training
    set of `seed` drops the examples that are in them instead, topped up from further
    draws (2 seed + REDRAW_STEP r): every seed is validated and tested on the same sets.
    ValueError when REDRAWS draws do not give enough: the setting has too few distinct
    examples.
    """
    task = get(name)
    val_examples = test_examples if val_examples is None else val_examples
    common = dict(seq_len=seq_len, vocab_size=vocab_size, **params)
    if test_seed is not None and test_seed != seed:
        _, val, test = split(name, train_examples, test_examples, seed=test_seed,
                             val_examples=val_examples, **common)
        held = {tuple(r) for r in val[0].tolist()} | {tuple(r) for r in test[0].tolist()}
        train = _draw_avoiding(task, train_examples, 2 * seed, held, common)
        if train is None:
            raise ValueError(f"{name}: {REDRAWS + 1} draws of {train_examples} training "
                             f"examples for seed {seed} did not avoid the held-out sets")
        return train, val, test
    train = task.generate(train_examples, seed=2 * seed, **common)
    seen = {tuple(r) for r in train[0].tolist()}
    test = _draw_avoiding(task, test_examples, 2 * seed + 1, seen, common)
    if test is not None:
        seen |= {tuple(r) for r in test[0].tolist()}
        val = _draw_avoiding(task, val_examples, 2 * seed + 1 + VAL_STREAM, seen, common)
    if test is None or val is None:
        raise ValueError(f"{name}: {REDRAWS + 1} draws of {test_examples} test and "
                         f"{val_examples} validation examples gave too few not among the "
                         f"{train_examples} training examples: the setting has too few "
                         "distinct examples")
    return train, val, test


def _draw_avoiding(task, n: int, seed: int, seen: set, common: dict):
    """n examples from draws with seeds seed + REDRAW_STEP r (r = 0, 1, ...), in order,
    those whose inputs are in `seen` or in an earlier draw dropped; None when REDRAWS
    further draws do not give n."""
    xs, ys, have = [], [], 0
    seen = set(seen)
    for r in range(REDRAWS + 1):
        x, y = task.generate(n, seed=seed + REDRAW_STEP * r, **common)
        rows = [tuple(row) for row in x.tolist()]
        keep = torch.tensor([row not in seen for row in rows], dtype=torch.bool)
        seen.update(rows)
        xs.append(x[keep][:n - have])
        ys.append(y[keep][:n - have])
        have += len(xs[-1])
        if have == n:
            return torch.cat(xs), torch.cat(ys)
    return None


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


def mqar_answer_at(inputs: torch.Tensor, labels: torch.Tensor, **_) -> torch.Tensor:
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


def mqar_guess(seq_len: int, vocab_size: int, num_kv_pairs: int, **_) -> float:
    """A guess among the example's num_kv_pairs values, all in its context: 1 / pairs."""
    return 1.0 / num_kv_pairs


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
    in_context_guess=mqar_guess,
))


# -- MAD's tasks (mad_tasks.py) --------------------------------------------------------------
MAD = "https://arxiv.org/abs/2403.17844"

register(Task(
    name="selective_copying",
    summary="selective copying: tokens scattered among blanks, copied in order after a separator",
    paper=MAD,
    params={"num_tokens": 2},
    generate=lambda num_examples, seq_len, vocab_size, *, seed=0, **p:
        mad_tasks.selective_copying(num_examples, seq_len, vocab_size, seed=seed, **p),
    problems=mad_tasks.selective_copying_problems,
    chance=mad_tasks.selective_copying_chance,
    answer_at=lambda inputs, labels, **_: mad_tasks.selective_copying_answer_at(inputs, labels),
    non_causal_ok=True,  # outputs are blanks: the copied tokens are all before them
    in_context_guess=mad_tasks.selective_copying_guess,
))

register(Task(
    name="noisy_recall",
    summary="in-context recall, pairs repeated, noise tokens in slots between them",
    paper=MAD,
    params={"noise_vocab_size": 16, "frac_noise": 0.2},
    generate=lambda num_examples, seq_len, vocab_size, *, seed=0, **p:
        mad_tasks.noisy_recall(num_examples, seq_len, vocab_size, seed=seed, **p),
    problems=mad_tasks.noisy_recall_problems,
    chance=mad_tasks.noisy_recall_chance,
    answer_at=lambda inputs, labels, **_: mad_tasks.recall_answer_at(inputs, labels, 1),
    non_causal_ok=False,  # every value, a scored one too, follows its key in the input
    in_context_guess=mad_tasks.noisy_recall_guess,
))

register(Task(
    name="fuzzy_recall",
    summary="in-context recall of value spans by key spans (several tokens each)",
    paper=MAD,
    params={"key_len": 2, "value_len": 2},
    generate=lambda num_examples, seq_len, vocab_size, *, seed=0, **p:
        mad_tasks.fuzzy_recall(num_examples, seq_len, vocab_size, seed=seed, **p),
    problems=mad_tasks.fuzzy_recall_problems,
    chance=mad_tasks.fuzzy_recall_chance,
    answer_at=lambda inputs, labels, key_len=2, **_: mad_tasks.recall_answer_at(
        inputs, labels, key_len),
    non_causal_ok=False,  # the value span follows its key span, the scored ones too
    in_context_guess=mad_tasks.fuzzy_recall_guess,
))



# -- language modelling and state tracking (text_windows.py, state_tasks.py) -----------------
def _register_more() -> None:
    from harness.train import state_tasks, text_windows

    state_tasks.register_into(register, Task, [*state_tasks.specs(), text_windows.lm_spec()])


_register_more()
