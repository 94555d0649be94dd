"""Sharded runs (`run --executor local|slurm --shards N`) against the serial run of the same
matrix, on a real Slurm (.ci/slurm.sh starts one; these tests skip, saying so, where no
controller answers) and on submitit's local executor; a cancelled shard resumed; bad
executor settings refused before anything is written; the split itself; which Slurm states
hold a job's units (a squeue of our own: COMPLETING treated as alive, or REQUEUED as dead,
fails it)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import run_bench
from harness.measure import matrix as mx
from harness.cluster import engine, executors, sharded, shards
from harness.cluster.shards import MATRIX as files
from harness.measure.store import COLUMNS
from harness.report import provenance
from harness.measure.worker import EXTRA_ENV, import_extra

REPO = Path(__file__).resolve().parent.parent
FAKES = str(REPO / "tests" / "harness_fakes.py")
import_extra(FAKES)

# Timed in 2 rounds: each shard does its rounds over its own cases (checked below).
TINY = ('variants = ["sdpa", "linear"]\nseq_lens = [64, 128]\nheads = 1\nhead_dim = 32\n'
        'passes = ["forward"]\nmin_run_time_s = 0.01\nmin_repeats = 3\nrounds = 2\n')
_PART = re.compile(r"^--- \S+ (\w+) ([0-9a-f]{16}) ", re.M)


def _slurm_reason() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "Slurm's client commands are not installed (.ci/slurm.sh start installs them)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Slurm controller reachable (scontrol ping: no answer in 30 s)"
    if ping.returncode != 0:
        said = " ".join((ping.stdout + ping.stderr).split())[:120]
        return f"no Slurm controller reachable ({said})"
    return None


_NO_SLURM = _slurm_reason()
# .ci/run starts Slurm and sets this: there a missing cluster fails these tests.
_REQUIRED = os.environ.get("ATTNBENCH_REQUIRE_SLURM") == "1"
needs_slurm = pytest.mark.skipif(_NO_SLURM is not None and not _REQUIRED, reason=str(_NO_SLURM))


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        return next(csv.reader(f))


def _run(cfg: Path, out: Path, run_id: str, *extra: str) -> int:
    return run_bench.main(["run", "--config", str(cfg), "--results-dir", str(out),
                           "--run-id", run_id, *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny matrix and its serial run (the reference for the sharded ones)."""
    d = tmp_path_factory.mktemp("sharded")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY)
    assert _run(cfg, d, "serial") == 0
    return cfg, d, d / "serial" / "results.csv"


def _same_as_serial(serial_csv: Path, folder: Path, jobs: int) -> None:
    sharded = folder / "results.csv"
    assert _header(sharded) == _header(serial_csv)
    assert [r["case_id"] for r in _rows(sharded)] == [r["case_id"] for r in _rows(serial_csv)]
    assert {r["status"] for r in _rows(sharded)} == {"ok"}
    # every case was measured once: no id twice over the shard files
    ids = Counter(r["case_id"] for i in files.shard_indices(folder)
                  for r in _rows(files.shard_csv(folder, i)))
    assert set(ids.values()) == {1} and len(ids) == len(_rows(serial_csv))
    assert {r["rounds"] for r in _rows(sharded)} == {"2"}
    for i in files.shard_indices(folder):  # round 1 of its cases, then round 2 of them
        parts = _PART.findall(files.shard_log(folder, i).read_text())
        mine = [c for p, c in parts if p == "time"]
        assert mine and [p for p, _ in parts][-len(mine):] == ["retime"] * len(mine)
        assert [c for p, c in parts if p == "retime"] == mine
    meta = json.loads((folder / "meta.json").read_text())
    assert len(meta["shards"]) == jobs and {r["shard"] for r in meta["shards"]} == set(range(jobs))
    assert all([s["before_round"] for s in r["busy"]] == [0, 2] for r in meta["shards"])
    assert "matrix" in meta and "executor" not in meta["matrix"]
    assert (folder / "report.md").is_file()


@needs_slurm
def test_slurm_two_shards_match_serial(tiny):
    cfg, d, serial = tiny
    assert _run(cfg, d, "slurm", "--executor", "slurm", "--shards", "2") == 0
    _same_as_serial(serial, d / "slurm", jobs=2)
    jobs = files.read_jobs(d / "slurm")
    assert [j["executor"] for j in jobs] == ["slurm", "slurm"] and "_" in jobs[0]["job_id"]


