"""Runs a matrix's cases, each in worker processes, and appends one row per case.

`run` is a serial run's session around the measuring loop (harness.measure.loop: the
rows, the rounds; its workers are harness.measure.processes's, its rows start as
harness.measure.rows makes them): it writes meta.json, with the environment, the matmul
rate of each device and dtype sampled at the start, before each later round and at the
end, and the read rate a decode case is set against; before the run and before each later
round, harness.measure.busy samples what other work uses the cores.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from harness.measure import busy as busy_sampler
from harness.measure.loop import measure
from harness.measure.matrix import Case
from harness.measure.rows import STATUSES
from harness.measure.store import (RunStore, environment, matmul_fp32_gflops, matmul_rates, now,
                                   read_bandwidth_gbps)


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
    # The read rate: decode's bound, and, in a run timed in rounds (a reference run), the
    # machine's memory speed beside its matmul rate, for comparing folders across machines.
    if any(c.decode or c.rounds > 1 for c in cases) and "read_bandwidth_gbps" not in meta:
        meta["read_bandwidth_gbps"] = read_bandwidth_gbps(threads)
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
