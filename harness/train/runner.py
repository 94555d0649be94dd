"""Runs a training matrix: per configuration, the learning-rate sweep in a worker process,
then one row in train.csv.

The runner knows no variant by name: the registry builds each configuration's variant, whose
declared reasons (non-causal only, a length it cannot take, no CUDA here) make the row
`skipped` with them. Each learning rate is one request to a `python -m
harness.train.worker` process (harness.measure.processes.Worker), killed after the
configuration's `timeout_s`; a worker that times out, dies (a crash, the kernel's OOM
killer) or runs out of memory is replaced before the next run. With `workers` > 1, that
many cells train at once, each in its own worker process.

A cell is a configuration over its seeds (`seed = [0, 1]`: one row per seed). On its first
seed the rates are raced (harness.train.race: rungs that cut only a rate clearly behind,
each rate's run continued in the worker, the race over at the first run that reaches
`early_stop`); every later seed races the rates the first seed's race ran to their end. A
row reports the run of the best validation accuracy over the rates tried, its test
accuracy (Zoology's report: the best over a sweep of learning rates), with what tells a
fair sweep from an unfinished one: every rate of the sweep (`lrs`), whether the winning run
had settled (`settled`, `steps_run`), was still rising at its end, and whether its rate is
at an end of the sweep (`lr_at_edge`).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from harness.measure import busy, layers
from harness.measure.processes import Worker
from harness.measure.rows import STATUSES
from harness.measure.store import environment, now
from harness.train import lm, race
from harness.train.trainer import target_score
from harness.train.matrix import TrainConfig
from harness.train.rows import (  # noqa: F401  (callers read them here)
    combine, config_row, lr_at_edge, reach, skip_reasons, state_elements)
from harness.train.store import TrainStore
from harness.train.worker import checkpoint_path

WORKER = "harness.train.worker"
BUSY_EVERY_S = 120.0  # seconds between samples of other work while a sweep trains
BUSY_EVERY_ENV = "ATTNBENCH_TRAIN_BUSY_EVERY_S"
BUSY_WINDOW_S = 5.0   # seconds each of those samples reads (see BusyWatch)
CHECKPOINTS = "checkpoints"  # a run folder's winning runs' states before their decay


class Sweeper:
    """The worker process a cell's runs go to, replaced when it dies or is killed."""

    def __init__(self, log_path: Path, checkpoints: Path | None = None):
        self.log_path, self.worker, self.checkpoints = log_path, None, checkpoints

    def run(self, config: TrainConfig, lr: float, until: int | None = None,
            extend: Path | None = None) -> tuple[dict, float]:
        """The run of (config, lr) advanced to step `until` (its end without it); with
        `extend`, continued from that checkpoint under config's cap."""
        if self.worker is None or not self.worker.alive():
            self.worker = Worker("train", self.log_path, config.threads, module=WORKER)
        start = time.monotonic()
        request = {"config": config.to_json(), "lr": lr}
        if until is not None:
            request["until"] = until
        if self.checkpoints is not None:
            request["checkpoints"] = str(self.checkpoints)
        if extend is not None:
            request["extend"] = str(extend)
        got = self.worker.call(request, f"train {config.config_id} {config.label()} lr={lr:g}"
                               f"{f' to step {until}' if until is not None else ''}",
                               config.timeout_s, config.timeout_s)
        if got["status"] == "oom" or not self.worker.alive():  # a fresh heap next time
            self.close()
        return got, time.monotonic() - start

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def race_rates(config: TrainConfig, sweeper: Sweeper, bar=None, lrs=None) -> list[tuple]:
    """The race of the configuration's rates (`lrs`: these instead, a later seed's, without
    a rate beyond the grid's edge): [(lr, last result, wall seconds)]."""
    wall: dict[float, float] = {}

    def advance(lr: float, until: int) -> dict:
        if bar is not None:
            bar.set_postfix_str(f"{config.label()} seed={config.seed} lr={lr:g} "
                                f"to {until}", refresh=True)
        got, seconds = sweeper.run(config, lr, until)
        wall[lr] = wall.get(lr, 0.0) + seconds
        return got

    done = race.race(config.lrs if lrs is None else lrs, advance, first=config.first_budget,
                     cap=config.max_steps, early_stop=target_score(config), edge=lrs is None)
    return [(lr, r, wall[lr]) for lr, r in done]


