"""Where a run's cases execute: `serial` (this process's worker pair, the default), or
shards submitted with submitit (https://github.com/facebookincubator/submitit): `local`
(LocalExecutor: processes on this node, each pinned to its own GPU when it has several)
or `slurm` (SlurmExecutor: one job array, a task per shard). harness.cluster.engine
submits, watches and resubmits the jobs, whatever their units (cases, configurations).

Settings come from the `[executor]` table of the matrix TOML and from the command line
(which wins); they are never part of the matrix, so a run resumed with another executor
or shard count is the same run. Each shard is a `ShardJob` (submitit's Checkpointable:
on preemption or a time limit, Slurm requeues it and it carries on from its own file,
leaving alone the units the waiting command has meanwhile given to a newer job).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.errors import UsageError
from harness.files import now

EXECUTORS = ("serial", "local", "slurm")
REPO = Path(__file__).resolve().parents[2]
# Slurm job states (squeue's long names) in which a job holds its units: it waits to run,
# runs, holds its allocation paused (a suspended job resumes mid-unit), or was requeued
# (it runs again, from its own shard file). Every other state ends the hold, COMPLETING
# included (`CG`: a cancelled job shows it for seconds): its unfinished units go to a new
# job. A requeued job that the waiting command saw ended (between two looks at squeue)
# skips the units a newer job of the run holds (shards.Files.taken_elsewhere).
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "RESIZING", "SUSPENDED", "STOPPED", "REQUEUED")
_FLAGS = {  # key (TOML and flag) -> (type, submitit AutoExecutor parameter)
    "slurm_partition": (str, "slurm_partition"), "slurm_time": (int, "timeout_min"),
    "slurm_gpus_per_node": (int, "gpus_per_node"), "slurm_cpus_per_task": (int, "cpus_per_task"),
    "slurm_mem_gb": (float, "mem_gb"), "slurm_account": (str, "slurm_account"),
    "slurm_constraint": (str, "slurm_constraint")}


@dataclasses.dataclass(frozen=True)
class Settings:
    kind: str = "serial"
    shards: int = 1
    slurm: tuple = ()  # ((submitit parameter, value), ...)
    sbatch: tuple = ()  # ((sbatch option, value), ...): slurm_additional_parameters
    no_wait: bool = False
    max_retries: int = 2  # new jobs for a case whose job ended while measuring it


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (also an [executor] table in the matrix TOML, same keys)")
    g.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="serial (default): this machine, one case at a time; local: --shards "
                        "processes here; slurm: --shards Slurm jobs")
    g.add_argument("--shards", default=None, help="jobs to split the cases over (default 1)")
    g.add_argument("--no-wait", dest="no_wait", action="store_true",
                   help="submit, print the job ids and the command that waits and merges, exit")
    g.add_argument("--max-retries", dest="max_retries", default=None,
                   help="new jobs for a case (a training configuration) whose job ended "
                        "while on it, before it "
                        "becomes an error row (default 2)")
    for key, (typ, _) in _FLAGS.items():
        g.add_argument("--" + key.replace("_", "-"), dest=key, default=None,
                       help={"slurm_time": "time limit per job, minutes (slurm default 60; local: "
                                            "none unless given)",
                             "slurm_partition": "the Slurm partition (sbatch --partition)",
                             "slurm_gpus_per_node": "GPUs per job (sbatch --gpus-per-node)",
                             "slurm_cpus_per_task": "CPUs per job (sbatch --cpus-per-task)",
                             "slurm_mem_gb": "memory per job, GB (sbatch --mem)",
                             "slurm_account": "the account charged (sbatch --account)",
                             "slurm_constraint": "node features (sbatch --constraint)"}[key])
    g.add_argument("--slurm-opt", dest="slurm_opt", action="append", default=None,
                   metavar="KEY[=VALUE]",
                   help="any other sbatch option, e.g. qos=high or exclusive (repeatable)")


def _typed(key: str, value, typ):
    try:
        if isinstance(value, bool) or (typ is int and isinstance(value, float)):
            raise ValueError
        out = typ(value)
    except (TypeError, ValueError):
        raise UsageError(f"executor: {key} must be {typ.__name__}, got {value!r}") from None
    if typ in (int, float) and out <= 0:
        raise UsageError(f"executor: {key} must be positive, got {value!r}")
    return out


def settings_from(args, table: dict | None) -> Settings:
    """Settings from the TOML's [executor] table overridden by the flags; UsageError if bad."""
    if table is not None and not isinstance(table, dict):
        raise UsageError("'executor' in the matrix TOML must be a table ([executor])")
    table = dict(table or {})
    known = {"executor", "shards", "slurm_opt", "max_retries", *_FLAGS}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UsageError(f"[executor]: unknown key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(sorted(known))}")
    kind = args.executor or table.get("executor", "serial")
    if kind not in EXECUTORS:
        raise UsageError(f"executor: unknown {kind!r}; allowed: {', '.join(EXECUTORS)}")
    if args.shards is not None:
        shards = _typed("--shards", args.shards, int)
        if kind == "serial" and shards > 1:
            raise UsageError("--shards needs --executor local or slurm")
    else:  # a TOML's shards count does not apply when the command line chose serial
        shards = _typed("shards", table.get("shards", 1), int) if kind != "serial" else 1
    slurm = {k: table[k] for k in _FLAGS if k in table}
    slurm.update({k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None})
    params = tuple(sorted((_FLAGS[k][1], _typed(k, v, _FLAGS[k][0])) for k, v in slurm.items()))
    opts = table.get("slurm_opt", {})
    if not isinstance(opts, dict):
        raise UsageError("[executor]: slurm_opt must be a table of sbatch options")
    # a bare flag (`--slurm-opt exclusive`, `exclusive = true`): submitit writes `--exclusive`
    opts = {str(k): True if v is True else str(v) for k, v in opts.items()}
    for text in args.slurm_opt or []:
        key, eq, value = text.partition("=")
        if not key.strip():
            raise UsageError(f"--slurm-opt: expected KEY=VALUE or KEY, got {text!r}")
        opts[key.strip()] = value.strip() if eq else True
    if args.no_wait and kind == "serial":
        raise UsageError("--no-wait needs --executor local or slurm")
    retries = getattr(args, "max_retries", None)
    retries = table.get("max_retries", 2) if retries is None else retries
    try:
        if isinstance(retries, bool) or int(str(retries)) < 0:
            raise ValueError
        retries = int(str(retries))
    except ValueError:
        raise UsageError(f"executor: max_retries must be a non-negative int, got {retries!r}") from None
    return Settings(kind, shards, params, tuple(sorted(opts.items())), bool(args.no_wait),
                    retries)


