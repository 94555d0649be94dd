"""A training sweep over shards (`train --executor local|slurm --shards N`): the unfinished
configurations split into submitit jobs, their rows merged into train.csv exactly as a
serial sweep writes it.

The executor settings, the submission, the job-state queries and the end-of-job signal
handling are harness.cluster.executors'; the cost-balanced split is harness.cluster.shards'
(each configuration a unit of its own). Files inside the run folder, beside a benchmark
run's shard files:

    shards/train-<i>.csv      rows of shard i (train.csv's columns), written by its job
    shards/train-<i>.json     where shard i ran: host, job id, devices, load (its job)
    shards/train-<i>.log      its training workers' stderr
    shards/train-jobs.json    every job submitted for this sweep (the submitting process)

Running the same command again resumes: jobs of this sweep still pending or running are
waited for, not resubmitted; every configuration neither finished (a complete row in
train.csv or a shard file) nor held by such a job is submitted again. Unlike a benchmark
run, a job that ended early is not retried within the same command: the command says so
and the same command again submits what is left.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shutil
import socket
import sys
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from harness.cluster import executors as ex
from harness.cluster import shards
from harness.errors import UsageError
from harness.files import TRAIN_COLUMNS, TRAIN_CSV, write_json
from harness.measure.store import environment, matmul_fp32_gflops, now
from harness.train import estimate, runner
from harness.train.matrix import TrainConfig
from harness.train.store import TrainStore

JOBS = "train-jobs.json"
_CSV = re.compile(r"train-(\d+)\.csv$")


def shard_csv(folder: Path, index: int) -> Path:
    return Path(folder) / shards.SHARDS / f"train-{index}.csv"


def shard_indices(folder: Path) -> list[int]:
    d = Path(folder) / shards.SHARDS
    found = [_CSV.search(p.name) for p in d.glob("train-*.csv")] if d.is_dir() else []
    return sorted(int(m.group(1)) for m in found if m)


def finished_rows(folder: Path) -> dict[str, dict]:
    """config id -> its row, over train.csv then every shard file (the first row wins)."""
    rows: dict[str, dict] = {}
    for path in [Path(folder) / TRAIN_CSV] + [shard_csv(folder, i) for i in shard_indices(folder)]:
        for row in shards.read_rows(path):
            rows.setdefault(row["config_id"], row)
    return rows


def merge(folder: Path, configs: list[TrainConfig]) -> int:
    """Rewrite train.csv with every finished configuration once, in the matrix's order
    (a temporary file, then a rename); returns the count."""
    rows = finished_rows(folder)
    order = {c.config_id: i for i, c in enumerate(configs)}
    ids = sorted(rows, key=lambda k: (order.get(k, len(order)), k))
    path = Path(folder) / TRAIN_CSV
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TRAIN_COLUMNS, extrasaction="raise")
        w.writeheader()
        for k in ids:
            w.writerow({c: rows[k].get(c, "") for c in TRAIN_COLUMNS})
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(ids)


def read_jobs(folder: Path) -> list[dict]:
    path = Path(folder) / shards.SHARDS / JOBS
    return json.loads(path.read_text()) if path.exists() else []


def write_jobs(folder: Path, jobs: list[dict]) -> None:
    write_json(Path(folder) / shards.SHARDS / JOBS, jobs)


# -- the job ---------------------------------------------------------------------------------
class TrainShardStore(ex.StopOnSignals, TrainStore):
    """A shard's train file that takes no row once the scheduler ends the job."""


def run_shard(folder: str, index: int, configs: list[TrainConfig], executor: str) -> dict:
    """Train one shard's configurations into shards/train-<index>.csv (inside the job);
    configurations already in that file (an earlier attempt, before a requeue) are skipped."""
    from harness.measure.worker import import_extra

    import_extra()  # variants registered outside the package (ATTNBENCH_EXTRA_MODULES)
    folder = Path(folder)
    store = TrainShardStore(folder, csv_path=shard_csv(folder, index))
    store.stop_on_signals()
    done = store.done_ids()
    record_path = Path(folder) / shards.SHARDS / f"train-{index}.json"
    env = environment(configs[0].threads if configs else 1)
    record = {"shard": index, "executor": executor, "job_id": ex._job_id(),
              "host": socket.gethostname(),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "configs": len(configs), "started": now(), "ended": None, "counts": None,
              **{k: env[k] for k in ("cpu_model", "cpu_count", "threads", "cuda_devices",
                                     "load_average_start")}}
    write_json(record_path, record)
    counts = runner.sweep(configs, store, done, folder / shards.SHARDS / f"train-{index}.log")
    record.update(ended=now(), counts=dict(counts),
                  load_average_end=[round(x, 2) for x in os.getloadavg()])
    write_json(record_path, record)
    return dict(counts)


class TrainShardJob:
    """One shard as a submitit callable, checkpointable as harness.cluster.executors.ShardJob
    is: on preemption or a time limit it is resubmitted and resumes from its own file."""

    def __init__(self, folder: str, index: int, configs: list[TrainConfig], executor: str):
        self.args = (folder, index, configs, executor)

    def __call__(self) -> dict:
        return run_shard(*self.args)

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(self)


# -- submitting, watching, merging -----------------------------------------------------------
def merge_before_serial(store: TrainStore, configs: list[TrainConfig]) -> None:
    """Before a serial session of a sweep that had shards: fold their rows into train.csv
    (so the serial sweep skips them); refuse while a job of the sweep still runs."""
    jobs = read_jobs(store.folder)
    if not jobs and not shard_indices(store.folder):
        return
    running = ex.alive(jobs)
    if running:
        raise UsageError(f"job(s) {', '.join(sorted(running))} of this sweep still run; wait "
                         "for them (rerun with their executor) or cancel them first")
    merge(store.folder, configs)


