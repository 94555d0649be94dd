"""The predicted cost of a training configuration, in seconds: `train --dry-run` prints the
sum, train_meta.json records it beside the wall time, shards balance on it.

Steps x the cost of a step. Steps: what the protocol runs when no run stops early and the
race cuts nothing (harness.train.race's worst case: every rate, and on the first seed one
beyond the grid's edge, to max_steps), the plan's ceiling, times the share of them that
committed reference runs of the variant trained (harness.train.stops: runs that reach
early_stop or settle take less). A step's cost is measured at plan time (`probe`):
PROBE_WARMUP then PROBE_STEPS training steps of the configuration's own model, batch and
threads, their median, in a training worker process (`probe_all`: a variant that crashes or
hangs costs its probe, not the plan; its step then falls back to the FLOP model): the
recurrences' chunk machinery and the routed variants' gathers cost what they cost here, not
what their FLOPs say (a FLOP model under-predicted their steps 1.2-2.5x). Each held-out
evaluation costs a forward over the held-out set, a third of a step per batch; each
configuration WORKER_S to start its process and data. Declared skips cost nothing.

`wall_seconds` puts a plan on the sweep's workers as the sweep gives them its cells.
`reference_steps` prices a preset's steps at those of its committed reference run, as the
preset test plans it; tools/plan_train_presets.py prints each preset's estimate and
ceiling so (the figures docs/training.md quotes).

`flop_step_seconds` is the FLOP model (analytic forward FLOPs x 3 at EFFICIENCY of a matmul
rate, plus STEP_OVERHEAD_S): shards balance on it, where no probe is run.
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import json
import queue
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from harness.measure import layers
from harness.measure.estimate import GPU_ASSUMED_GFLOPS
from harness.measure.rows import NO_CUDA
from harness.train.matrix import TrainConfig

EFFICIENCY = 0.25  # the share of the matmul rate a tiny model's step reaches (measured here)
STEP_OVERHEAD_S = 0.002
WORKER_S = 3.0  # start a worker process, import torch, generate the data
PROBE_WARMUP, PROBE_STEPS = 2, 3
PROBE_TIMEOUT_S = 60.0  # at most, per probe (or the configuration's timeout_s)
EVAL_STEP_SHARE = 1 / 3  # a forward of one batch against a training step (forward, backward)


def forward_flops(config: TrainConfig, module, batch: int) -> float:
    """Analytic FLOPs of one forward of `batch` examples (2 per multiply-add)."""
    d, N, L = config.d_model, config.seq_len, config.layers
    tokens = batch * N
    per_token = 8 * d * d + 2 * 3 * d + (16 * d * d if config.mlp else 0)  # qkv+out, conv, mlp
    # per layer: a layer pattern's module counts its layers, repeated to L
    attention = module.flops(batch, config.heads, N, config.head_dim, config.causal) \
        / len(layers.of(module))
    scored = batch * config.task_param_dict.get("num_kv_pairs", N)  # the head's rows
    return L * (tokens * per_token + attention) + scored * 2 * d * config.vocab_size


def flop_step_seconds(config: TrainConfig, module, rate_flops_per_s: float) -> float:
    """The FLOP model of one training step (forward and backward, 3 forwards)."""
    rate = GPU_ASSUMED_GFLOPS * 1e9 if config.device == "cuda" else rate_flops_per_s
    return 3 * forward_flops(config, module, config.batch) / (rate * EFFICIENCY) \
        + STEP_OVERHEAD_S


def planned_steps(config: TrainConfig) -> int:
    """Training steps of this configuration's row when no run stops early and the race
    cuts nothing (every rate on MQAR's plateau, or tied: harness.train.race's worst
    case): every rate to max_steps, and on the first seed one rate beyond the grid's edge
    (a grid of two or more); a later seed races the rates the first ran to their end, at
    most the grid."""
    rates = len(config.lrs) + (config.first_seed and len(config.lrs) > 1)
    return rates * config.max_steps


def config_seconds(config: TrainConfig, step_s: float, share: float = 1.0) -> float:
    """Predicted wall time of a configuration's row at `step_s` a training step, training
    `share` of its planned steps (1: the plan, no run stopping early; harness.train.stops
    gives the share reference runs trained)."""
    steps = share * planned_steps(config)
    evals = -(-steps // config.eval_every)
    per_eval = -(-config.validation_examples // config.batch) * EVAL_STEP_SHARE * step_s
    return WORKER_S + steps * step_s + evals * per_eval


_PROBED: dict[tuple, float] = {}


def probe(config: TrainConfig) -> float:
    """Seconds of one training step of the configuration, measured now: PROBE_WARMUP, then
    PROBE_STEPS steps at its first rate, median; on its threads, on a small training set
    of its task (a step's cost does not depend on the data). Cached per model and batch
    (seeds and budgets share it)."""
    from harness.train.trainer import Run

    key = probe_key(config)
    if key not in _PROBED:
        n = PROBE_WARMUP + PROBE_STEPS + 1  # the last step (an evaluation) is not run
        small = dataclasses.replace(config, train_examples=n * config.batch,
                                    test_examples=config.batch, val_examples=0, max_steps=n,
                                    eval_every=n, seed=config.seeds[0])
        threads = torch.get_num_threads()
        try:
            run = Run(small, config.lrs[0], check_causal=False)  # the steps alone
            run.advance(n - 1)  # no evaluation: it is at step n
        finally:
            torch.set_num_threads(threads)
        _PROBED[key] = statistics.median(run.step_s[PROBE_WARMUP:])
    return _PROBED[key]


def probe_key(config: TrainConfig) -> tuple:
    """What a step's cost depends on: the model, its batch, device and threads."""
    return (config.task, config.task_params, config.variant, config.params, config.seq_len,
            config.vocab_size, config.causal, config.d_model, config.layers, config.heads,
            config.mlp, config.output_layer, config.batch, config.device, config.threads)


def probe_all(configs: list[TrainConfig], log_path: Path, workers: int = 1
              ) -> dict[tuple, float | None]:
    """probe_key -> a step's seconds (None where the probe failed: the variant raised,
    crashed its process or hung past PROBE_TIMEOUT_S), each probe a request to a training
    worker process (harness.train.worker), `workers` of them at once."""
    from harness.measure.processes import Worker

    todo = list({probe_key(c): c for c in configs if c.device != "cuda"}.values())
    out: dict[tuple, float | None] = {}
    idle: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(max(1, min(workers, len(todo)))):
        idle.put(None)

    def one(c: TrainConfig) -> None:
        w = idle.get()
        try:
            if w is None or not w.alive():
                w = Worker("probe", log_path, c.threads, module="harness.train.worker")
            limit = min(PROBE_TIMEOUT_S, c.timeout_s)
            got = w.call({"probe": c.to_json()}, f"probe {c.label()}", limit, limit)
            out[probe_key(c)] = got.get("step_s") if got["status"] == "ok" else None
            if not w.alive():
                w.close()
                w = None
        finally:
            idle.put(w)

    try:
        with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            list(pool.map(one, todo))
    finally:
        while not idle.empty():
            w = idle.get()
            if w is not None:
                w.close()
    return out


def plan_seconds(configs: list[TrainConfig], step_seconds: Callable, skip_reasons,
                 share: Callable[[TrainConfig], float] | None = None
                 ) -> list[tuple[TrainConfig, float, list[str]]]:
    """(config, predicted seconds, declared skips) per configuration, as `--dry-run` sums
    them: a configuration declared unsupported costs nothing (CUDA missing here aside, so a
    GPU preset is planned on a CPU machine, at the FLOP model's assumed GPU rate).
    `step_seconds(config, module)` is a step's cost (`probe`, or a model of it);
    `skip_reasons(config, module)` the runner's; `share(config)` the share of its planned
    steps a configuration is expected to train (harness.train.stops.share; None: all of
    them, the plan's ceiling)."""
    out = []
    for c in configs:
        module = layers.build(c)
        why = [r for r in skip_reasons(c, module) if r != NO_CUDA]
        if why:
            out.append((c, 0.0, why))
            continue
        step = flop_step_seconds(c, module, 0.0) if c.device == "cuda" \
            else step_seconds(c, module)
        out.append((c, config_seconds(c, step, 1.0 if share is None else share(c)), why))
    return out


def wall_seconds(costs: list[tuple[TrainConfig, float, list[str]]], workers: int) -> float:
    """The wall time of a plan (`plan_seconds`'s list) on `workers` workers as the sweep
    runs it (harness.train.runner.sweep): cells in the matrix's order, a cell's seeds one
    after another on one worker, each cell on the first worker free. More than the sum over
    the workers where the last cells are long: the others wait idle for them."""
    cells: dict[str, float] = {}
    for c, seconds, _ in costs:
        cells[c.cell_id] = cells.get(c.cell_id, 0.0) + seconds
    free = [0.0] * max(1, workers)
    for seconds in cells.values():
        heapq.heappush(free, heapq.heappop(free) + seconds)
    return max(free)


def reference_steps(folder) -> Callable:
    """step_seconds(config, module) from a committed reference run's train.csv (its quiet
    run, two one-thread workers): the configuration's own model's step, else the same
    model at another size, else (a model or setting the run did not train) the slowest step
    the run took at the same length and depth; per batch of the configuration's."""
    steps = {}
    with open(Path(folder) / "train.csv") as f:
        for r in csv.DictReader(f):
            if r["step_ms"]:
                key = (r["task"], r["task_params"], r["variant"],
                       json.dumps(json.loads(r["params"]), sort_keys=True), int(r["seq_len"]),
                       int(r["heads"]), int(r["layers"]), int(r["d_model"]))
                steps[key] = float(r["step_ms"]) / 1e3 * 64 / int(r["batch"])  # per 64

    def step(c: TrainConfig, module) -> float:
        key = (c.task, c.task_params, c.variant, c.params, c.seq_len, c.heads, c.layers,
               c.d_model)
        same = [k for k in steps if k[:3] == key[:3] and k[4:] == key[4:]]
        alike = [k for k in steps if k[0] == key[0] and k[4] == key[4] and k[6:] == key[6:]]
        seconds = steps[key] if key in steps else \
            steps[max(same)] if same else max(steps[k] for k in alike)
        return seconds * c.batch / 64
    return step

