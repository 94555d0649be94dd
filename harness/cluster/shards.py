"""A sharded run's files: the split of cases into shards, reading and merging shard files,
and the shards' provenance records for meta.json (the report reads them there).

Layout inside a run folder (only one process writes each file):

    shards/shard-<i>.csv      rows of shard i (results.csv's columns), written by its job
    shards/shard-<i>.rounds.jsonl  a run with rounds: shard i's finished rounds of cases
                              that have more to come (harness.measure.store), its job
    shards/shard-<i>.json     where shard i ran: host, job id, devices, load, busy samples
    shards/shard-<i>.log      its worker processes' stderr, a `--- <time> <part> <case id>`
                              line before each case (its job; the last names the case a
                              job that died was on)
    shards/jobs.json          every job submitted for this run, with the state it ended
                              in (the submitting process)
    submitit/                 submitit's pickles and job logs

Shard numbers grow across sessions (a resumed run's new jobs get new numbers), so no job
ever appends to a file an earlier job may still write. A case is finished when a complete
row with its id is in results.csv or in any shard file; merging writes results.csv with
every finished case once, in the order of the matrix (the order a serial run writes).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
from collections import defaultdict
from pathlib import Path

from harness.measure.matrix import Case
from harness.measure.store import COLUMNS, RESULTS, ROUNDS

SHARDS = "shards"
JOBS = "jobs.json"
_SHARD_CSV = re.compile(r"shard-(\d+)\.csv$")


def shard_csv(folder: Path, index: int) -> Path:
    return Path(folder) / SHARDS / f"shard-{index}.csv"


def shard_record_path(folder: Path, index: int) -> Path:
    return Path(folder) / SHARDS / f"shard-{index}.json"


def shard_rounds(folder: Path, index: int) -> Path:
    return Path(folder) / SHARDS / f"shard-{index}.{ROUNDS}"


def shard_log(folder: Path, index: int) -> Path:
    return Path(folder) / SHARDS / f"shard-{index}.log"


_LOGGED = re.compile(rb"^--- \S+ \w+ ([0-9a-f]{16}) ", re.M)


def last_logged_case(folder: Path, index: int) -> str | None:
    """The case id shard i's workers were last given (runner.Worker logs one line before
    each part of each case), or None when its log names none."""
    path = shard_log(folder, index)
    if not path.is_file():
        return None
    with path.open("rb") as f:  # the tail is enough: one case's stderr is short
        f.seek(max(f.seek(0, os.SEEK_END) - (1 << 20), 0))
        found = _LOGGED.findall(f.read())
    return found[-1].decode() if found else None


_cache: dict[Path, tuple[tuple[int, int], object]] = {}


def _cached(path: Path, parse):
    """parse(path), read again only when the file's mtime or size changed."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return parse(None)
    key = (st.st_mtime_ns, st.st_size)
    if path not in _cache or _cache[path][0] != key:
        _cache[path] = (key, parse(path))
    return _cache[path][1]


def taken_elsewhere(folder: Path, case_id: str, index: int) -> bool:
    """A case that shard i must leave alone: a newer job of the run holds it (shard i's
    job ended once, its cases went to a new job, and Slurm ran it again after a requeue),
    or results.csv has its row (the submitting process gave up on it)."""
    folder = Path(folder)
    holders = _cached(folder / SHARDS / JOBS, lambda p: _holders(read_jobs(folder) if p else []))
    if holders.get(case_id, index) > index:
        return True
    return case_id in _cached(folder / RESULTS,
                              lambda p: {r["case_id"] for r in read_rows(p)} if p else set())


def _holders(jobs: list[dict]) -> dict[str, int]:
    """case id -> the newest shard number that holds it."""
    out: dict[str, int] = {}
    for j in jobs:
        for cid in j["cases"]:
            out[cid] = max(out.get(cid, j["shard"]), j["shard"])
    return out