def test_local_two_shards_match_serial(tiny):
    cfg, d, serial = tiny
    assert _run(cfg, d, "local", "--executor", "local", "--shards", "2") == 0
    _same_as_serial(serial, d / "local", jobs=2)
    md = (d / "local" / "report.md").read_text()
    assert "shards at once on one node" in md  # CPU timings with 2 shards on this node
    before = (d / "local" / "results.csv").read_text()
    # another executor is the same run: resumed, nothing left to measure
    assert _run(cfg, d, "local", "--executor", "serial", "--no-report") == 0
    assert (d / "local" / "results.csv").read_text() == before


@needs_slurm
def test_scancel_one_shard_then_one_rerun_finishes_each_case_once(tmp_path, monkeypatch):
    monkeypatch.setenv(EXTRA_ENV, FAKES)  # the jobs inherit it and register the fakes
    monkeypatch.setattr(engine, "SCHEDULER_POLL_S", 1.0)  # a test need not spare squeue
    cfg = tmp_path / "slow.toml"
    # each case sleeps through 8 calls (3 for memory, 5 for error and time): at least
    # 1.6 s, so the cancel (SIGTERM, then SIGKILL after KillWait = 5 s), sent as soon as
    # shard 0's first row is there, lands mid-shard and kills a worker in the middle of a case
    cfg.write_text('variants = {_test_sleeps = [{seconds = 0.2}, {seconds = 0.25}]}\n'
                   'seq_lens = [16, 32, 48]\nheads = 1\nhead_dim = 8\npasses = ["forward"]\n'
                   'min_run_time_s = 0.01\nmin_repeats = 3\n')
    argv = ("--executor", "slurm", "--shards", "2")
    assert _run(cfg, tmp_path, "r", *argv, "--no-wait") == 0
    folder = tmp_path / "r"
    [a, b] = files.read_jobs(folder)
    deadline = time.monotonic() + 120
    while not _rows_or_none(files.shard_csv(folder, a["shard"])):
        assert time.monotonic() < deadline, "shard 0 wrote no row in 120 s"
        time.sleep(0.1)
    subprocess.run(["scancel", a["job_id"]], check=True)
    # at once, while squeue still shows the job (RUNNING, then COMPLETING for seconds): the
    # same command waits for it to end, resubmits what it left, and delivers the whole run
    # (its report, which nothing here reads, left out)
    assert _run(cfg, tmp_path, "r", *argv, "--no-report") == 0
    done_before = len(_rows(files.shard_csv(folder, a["shard"])))
    assert 1 <= done_before < 3, "the cancel came after shard 0 had finished"
    planned = [c.case_id for c in mx.load(str(cfg))[1]]
    rows = _rows(folder / "results.csv")
    assert [r["case_id"] for r in rows] == planned
    assert {r["status"] for r in rows} == {"ok"}  # the killed worker left no error row
    ids = Counter(r["case_id"] for i in files.shard_indices(folder)
                  for r in _rows(files.shard_csv(folder, i)))
    assert ids == Counter(planned)  # each case finished exactly once over all shard files
    jobs = files.read_jobs(folder)
    assert len(jobs) == 3 and len(jobs[2]["cases"]) == 3 - done_before  # only the rest again
    assert jobs[0]["state"] in ("CANCELLED", "COMPLETING")


KILLER = ('heads = 1\nhead_dim = 16\npasses = ["forward"]\nmin_run_time_s = 0.01\n'
          'min_repeats = 3\n[[groups]]\nvariants = ["sdpa", "linear"]\nseq_lens = [64, 128]\n'
          '[[groups]]\nvariants = ["_test_kills_job"]\nseq_lens = [64]\n')


