"""A run over shards (`run --executor local|slurm`): submit the unfinished cases, watch the
shard files with one progress bar, merge them into results.csv, write meta and the report.

Running the same command again resumes: jobs of this run still pending or running are
waited for, not resubmitted; every case that is neither finished (a complete row in
results.csv or a shard file) nor held by such a job is submitted again, whatever ended
its job (cancelled, preempted, a dead node, a time limit). No finished case is measured
twice, none is lost. harness.cluster.shards describes the files.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from harness.measure import estimate

from harness.measure import runner

from harness.cluster import shards
from harness.cluster import executors as ex
from harness.errors import UsageError
from harness.measure.matrix import Case
from harness.measure.store import RunStore, environment, matmul_fp32_gflops, now

POLL_S = 0.5  # reading the shard files
SCHEDULER_POLL_S = 10.0  # asking squeue: a shared controller is not to be hammered
# What a shard's record says about the machine its cases ran on; meta.json's top level
# takes them from the first shard (the report warns when the shards differ).
_HARDWARE = ("cpu_model", "cpu_count", "threads", "cuda_devices")


def merge_before_serial(store: RunStore, cases: list[Case]) -> None:
    """Before a serial session of a run that had shards: fold their rows into results.csv
    (so the serial runner skips them); refuse while a job of the run still runs."""
    jobs = shards.read_jobs(store.folder)
    if not jobs and not shards.shard_indices(store.folder):
        return
    running = ex.alive(jobs)
    if running:
        raise UsageError(f"job(s) {', '.join(sorted(running))} of this run still run; wait for "
                         "them (rerun with their executor) or cancel them first")
    shards.merge(store.folder, cases)


def run(matrix: dict, cases: list[Case], store: RunStore, resume: bool,
        settings: ex.Settings, rerun: str) -> int | Path:
    """Submit, wait (unless settings.no_wait), merge. Returns the run folder when every case
    has a row (the command then writes the report), else the exit status of `run`."""
    folder = store.folder
    created = not folder.exists()
    jobs = shards.read_jobs(folder)
    running = ex.alive(jobs)  # before anything is written: squeue may be missing
    held = {cid for j in jobs if j["job_id"] in running for cid in j["cases"]}
    finished_before = set(shards.finished_rows(folder))
    todo = [c for c in cases if c.case_id not in finished_before | held]
    threads = cases[0].threads
    meta = store.read_meta() if resume else {}
    meta.update(environment(threads))  # versions and commit of the code the jobs run
    # The split's cost model needs a FLOP rate: measured here once per run (a 1024^3
    # matmul: it only weighs the cases against each other), so that a resumed run splits
    # the same remaining cases the same way.
    meta.setdefault("plan_matmul_fp32_gflops", matmul_fp32_gflops(threads, n=1024))
    new: list[dict] = []
    if todo:
        rate = meta["plan_matmul_fp32_gflops"] * 1e9
        parts = shards.split([(c, cost) for c, _, cost in estimate.plan_cases(todo, rate)],
                             settings.shards)
        first = max(shards.shard_indices(folder) + [j["shard"] for j in jobs], default=-1) + 1
        new = _submit(settings, folder, parts, first, created)
        shards.write_jobs(folder, jobs + new)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None,
                                            "executor": settings.kind, "shards": settings.shards})
    meta.update({"matrix": matrix, "cases": len(cases), "ended": None})
    store.write_meta(meta)
    watch = [j for j in jobs if j["job_id"] in running] + new
    for j in watch:
        print(f"{'submitted' if j in new else 'waiting for'} shard {j['shard']}: "
              f"{j['executor']} job {j['job_id']}, {len(j['cases'])} cases", file=sys.stderr)
    if settings.no_wait:
        print(f"{len(new)} job(s) submitted ({', '.join(j['job_id'] for j in new) or 'none'}). "
              f"To wait for them, merge and report, run:\n  {rerun}")
        _close_session(store, meta)
        return 0

    _watch(watch, cases, folder)
    shards.merge(folder, cases)
    rows = shards.finished_rows(folder)
    _close_session(store, meta)
    ids = [c.case_id for c in cases]
    counts = Counter(rows[k]["status"] for k in ids if k in rows and k not in finished_before)
    print(runner.summary_line(len(cases), counts, sum(k in finished_before for k in ids),
                              folder))
    missing = [k for k in ids if k not in rows]
    if missing:
        logs = folder / "submitit"
        print(f"{len(missing)} case(s) not finished: a job ended before them (logs: {logs}). "
              f"Run the same command again to submit them:\n  {rerun}", file=sys.stderr)
        return 1
    return folder


def _submit(settings: ex.Settings, folder: Path, parts: list[list[Case]], first: int,
            created: bool) -> list[dict]:
    """ex.submit; a submission the scheduler refuses (a bad partition, account, option) is
    a UsageError, and a run folder this call created is removed again."""
    from submitit.core.utils import FailedJobError

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's stderr too
            return ex.submit(settings, folder, parts, first)
    except FailedJobError as e:
        if created:  # submitit's files only: this run folder did not exist before
            shutil.rmtree(folder, ignore_errors=True)
        lines = [ln for ln in (str(e) or said.getvalue()).splitlines() if ln.strip()]
        raise UsageError(f"the scheduler refused the jobs: {lines[-1] if lines else e!r}") from None


def _watch(jobs: list[dict], cases: list[Case], folder: Path) -> None:
    """One progress bar over all shards (their files) until no job is pending or running.

    The files are read every POLL_S; the scheduler is asked every SCHEDULER_POLL_S, or at
    once when every case of the live jobs is in a file (the jobs are about to end)."""
    ids = {c.case_id for c in cases}
    bar = tqdm(total=len(ids), initial=len(ids & set(shards.finished_rows(folder))),
               unit="case", file=sys.stderr, dynamic_ncols=True)
    live, asked = {j["job_id"] for j in jobs}, float("-inf")
    try:
        while True:
            finished = set(shards.finished_rows(folder))
            bar.update(len(ids & finished) - bar.n)
            held = {cid for j in jobs if j["job_id"] in live for cid in j["cases"]}
            if held <= finished or time.monotonic() - asked > SCHEDULER_POLL_S:
                live, asked = ex.alive([j for j in jobs if j["job_id"] in live]), time.monotonic()
                bar.set_postfix_str(f"{len(live)} of {len(jobs)} job(s) pending or running")
            if not live:
                break
            time.sleep(POLL_S)
    finally:
        bar.close()


def _close_session(store: RunStore, meta: dict) -> None:
    """meta.json: the shards' records, hardware from the first, the session's end."""
    recs = shards.records(store.folder)
    meta["shards"] = recs
    if recs:
        meta.update({k: recs[0].get(k) for k in _HARDWARE})
        rates = [r["matmul_fp32_gflops"] for r in recs if r.get("matmul_fp32_gflops")]
        if rates:  # the rate where the cases ran (the report's GFLOP/s section uses it)
            meta["matmul_fp32_gflops"] = statistics.median(rates)
        per = {}  # each device and dtype's rate, the median over the shards that ran it
        for r in recs:
            for key, rate in (r.get("matmul_gflops") or {}).items():
                per.setdefault(key, []).append(rate)
        if per:
            meta["matmul_gflops"] = {k: statistics.median(v) for k, v in per.items()}
        nodes: dict[str, int] = {}
        for r in recs:
            nodes[r["host"]] = max(nodes.get(r["host"], 0), r["shards_on_node"])
        meta["shards_per_node"] = nodes
    meta["sessions"][-1]["ended"] = meta["ended"] = now()
    store.write_meta(meta)
