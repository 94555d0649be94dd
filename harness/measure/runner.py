"""Runs a matrix's cases, each in a worker process, and appends one row per case.

The runner knows no variant by name: it asks the registry for each case's module, its
declared unsupported reasons (the case is `skipped` with them) and its FLOP count. Two
`python -m harness.measure.worker` processes run cases one after the other: one measures peak
memory under the malloc settings that make it readable, the other error and time under
glibc's defaults (harness.measure.worker says why). Peak memory is read per call relative to the
resident size before it, so reuse keeps readings right; a worker is replaced after a
timeout (killed), a crash, or an out-of-memory case. The time limit covers both parts. Before a case runs,
the memory guard (harness.measure.memory.MemoryGuard) may refuse it, and a case longer than one
of the same series that timed out or ran out of memory is skipped with that reason.

Rounds (a matrix's `rounds` = R > 1): round 1 of every case (memory, error and a timing
with min_run_time_s / R), then round 2 of every case (a fresh timing alone, `retime`),
..., in the matrix's order, so a case's rounds lie minutes apart and a drift of the
machine's speed shows as a spread instead of hiding in one slow minute. Each finished
round that is not the case's last goes to the store's rounds file; the last one writes the
row: time_ms, time_ms_iqr and repeats over every round's samples, `rounds`, and
`time_ms_spread`, the largest relative difference between two rounds' medians. A case
whose round 1 is not ok is a row at once; a later round that fails makes the row that
failure ("round r of R: ..."), keeping the earlier rounds' times. Before the run and
before each later round, harness.measure.busy samples what other work uses the cores.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import variants
from harness.models import capture
from harness.measure import busy as busy_sampler
from harness.measure import timing
from harness.measure.inputs import DISTRIBUTIONS
from harness.measure.matrix import Case
from harness.measure.memory import MALLOC_ENV, MemoryGuard, is_oom_message
from harness.measure.store import (RunStore, environment, matmul_fp32_gflops, matmul_rates, now,
                                   read_bandwidth_gbps)
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

    def run(self, case: Case, timeout_s: float, part: str | None = None) -> dict:
        """The worker's result for case, or a timeout/oom/error result if it did not give one.

        part: what to measure (default the worker's own part; `retime` in the time worker)."""
        part = part or self.part
        return self.call({"case": case.to_json(), "part": part},
                         f"{part} {case.case_id} {case.label()}", timeout_s, case.timeout_s)

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

    def retime(self, case: Case) -> dict:
        """A later round of a case: its time alone, in the time worker, within timeout_s."""
        w = self.workers["time"]
        if w is None or not w.alive():
            w = self.workers["time"] = Worker("time", self.log_path, case.threads)
        got = w.run(case, case.timeout_s, part="retime")
        if got["status"] == "oom" or not w.alive():
            w.close()
            self.workers["time"] = None
        return got

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
    if case.decode:
        flops = None  # the forward's count says nothing of one token's step
    per_head = module.state_size(case.seq_len, case.head_dim)
    return {"case_id": case.case_id, "variant": case.variant, "family": module.family,
            "params": case.params, "exact": module.exact_at(case.seq_len, case.causal),
            "err_ref": module.err_ref,
            "device": case.device, "dtype": case.dtype,
            "batch": case.batch, "heads": case.heads, "head_dim": case.head_dim,
            "seq_len": case.seq_len, "causal": case.causal, "pass": case.pass_,
            "input": case.input, "flops": flops, "seed": case.seed, "threads": case.threads,
            "state_size": None if per_head is None else case.batch * case.heads * per_head,
            "decode_tokens": case.decode_tokens if case.decode else None,
            "keys_per_query": module.keys_per_query(case.seq_len, case.causal)}


def skip_reasons(case: Case, module) -> list[str]:
    """Reasons, known before running, that a case cannot run here (declared by the variant)."""
    reasons = []
    if case.device == "cuda" and not torch.cuda.is_available():
        reasons.append(NO_CUDA)
    reasons += module.unsupported_reasons(device=case.device, dtype=getattr(torch, case.dtype),
                                          causal=case.causal, seq_len=case.seq_len,
                                          head_dim=case.head_dim, backward=case.backward)
    if case.decode and module.supports_causal:  # (a non-causal one's reason is above)
        reasons += module.decode_reasons()
        if case.input not in DISTRIBUTIONS:
            reasons.append(f"decode draws its context from a synthetic distribution, chunk by "
                           f"chunk; {case.input} is a captured input")
    if module.inputs and case.input not in DISTRIBUTIONS:  # nothing to draw them from
        reasons.append(f"{case.input} is a captured input without "
                       f"{', '.join(s.name for s in module.inputs)} ({case.variant}'s "
                       "inputs beyond q, k, v: the captured model has no gates)")
    return reasons + capture.skip_reasons(case)


def _why(what: str, case: Case) -> str:
    return f" (timeout_s={case.timeout_s:g})" if what == "timed out" else ""


def _total_mib(row: dict) -> float | None:
    """A case's measured memory: one call's peak plus the state the variant keeps."""
    peak = row.get("peak_mem_mib")
    return None if peak is None else peak + (row.get("state_mib") or 0.0)


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
    meta.setdefault("busy", []).append(busy_sample(0))
    if "matmul_fp32_gflops" not in meta:  # once per run, not per resumed session
        meta["matmul_fp32_gflops"] = matmul_fp32_gflops(threads)
    if any(c.decode for c in cases) and "read_bandwidth_gbps" not in meta:
        meta["read_bandwidth_gbps"] = read_bandwidth_gbps(threads)  # decode's bound
    # The rate each (device, dtype) of the run is set against: its own matmul, measured at
    # the start, before each later round and at the end (the machine's speed drifts
    # between minutes); `matmul_gflops` is the median of those samples.
    samples = meta.setdefault("matmul_samples", [])

    def sample_matmul(at: str, known: dict | None = None, min_run_time: float = 0.2) -> None:
        samples.append({"at": at, "rates": matmul_rates(cases, threads, known, min_run_time)})
        meta["matmul_gflops"] = median_rates(samples)

    # A first session's start reuses the fp32 rate just measured.
    sample_matmul("start", None if samples else {"cpu float32": meta["matmul_fp32_gflops"]}, 0.5)
    meta.setdefault("started", now())
    meta.setdefault("sessions", []).append({"started": now(), "ended": None})
    meta.update({"matrix": matrix, "cases": len(cases), "ended": None})
    store.write_meta(meta)
    bar = tqdm(total=sum(c.rounds for c in cases),
               initial=sum(c.rounds for c in cases if c.case_id in done),
               unit="case" if all(c.rounds == 1 for c in cases) else "case-round",
               file=sys.stderr, dynamic_ncols=True)

    def between_rounds(r: int) -> None:
        meta["busy"].append(busy_sample(r))
        sample_matmul(f"before round {r}")
        store.write_meta(meta)

    try:
        return measure(cases, store, done, store.folder / "worker.log", bar, between_rounds)
    finally:
        bar.close()
        if any(c.rounds > 1 for c in cases):  # rows came as last rounds ended: matrix order
            store.reorder([c.case_id for c in cases])
        sample_matmul("end")
        meta["sessions"][-1]["ended"] = meta["ended"] = now()
        meta["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        store.write_meta(meta)


def median_rates(samples: list[dict]) -> dict[str, float]:
    """"device dtype" -> the median of the matmul rates sampled during the run."""
    keys = dict.fromkeys(k for s in samples for k in s["rates"])
    return {k: statistics.median(s["rates"][k] for s in samples if k in s["rates"])
            for k in keys}


def busy_sample(before_round: int) -> dict:
    """A harness.measure.busy sample, its warning printed; before_round 0: the run's start."""
    s = busy_sampler.sample()
    when = f" before round {before_round}" if before_round else " as the run starts"
    said = busy_sampler.warning(s, when)
    if said:
        print(said, file=sys.stderr)
    return {**s, "before_round": before_round}


def measure(cases: list[Case], store: RunStore, done: set[str], log_path: Path,
            bar=None, between_rounds=None, skip=None) -> Counter:
    """The measuring loop: append one row per case not in `done`, in order, to the store;
    with rounds, round by round over all the cases (the module docstring).

    Shared by the serial run (above) and each shard of a sharded one (harness.cluster.executors).
    Returns the count of rows written by status. `bar`: a tqdm bar to advance by case-rounds,
    or None. `between_rounds(r)`: called before round r > 1 when it has cases to time.
    `skip(case)`: True leaves a case alone from then on (a shard's case given to a newer job).
    """
    store.open()
    guard, counts = MemoryGuard(), Counter()
    workers = WorkerPair(log_path)
    # series -> (shortest length that timed out or ran out of memory, what happened there)
    stopped: dict[tuple, tuple[int, str]] = {}
    done = set(done)  # grows as rows are written: a case failed in round 1 has no round 2
    todo = [c for c in cases if c.case_id not in done]
    earlier = store.read_rounds() if any(c.rounds > 1 for c in todo) else {}
    if bar is not None:
        bar.update(sum(len(earlier.get(c.case_id, {})) for c in todo))
    try:
        for r in range(1, max((c.rounds for c in todo), default=0) + 1):
            this = [c for c in todo if r <= c.rounds and c.case_id not in done
                    and r not in earlier.get(c.case_id, {})]
            if r > 1 and this and between_rounds is not None:
                between_rounds(r)
            for case in this:
                if case.case_id in done or (skip is not None and skip(case)):
                    continue
                if bar is not None:
                    bar.set_postfix_str(f"round {r}/{case.rounds} {case.label()}"
                                        if case.rounds > 1 else case.label(), refresh=True)
                if r == 1:
                    row, rec = _first_round(case, workers, guard, stopped)
                else:
                    row, rec = _later_round(case, r, workers, earlier[case.case_id])
                if rec is not None:  # more rounds to come: this one goes to the rounds file
                    store.append_round(rec)
                    earlier.setdefault(case.case_id, {})[r] = rec
                    if bar is not None:
                        bar.update(1)
                    continue
                if row.get("time_ms") and row.get("flops") is not None:
                    row["gflops_per_s"] = row["flops"] / (row["time_ms"] * 1e6)
                store.append(row)
                done.add(case.case_id)
                counts[row["status"]] += 1
                if bar is not None:
                    bar.update(case.rounds - len(earlier.get(case.case_id, {})))
    finally:
        workers.close()
        store.close()
    return counts


def _first_round(case: Case, workers: WorkerPair, guard: MemoryGuard,
                 stopped: dict) -> tuple[dict | None, dict | None]:
    """Round 1 (the only one without rounds): skip checks, memory, error, a timing.

    Returns (the case's row, None), or (None, round 1's record) when the case is ok and
    has more rounds to come."""
    module = variants.build(case.variant, **case.param_dict)
    row = case_row(case, module)
    reasons = skip_reasons(case, module)
    guard_reason = None if reasons else guard.refuse_reason(case, module)
    stop = stopped.get(case.series())
    if stop is not None and stop[0] < case.seq_len:  # a longer case would fail too
        guard_reason = guard_reason or (f"the same case {stop[1]} at N={stop[0]}"
                                        f"{_why(stop[1], case)}; longer skipped")
    if reasons or guard_reason:
        row.update(status="skipped", reason="; ".join(reasons) or guard_reason)
    else:
        row.update(workers.measure(case))
    guard.record(case.series(), case.seq_len, _total_mib(row))
    what = {"timeout": "timed out", "oom": "ran out of memory"}.get(row["status"])
    if what and case.seq_len < stopped.get(case.series(), (case.seq_len + 1,))[0]:
        stopped[case.series()] = (case.seq_len, what)
    samples = row.pop("samples_ms", None)
    if row["status"] != "ok":
        return row, None
    if case.rounds == 1:
        return {**row, "rounds": 1}, None
    return None, _record(case, 1, samples, row=row)


def _later_round(case: Case, r: int, workers: WorkerPair,
                 rounds: dict[int, dict]) -> tuple[dict | None, dict | None]:
    """Round r > 1: the time alone. (row, None) when it is the last round or it failed,
    else (None, its record)."""
    got = workers.retime(case)
    if got["status"] != "ok":
        row = _pooled(rounds)
        row.update(status=got["status"], reason=f"round {r} of {case.rounds}: {got['reason']}")
        return row, None
    rec = _record(case, r, got["samples_ms"])
    if r < case.rounds:
        return None, rec
    return _pooled({**rounds, r: rec}), None


def _record(case: Case, r: int, samples_ms: list[float], **extra) -> dict:
    """A finished round of a case, as the rounds file keeps it."""
    return {"case_id": case.case_id, "round": r, "rounds": case.rounds,
            "samples_ms": samples_ms, **extra}


def _pooled(rounds: dict[int, dict]) -> dict:
    """The row of a case timed in rounds: round 1's row with the time over every round's
    samples, the number of rounds, and the spread of the rounds' medians."""
    row = dict(rounds[1]["row"])
    medians = [statistics.median(rounds[r]["samples_ms"]) for r in sorted(rounds)]
    t = timing.summarise([ms / 1e3 for r in sorted(rounds) for ms in rounds[r]["samples_ms"]])
    row.update(time_ms=t.time_ms, time_ms_iqr=t.time_ms_iqr, repeats=t.repeats,
               rounds=len(medians),
               time_ms_spread=(max(medians) - min(medians)) / min(medians)
               if len(medians) > 1 else None)
    return row