def check_available(settings: Settings) -> None:
    """For slurm: the client commands are on PATH and the controller answers; else UsageError."""
    if settings.kind != "slurm":
        return
    missing = [c for c in ("sbatch", "srun", "squeue", "scontrol") if shutil.which(c) is None]
    if missing:
        raise UsageError(f"--executor slurm: {', '.join(missing)} not on PATH "
                         "(run it where Slurm's client commands are installed)")
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        ping = None
    if ping is None or ping.returncode != 0 or " is UP" not in ping.stdout:
        said = " ".join(((ping.stdout + ping.stderr) if ping else "no answer in 30 s").split())
        raise UsageError(f"--executor slurm: no Slurm controller reachable (scontrol ping: {said})")


# -- the job ---------------------------------------------------------------------------------
class _Stopped(Exception):
    """The scheduler is ending this job (scancel, preemption, time limit): record no more."""


class StopOnSignals:
    """A shard's file that takes no row once Slurm signals the end of the job (a mixin over
    a store with `append`: harness.measure's RunStore, harness.train's TrainStore).

    scancel sends SIGTERM, a time limit or preemption SIGUSR2 (submitit's --signal), to
    every process of the job: the worker processes too, and a worker killed so would be
    recorded as an `error` row, i.e. a unit lost. So the signal sets `stopping` (then
    submitit's own handler runs: it ignores SIGTERM, requeues on SIGUSR2), and a row
    telling of a dead worker waits a moment for that signal before it is written.
    """
    stopping = False

    def stop_on_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                self.stopping = True
                if callable(previous):  # submitit's
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:  # not in a submitit job: stop now
                    raise _Stopped(f"signal {signum}")
            signal.signal(sig, handler)

    def append(self, row: dict) -> None:
        if row.get("status") in ("error", "oom"):
            time.sleep(1.0)  # the signal that killed the worker reaches us meanwhile
        if self.stopping:
            which = row.get("case_id") or row.get("config_id")
            raise _Stopped(f"job ending: {which} left for a rerun")
        super().append(row)

    def append_round(self, record: dict) -> None:
        if self.stopping:
            raise _Stopped(f"job ending: round {record['round']} of case {record['case_id']} "
                           "left for a rerun")
        super().append_round(record)


def _job_id() -> str | None:
    import submitit

    try:
        return submitit.JobEnvironment().job_id
    except RuntimeError:  # not inside a submitit job (a direct call)
        return None


def job_record(index: int, executor: str, held: str, units: list, env: dict, **more) -> dict:
    """A shard's record as its job starts: where it runs (host, job id, devices, the
    machine from `env`, harness.measure.store.environment), how many units it holds."""
    return {"shard": index, "executor": executor, "job_id": _job_id(),
            "host": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            held: len(units), "started": now(), "ended": None, "counts": None, **more,
            **{k: env[k] for k in ("cpu_model", "cpu_count", "threads", "cuda_devices",
                                   "load_average_start")}}


def job_ended(record: dict, counts) -> None:
    record.update(ended=now(), counts=dict(counts),
                  load_average_end=[round(x, 2) for x in os.getloadavg()])


