"""The worker processes as the runner sees them: a `Worker` is one `python -m <module>`
subprocess answering JSON-line requests (by default harness.measure.worker), a
`WorkerPair` the two a case is measured in.

One measures peak memory under the malloc settings that make it readable, the other
error and time under glibc's defaults (harness.measure.worker says why). A worker is
replaced after a timeout (killed), a crash, or an out-of-memory case; a result that does
not come back is a `timeout`, `oom` or `error` result with the reason.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from harness.measure.matrix import Case
from harness.measure.memory import MALLOC_ENV, is_oom_message
from harness.measure.store import now
from harness.measure.worker import RESULT_PREFIX

REPO = Path(__file__).resolve().parents[2]


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