def cells(configs: list[TrainConfig]) -> list[list[TrainConfig]]:
    """The configurations grouped by cell, in the matrix's order, first seed first."""
    out: dict[str, list[TrainConfig]] = {}
    for c in configs:
        out.setdefault(c.cell_id, []).append(c)
    return [sorted(g, key=lambda c: c.seeds.index(c.seed)) for g in out.values()]


def train_cell(cell: list[TrainConfig], sweeper: Sweeper, done: dict[str, dict | None],
               bar=None):
    """Rows of a cell's configurations not in `done` (config_id -> its row, None when the
    row is done but not at hand), yielded as each finishes: declared skips, else the race
    on the first seed and one run per later seed at the rate it picked."""
    first = cell[0]
    module = layers.build(first)
    reasons = skip_reasons(first, module)
    chosen = None
    for config in cell:
        if config.config_id in done and not config.first_seed:
            continue
        row = config_row(config, module)
        if reasons:
            if config.config_id not in done:
                yield {**row, "status": "skipped", "reason": "; ".join(reasons)}
            continue
        if config.first_seed:
            got = done.get(first.config_id)
            if got is None:  # not done, or done elsewhere: the race (deterministic) again
                got = {**row, **combine(config, race_rates(config, sweeper, bar))}
                prune(sweeper, config, got)
                if config.config_id not in done:
                    yield got
            chosen = got
            continue
        if chosen.get("status") != "ok":
            yield {**row, "status": chosen["status"],
                   "reason": f"seed {first.seed} trained no rate: {chosen.get('reason', '')}"}
            continue
        got = {**row, **combine(config, race_rates(config, sweeper, bar, survivors(chosen)))}
        prune(sweeper, config, got)
        yield got


def prune(sweeper, config: TrainConfig, row: dict) -> None:
    """Of a row's runs' checkpoints, keep the winning rate's (`train --extend-to`)."""
    folder = getattr(sweeper, "checkpoints", None)
    if folder is None:
        return
    for run in row.get("curves") or []:
        if run["lr"] != row.get("best_lr"):
            checkpoint_path(folder, config, run["lr"]).unlink(missing_ok=True)


def survivors(row: dict) -> list[float]:
    """The rates a cell's first seed ran to their end (its race's survivors, in the order
    run), from its row's `curves`; its best rate alone where the row has none."""
    out = [float(r["lr"]) for r in row.get("curves") or []
           if r["status"] == "ok" and r.get("stopped") is not None]
    return out or [float(row["best_lr"])]


def train_config(config: TrainConfig, sweeper: Sweeper, bar=None) -> dict:
    """The row of one configuration trained alone (its cell's first seed)."""
    return next(train_cell([config], sweeper, {}, bar))


def sweep(configs: list[TrainConfig], store: TrainStore, done: set[str], log_path: Path,
          bar=None, workers: int = 1) -> Counter:
    """Append one row per configuration not in `done`; counts rows by status.

    `workers` cells train at once, each in a worker process of its own (two one-thread
    workers use both cores of a 2-core machine); rows are appended as they finish, in the
    matrix's order when workers = 1. Shared by the serial run (below) and each shard of a
    sharded one (harness.cluster).
    """
    todo = [g for g in cells(configs) if any(c.config_id not in done for c in g)]
    rows = {r["config_id"]: r for r in store.rows()} if todo else {}
    runs = store.curves() if todo else {}
    for i, r in rows.items():  # a resumed first seed's survivors: its curves
        r["curves"] = runs.get(i, {}).get("runs")
    known = {i: rows.get(i) for i in done}
    store.open()
    counts, lock = Counter(), threading.Lock()
    idle = queue.SimpleQueue()
    sweepers = [Sweeper(log_path, store.folder / CHECKPOINTS)
                for _ in range(max(1, min(workers, len(todo))))]
    for s in sweepers:
        idle.put(s)

    def one(cell: list[TrainConfig]) -> None:
        sweeper = idle.get()
        try:
            for row in train_cell(cell, sweeper, known, bar):
                with lock:
                    store.append(row)
                    counts[row["status"]] += 1
                    if bar is not None:
                        bar.update(1)
        finally:
            idle.put(sweeper)

    try:
        if len(sweepers) == 1:
            for cell in todo:
                one(cell)
        else:
            with ThreadPoolExecutor(len(sweepers)) as pool:
                for _ in pool.map(one, todo):  # re-raises a failure of the harness itself
                    pass
    finally:
        for s in sweepers:
            s.close()
        store.close()
    return counts