def _killer_run(tmp_path, monkeypatch, executor: str) -> tuple[Path, list[dict]]:
    """A run whose case _test_kills_job N=64 kills its job each time it runs."""
    monkeypatch.setenv(EXTRA_ENV, FAKES)
    monkeypatch.setattr(engine, "SCHEDULER_POLL_S", 1.0)
    cfg = tmp_path / "killer.toml"
    cfg.write_text(KILLER)
    assert _run(cfg, tmp_path, "k", "--executor", executor, "--shards", "2",
                "--max-retries", "1", "--no-report") == 0  # every case has a row: exit 0
    folder = tmp_path / "k"
    rows = _rows(folder / "results.csv")
    assert [r["case_id"] for r in rows] == [c.case_id for c in mx.load(str(cfg))[1]]
    by = {(r["variant"], r["seq_len"]): r for r in rows}
    dead = by[("_test_kills_job", "64")]
    assert dead["status"] == "error"
    assert "each of the 2 times it ran (1 + --max-retries 1)" in dead["reason"]
    assert "shards/shard-" in dead["reason"] and "_log.err" in dead["reason"]
    assert all(r["status"] == "ok" for k, r in by.items() if k != ("_test_kills_job", "64"))
    jobs = files.read_jobs(folder)
    # two shards, then the killer once more (it dies again), then nothing: no loop
    assert len(jobs) == 3 and jobs[-1]["cases"] == [dead["case_id"]]
    ids = Counter(r["case_id"] for i in files.shard_indices(folder)
                  for r in _rows(files.shard_csv(folder, i)))
    assert set(ids.values()) == {1} and len(ids) == 4  # no case finished twice
    return folder, jobs


@pytest.mark.timeout(240)
def test_local_case_that_kills_its_job_becomes_an_error_row_after_retries(tmp_path, monkeypatch):
    _, jobs = _killer_run(tmp_path, monkeypatch, "local")
    dead = [j for j in jobs if j.get("state")]
    assert [j["state"] for j in dead] == ["KILLED", "KILLED"]


@needs_slurm
@pytest.mark.timeout(240)
def test_slurm_case_that_kills_its_job_becomes_an_error_row_after_retries(tmp_path, monkeypatch):
    folder, jobs = _killer_run(tmp_path, monkeypatch, "slurm")
    assert [j["state"] for j in jobs if j.get("state")] == ["FAILED", "FAILED"]
    dead = [r for r in _rows(folder / "results.csv") if r["status"] == "error"][0]
    assert "slurm job" in dead["reason"] and "FAILED" in dead["reason"]


def _fake_job(folder: Path, shard: int, cases: list[str], logged: list[str]) -> dict:
    """An ended local job (no such process, no result) whose worker log names `logged`."""
    log = files.shard_log(folder, shard)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"--- 2026-01-01T00:00:00+00:00 time {c} label\n" for c in logged))
    return {"shard": shard, "job_id": str(2**22 + 7 + shard), "executor": "local",
            "logs": str(folder / "submitit"), "cases": cases}


def test_a_dead_job_uses_the_chance_of_the_case_it_was_on(tmp_path, monkeypatch):
    monkeypatch.setattr(executors, "_controller_alive", lambda pid: False)
    cases = mx.expand(mx.normalise({"variants": ["sdpa"], "seq_lens": [16, 32, 48, 64],
                                    "heads": 1, "head_dim": 8}))
    c = [x.case_id for x in cases]
    folder = tmp_path / "run"
    jobs = [_fake_job(folder, 0, c[:3], [c[0], c[1]]),   # finished c0, died on c1
            _fake_job(folder, 1, c[3:], []),             # died before measuring anything
            _fake_job(folder, 2, c[1:3], [c[1]])]        # c1 again: died on it again
    with files.shard_csv(folder, 0).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerow({"case_id": c[0], "variant": "sdpa", "status": "ok"})
    submitted = []
    monkeypatch.setattr(engine, "_submit", lambda w, s, f, parts, first, created: submitted.extend(
        {"shard": first + i, "job_id": "1", "executor": "local",
         "cases": [x.case_id for x in p]} for i, p in enumerate(parts)) or submitted)
    rs = engine._Resubmit(sharded.WORK, cases, folder, jobs,
                          executors.Settings("local", 1, max_retries=1), rate=1e9)
    used = rs._chances_used(live=set(), finished={c[0]})
    # c1: the case jobs 0 and 2 were on (c2, queued behind it, keeps its chances); c3: job
    # 1 named no case, so the cases it held lost one
    assert {k: [j["shard"] for j in v] for k, v in used.items()} == {c[1]: [0, 2], c[3]: [1]}
    assert {j["state"] for j in jobs} == {"KILLED"}
    rs(live=set())
    rows = _rows(folder / "results.csv")  # c1 had 1 + 1 chances: an error row
    assert [(r["case_id"], r["status"]) for r in rows] == [(c[1], "error")]
    assert "local job 4194311 KILLED, 4194313 KILLED" in rows[0]["reason"]
    assert [j["cases"] for j in submitted] == [c[2:]]  # the others get their next chance
    assert len(files.read_jobs(folder)) == 4


