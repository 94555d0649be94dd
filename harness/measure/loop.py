"""The measuring loop: one row per case, appended to the store as each case finishes.

Before a case runs, the memory guard (harness.measure.memory.MemoryGuard) may refuse it,
and a case longer than one of the same series that timed out or ran out of memory is
skipped with that reason; the others go to the worker pair (harness.measure.processes).
Peak memory is read per call relative to the resident size before it, so reuse keeps
readings right. The time limit covers both parts of a case.

Rounds (a matrix's `rounds` = R > 1): round 1 of every case (memory, error and a timing
with min_run_time_s / R), then round 2 of every case (a fresh timing alone, `retime`),
..., in the matrix's order, so a case's rounds lie minutes apart and a drift of the
machine's speed shows as a spread instead of hiding in one slow minute. Each finished
round that is not the case's last goes to the store's rounds file; the last one writes the
row: time_ms, time_ms_iqr and repeats over every round's samples, `rounds`, and
`time_ms_spread`, the largest relative difference between two rounds' medians. A case
whose round 1 is not ok is a row at once; a later round that fails makes the row that
failure ("round r of R: ..."), keeping the earlier rounds' times.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from harness.measure import layers, timing
from harness.measure.matrix import Case
from harness.measure.memory import MemoryGuard
from harness.measure.processes import WorkerPair
from harness.measure.rows import case_row, skip_reasons
from harness.measure.store import RunStore


def measure(cases: list[Case], store: RunStore, done: set[str], log_path: Path,
            bar=None, between_rounds=None, skip=None) -> Counter:
    """The measuring loop: append one row per case not in `done`, in order, to the store;
    with rounds, round by round over all the cases (the module docstring).

    Shared by the serial run (harness.measure.runner) and each shard of a sharded one
    (harness.cluster.sharded).
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
    module = layers.build(case)
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


def _why(what: str, case: Case) -> str:
    return f" (timeout_s={case.timeout_s:g})" if what == "timed out" else ""


def _total_mib(row: dict) -> float | None:
    """A case's measured memory: one call's peak plus the state the variant keeps."""
    peak = row.get("peak_mem_mib")
    return None if peak is None else peak + (row.get("state_mib") or 0.0)


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