def run(matrix: dict, configs: list[TrainConfig], store: TrainStore, *, resume: bool,
        workers: int = 1, estimate_s: float | None = None,
        ceiling_s: float | None = None) -> Counter:
    """Train every configuration not yet in the store (`workers` at once); returns the rows
    written by status. `estimate_s` (the plan's, harness.train.estimate) and `ceiling_s`
    (the plan's if no run stopped early) are recorded in the session beside its wall
    time."""
    done = store.done_ids() if resume else set()
    meta = store.read_meta() if resume else {}
    threads = configs[0].threads if configs else 1
    meta.update(environment(threads))
    load = meta["load_average_start"][0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load} on {os.cpu_count()} cores: other work slows "
              "this sweep and distorts its times (accuracy does not depend on it)",
              file=sys.stderr)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None})
    meta.update({"matrix": matrix, "configs": len(configs), "ended": None})
    corpora = lm.describe(configs)  # each lm corpus's splits: documents, bytes, sha256
    if corpora:
        meta["corpora"] = corpora
    meta["sessions"][-1]["workers"] = workers
    if estimate_s is not None:
        meta["sessions"][-1]["estimate_s"] = round(estimate_s, 1)
    if ceiling_s is not None:
        meta["sessions"][-1]["ceiling_s"] = round(ceiling_s, 1)
    store.write_meta(meta)
    began = time.monotonic()
    bar = tqdm(total=len(configs), initial=sum(c.config_id in done for c in configs),
               unit="config", file=sys.stderr, dynamic_ncols=True)
    watch = BusyWatch(meta.setdefault("busy", []))
    watch.start()
    try:
        return sweep(configs, store, done, store.folder / "train_worker.log", bar, workers)
    finally:
        watch.stop()
        bar.close()
        meta["sessions"][-1]["ended"] = meta["ended"] = now()
        meta["sessions"][-1]["wall_s"] = round(time.monotonic() - began, 1)
        meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        store.write_meta(meta)


class BusyWatch(threading.Thread):
    """Other work on the cores while the sweep trains (harness.measure.busy, this process
    tree's own time taken away): a sample at the start and every `every_s` seconds, kept
    in train_meta.json's `busy` (step_ms and the estimate's check against the wall time
    are worth what these say); a sample that warns is also printed.

    Each sample reads BUSY_WINDOW_S seconds (or $ATTNBENCH_BUSY_WINDOW_S), not the
    benchmark run's one: with both cores busy training, a 1 s window's reading moves by
    the kernel's tick accounting alone (measured here, two spinning processes of the tree
    and nothing else: 0.00-0.05 other cores over 1 s, 0.00-0.01 over 5 s), which is the
    size of the 0.05 that a quiet reference run is held to."""

    def __init__(self, samples: list, every_s: float | None = None):
        super().__init__(daemon=True)
        self.samples, self.halt = samples, threading.Event()
        self.every_s = float(os.environ.get(BUSY_EVERY_ENV, BUSY_EVERY_S)) \
            if every_s is None else every_s
        self.window_s = float(os.environ.get(busy.WINDOW_ENV, BUSY_WINDOW_S))

    def run(self) -> None:
        while True:
            s = busy.sample(self.window_s, root=os.getpid())
            self.samples.append(s)
            if (line := busy.warning(s, " while training")) is not None:
                print(line, file=sys.stderr)
            if self.halt.wait(self.every_s):
                return

    def stop(self) -> None:
        self.halt.set()
        self.join()


def summary_line(n: int, counts: Counter, earlier: int, folder: Path) -> str:
    """The last line of a sweep: rows written by status, configurations done earlier."""
    summary = ", ".join(f"{s} {counts[s]}" for s in STATUSES)
    return (f"{n} configurations: {summary}"
            f"{f' ({earlier} done earlier)' if earlier else ''} -> {folder}")
