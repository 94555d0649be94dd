"""Is other work using this machine's cores now? CPU time over a short window, from /proc.

    python -m harness.measure.busy      # one sample (JSON) and the warning a run would give

The load average is the wrong witness: it decays over minutes, so a `pip install` that
ended a minute ago still reads as load 1 on an idle machine, and a run started then warns
for nothing. Here the busy time of the cores this process may run on (/proc/stat: user,
nice, system, irq, softirq and steal, the time a hypervisor gave to other machines) is
read twice, `window_s` apart, and this process tree's own CPU time over the same window
(/proc/<pid>/stat of it and every descendant: the run and its idle workers) is taken
away. What remains is other work, in cores: 1.0 means one core fully used by others.
A run samples at its start and before each later round, warns when other work used at
least WARN_FRACTION of the cores, and keeps the samples in meta.json (`busy`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness.files import now

# The window, seconds; ATTNBENCH_BUSY_WINDOW_S changes it (the test suite shortens it).
WINDOW_ENV = "ATTNBENCH_BUSY_WINDOW_S"
WINDOW_S = 1.0
# Warn when other work used at least this share of the cores over the window: on 2 cores,
# half a core. Torch's threads wait on each other, so even one busy core slows every case.
WARN_FRACTION = 0.25
_IDLE = (3, 4)  # /proc/stat columns after the cpu name: idle, iowait
_BUSY = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guest is inside user)


def _cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks summed over the given CPUs since boot."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [int(x) for x in fields[:8]]
        busy += sum(ticks[i] for i in _BUSY)
        total += sum(ticks[i] for i in _BUSY + _IDLE)
    return busy, total


def _tree_ticks(root: int) -> int:
    """CPU ticks of `root` and its descendants: utime + stime + the reaped children's.

    A worker that exits inside the window moves its time into its parent's cutime, so the
    difference of two readings still counts what it used in between, once."""
    parent, used = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        used[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    total = 0
    for pid, ticks in used.items():
        p = pid
        while p not in (root, 0, 1) and p in parent:
            p = parent[p]
        if p == root:
            total += ticks
    return total


def sample(window_s: float | None = None, root: int | None = None) -> dict:
    """Other work on this process's cores over the next `window_s` seconds (default
    WINDOW_S, or $ATTNBENCH_BUSY_WINDOW_S).

    Returns {"at", "window_s", "cores", "other_cores", "own_cores", "load_average",
    "warn"}: other_cores and own_cores in cores (CPU seconds per second); `warn` is
    other_cores >= WARN_FRACTION * cores. `root`: whose tree is "own" (default: this process).
    """
    root = os.getpid() if root is None else root
    if window_s is None:
        window_s = float(os.environ.get(WINDOW_ENV, WINDOW_S))
    cpus = os.sched_getaffinity(0)
    busy0, total0 = _cpu_ticks(cpus)
    own0 = _tree_ticks(root)
    time.sleep(window_s)
    busy1, total1 = _cpu_ticks(cpus)
    own1 = _tree_ticks(root)
    per_cpu = max(total1 - total0, 1) / len(cpus)  # ticks one core had in the window
    own = max(own1 - own0, 0) / per_cpu
    other = round(max(busy1 - busy0 - (own1 - own0), 0) / per_cpu, 2)
    return {"at": now(), "window_s": window_s, "cores": len(cpus),
            "other_cores": other, "own_cores": round(own, 2),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "warn": other >= WARN_FRACTION * len(cpus)}


def warning(s: dict, when: str = "") -> str | None:
    """The run's warning for a sample, or None when other work leaves the cores alone.

    Decided by the sample's other_cores alone, never by the load average."""
    if s["other_cores"] < WARN_FRACTION * s["cores"]:
        return None
    return (f"warning: other work used {s['other_cores']:.1f} of {s['cores']} cores over "
            f"{s['window_s']:g} s{when}: it distorts the times of this run")


def main() -> None:
    s = sample()
    print(json.dumps(s))
    print(warning(s) or f"quiet: other work used {s['other_cores']:.2f} of {s['cores']} cores "
                        f"(load average {s['load_average'][0]} is not looked at)")


if __name__ == "__main__":
    main()
