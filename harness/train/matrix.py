"""The training matrix: a TOML table (a preset in harness/presets/train-*.toml or a file)
expanded by product into configurations, every one checked before anything runs.

The layout of the benchmark matrix (harness.measure.matrix): top-level keys are the
defaults, optional `[[groups]]` tables override some of them, each group expands by
product, and the union (first occurrence of each configuration wins) is the run.

    task = "mqar"               # harness.train.tasks.names(); a list expands
    variants = ["sdpa", "linear"]   # as in the benchmark matrix: "all", a list, or a table
    params = {sliding_window = [{window = 8}, {window = 32}]}
    seq_lens = [64, 128]        # each key below takes a value or a list (product) ...
    vocab_size = 64
    causal = [true, false]
    num_kv_pairs = 8            # ... and so do the task's own parameters (mqar: num_kv_pairs,
    power_a = 0.01              #     power_a, random_non_queries)
    d_model = 64
    layers = 1
    heads = 1
    mlp = false
    lrs = [1e-3, 3e-3]          # the sweep inside each configuration (not a product axis)
    batch = 64                  # training examples per step
    max_steps = 1000            # the step budget of one learning rate
    warmup = 150                # steps of linear warm-up, then the full rate, then 1 - sqrt
                                #   decay over the last 20% of max_steps (harness.train.
                                #   schedule); a float in [0, 1]: that share of max_steps
                                #   warms up, then cosine to 0 (earlier folders' matrices)
    weight_decay = 0.1          # AdamW's
    eval_every = 50             # steps between held-out evaluations
    early_stop = 0.99           # held-out accuracy that ends a run (and the race); on a
                                #   bits_per_byte task (lm) the bits per byte at or below
                                #   which it ends, 0 for none (harness.train.lm)
    settle_window = 1000        # a run has settled: no gain above settle_margin over its last
    settle_margin = 0.02        #   settle_window steps, after at least 2 x settle_window
    race_steps = 0              # the race's first budget per rate (0: max_steps / 8)
    train_examples = 20000      # the training set (seed), drawn in shuffled epochs
    test_examples = 500         # the test set: the reported accuracy, scored once at the
                                #   kept checkpoint (the first seed's, for every seed)
    val_examples = 0            # the validation set: picks the rate, stops the run; 0: as
                                #   test_examples (disjoint from test and training sets)
    seed = 0                    # or a list: one row per seed (initialisation, batch order,
                                #   training set); the race of rates runs on the first
    device = "cpu"              # or "cuda"
    threads = 0                 # torch threads in the worker; 0: all cores
    timeout_s = 300             # per learning rate, wall clock; the worker is killed after it
    mem_limit_mib = 0           # worker address-space cap above its baseline; 0: MemAvailable*0.9
    output_layer = "paper"      # after each mixer, its paper's norm and gate (harness.train.
                                #   output_layer); "none": the bare block, as before
    workers = 1                 # top level only: configurations trained at once (serial run)

A top-level `modules = [...]` imports variant modules first, as in the benchmark matrix.
`workers` and an `[executor]` table (harness.cluster.executors) say how to run it, not what
is run: a sweep resumed with other values is the same sweep.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import os

from harness.errors import UsageError
from harness.measure import stack
from harness.measure.matrix import narrow_variants, read_toml, resolve_variants
from harness.train import tasks
from harness.train.output_layer import OUTPUT_LAYERS

# key -> (default, kind). "list:" keys take a value or a list and are product axes.
_KEYS: dict[str, tuple[object, str]] = {
    "task": (["mqar"], "list:str"), "variants": (["sdpa"], "variants"), "params": ({}, "params"),
    "seq_lens": ([64], "list:int"), "vocab_size": ([64], "list:int"),
    "causal": ([True], "list:bool"), "d_model": ([64], "list:int"), "layers": ([1], "list:int"),
    "heads": ([1], "list:int"), "mlp": ([False], "list:bool"), "lrs": ([3e-3], "floats"),
    "batch": (64, "int"), "max_steps": (1000, "int"), "warmup": (150, "warmup"),
    "weight_decay": (0.1, "float"), "eval_every": (50, "int"), "early_stop": (0.99, "fraction"),
    "settle_window": (1000, "int"), "settle_margin": (0.02, "fraction"),
    "race_steps": (0, "int0"),
    "train_examples": (20000, "int"), "test_examples": (500, "int"), "val_examples": (0, "int0"),
    "seed": ([0], "seeds"),
    "device": ("cpu", "device"), "threads": (0, "int0"), "timeout_s": (300.0, "float"),
    "mem_limit_mib": (0, "int0"), "output_layer": ("paper", "output_layer"),
}
DEVICES = ("cpu", "cuda")
_BENCHMARK_ONLY = {"passes", "inputs", "dtypes", "devices", "head_dim", "min_run_time_s"}
# Fields that make a configuration: its id is their hash. Run settings (threads, the time
# limit, the memory cap) are not in it, so runs on different machines compare row by row.
KEY_FIELDS = ("task", "task_params", "variant", "params", "seq_len", "vocab_size", "causal",
              "d_model", "layers", "heads", "mlp", "lrs", "batch", "max_steps", "warmup",
              "weight_decay", "eval_every", "early_stop", "train_examples", "test_examples",
              "seed", "device", "seeds", "settle_window", "settle_margin", "race_steps")
# A cell: the configuration but for its seed (the report's median and range are over it).
CELL_FIELDS = tuple(f for f in KEY_FIELDS if f != "seed")
# Key fields added later, hashed only away from the value earlier sweeps trained with, so
# that their configurations keep their ids: field -> that value (0 is always that value).
# output_layer: the earlier folders trained the bare block ("none"), so today's default
# ("paper") gets an id of its own and resuming an old folder never counts a bare-block row
# as a run of the papers' layers.
LATER_KEY_FIELDS = {"val_examples": lambda c: c.test_examples,
                    "output_layer": lambda c: "none"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    task: str
    task_params: str  # JSON, sorted keys, every task parameter with its default filled in
    variant: str
    params: str  # JSON, sorted keys, the variant's full parameters
    seq_len: int
    vocab_size: int
    causal: bool
    d_model: int
    layers: int
    heads: int
    mlp: bool
    lrs: tuple[float, ...]
    batch: int
    max_steps: int
    warmup: float | int  # an int: steps, warmup-stable-decay; a float: the older fraction
    weight_decay: float
    eval_every: int
    early_stop: float
    train_examples: int
    test_examples: int
    seed: int
    device: str
    threads: int
    timeout_s: float
    mem_limit_mib: int
    seeds: tuple[int, ...] = ()  # every seed of the cell, the first the race's; () = (seed,)
    settle_window: int = 1000
    settle_margin: float = 0.02
    race_steps: int = 0
    val_examples: int = 0  # 0: as test_examples
    output_layer: str = "paper"

    def __post_init__(self):
        if not self.seeds:
            object.__setattr__(self, "seeds", (self.seed,))

    @property
    def config_id(self) -> str:
        return self._hash(KEY_FIELDS)

    @property
    def cell_id(self) -> str:
        """The id of the configuration's cell: every seed of it shares it."""
        return self._hash(CELL_FIELDS)

    def _hash(self, fields) -> str:
        key = {f: getattr(self, f) for f in fields}
        key.update({f: getattr(self, f) for f, default in LATER_KEY_FIELDS.items()
                    if getattr(self, f) not in (0, default(self))})
        return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def validation_examples(self) -> int:
        """The validation set's size: val_examples, else test_examples."""
        return self.val_examples or self.test_examples

    @property
    def first_seed(self) -> bool:
        """Whether this is the cell's first seed, the one whose race picks the rate."""
        return self.seed == self.seeds[0]

    @property
    def first_budget(self) -> int:
        """The race's first budget per rate, in steps: race_steps, else max_steps / 8,
        rounded up to a held-out evaluation."""
        steps = self.race_steps or max(1, self.max_steps // 8)
        return min(self.max_steps, -(-steps // self.eval_every) * self.eval_every)

    @property
    def param_dict(self) -> dict:
        return json.loads(self.params)

    @property
    def task_param_dict(self) -> dict:
        return json.loads(self.task_params)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def label(self) -> str:
        """`variant(params) task N=.. V=.. P=.. causal d=.. L=..` (the progress bar, logs)."""
        p = ",".join(f"{k}={v}" for k, v in self.param_dict.items())
        pairs = self.task_param_dict.get("num_kv_pairs")
        return (f"{self.variant}({p}) {self.task} N={self.seq_len} V={self.vocab_size}"
                f"{f' P={pairs}' if pairs is not None else ''} "
                f"{'causal' if self.causal else 'non-causal'} d={self.d_model} L={self.layers}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TrainConfig":
        return cls(**{"output_layer": "none", **d, "lrs": tuple(d["lrs"]),  # none: stored
                      "seeds": tuple(d.get("seeds") or ())})               # before the key


def _task_keys(task_names) -> dict[str, object]:
    """The task parameters allowed in a group: those of every task it names."""
    out: dict[str, object] = {}
    for t in task_names:
        if t in tasks.names():
            out.update(tasks.get(t).params)
    return out


def _check(table: dict, where: str, errors: list[str], task_keys: dict) -> dict:
    out = {}
    for key, value in table.items():
        if key in task_keys:  # a task parameter: a value or a list, typed like its default
            value = value if isinstance(value, list) else [value]
            typ = type(task_keys[key])
            ok = bool(value) and all(
                isinstance(v, typ) and not (typ is not bool and isinstance(v, bool))
                or (typ is float and isinstance(v, int) and not isinstance(v, bool))
                for v in value)
            if not ok:
                errors.append(f"{where}: {key!r} must be a {typ.__name__} or a non-empty list "
                              f"of them, got {value!r}")
                continue
            out[key] = [float(v) if typ is float else v for v in value]
            continue
        if key not in _KEYS:
            allowed = ", ".join([*_KEYS, *task_keys, "groups"])
            errors.append(f"{where}: unknown key {key!r}; allowed: {allowed}")
            continue
        kind = _KEYS[key][1]
        if kind.startswith("list:"):
            typ = {"int": int, "str": str, "bool": bool}[kind[5:]]
            value = value if isinstance(value, list) else [value]
            bad = [v for v in value if not isinstance(v, typ) or (typ is int and isinstance(v, bool))]
            if bad or not value or (typ is int and any(v < 1 for v in value)):
                errors.append(f"{where}: {key!r} must be a {'positive ' * (typ is int)}"
                              f"{kind[5:]} or a non-empty list of them, got {value!r}")
                continue
        elif kind == "floats":
            value = value if isinstance(value, list) else [value]
            if not value or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                    and v > 0 for v in value):
                errors.append(f"{where}: {key!r} must be a non-empty list of positive numbers, "
                              f"got {value!r}")
                continue
            value = [float(v) for v in value]
        elif kind == "seeds":
            value = value if isinstance(value, list) else [value]
            if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                    for v in value) or len(set(value)) < len(value):
                errors.append(f"{where}: 'seed' must be a non-negative integer or a list of "
                              f"distinct ones, got {value!r}")
                continue
        elif kind in ("int", "int0"):
            if not isinstance(value, int) or isinstance(value, bool) or value < (kind == "int"):
                errors.append(f"{where}: {key!r} must be a {'positive' if kind == 'int' else 'non-negative'} "
                              f"integer, got {value!r}")
                continue
        elif kind == "warmup":  # steps (an integer), or an earlier matrix's fraction
            if isinstance(value, bool) or not (
                    isinstance(value, int) and value >= 0
                    or isinstance(value, float) and 0 <= value <= 1):
                errors.append(f"{where}: 'warmup' must be a whole number of steps (>= 0) or "
                              f"a fraction of max_steps in [0.0, 1.0], got {value!r}")
                continue
        elif kind in ("float", "fraction"):
            num = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not num or value < 0 or (kind == "fraction" and value > 1):
                errors.append(f"{where}: {key!r} must be a number in "
                              f"{'[0, 1]' if kind == 'fraction' else '[0, inf)'}, got {value!r}")
                continue
            value = float(value)
        elif kind == "device" and value not in DEVICES:
            errors.append(f"{where}: device must be one of {', '.join(DEVICES)}, got {value!r}")
            continue
        elif kind == "output_layer" and value not in OUTPUT_LAYERS:
            errors.append(f"{where}: output_layer must be one of {', '.join(OUTPUT_LAYERS)}, "
                          f"got {value!r}")
            continue
        elif kind == "params" and not isinstance(value, dict):
            errors.append(f"{where}: 'params' must be a table name -> list of settings")
            continue
        out[key] = value
    return out


def normalise(raw: dict, overrides: dict | None = None) -> dict:
    """Check every key of a raw training matrix; return {"groups": [full group, ...]}.

    Every problem is collected and raised together as one UsageError ("; "-joined).
    `overrides` (the command line) replace keys in every group; "variants" and "task" there
narrow (keep only the named ones; a group left with no task is dropped).
    """
    errors: list[str] = []
    raw = copy.deepcopy(raw)
    groups_raw = raw.pop("groups", None)
    if groups_raw is not None and not (isinstance(groups_raw, list)
                                       and all(isinstance(g, dict) for g in groups_raw)):
        errors.append("'groups' must be an array of tables ([[groups]])")
        groups_raw = None
    overrides = dict(overrides or {})
    narrow = overrides.pop("variants", None)
    narrow_tasks = overrides.pop("task", None)  # --task: keep the groups' tasks named there
    full = []
    for i, g in enumerate(groups_raw or [{}]):
        where = f"groups[{i}]" if groups_raw else "top level"
        if "groups" in g:
            errors.append(f"{where}: groups do not nest")
            g = {k: v for k, v in g.items() if k != "groups"}
        names = g.get("task", raw.get("task", _KEYS["task"][0]))
        names = names if isinstance(names, list) else [names]
        for t in names:
            if isinstance(t, str) and t not in tasks.names():
                errors.append(f"{where}: unknown task {t!r}; tasks: {', '.join(tasks.names())}")
        task_keys = _task_keys(n for n in names if isinstance(n, str))
        merged = {**{k: d for k, (d, _) in _KEYS.items()},
                  **{k: [d] for k, d in task_keys.items()},
                  **_check(raw, "top level", errors, task_keys),
                  **_check(g, where, errors, task_keys),
                  **_check(overrides, "command line", errors, task_keys)}
        merged["variants"] = resolve_variants(merged["variants"], merged["params"], where, errors)
        merged["task_keys"] = sorted(task_keys)
        full.append(merged)
    if narrow is not None:
        narrow_variants(full, narrow, errors)
    for g in full:  # kept until here: a pattern named by --variants takes its mixers' settings
        g.pop("params")
    if narrow_tasks is not None:
        full = _narrow_tasks(full, narrow_tasks, errors)
    if not errors:
        expand({"groups": full}, errors)  # settings the tasks or the model cannot take
    if errors:  # a top-level key is checked once per group: each problem once
        raise UsageError("; ".join(dict.fromkeys(errors)))
    return {"groups": full}


def _narrow_tasks(groups: list[dict], wanted: list[str], errors: list[str]) -> list[dict]:
    """The groups narrowed to the tasks in `wanted` (--task), those left with none dropped;
    a task that is not registered, or not in the matrix, is an error."""
    present = {t for g in groups for t in g["task"]}
    for t in wanted:
        if t not in tasks.names():
            errors.append(f"unknown task {t!r}; tasks: {', '.join(tasks.names())}")
        elif t not in present:
            errors.append(f"task {t!r} is not in this matrix (it trains "
                          f"{', '.join(sorted(present))})")
    out = []
    for g in groups:
        g["task"] = [t for t in g["task"] if t in wanted]
        if g["task"]:
            out.append(g)
    return out


def expand(matrix: dict, errors: list[str] | None = None) -> list[TrainConfig]:
    """Every configuration of a normalised matrix, deduplicated, in the matrix's order.

    With `errors`, impossible settings (a task's problems, d_model not a multiple of heads)
    are appended there; without, they raise UsageError.
    """
    collect = [] if errors is None else errors
    out: dict[str, TrainConfig] = {}
    for g in matrix["groups"]:
        settings = [(n, p) for n, ps in g["variants"].items() for p in ps]
        task_keys = g["task_keys"]
        axes = [g["task"], sorted(g["seq_lens"]), *(g[k] for k in task_keys), g["vocab_size"],
                g["causal"], g["d_model"], g["layers"], g["heads"], g["mlp"]]
        for task, N, *rest in itertools.product(*axes):
            tvals, (V, causal, d, L, H, mlp) = rest[:len(task_keys)], rest[len(task_keys):]
            spec = tasks.get(task)
            tparams = {**spec.params, **{k: v for k, v in zip(task_keys, tvals)
                                         if k in spec.params}}
            problems = spec.problems(N, V, **tparams)
            if d % H:
                problems.append(f"d_model={d} is not a multiple of heads={H}")
            if not causal and not spec.non_causal_ok:
                problems.append(f"task {task} has no non-causal form (an answer is in the "
                                "input after its query)")
            if problems:
                collect.extend(problems)
                continue
            for (name, params), seed in itertools.product(settings, g["seed"]):
                if stack.is_pattern(name) and L % len(stack.parse(name)):
                    collect.append(f"layer pattern {name!r} has {len(stack.parse(name))} "
                                   f"layers, which does not divide layers = {L}")
                    continue
                c = TrainConfig(task, json.dumps(tparams, sort_keys=True), name, params, N, V,
                                causal, d, L, H, mlp, tuple(g["lrs"]), g["batch"],
                                g["max_steps"], g["warmup"], g["weight_decay"], g["eval_every"],
                                g["early_stop"], g["train_examples"], g["test_examples"],
                                seed, g["device"], g["threads"] or os.cpu_count() or 1,
                                float(g["timeout_s"]), g["mem_limit_mib"], tuple(g["seed"]),
                                g["settle_window"], g["settle_margin"], g["race_steps"],
                                val_examples=g.get("val_examples", 0),
                                # a matrix stored before the key trained the bare block
                                output_layer=g.get("output_layer", "none"))
                out.setdefault(c.config_id, c)
    if errors is None and collect:
        raise UsageError("; ".join(dict.fromkeys(collect)))
    return list(out.values())


def sweep_workers(source: str) -> int:
    """The TOML's top-level `workers` (configurations trained at once; default 1)."""
    value = read_toml(source).get("workers", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"'workers' must be a positive integer, got {value!r}")
    return value


def load(source: str, overrides: dict | None = None) -> tuple[dict, list[TrainConfig]]:
    """Read, check and expand a train preset or TOML file: (normalised matrix, configs)."""
    raw = read_toml(source)
    raw.pop("executor", None)  # how to run it (harness.cluster.executors), not what is run
    raw.pop("modules", None)  # variant modules to import (harness.cli.modules), loaded before
    raw.pop("workers", None)  # how many at once (sweep_workers), likewise
    if _BENCHMARK_ONLY & set(raw):  # a preset of `run` handed to `train`: say so, in short
        raise UsageError(f"{source} is a benchmark matrix (for `attnbench run`); `train` "
                         "takes a training matrix: train-quick, train-cpu, mad-cpu, "
                         "hybrid-cpu, lm-cpu, state-cpu, train-gpu or a file like them")
    matrix = normalise(raw, overrides)
    configs = expand(matrix)
    from harness.train import lm  # its corpora read and split now: a bad one is exit 2 here

    lm.check_plan(configs)
    return matrix, configs
