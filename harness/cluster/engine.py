"""The sharded engine of `run` and `train` (`--executor local|slurm --shards N`): submit the
unfinished units (a matrix's cases, a sweep's configurations), watch the shard files with
one progress bar, resubmit what dead jobs left, merge the shard files into the result file
exactly as a serial run writes it, and record the shards in the folder's meta.

Each command supplies only what differs (`Work`): the files (shards.Files), how a shard's
units run inside its job, what a unit costs (the split), the row of a unit that never got
one. The waiting command (a run without --no-wait, or the same command run again after
one) goes on until every unit has a row: jobs of the run still pending or running are
waited for, not resubmitted; as soon as a job ends (executors.ACTIVE says which Slurm
states hold a job's units), every unit that is neither finished (a complete row in the
result file or a shard file) nor held by a live job is submitted again in new jobs,
whatever ended its job (cancelled, preempted, a dead node, a time limit, a crash), up to
`--max-retries` new jobs for a unit whose jobs ended while running it; then it becomes an
`error` row naming the jobs' states and logs (`_Resubmit`). No finished unit runs twice,
none is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from harness.cluster import executors as ex
from harness.cluster.shards import Files, split
from harness.errors import UsageError
from harness.files import CsvLog
from harness.measure.store import environment, matmul_fp32_gflops, now

POLL_S = 0.5  # reading the shard files
SCHEDULER_POLL_S = 10.0  # asking squeue: a shared controller is not to be hammered
# What a shard's record says about the machine its units ran on; meta's top level takes
# them from the first shard (the report warns when the shards differ).
_HARDWARE = ("cpu_model", "cpu_count", "threads", "cuda_devices")


@dataclasses.dataclass(frozen=True)
class Work:
    """What one command runs over shards.

    files: its files in the run folder; body(folder, index, units, executor) -> counts by
    status: a shard's job (module-level, pickled by name); costs(units, flop rate) ->
    [(unit, predicted seconds)] in the units' order; together(unit): what stays in one
    shard; row(unit): the descriptive columns of a unit's row (the engine's error rows add
    status and reason); summary(n, counts, earlier, folder): the command's last line.
    noun and doing name a unit and what a job does with it, in messages.
    """
    files: Files
    body: Callable
    costs: Callable
    together: Callable
    row: Callable
    summary: Callable
    noun: str  # "case", "configuration"
    doing: str  # "measuring", "training"

    def uid(self, unit) -> str:
        return getattr(unit, self.files.key)

    def run(self, matrix: dict, units: list, store, resume: bool, settings: ex.Settings,
            rerun: str) -> int | Path:
        return run(self, matrix, units, store, resume, settings, rerun)

    def merge_before_serial(self, store, units: list) -> None:
        merge_before_serial(self, store, units)


def merge_before_serial(work: Work, store, units: list) -> None:
    """Before a serial session of a run that had shards: fold their rows into the result
    file (so the serial loop skips them); refuse while a job of the run still runs."""
    folder = store.folder
    jobs = work.files.read_jobs(folder)
    if not jobs and not work.files.shard_indices(folder):
        return
    running = ex.alive(jobs)
    if running:
        raise UsageError(f"job(s) {', '.join(sorted(running))} of this run still run; wait for "
                         "them (rerun with their executor) or cancel them first")
    work.files.merge(folder, [work.uid(u) for u in units])


def run(work: Work, matrix: dict, units: list, store, resume: bool, settings: ex.Settings,
        rerun: str) -> int | Path:
    """Submit, wait (unless settings.no_wait) and resubmit until every unit has a row, merge.
    `store` is the command's (read_meta, write_meta, folder). Returns the run folder when
    every unit has a row (the command then writes the report), else the exit status: 0
    after --no-wait, 1 when the wait was interrupted."""
    folder, files = store.folder, work.files
    created = not folder.exists()
    jobs = files.read_jobs(folder)
    live = ex.alive(jobs)  # before anything is written: squeue may be missing
    finished_before = set(files.finished_rows(folder))
    threads = units[0].threads
    meta = store.read_meta() if resume else {}
    meta.update(environment(threads))  # versions and commit of the code the jobs run
    # The split's cost model needs a FLOP rate: measured here once per run (a 1024^3
    # matmul: it only weighs the units against each other), so that a resumed run splits
    # the same remaining units the same way.
    meta.setdefault("plan_matmul_fp32_gflops", matmul_fp32_gflops(threads, n=1024))
    resubmit = _Resubmit(work, units, folder, jobs, settings,
                         meta["plan_matmul_fp32_gflops"] * 1e9)
    new = resubmit(live, created)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None,
                                            "executor": settings.kind, "shards": settings.shards})
    meta.update({"matrix": matrix, files.held: len(units), "ended": None})
    store.write_meta(meta)
    for j in [j for j in jobs if j["job_id"] in live] + new:
        print(f"{'submitted' if j in new else 'waiting for'} shard {j['shard']}: "
              f"{j['executor']} job {j['job_id']}, {len(j[files.held])} {work.noun}s",
              file=sys.stderr)
    if settings.no_wait:
        print(f"{len(new)} job(s) submitted ({', '.join(j['job_id'] for j in new) or 'none'}). "
              f"To wait for them, merge and report, run:\n  {rerun}")
        _close_session(files, store, meta)
        return 0

    ids = [work.uid(u) for u in units]
    try:
        _watch(live | {j["job_id"] for j in new}, resubmit, set(ids), work)
    except KeyboardInterrupt:
        files.merge(folder, ids)
        _close_session(files, store, meta)
        print(f"\nstopped waiting; the run's jobs go on. To wait for them again, run:\n  {rerun}",
              file=sys.stderr)
        return 1
    files.merge(folder, ids)
    rows = files.finished_rows(folder)
    _close_session(files, store, meta)
    counts = Counter(rows[k]["status"] for k in ids if k in rows and k not in finished_before)
    print(work.summary(len(units), counts, sum(k in finished_before for k in ids), folder))
    missing = [k for k in ids if k not in rows]
    if missing:  # not expected: every unit ends as a row or in a job that is waited for
        print(f"{len(missing)} {work.noun}(s) have no row (logs: {folder / 'submitit'}). Run "
              f"the same command again to submit them:\n  {rerun}", file=sys.stderr)
        return 1
    return folder


class _Resubmit:
    """Gives each unit without a row that no live job holds its next chance: a new job, or,
    once jobs have ended while running it 1 + max_retries times, an `error` row.

    Whose chance a dead job used is read from the files, so every session counts alike: a
    job that ended with units unfinished used a chance of the unit its worker log names
    last (the one it was on), or, when that unit has its row (the job died between units)
    or it named none (it died before running anything), of every unit it left. Units
    queued behind the one it was on keep their chances: a unit that kills its job takes
    only itself down.
    """

    def __init__(self, work: Work, units: list, folder: Path, jobs: list[dict],
                 settings: ex.Settings, rate: float):
        self.work, self.units, self.folder, self.jobs = work, units, folder, jobs
        self.settings, self.rate = settings, rate

    def __call__(self, live: set[str], created: bool = False) -> list[dict]:
        """Submit what needs it; returns the new jobs (also appended to self.jobs)."""
        work, files = self.work, self.work.files
        finished = set(files.finished_rows(self.folder))
        held = {uid for j in self.jobs if j["job_id"] in live for uid in j[files.held]}
        orphans = [u for u in self.units if work.uid(u) not in finished | held]
        if not orphans:
            return []
        used = self._chances_used(live, finished)
        out = [u for u in orphans if len(used.get(work.uid(u), ())) > self.settings.max_retries]
        if out:
            self._give_up(out, used)
        todo = [u for u in orphans if u not in out]
        new: list[dict] = []
        if todo:
            parts = split(work.costs(todo, self.rate), self.settings.shards, unit=work.together)
            first = max(files.shard_indices(self.folder) + [j["shard"] for j in self.jobs],
                        default=-1) + 1
            new = _submit(work, self.settings, self.folder, parts, first, created)
        self.jobs += new
        files.write_jobs(self.folder, self.jobs)
        return new

    def _chances_used(self, live: set[str], finished: set[str]) -> dict[str, list[dict]]:
        """unit id -> the ended jobs that used one of its chances (the class docstring)."""
        files = self.work.files
        used: dict[str, list[dict]] = defaultdict(list)
        ended = [j for j in self.jobs if j["job_id"] not in live
                 and any(u not in finished for u in j[files.held])]
        if ended:  # the state each ended in, for the error rows (squeue forgets old jobs)
            now_states = ex.states(ended)
            for j in ended:
                if now_states[j["job_id"]] != "GONE" or "state" not in j:
                    j["state"] = now_states[j["job_id"]]
        for j in ended:
            left = [u for u in j[files.held] if u not in finished]
            on = files.last_logged(self.folder, j["shard"])
            for uid in [on] if on in left else left:
                used[uid].append(j)
        return used

    def _give_up(self, units: list, used: dict[str, list[dict]]) -> None:
        """An `error` row in the result file for each unit whose every chance ended its job."""
        files = self.work.files
        log = CsvLog(self.folder / files.results, list(files.columns))
        log.open()
        try:
            for unit in units:
                jobs = used[self.work.uid(unit)]
                states = ", ".join(f"{j['job_id']} {j.get('state', 'ENDED')}" for j in jobs)
                last = jobs[-1]
                logs = Path(ex.log_path(last))
                logs = logs.relative_to(self.folder) if logs.is_relative_to(self.folder) else logs
                row = self.work.row(unit)
                row.update(status="error", reason=(
                    f"its job ended while {self.work.doing} it, each of the {len(jobs)} times "
                    f"it ran (1 + --max-retries {self.settings.max_retries}): "
                    f"{last['executor']} job {states}; logs: {logs}, "
                    f"{files.shard_log(Path(''), last['shard'])} in the run folder"))
                log.append(row)
                print(f"gave up on {unit.label()}: {row['reason']}", file=sys.stderr)
        finally:
            log.close()


def _submit(work: Work, settings: ex.Settings, folder: Path, parts: list[list], first: int,
            created: bool) -> list[dict]:
    """Each part as one job; returns one {"shard", "job_id", "executor", "logs", <held>}
    each. A submission the scheduler refuses (a bad partition, account, option) is a
    UsageError, and a run folder this call created is removed again."""
    from submitit.core.utils import FailedJobError

    indices = list(range(first, first + len(parts)))
    fns = [ex.ShardJob(work.body, str(folder), i, part, settings.kind)
           for i, part in zip(indices, parts)]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's stderr too
            jobs = ex.submit_jobs(settings, folder, fns)
    except FailedJobError as e:
        if created:  # submitit's files only: this run folder did not exist before
            shutil.rmtree(folder, ignore_errors=True)
        lines = [ln for ln in (str(e) or said.getvalue()).splitlines() if ln.strip()]
        raise UsageError(f"the scheduler refused the jobs: {lines[-1] if lines else e!r}") from None
    logs = str(folder / "submitit")
    return [{"shard": i, "job_id": str(j.job_id), "executor": settings.kind, "logs": logs,
             work.files.held: [work.uid(u) for u in part]}
            for i, j, part in zip(indices, jobs, parts)]


def _watch(live: set[str], resubmit: _Resubmit, ids: set[str], work: Work) -> None:
    """One progress bar over all shards (their files) until no job of the run is live; as
    soon as jobs end, their unfinished units get their next chance (`resubmit`).

    The files are read every POLL_S; Slurm is asked every SCHEDULER_POLL_S, or at once when
    every unit of the live jobs is in a file (the jobs are about to end); local jobs (a
    look at /proc) every POLL_S."""
    files, folder = work.files, resubmit.folder
    bar = tqdm(total=len(ids), initial=len(ids & set(files.finished_rows(folder))),
               unit=work.noun, file=sys.stderr, dynamic_ncols=True)
    asked = float("-inf")
    try:
        while True:
            finished = set(files.finished_rows(folder))
            bar.update(len(ids & finished) - bar.n)
            watched = [j for j in resubmit.jobs if j["job_id"] in live]
            held = {uid for j in watched for uid in j[files.held]}
            every = POLL_S if all(j["executor"] == "local" for j in watched) else SCHEDULER_POLL_S
            if held <= finished or time.monotonic() - asked > every:
                now_live, asked = ex.alive(watched), time.monotonic()
                if now_live != live:  # jobs ended: resubmit their unfinished units
                    new = resubmit(now_live)
                    for j in new:
                        bar.write(f"resubmitted to shard {j['shard']}: {j['executor']} job "
                                  f"{j['job_id']}, {len(j[files.held])} {work.noun}s",
                                  file=sys.stderr)
                    live = now_live | {j["job_id"] for j in new}
                bar.set_postfix_str(f"{len(live)} of {len(resubmit.jobs)} job(s) pending "
                                    "or running")
            if not live:
                break
            time.sleep(POLL_S)
    finally:
        bar.close()


def _close_session(files: Files, store, meta: dict) -> None:
    """The meta: the shards' records, hardware from the first, the session's end."""
    recs = files.records(store.folder)
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