def split(planned: list[tuple[Case, float]], n: int, unit=lambda case: case.series()
          ) -> list[list[Case]]:
    """Cases into at most n shards of near-equal predicted cost; deterministic.

    A series (cases differing only in length, input and seed) stays whole in one shard and
    in order, so the memory guard's extrapolation and the skip after a timeout see what a
    serial run sees. Series go largest first to the least loaded shard (LPT scheduling,
    Graham 1969: within 4/3 of the best makespan); ties go to the lower shard number.
    Each shard keeps the matrix's order. Empty shards are dropped. `unit` names what stays
    together (a training sweep's configurations: each one alone).
    """
    series: dict[object, list[tuple[int, Case, float]]] = defaultdict(list)
    for pos, (case, cost) in enumerate(planned):
        series[unit(case)].append((pos, case, cost))
    units = sorted(series.values(), key=lambda u: (-sum(c for _, _, c in u), u[0][0]))
    loads, shards = [0.0] * n, [[] for _ in range(n)]
    for members in units:
        i = min(range(n), key=lambda k: (loads[k], k))
        loads[i] += sum(c for _, _, c in members)
        shards[i] += members
    return [[case for _, case, _ in sorted(s, key=lambda m: m[0])] for s in shards if s]


def read_rows(path: Path) -> list[dict]:
    """The complete rows of a results file; a partial last line (a job killed mid-write,
    or one still writing) is left out, not cut: its writer may still own the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    data = data[:data.rfind(b"\n") + 1]
    return list(csv.DictReader(io.StringIO(data.decode())))


def shard_indices(folder: Path) -> list[int]:
    d = Path(folder) / SHARDS
    found = [_SHARD_CSV.search(p.name) for p in d.glob("shard-*.csv")] if d.is_dir() else []
    return sorted(int(m.group(1)) for m in found if m)


def finished_rows(folder: Path) -> dict[str, dict]:
    """case id -> its row, over results.csv then every shard file (first row of an id wins)."""
    rows: dict[str, dict] = {}
    paths = [Path(folder) / RESULTS] + [shard_csv(folder, i) for i in shard_indices(folder)]
    for path in paths:
        for row in read_rows(path):
            rows.setdefault(row["case_id"], row)
    return rows


def merge(folder: Path, cases: list[Case]) -> int:
    """Rewrite results.csv with every finished case once, in matrix order; returns the count.

    Written to a temporary file and renamed, so results.csv is never half written.
    """
    rows = finished_rows(folder)
    order = {c.case_id: i for i, c in enumerate(cases)}
    ids = sorted(rows, key=lambda k: (order.get(k, len(order)), k))
    path = Path(folder) / RESULTS
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        w.writeheader()
        for k in ids:
            w.writerow({c: rows[k].get(c, "") for c in COLUMNS})
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(ids)


# -- jobs and provenance ---------------------------------------------------------------------
def read_jobs(folder: Path) -> list[dict]:
    path = Path(folder) / SHARDS / JOBS
    return json.loads(path.read_text()) if path.exists() else []


def write_jobs(folder: Path, jobs: list[dict]) -> None:
    path = Path(folder) / SHARDS / JOBS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jobs, indent=1) + "\n")
    os.replace(tmp, path)


def write_record(folder: Path, index: int, record: dict) -> None:
    path = shard_record_path(folder, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _when(text: str | None) -> datetime.datetime:
    if not text:
        return datetime.datetime.now(datetime.timezone.utc)
    return datetime.datetime.fromisoformat(text)


def records(folder: Path) -> list[dict]:
    """Every shard's record, with `shards_on_node`: how many shards of this run ran on its
    host at once with it (itself included): more than one share that node's cores."""
    out = []
    for i in shard_indices(folder):
        path = shard_record_path(folder, i)
        if path.exists():
            out.append(json.loads(path.read_text()))
    for r in out:
        start, end = _when(r.get("started")), _when(r.get("ended"))
        r["shards_on_node"] = sum(1 for o in out if o["host"] == r["host"]
                                  and _when(o.get("started")) < end
                                  and start < _when(o.get("ended")))
    return out