HOLDING = ("PENDING", "RUNNING", "CONFIGURING", "RESIZING", "SUSPENDED", "STOPPED", "REQUEUED")
ENDED = ("COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REQUEUE_HOLD", "SPECIAL_EXIT", "REVOKED")


def test_a_slurm_job_holds_its_units_only_in_the_states_that_keep_it(tmp_path, monkeypatch):
    """executors.alive (the engine's only view of a job, for `run` and `train`) against a
    squeue that lists one job in each state; COMPLETING (a cancelled job, for seconds)
    ends the hold, REQUEUED keeps it (the job runs again)."""
    states = HOLDING + ENDED
    listing = "".join(f"{i}|{s}\n" for i, s in enumerate(states))
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    jobs = [{"job_id": str(i), "executor": "slurm"} for i in range(len(states) + 1)]
    assert executors.states(jobs)[str(len(states))] == "GONE"  # squeue forgot it: ended
    live = executors.alive(jobs)
    assert {states[int(j)] for j in live} == set(HOLDING)


def test_a_requeued_job_leaves_alone_what_a_newer_job_holds(tmp_path):
    folder = tmp_path / "run"
    files.write_jobs(folder, [{"shard": 0, "job_id": "1_0", "executor": "slurm",
                                "cases": ["a" * 16, "b" * 16]}])
    assert not files.taken_elsewhere(folder, "b" * 16, 0)
    # shard 0's job ended (COMPLETING), b went to shard 2; then Slurm ran shard 0 again
    files.write_jobs(folder, files.read_jobs(folder) + [
        {"shard": 2, "job_id": "3", "executor": "slurm", "cases": ["b" * 16]}])
    assert files.taken_elsewhere(folder, "b" * 16, 0)
    assert not files.taken_elsewhere(folder, "a" * 16, 0)
    assert not files.taken_elsewhere(folder, "b" * 16, 2)  # the newest holder measures it
    with (folder / "results.csv").open("w", newline="") as f:  # a was given up on: a row
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerow({"case_id": "a" * 16, "status": "error"})
    assert files.taken_elsewhere(folder, "a" * 16, 0)


