"""A run's folder: results.csv (appended and fsynced row by row) and meta.json.

Resume rule: a folder is resumed only when its meta.json holds the same normalised matrix;
every case id already in results.csv (whatever its status) counts as done and is skipped.
A partial last line (a run killed while writing) is cut off before appending.

A run timed in rounds (`rounds` > 1) appends each finished round of a case that has more
to come to rounds.jsonl (a shard: shards/shard-<i>.rounds.jsonl), one JSON line each:
{"case_id", "round", "rounds", "samples_ms", "row"}, `row` being round 1's full result
(memory, error, its timing). The case's row goes to results.csv when its last round ends,
so a run killed in round 2 keeps round 1 and its resume times only what is missing.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import variants
from harness.files import META, RESULTS, ROUNDS, CsvLog, check_folder, now, write_json  # noqa: F401 (re-exported)
from harness.files import RESULT_COLUMNS as COLUMNS
from harness.files.columns import LATER_RESULT_COLUMNS


class RunStore:
    def __init__(self, folder: Path, csv_path: Path | None = None,
                 rounds_path: Path | None = None):
        self.folder = Path(folder)
        # a shard of a sharded run appends to its own files (harness.cluster.shards)
        self.csv_path = Path(csv_path) if csv_path is not None else self.folder / RESULTS
        self.rounds_path = Path(rounds_path) if rounds_path is not None else self.folder / ROUNDS
        self.meta_path = self.folder / META

    def _csv(self) -> CsvLog:
        """results.csv: this version's columns, or a folder's from before the later ones."""
        return CsvLog(self.csv_path, COLUMNS, LATER_RESULT_COLUMNS)

    # -- checks before anything is written ---------------------------------------------
    def check(self, matrix: dict) -> bool:
        """Raise UsageError unless the folder is absent, empty, or a run of this matrix.

        Returns True when it is an existing run to resume.
        """
        return check_folder(self.folder, self.meta_path, self._csv(),
                            runs={META}, key="matrix", value=matrix,
                            other="a run of a different matrix")

    # -- results -------------------------------------------------------------------------
    def done_ids(self) -> set[str]:
        """Case ids already in results.csv, after cutting off a partial last line."""
        return {r["case_id"] for r in self._csv().rows(cut=True)}

    def open(self) -> None:
        self._log = self._csv()
        self._log.open()

    def append(self, row: dict) -> None:
        self._log.append(row)

    def close(self) -> None:
        self._log.close()

    def reorder(self, case_ids: list[str]) -> None:
        """Rewrite results.csv with its rows in this order (unknown ids last): a run with
        rounds writes a case's row when its last round ends, after the cases that failed
        or were skipped in round 1. Written aside and renamed: never half a file."""
        rows = CsvLog(self.csv_path, COLUMNS, LATER_RESULT_COLUMNS).rows(cut=True)
        rank = {cid: i for i, cid in enumerate(case_ids)}
        ordered = sorted(rows, key=lambda r: rank.get(r["case_id"], len(rank)))
        if ordered == rows:
            return
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(ordered)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.csv_path)

    # -- rounds ----------------------------------------------------------------------------
    def read_rounds(self) -> dict[str, dict[int, dict]]:
        """case id -> round -> its record, over every rounds file of the run folder (this
        one's and its shards': a case resubmitted to another shard keeps its rounds). The
        first record of a (case, round) wins; a partial last line is left out."""
        out: dict[str, dict[int, dict]] = {}
        paths = [self.folder / ROUNDS, *sorted(self.folder.glob(f"*/*.{ROUNDS}"))]
        for path in dict.fromkeys(paths + [self.rounds_path]):
            if not path.is_file():
                continue
            data = path.read_bytes()
            for line in data[:data.rfind(b"\n") + 1].splitlines():
                rec = json.loads(line)
                out.setdefault(rec["case_id"], {}).setdefault(rec["round"], rec)
        return out

    def append_round(self, record: dict) -> None:
        """Append one finished round of a case (fsynced: a kill after it keeps it)."""
        path = self.rounds_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            if f.tell():  # a partial last line left by a killed writer of this file: cut it
                data = path.read_bytes()
                end = data.rfind(b"\n") + 1
                if end < len(data):
                    f.truncate(end)
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())

    # -- meta ------------------------------------------------------------------------------
    def read_meta(self) -> dict:
        return json.loads(self.meta_path.read_text()) if self.meta_path.exists() else {}

    def write_meta(self, meta: dict) -> None:
        write_json(self.meta_path, meta)


def environment(threads: int) -> dict:
    """The facts meta.json keeps beside the results: versions, devices, CPU, commit, speed,
    the variant modules loaded (variants.loaded_modules)."""
    import platform
    import subprocess
    from importlib import metadata

    import torch

    try:
        xformers = metadata.version("xformers")
    except metadata.PackageNotFoundError:
        xformers = None
    cpu_model = None
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    repo = Path(__file__).resolve().parents[2]
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           capture_output=True, text=True)
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"python": platform.python_version(), "torch": torch.__version__,
            "xformers": xformers, "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
            "threads": threads, "cuda_devices": cuda,
            # Other work on the cores distorts times (OpenMP threads wait on each other):
            # the 1, 5, 15-minute load averages as the run starts.
            "load_average_start": [round(x, 2) for x in os.getloadavg()],
            "git_commit": git.stdout.strip() or None,
            "git_dirty": bool(dirty.stdout.strip()) if git.returncode == 0 else None,
            # Variants from outside the package: each module's file and source hash.
            "variant_modules": variants.loaded_modules()}


def matmul_fp32_gflops(threads: int, n: int = 2048) -> float:
    """This machine's fp32 matmul rate: 2 n^3 / median time of an n x n matmul, on CPU."""
    return matmul_gflops("cpu", "float32", threads, n)