class ShardJob:
    """One shard as a submitit callable: `body(folder, index, units, executor)`, a
    module-level function (pickled by name). Checkpointable the way
    submitit.helpers.Checkpointable is (submitit requeues a callable that has a `checkpoint`
    method after a preemption or a time limit); not its subclass, so that importing
    harness.cluster.executors does not import submitit. The requeued job resumes from its
    own shard file."""

    def __init__(self, body, folder: str, index: int, units: list, executor: str):
        from harness.measure.worker import EXTRA_ENV

        self.body, self.args = body, (folder, index, units, executor)
        # The variant modules of the submitting command (--variant-module, the TOML's
        # `modules`, ATTNBENCH_EXTRA_MODULES) travel pickled with the job, whatever
        # environment the job starts in (a Slurm node, a requeue); its workers inherit them.
        self.modules = os.environ.get(EXTRA_ENV, "")

    def __call__(self) -> dict:
        from harness.measure.worker import EXTRA_ENV, import_extra

        if self.modules:
            os.environ[EXTRA_ENV] = self.modules
        import_extra()  # variants registered outside the package, and entry points
        return self.body(*self.args)

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on preemption/timeout: resubmit the same shard (it resumes)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self)


# -- submitting and watching -----------------------------------------------------------------
def submit_jobs(settings: Settings, folder: Path, fns: list) -> list:
    """Submit each callable as one job (Slurm: one array; local: one process each, pinned
    to a GPU where there are some); returns submitit's jobs in the same order."""
    import submitit

    logs = folder / "submitit"
    setup = [f"export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}"]  # this repo's harness
    jobs = []
    if settings.kind == "slurm":
        ex = submitit.AutoExecutor(folder=logs, cluster="slurm", slurm_max_num_timeout=3)
        params = {"timeout_min": 60, **dict(settings.slurm)}
        ex.update_parameters(name=f"attnbench-{folder.name}", slurm_setup=setup,
                             slurm_additional_parameters=dict(settings.sbatch), **params)
        jobs = ex.submit_array(fns)
    else:
        import torch

        gpus = torch.cuda.device_count()  # one shard per GPU: CUDA_VISIBLE_DEVICES=<its GPU>
        if 0 < gpus < len(fns):
            print(f"warning: {len(fns)} shards on {gpus} GPU(s): some share a GPU, and their "
                  "times distort each other", file=sys.stderr)
        for k, fn in enumerate(fns):
            ex = submitit.LocalExecutor(folder=logs)
            # no limit unless asked (--slurm-time): a week
            timeout = dict(settings.slurm).get("timeout_min", 7 * 24 * 60)
            pin = {"gpus_per_node": 1, "visible_gpus": (k % gpus,)} if gpus else {}
            ex.update_parameters(timeout_min=timeout, setup=setup, **pin)
            jobs.append(ex.submit(fn))
    return jobs


def states(jobs: list[dict]) -> dict[str, str]:
    """job id -> its state now: Slurm's (squeue's long name; GONE when squeue no longer
    lists it), or for a local job RUNNING, COMPLETED, FAILED (its function raised) or KILLED."""
    out = {}
    slurm = [j["job_id"] for j in jobs if j["executor"] == "slurm"]
    if slurm:
        if shutil.which("squeue") is None:
            raise UsageError(f"this run has Slurm jobs ({', '.join(slurm[-3:])}, ...) and squeue "
                             "is not on PATH: their states are unknown; run it where Slurm is")
        r = subprocess.run(["squeue", "--me", "-h", "-r", "--states=all", "-o", "%i|%T"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:  # unknown is not dead: never resubmit what may still run
            raise UsageError(f"squeue failed, job states unknown: {' '.join(r.stderr.split())}")
        listed = dict(line.split("|", 1) for line in r.stdout.split() if "|" in line)
        out |= {j: listed.get(j, "GONE") for j in slurm}
    for j in jobs:
        if j["executor"] == "local":
            if _controller_alive(int(j["job_id"])):
                out[j["job_id"]] = "RUNNING"
            else:
                out[j["job_id"]] = _local_end(Path(j.get("logs", ".")) / f"{j['job_id']}_0_result.pkl")
    return out


def _local_end(result: Path) -> str:
    """How an ended local job ended: submitit pickles ("success", value) or ("error",
    traceback) when its function returns or raises; a killed job leaves nothing."""
    import pickle

    try:
        with result.open("rb") as f:
            outcome = pickle.load(f)[0]
    except (OSError, EOFError, pickle.UnpicklingError, IndexError, TypeError):
        return "KILLED"
    return "COMPLETED" if outcome == "success" else "FAILED"


def alive(jobs: list[dict]) -> set[str]:
    """Job ids among `jobs` that hold their units (Slurm: ACTIVE states; local: /proc)."""
    return {j for j, state in states(jobs).items() if state in ACTIVE}


def log_path(job: dict) -> str:
    """submitit's stderr file of a job (task 0), as jobs.json's `logs` folder names it."""
    return str(Path(job.get("logs", "submitit")) / f"{job['job_id']}_0_log.err")


def _controller_alive(pid: int) -> bool:
    """The submitit local controller with this pid runs (not a zombie, not a reused pid)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and b"submitit" in cmdline