@needs_slurm
def test_refused_submission_exits_2_writes_nothing(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    argv = ("--executor", "slurm", "--slurm-partition", "no-such-partition")
    assert _run(cfg, tmp_path / "runs", "r", *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused" in err and "partition" in err
    assert not (tmp_path / "runs" / "r").exists()


def _rows_or_none(path: Path) -> list[dict]:
    return shards.read_rows(path) if path.exists() else []


@pytest.mark.parametrize("argv, words", [
    (["--executor", "slurm"], "not on PATH"),
    (["--executor", "slurm"], "no Slurm controller reachable"),
    (["--executor", "kubernetes"], "invalid choice: 'kubernetes'"),
    (["--executor", "local", "--shards", "0"], "shards must be positive"),
    (["--executor", "local", "--shards", "two"], "shards must be int"),
    (["--shards", "2"], "--shards needs --executor local or slurm"),
    (["--executor", "local", "--slurm-opt", "=high"], "expected KEY=VALUE or KEY"),
    (["--executor", "local", "--max-retries", "-1"], "max_retries must be a non-negative int"),
], ids=["no-sbatch", "no-controller", "unknown-executor", "zero-shards", "text-shards",
        "serial-shards", "bad-opt", "negative-retries"])
def test_bad_executor_settings_exit_2_write_nothing(tmp_path, monkeypatch, capsys, argv, words):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    if words == "not on PATH":
        empty = tmp_path / "bin"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))
    if words.startswith("no Slurm controller"):
        if shutil.which("scontrol") is None and not _REQUIRED:
            pytest.skip("scontrol is not installed: a dead controller cannot be asked")
        conf = tmp_path / "slurm.conf"  # a controller nobody runs, on a port nobody serves
        conf.write_text("ClusterName=dead\nSlurmctldHost=localhost\nSlurmctldPort=6999\n"
                        f"AuthType=auth/munge\nAuthInfo=socket={tmp_path}/none.socket\n"
                        "MessageTimeout=2\nNodeName=localhost CPUs=1\n"
                        "PartitionName=debug Nodes=ALL Default=YES\n")
        monkeypatch.setenv("SLURM_CONF", str(conf))
    out = tmp_path / "runs"
    assert _run(cfg, out, "r", *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and err.startswith("attnbench: error:")
    assert not out.exists()


def test_executor_table_in_toml_is_not_the_matrix(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text(TINY + '\n[executor]\nexecutor = "slurm"\nshards = 4\nslurm_time = 30\n')
    plain = tmp_path / "p.toml"
    plain.write_text(TINY)
    assert mx.load(str(cfg)) == mx.load(str(plain))  # a rerun with other settings resumes


def test_split_is_deterministic_balanced_and_keeps_series_whole():
    cfg_cases = mx.expand(mx.normalise({
        "variants": ["sdpa", "linear", "standard", "nystrom"], "seq_lens": [256, 1024, 4096],
        "passes": ["forward", "forward_backward"], "heads": 2}))
    cost = {c.case_id: c.seq_len ** 2 / 1e6 * (3 if c.backward else 1) for c in cfg_cases}
    planned = [(c, cost[c.case_id]) for c in cfg_cases]
    parts = shards.split(planned, 3)
    assert parts == shards.split(planned, 3)
    assert sorted(c.case_id for p in parts for c in p) == sorted(cost)
    homes = {}
    for i, p in enumerate(parts):
        for c in p:
            assert homes.setdefault(c.series(), i) == i  # a series never spans two shards
        order = [cfg_cases.index(c) for c in p]
        assert order == sorted(order)  # each shard keeps the matrix's order
    loads = [sum(cost[c.case_id] for c in p) for p in parts]
    # LPT: no shard exceeds the ideal share by more than the largest series
    biggest = max(sum(cost[c.case_id] for c in cfg_cases if c.series() == s)
                  for s in {c.series() for c in cfg_cases})
    assert max(loads) <= sum(loads) / 3 + biggest
    assert len(shards.split(planned[:2], 5)) == 1  # one series: one shard, none empty


@pytest.mark.parametrize("table, words", [
    ('executor = "slurm"\n', "must be a table ([executor])"),
    ('[executor]\nexecutor = "local"\nnodes = 2\n', "unknown key(s) nodes"),
    ('[executor]\nexecutor = "local"\nshards = 0\n', "shards must be positive"),
])
def test_bad_executor_table_exits_2(tmp_path, capsys, table, words):
    cfg = tmp_path / "m.toml"
    cfg.write_text(table + TINY if not table.startswith("[") else TINY + table)
    assert _run(cfg, tmp_path / "runs", "r") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
    assert not (tmp_path / "runs").exists()


def test_report_notes_warn_about_mixed_hardware_and_shared_nodes():
    rec = {"host": "a", "cpu_model": "EPYC", "cpu_count": 64, "cuda_devices": ["H100"],
           "shards_on_node": 1}
    same = {"shards": [rec, {**rec, "host": "b"}]}
    assert not any("Warning" in n for n in provenance.environment_notes(same, {"cuda"}))
    assert "host(s): a (1), b (1)" in provenance.environment_notes(same, {"cuda"})[-1]
    mixed = {"shards": [rec, {**rec, "host": "b", "cuda_devices": ["A100"]}]}
    assert "different hardware" in provenance.environment_notes(mixed, {"cuda"})[0]
    shared = {"shards": [{**rec, "shards_on_node": 2}, {**rec, "shards_on_node": 2}]}
    assert not any("CPU timings" in n for n in provenance.environment_notes(shared, {"cuda"}))
    assert "2 shards at once on one node (a)" in provenance.environment_notes(shared, {"cpu"})[0]
    assert provenance.environment_notes({}, {"cpu"}) == []  # a serial run: nothing to say
