"""The busy-machine check (harness.measure.busy): other work on the cores now, not the load
average. A process spinning beside the run is seen and warned about; the run's own
processes are not other work; a CPU-heavy child that has finished (the `pip install`
before a run: a high load average, nothing running) leaves nothing behind.

This machine is shared, so the tests that read the real /proc/stat never assume it idle:
they check the sampler against a second witness over the same window, the CPU time of
every process outside the tree (/proc/<pid>/stat).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import run_bench
from harness.measure import busy

REPO = Path(__file__).resolve().parent.parent
SPIN = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_warning_is_decided_by_other_work_now_not_the_load_average():
    quiet = {"other_cores": 0.05, "own_cores": 0.0, "cores": 2, "window_s": 1.0,
             "load_average": [8.0, 6.0, 3.0]}  # a pip install that just ended
    assert busy.warning(quiet) is None
    loaded = {**quiet, "other_cores": 1.2, "load_average": [0.0, 0.0, 0.0]}
    said = busy.warning(loaded, " before round 2")
    assert said.startswith("warning: other work used 1.2 of 2 cores over 1 s before round 2")


def _others_by_process(root: int) -> dict[int, int]:
    """pid -> utime + stime + cutime + cstime ticks of every process outside root's tree."""
    parent, used = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(name)] = int(fields[1])
            used[int(name)] = sum(int(x) for x in fields[11:15])
    out = {}
    for pid, ticks in used.items():
        p = pid
        while p not in (root, 0) and p in parent:
            p = parent[p]
        if p != root:
            out[pid] = ticks
    return out


def _witnessed_sample(window_s: float = 1.0) -> tuple[dict, float]:
    """A sample of this process, and other work over the same window by the second witness."""
    before = _others_by_process(os.getpid())
    start = time.monotonic()
    s = busy.sample(window_s)
    after = _others_by_process(os.getpid())
    # totals, not per-pid differences: a process reaped meanwhile moved into its parent's
    # cutime with its whole life, and its own earlier reading must go
    ticks = max(sum(after.values()) - sum(before.values()), 0)
    return s, ticks / os.sysconf("SC_CLK_TCK") / (time.monotonic() - start)


def _spinner(seconds: float, detached: bool) -> int:
    """A process spinning one core; detached: not a descendant of this one (a double fork)."""
    code = SPIN.format(s=seconds)
    if not detached:
        return subprocess.Popen([sys.executable, "-c", code]).pid
    out = subprocess.run(["/bin/sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!',
                          code], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_spinning_process_is_other_work_unless_it_is_ours():
    pid = _spinner(30, detached=True)
    try:
        time.sleep(0.2)
        s, witness = _witnessed_sample()
        assert s["other_cores"] >= 0.7 and s["warn"], s  # one of the 2 cores, at least mostly
        assert abs(s["other_cores"] - witness) < 0.35, (s, witness)
    finally:
        os.kill(pid, signal.SIGKILL)
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
    try:
        time.sleep(0.2)
        s, witness = _witnessed_sample()
        assert s["own_cores"] >= 0.25, s  # its share of a core, however loaded the machine
        assert abs(s["other_cores"] - witness) < 0.35, (s, witness)
    finally:
        child.kill()
        child.wait()


def test_a_finished_heavy_child_leaves_no_warning_behind():
    # the pip-install case: both cores busy for a while, the load average up, then nothing
    heavy = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)]) for _ in range(2)]
    for p in heavy:
        p.wait()
    s, witness = _witnessed_sample()
    assert s["own_cores"] < 0.1, s  # the reaped children's time is not in the window
    assert abs(s["other_cores"] - witness) < 0.35, (s, witness)
    if witness < busy.WARN_FRACTION * s["cores"] - 0.35:  # nobody else busy right now
        assert busy.warning(s) is None and not s["warn"], (s, witness)


@pytest.mark.timeout(120)
def test_a_run_warns_while_a_process_spins_beside_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(busy.WINDOW_ENV, "0.5")
    cfg = tmp_path / "m.toml"
    cfg.write_text('variants = ["sdpa"]\nseq_lens = [64]\nheads = 1\nhead_dim = 16\n'
                   'passes = ["forward"]\nmin_run_time_s = 0.01\nmin_repeats = 3\nrounds = 2\n')
    pid = _spinner(60, detached=True)
    try:
        time.sleep(0.2)
        assert run_bench.main(["run", "--config", str(cfg), "--results-dir", str(tmp_path),
                               "--run-id", "r"]) == 0
    finally:
        os.kill(pid, signal.SIGKILL)
    err = capsys.readouterr().err
    assert "warning: other work used" in err and "as the run starts" in err
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert [s["before_round"] for s in meta["busy"]] == [0, 2] and meta["busy"][0]["warn"]
    assert len(meta["load_average_start"]) == 3  # the load averages are kept too
    run_bench.main(["report", str(tmp_path / "r")])
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Warning: other work used" in md and "at the start" in md
