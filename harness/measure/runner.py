"""Runs a matrix's cases, each in a worker process, and appends one row per case.

The runner knows no variant by name: it asks the registry for each case's module, its
declared unsupported reasons (the case is `skipped` with them) and its FLOP count. Two
`python -m harness.measure.worker` processes run cases one after the other: one measures peak
memory under the malloc settings that make it readable, the other error and time under
glibc's defaults (harness.measure.worker says why). Peak memory is read per call relative to the
resident size before it, so reuse keeps readings right; a worker is replaced after a
timeout (killed), a crash, or an out-of-memory case. The time limit covers both parts. Before a case runs,
the memory guard (harness.measure.memory.MemoryGuard) may refuse it, and a case longer than one
of the same series that timed out is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import variants
from harness.models import capture
from harness.measure.matrix import Case
from harness.measure.memory import MALLOC_ENV, MemoryGuard, is_oom_message
from harness.measure.store import RunStore, environment, matmul_fp32_gflops, now
from harness.measure.worker import RESULT_PREFIX

REPO = Path(__file__).resolve().parents[2]
STATUSES = ("ok", "skipped", "oom", "timeout", "error", "nonfinite")
NO_CUDA = "CUDA is not available on this machine"


class Worker:
    """One `python -m <module>` subprocess answering JSON-line requests, one result each:
    by default harness.measure.worker, measuring one part of each case it is fed."""

    def __init__(self, part: str, log_path: Path, threads: int,
                 module: str = "harness.measure.worker"):
        self.part = part
        malloc = MALLOC_ENV if part == "memory" else {}
        env = {**os.environ, **malloc, "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, start_new_session=True)

    def run(self, case: Case, timeout_s: float) -> dict:
        """The worker's result for case, or a timeout/oom/error result if it did not give one."""
        return self.call({"case": case.to_json(), "part": self.part},
                         f"{self.part} {case.case_id} {case.label()}", timeout_s, case.timeout_s)

    def call(self, request: dict, label: str, timeout_s: float, limit_s: float) -> dict:
        """Send one request; its result, or a timeout/oom/error result if none came back
        within timeout_s (the time left of the limit limit_s the reason names)."""
        start = time.monotonic()
        self._log.write(f"--- {now()} {label}\n".encode())
        self._log.flush()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        buf = b""
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(RESULT_PREFIX.encode()):
                    return json.loads(line[len(RESULT_PREFIX):])
            left = timeout_s - (time.monotonic() - start)
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                self.kill()
                return {"status": "timeout",
                        "reason": f"exceeded timeout_s={limit_s:g} s; worker killed"}
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return self._died()
            buf += chunk

    def _died(self) -> dict:
        rc = self.proc.wait()
        tail = _tail(self.log_path)
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        if is_oom_message(tail):
            return {"status": "oom", "reason": f"worker {how}: {tail}"}
        if rc == -9:  # not our kill: on Linux the usual sender is the kernel's OOM killer
            return {"status": "oom", "reason": f"worker {how} (likely the kernel OOM killer)"}
        return {"status": "error", "reason": f"worker {how}: {tail}"}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # its own session: the worker and nothing else
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class WorkerPair:
    """The memory worker and the time worker; a case's row merges their results."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.workers: dict[str, Worker | None] = {"memory": None, "time": None}

    def measure(self, case: Case) -> dict:
        start, result = time.monotonic(), {}
        for part in ("memory", "time"):
            w = self.workers[part]
            if w is None or not w.alive():
                w = self.workers[part] = Worker(part, self.log_path, case.threads)
            left = case.timeout_s - (time.monotonic() - start)
            got = w.run(case, left) if left > 0 else {
                "status": "timeout", "reason": f"exceeded timeout_s={case.timeout_s:g} s"}
            if got["status"] == "oom" or not w.alive():  # a fresh heap for the next case
                w.close()
                self.workers[part] = None
            if got["status"] != "ok":  # the failing part's row alone: no partial measurements
                return got
            result.update(got)
        return result

    def close(self) -> None:
        for w in self.workers.values():
            if w is not None:
                w.close()


def _tail(path: Path) -> str:
    lines = [s for s in path.read_text(errors="replace").splitlines() if s.strip()]
    return lines[-1][:400] if lines else "(no output)"


def case_row(case: Case, module) -> dict:
    """The descriptive columns of a case (everything but the measurements)."""
    flops = module.flops(case.batch, case.heads, case.seq_len, case.head_dim, case.causal)
    if case.backward:
        flops *= 3  # backward counted as twice the forward (two matmuls per forward matmul)
    return {"case_id": case.case_id, "variant": case.variant, "family": module.family,
            "params": case.params, "device": case.device, "dtype": case.dtype,
            "batch": case.batch, "heads": case.heads, "head_dim": case.head_dim,
            "seq_len": case.seq_len, "causal": case.causal, "pass": case.pass_,
            "input": case.input, "flops": flops, "seed": case.seed, "threads": case.threads}


def skip_reasons(case: Case, module) -> list[str]:
    """Reasons, known before running, that a case cannot run here (declared by the variant)."""
    reasons = []
    if case.device == "cuda" and not torch.cuda.is_available():
        reasons.append(NO_CUDA)
    reasons += module.unsupported_reasons(device=case.device, dtype=getattr(torch, case.dtype),
                                          causal=case.causal, seq_len=case.seq_len,
                                          head_dim=case.head_dim, backward=case.backward)
    return reasons + capture.skip_reasons(case)


def summary_line(n_cases: int, counts: Counter, earlier: int, folder: Path) -> str:
    """The last line of a run: rows written by status, cases done in earlier sessions."""
    summary = ", ".join(f"{s} {counts[s]}" for s in STATUSES)
    return (f"{n_cases} cases: {summary}{f' ({earlier} done earlier)' if earlier else ''} "
            f"-> {folder}")


def run(matrix: dict, cases: list[Case], store: RunStore, *, resume: bool) -> Counter:
    """Run every case not yet in the store; returns the count of rows by status (this run)."""
    done = store.done_ids() if resume else set()
    meta = store.read_meta() if resume else {}
    threads = cases[0].threads if cases else 1
    meta.update(environment(threads))
    busy = meta["load_average_start"][0]
    if busy > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {busy} on {os.cpu_count()} cores: other work will "
              "distort the times of this run", file=sys.stderr)
    if "matmul_fp32_gflops" not in meta:  # once per run, not per resumed session
        meta["matmul_fp32_gflops"] = matmul_fp32_gflops(threads)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None})
    meta.update({"matrix": matrix, "cases": len(cases), "ended": None})
    store.write_meta(meta)
    bar = tqdm(total=len(cases), initial=sum(c.case_id in done for c in cases), unit="case",
               file=sys.stderr, dynamic_ncols=True)
    try:
        return measure(cases, store, done, store.folder / "worker.log", bar)
    finally:
        bar.close()
        meta["sessions"][-1]["ended"] = meta["ended"] = now()
        meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        store.write_meta(meta)


def measure(cases: list[Case], store: RunStore, done: set[str], log_path: Path,
            bar=None) -> Counter:
    """The measuring loop: append one row per case not in `done`, in order, to the store.

    Shared by the serial run (above) and each shard of a sharded one (harness.cluster.executors).
    Returns the count of rows written by status. `bar`: a tqdm bar to advance, or None.
    """
    store.open()
    guard, counts = MemoryGuard(), Counter()
    workers = WorkerPair(log_path)
    timed_out: dict[tuple, int] = {}  # series -> shortest length that timed out
    try:
        for case in cases:
            if case.case_id in done:
                continue
            if bar is not None:
                bar.set_postfix_str(case.label(), refresh=True)
            module = variants.build(case.variant, **case.param_dict)
            row = case_row(case, module)
            reasons = skip_reasons(case, module)
            guard_reason = None if reasons else guard.refuse_reason(case, module)
            slow = timed_out.get(case.series())
            if slow is not None and slow < case.seq_len:  # a longer case would time out too
                guard_reason = guard_reason or (f"the same case timed out at N={slow} "
                                                f"(timeout_s={case.timeout_s:g}); longer skipped")
            if reasons or guard_reason:
                row.update(status="skipped", reason="; ".join(reasons) or guard_reason)
            else:
                row.update(workers.measure(case))
            if row.get("time_ms"):
                row["gflops_per_s"] = row["flops"] / (row["time_ms"] * 1e6)
            guard.record(case.series(), case.seq_len, row.get("peak_mem_mib"))
            if row["status"] == "timeout":
                timed_out[case.series()] = min(case.seq_len, timed_out.get(case.series(), case.seq_len))
            store.append(row)
            counts[row["status"]] += 1
            if bar is not None:
                bar.update(1)
    finally:
        workers.close()
        store.close()
    return counts
