"""A sharded run's files: the split of units into shards, reading and merging shard files,
the list of jobs, and the shards' provenance records for meta.json (the report reads them).

Two layouts, one per command (`Files`): a benchmark run (`MATRIX`: its units are cases) and
a training sweep (`TRAIN`: configurations), side by side in one run folder (only one
process writes each file):

    shards/shard-<i>.csv      rows of shard i (results.csv's columns), written by its job
    shards/shard-<i>.rounds.jsonl  a run with rounds: shard i's finished rounds of cases
                              that have more to come (harness.measure.store), its job
    shards/shard-<i>.json     where shard i ran: host, job id, devices, load, busy samples
    shards/shard-<i>.log      its worker processes' stderr, a `--- <time> <part> <unit id>`
                              line before each unit (its job; the last names the unit a
                              job that died was on)
    shards/jobs.json          every job submitted for this run, with the state it ended
                              in (the submitting process)
    shards/train-<i>.csv, .json, .log, shards/train-jobs.json
                              the same for a training sweep (train.csv's columns)
    shards/train-<i>_curves.jsonl  shard i's training curves (train_curves.jsonl's lines)
    submitit/                 submitit's pickles and job logs

Shard numbers grow across sessions (a resumed run's new jobs get new numbers), so no job
ever appends to a file an earlier job may still write. A unit is finished when a complete
row with its id is in the result file or in any shard file; merging writes the result file
with every finished unit once, in the order of the matrix (the order a serial run writes),
and a training sweep's curves file with each of those units' line from the file beside the
row that was kept.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import os
import re
from collections import defaultdict
from pathlib import Path

from harness.files import RESULT_COLUMNS, RESULTS, ROUNDS, TRAIN_COLUMNS, TRAIN_CSV, write_json
from harness.files.curves import curves_path, read_curves

SHARDS = "shards"
_LOGGED = re.compile(rb"^--- \S+ \w+ ([0-9a-f]{16}) ", re.M)


@dataclasses.dataclass(frozen=True)
class Files:
    """One command's files in a run folder: `prefix`-<i>.* per shard, the result file
    (`results`, its `columns`, a row's id in column `key`), the jobs list (`jobs`), where
    each job lists the ids it holds under `held`; with `curves`, each result file has a
    training curves file beside it (harness.files.curves), merged with it."""
    prefix: str
    results: str
    columns: tuple
    key: str
    jobs: str
    held: str
    curves: bool = False

    def _shard(self, folder: Path, index: int, suffix: str) -> Path:
        return Path(folder) / SHARDS / f"{self.prefix}-{index}.{suffix}"

    def shard_csv(self, folder: Path, index: int) -> Path:
        return self._shard(folder, index, "csv")

    def shard_record(self, folder: Path, index: int) -> Path:
        return self._shard(folder, index, "json")

    def shard_log(self, folder: Path, index: int) -> Path:
        return self._shard(folder, index, "log")

    def shard_rounds(self, folder: Path, index: int) -> Path:
        return self._shard(folder, index, ROUNDS)

    def shard_indices(self, folder: Path) -> list[int]:
        d = Path(folder) / SHARDS
        pattern = re.compile(rf"{self.prefix}-(\d+)\.csv$")
        found = [pattern.match(p.name) for p in d.glob(f"{self.prefix}-*.csv")] if d.is_dir() else []
        return sorted(int(m.group(1)) for m in found if m)

    def finished_rows(self, folder: Path) -> dict[str, dict]:
        """unit id -> its row, over the result file then every shard file (the first row
        of an id wins)."""
        return {k: row for k, (row, _) in self._finished(folder).items()}

    def _finished(self, folder: Path) -> dict[str, tuple[dict, Path]]:
        """unit id -> (its row, the file it was read from), as finished_rows."""
        rows: dict[str, tuple[dict, Path]] = {}
        paths = [Path(folder) / self.results] + [self.shard_csv(folder, i)
                                                 for i in self.shard_indices(folder)]
        for path in paths:
            for row in read_rows(path):
                rows.setdefault(row[self.key], (row, path))
        return rows

    def merge(self, folder: Path, ids: list[str]) -> int:
        """Rewrite the result file with every finished unit once, in the order of `ids`
        (the matrix's; unknown ids last); returns the count. Written to a temporary file
        and renamed, so it is never half written."""
        found = self._finished(folder)
        order = {k: i for i, k in enumerate(ids)}
        keys = sorted(found, key=lambda k: (order.get(k, len(order)), k))
        path = Path(folder) / self.results
        if self.curves:  # first, so that no merged row's line is missing from it
            lines = {p: read_curves(curves_path(p)) for p in {src for _, src in found.values()}}
            kept = [lines[found[k][1]][k] for k in keys if k in lines[found[k][1]]]
            _replace(curves_path(path),
                     lambda f: f.writelines(json.dumps(c) + "\n" for c in kept))
        _replace(path, lambda f: _write_rows(f, self.columns, [found[k][0] for k in keys]))
        return len(keys)

    def read_jobs(self, folder: Path) -> list[dict]:
        path = Path(folder) / SHARDS / self.jobs
        return json.loads(path.read_text()) if path.exists() else []

    def write_jobs(self, folder: Path, jobs: list[dict]) -> None:
        path = Path(folder) / SHARDS / self.jobs
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(jobs, indent=1) + "\n")
        os.replace(tmp, path)

    def last_logged(self, folder: Path, index: int) -> str | None:
        """The unit id shard i's workers were last given (harness.measure.processes.Worker
        logs one line before each request), or None when its log names none."""
        path = self.shard_log(folder, index)
        if not path.is_file():
            return None
        with path.open("rb") as f:  # the tail is enough: one unit's stderr is short
            f.seek(max(f.seek(0, os.SEEK_END) - (1 << 20), 0))
            found = _LOGGED.findall(f.read())
        return found[-1].decode() if found else None

    def taken_elsewhere(self, folder: Path, unit_id: str, index: int) -> bool:
        """A unit that shard i must leave alone: a newer job of the run holds it (shard i's
        job ended once, its units went to a new job, and Slurm ran it again after a
        requeue), or the result file has its row (the submitting process gave up on it)."""
        folder = Path(folder)
        holders = _cached(folder / SHARDS / self.jobs,
                          lambda p: self._holders(self.read_jobs(folder) if p else []))
        if holders.get(unit_id, index) > index:
            return True
        return unit_id in _cached(folder / self.results,
                                  lambda p: {r[self.key] for r in read_rows(p)} if p else set())

    def _holders(self, jobs: list[dict]) -> dict[str, int]:
        """unit id -> the newest shard number that holds it."""
        out: dict[str, int] = {}
        for j in jobs:
            for uid in j[self.held]:
                out[uid] = max(out.get(uid, j["shard"]), j["shard"])
        return out

    def write_record(self, folder: Path, index: int, record: dict) -> None:
        write_json(self.shard_record(folder, index), record)

    def records(self, folder: Path) -> list[dict]:
        """Every shard's record, with `shards_on_node`: how many shards of this run ran on
        its host at once with it (itself included): more than one share that node's cores."""
        out = []
        for i in self.shard_indices(folder):
            path = self.shard_record(folder, i)
            if path.exists():
                out.append(json.loads(path.read_text()))
        for r in out:
            start, end = _when(r.get("started")), _when(r.get("ended"))
            r["shards_on_node"] = sum(1 for o in out if o["host"] == r["host"]
                                      and _when(o.get("started")) < end
                                      and start < _when(o.get("ended")))
        return out


MATRIX = Files("shard", RESULTS, tuple(RESULT_COLUMNS), "case_id", "jobs.json", "cases")
TRAIN = Files("train", TRAIN_CSV, tuple(TRAIN_COLUMNS), "config_id", "train-jobs.json",
              "configs", curves=True)


def _replace(path: Path, write) -> None:
    """write(f) into a temporary file, then renamed over `path`: never half written."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_rows(f, columns: tuple, rows: list[dict]) -> None:
    w = csv.DictWriter(f, fieldnames=columns, extrasaction="raise")
    w.writeheader()
    for row in rows:
        w.writerow({c: row.get(c, "") for c in columns})


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


def split(planned: list[tuple[object, float]], n: int, unit=lambda case: case.series()
          ) -> list[list]:
    """Units (cases, configurations) into at most n shards of near-equal predicted cost;
    deterministic.

    A series (cases differing only in length, input and seed) stays whole in one shard and
    in order, so the memory guard's extrapolation and the skip after a timeout see what a
    serial run sees. Series go largest first to the least loaded shard (LPT scheduling,
    Graham 1969: within 4/3 of the best makespan); ties go to the lower shard number.
    Each shard keeps the matrix's order. Empty shards are dropped. `unit` names what stays
    together (a training sweep's configurations: each one alone).
    """
    series: dict[object, list[tuple[int, object, float]]] = defaultdict(list)
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


def _when(text: str | None) -> datetime.datetime:
    if not text:
        return datetime.datetime.now(datetime.timezone.utc)
    return datetime.datetime.fromisoformat(text)
