"""A run over shards (`run --executor local|slurm`): submit the unfinished cases, watch the
shard files with one progress bar, merge them into results.csv, write meta and the report.

The waiting command (a run without --no-wait, or the same command run again after one)
goes on until every case has a row: jobs of this run still pending or running are
waited for, not resubmitted; as soon as a job ends (executors.ACTIVE says which Slurm
states hold a job's cases), every case that is neither finished (a complete row in
results.csv or a shard file) nor held by a live job is submitted again in new jobs,
whatever ended its job (cancelled, preempted, a dead node, a time limit, a crash), up to
`--max-retries` new jobs for a case whose jobs ended while measuring it; then it becomes
an `error` row naming the jobs' states and logs (`_Resubmit`). No finished case is
measured twice, none is lost. harness.cluster.shards describes the files.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm import tqdm

import variants
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
    """Submit, wait (unless settings.no_wait) and resubmit until every case has a row, merge.
    Returns the run folder when every case has a row (the command then writes the report),
    else the exit status of `run`: 0 after --no-wait, 1 when the wait was interrupted."""
    folder = store.folder
    created = not folder.exists()
    jobs = shards.read_jobs(folder)
    live = ex.alive(jobs)  # before anything is written: squeue may be missing
    finished_before = set(shards.finished_rows(folder))
    threads = cases[0].threads
    meta = store.read_meta() if resume else {}
    meta.update(environment(threads))  # versions and commit of the code the jobs run
    # The split's cost model needs a FLOP rate: measured here once per run (a 1024^3
    # matmul: it only weighs the cases against each other), so that a resumed run splits
    # the same remaining cases the same way.
    meta.setdefault("plan_matmul_fp32_gflops", matmul_fp32_gflops(threads, n=1024))
    resubmit = _Resubmit(cases, folder, jobs, settings, meta["plan_matmul_fp32_gflops"] * 1e9)
    new = resubmit(live, created)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None,
                                            "executor": settings.kind, "shards": settings.shards})
    meta.update({"matrix": matrix, "cases": len(cases), "ended": None})
    store.write_meta(meta)
    for j in [j for j in jobs if j["job_id"] in live] + new:
        print(f"{'submitted' if j in new else 'waiting for'} shard {j['shard']}: "
              f"{j['executor']} job {j['job_id']}, {len(j['cases'])} cases", file=sys.stderr)
    if settings.no_wait:
        print(f"{len(new)} job(s) submitted ({', '.join(j['job_id'] for j in new) or 'none'}). "
              f"To wait for them, merge and report, run:\n  {rerun}")
        _close_session(store, meta)
        return 0

    try:
        _watch(live | {j["job_id"] for j in new}, resubmit, cases, folder)
    except KeyboardInterrupt:
        shards.merge(folder, cases)
        _close_session(store, meta)
        print(f"\nstopped waiting; the run's jobs go on. To wait for them again, run:\n  {rerun}",
              file=sys.stderr)
        return 1
    shards.merge(folder, cases)
    rows = shards.finished_rows(folder)
    _close_session(store, meta)
    ids = [c.case_id for c in cases]
    counts = Counter(rows[k]["status"] for k in ids if k in rows and k not in finished_before)
    print(runner.summary_line(len(cases), counts, sum(k in finished_before for k in ids),
                              folder))
    missing = [k for k in ids if k not in rows]
    if missing:  # not expected: every case ends as a row or in a job that is waited for
        print(f"{len(missing)} case(s) have no row (logs: {folder / 'submitit'}). Run the "
              f"same command again to submit them:\n  {rerun}", file=sys.stderr)
        return 1
    return folder


class _Resubmit:
    """Gives each case without a row that no live job holds its next chance: a new job, or,
    once jobs have ended while measuring it 1 + max_retries times, an `error` row.

    Whose chance a dead job used is read from the files, so every session counts alike: a
    job that ended with cases unfinished used a chance of the case its worker log names
    last (the one it was measuring), or, when that case has its row (the job died between
    cases) or it named none (it died before measuring anything), of every case it left.
    Cases queued behind the one it was on keep their chances: a case that kills its job
    takes only itself down.
    """

    def __init__(self, cases: list[Case], folder: Path, jobs: list[dict],
                 settings: ex.Settings, rate: float):
        self.cases, self.folder, self.jobs = cases, folder, jobs
        self.settings, self.rate = settings, rate

    def __call__(self, live: set[str], created: bool = False) -> list[dict]:
        """Submit what needs it; returns the new jobs (also appended to self.jobs)."""
        finished = set(shards.finished_rows(self.folder))
        held = {cid for j in self.jobs if j["job_id"] in live for cid in j["cases"]}
        orphans = [c for c in self.cases if c.case_id not in finished | held]
        if not orphans:
            return []
        used = self._chances_used(live, finished)
        out = [c for c in orphans if len(used.get(c.case_id, ())) > self.settings.max_retries]
        if out:
            self._give_up(out, used)
        todo = [c for c in orphans if c not in out]
        new: list[dict] = []
        if todo:
            parts = shards.split([(c, cost) for c, _, cost in estimate.plan_cases(todo, self.rate)],
                                 self.settings.shards)
            first = max(shards.shard_indices(self.folder) + [j["shard"] for j in self.jobs],
                        default=-1) + 1
            new = _submit(self.settings, self.folder, parts, first, created)
        self.jobs += new
        shards.write_jobs(self.folder, self.jobs)
        return new

    def _chances_used(self, live: set[str], finished: set[str]) -> dict[str, list[dict]]:
        """case id -> the ended jobs that used one of its chances (the class docstring)."""
        used: dict[str, list[dict]] = defaultdict(list)
        ended = [j for j in self.jobs if j["job_id"] not in live
                 and any(c not in finished for c in j["cases"])]
        if ended:  # the state each ended in, for the error rows (squeue forgets old jobs)
            now_states = ex.states(ended)
            for j in ended:
                if now_states[j["job_id"]] != "GONE" or "state" not in j:
                    j["state"] = now_states[j["job_id"]]
        for j in ended:
            left = [c for c in j["cases"] if c not in finished]
            on = shards.last_logged_case(self.folder, j["shard"])
            for cid in [on] if on in left else left:
                used[cid].append(j)
        return used

    def _give_up(self, cases: list[Case], used: dict[str, list[dict]]) -> None:
        """An `error` row in results.csv for each case whose every chance ended its job."""
        store = RunStore(self.folder)
        store.open()
        try:
            for case in cases:
                jobs = used[case.case_id]
                states = ", ".join(f"{j['job_id']} {j.get('state', 'ENDED')}" for j in jobs)
                last = jobs[-1]
                log = Path(ex.log_path(last))
                log = log.relative_to(self.folder) if log.is_relative_to(self.folder) else log
                row = runner.case_row(case, variants.build(case.variant, **case.param_dict))
                row.update(status="error", reason=(
                    f"its job ended while measuring it, each of the {len(jobs)} times it ran "
                    f"(1 + --max-retries {self.settings.max_retries}): {last['executor']} "
                    f"job {states}; logs: {log}, "
                    f"{shards.shard_log(Path(''), last['shard'])} in the run folder"))
                store.append(row)
                print(f"gave up on {case.label()}: {row['reason']}", file=sys.stderr)
        finally:
            store.close()


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


def _watch(live: set[str], resubmit: _Resubmit, cases: list[Case], folder: Path) -> None:
    """One progress bar over all shards (their files) until no job of the run is live; as
    soon as jobs end, their unfinished cases get their next chance (`resubmit`).

    The files are read every POLL_S; Slurm is asked every SCHEDULER_POLL_S, or at once when
    every case of the live jobs is in a file (the jobs are about to end); local jobs (a
    look at /proc) every POLL_S."""
    ids = {c.case_id for c in cases}
    bar = tqdm(total=len(ids), initial=len(ids & set(shards.finished_rows(folder))),
               unit="case", file=sys.stderr, dynamic_ncols=True)
    asked = float("-inf")
    try:
        while True:
            finished = set(shards.finished_rows(folder))
            bar.update(len(ids & finished) - bar.n)
            watched = [j for j in resubmit.jobs if j["job_id"] in live]
            held = {cid for j in watched for cid in j["cases"]}
            every = POLL_S if all(j["executor"] == "local" for j in watched) else SCHEDULER_POLL_S
            if held <= finished or time.monotonic() - asked > every:
                now_live, asked = ex.alive(watched), time.monotonic()
                if now_live != live:  # jobs ended: resubmit their unfinished cases
                    new = resubmit(now_live)
                    for j in new:
                        bar.write(f"resubmitted to shard {j['shard']}: {j['executor']} job "
                                  f"{j['job_id']}, {len(j['cases'])} cases", file=sys.stderr)
                    live = now_live | {j["job_id"] for j in new}
                bar.set_postfix_str(f"{len(live)} of {len(resubmit.jobs)} job(s) pending "
                                    "or running")
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