def read_bandwidth_gbps(threads: int, nbytes: int = 2**30) -> float:
    """This machine's read rate (GB/s, 1e9 bytes): the bytes of a float32 tensor of
    `nbytes` over the median time of its sum (each byte read once), on CPU. A decode step
    reads its whole state: this is the bound its time per token is set against."""
    import statistics
    import time

    import torch

    torch.set_num_threads(threads)
    x = torch.ones(nbytes // 4)
    x.sum()  # first touch and warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    del x
    return nbytes / statistics.median(times) / 1e9


def matmul_rates(cases, threads: int, known: dict | None = None,
                 min_run_time: float = 0.5) -> dict[str, float]:
    """"device dtype" -> matmul GFLOP/s for every (device, dtype) of the cases not in
    `known` (CUDA only where a device is visible: the runner skips those cases otherwise)."""
    import torch

    rates = dict(known or {})
    for device, dtype in dict.fromkeys((c.device, c.dtype) for c in cases):
        if f"{device} {dtype}" not in rates and (device != "cuda" or torch.cuda.is_available()):
            rates[f"{device} {dtype}"] = matmul_gflops(device, dtype, threads,
                                                       min_run_time=min_run_time)
    return rates


def matmul_gflops(device: str, dtype: str, threads: int, n: int | None = None,
                  min_run_time: float = 0.5) -> float:
    """The matmul rate of `device` in `dtype`: 2 n^3 / median time of an n x n matmul.

    CPU: n = 2048 in float32, 1024 in other dtypes (slower here: no bf16 units, float64
    at half rate). CUDA: n = 8192, timed with CUDA events (harness.measure.timing), the
    operands freed and the caching allocator emptied afterwards. The variants of a CUDA
    run are set against this rate in their own dtype (tensor cores in bfloat16, not the
    CPU's float32).
    """
    import torch
    from harness.measure.memory import release
    from harness.measure.timing import time_call

    dev = torch.device(device)
    if n is None:
        n = 8192 if dev.type == "cuda" else (2048 if dtype == "float32" else 1024)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=dev, dtype=getattr(torch, dtype))
            for _ in range(2))
    t = time_call(lambda: a @ b, min_run_time=min_run_time, min_repeats=5, warmup=2, device=dev)
    del a, b
    release(dev.type)
    return 2 * n**3 / (t.time_ms * 1e6)