def _submit(settings: ex.Settings, folder: Path, parts: list[list[TrainConfig]], first: int,
            created: bool) -> list[dict]:
    """Submit the parts; a submission the scheduler refuses is a UsageError (and a run
    folder this call created is removed again)."""
    from submitit.core.utils import FailedJobError

    indices = list(range(first, first + len(parts)))
    fns = [TrainShardJob(str(folder), i, part, settings.kind) for i, part in zip(indices, parts)]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's stderr too
            jobs = ex.submit_jobs(settings, folder, fns)
    except FailedJobError as e:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        lines = [ln for ln in (str(e) or said.getvalue()).splitlines() if ln.strip()]
        raise UsageError(f"the scheduler refused the jobs: {lines[-1] if lines else e!r}") from None
    return [{"shard": i, "job_id": str(j.job_id), "executor": settings.kind,
             "configs": [c.config_id for c in part]} for i, j, part in zip(indices, jobs, parts)]


def run(matrix: dict, configs: list[TrainConfig], store: TrainStore, resume: bool,
        settings: ex.Settings, rerun: str) -> int | Path:
    """Submit, wait (unless settings.no_wait), merge. Returns the run folder when every
    configuration has a row (the command then writes the report), else the exit status."""
    import variants

    folder = store.folder
    created = not folder.exists()
    jobs = read_jobs(folder)
    running = ex.alive(jobs)  # before anything is written: squeue may be missing
    held = {cid for j in jobs if j["job_id"] in running for cid in j["configs"]}
    finished_before = set(finished_rows(folder))
    todo = [c for c in configs if c.config_id not in finished_before | held]
    meta = store.read_meta() if resume else {}
    meta.update(environment(configs[0].threads))
    # the split weighs configurations against each other: a rate measured once per sweep
    meta.setdefault("plan_matmul_fp32_gflops", matmul_fp32_gflops(configs[0].threads, n=1024))
    new: list[dict] = []
    if todo:
        rate = meta["plan_matmul_fp32_gflops"] * 1e9
        costs = [(c, estimate.config_seconds(c, variants.build(c.variant, **c.param_dict), rate))
                 for c in todo]
        parts = shards.split(costs, settings.shards, unit=lambda c: c.config_id)
        first = max(shard_indices(folder) + [j["shard"] for j in jobs], default=-1) + 1
        new = _submit(settings, folder, parts, first, created)
        write_jobs(folder, jobs + new)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None,
                                            "executor": settings.kind, "shards": settings.shards})
    meta.update({"matrix": matrix, "configs": len(configs), "ended": None})
    store.write_meta(meta)
    watch = [j for j in jobs if j["job_id"] in running] + new
    for j in watch:
        print(f"{'submitted' if j in new else 'waiting for'} shard {j['shard']}: "
              f"{j['executor']} job {j['job_id']}, {len(j['configs'])} configurations",
              file=sys.stderr)
    if settings.no_wait:
        print(f"{len(new)} job(s) submitted ({', '.join(j['job_id'] for j in new) or 'none'}). "
              f"To wait for them, merge and report, run:\n  {rerun}")
        _close(store, meta)
        return 0
    _watch(watch, configs, folder)
    merge(folder, configs)
    rows = finished_rows(folder)
    meta["shards"] = [json.loads(p.read_text()) for p in
                      sorted((folder / shards.SHARDS).glob("train-*.json")) if p.name != JOBS]
    _close(store, meta)
    ids = [c.config_id for c in configs]
    counts = Counter(rows[k]["status"] for k in ids if k in rows and k not in finished_before)
    print(runner.summary_line(len(configs), counts, sum(k in finished_before for k in ids),
                              folder))
    missing = [k for k in ids if k not in rows]
    if missing:
        print(f"{len(missing)} configuration(s) not finished: a job ended before them (logs: "
              f"{folder / 'submitit'}). Run the same command again to submit them:\n  {rerun}",
              file=sys.stderr)
        return 1
    return folder


def _watch(jobs: list[dict], configs: list[TrainConfig], folder: Path) -> None:
    """One progress bar over every shard's file until no job is pending or running."""
    from harness.cluster.sharded import POLL_S, SCHEDULER_POLL_S

    ids = {c.config_id for c in configs}
    bar = tqdm(total=len(ids), initial=len(ids & set(finished_rows(folder))), unit="config",
               file=sys.stderr, dynamic_ncols=True)
    live, asked = {j["job_id"] for j in jobs}, float("-inf")
    try:
        while True:
            finished = set(finished_rows(folder))
            bar.update(len(ids & finished) - bar.n)
            held = {cid for j in jobs if j["job_id"] in live for cid in j["configs"]}
            if held <= finished or time.monotonic() - asked > SCHEDULER_POLL_S:
                live, asked = ex.alive([j for j in jobs if j["job_id"] in live]), time.monotonic()
                bar.set_postfix_str(f"{len(live)} of {len(jobs)} job(s) pending or running")
            if not live:
                break
            time.sleep(POLL_S)
    finally:
        bar.close()


def _close(store: TrainStore, meta: dict) -> None:
    meta["sessions"][-1]["ended"] = meta["ended"] = now()
    store.write_meta(meta)
