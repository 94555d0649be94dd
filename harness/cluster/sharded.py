"""A benchmark run over shards (`run --executor local|slurm`): what the engine
(harness.cluster.engine) needs to know of a matrix: its units are cases, a series stays in
one shard, a shard's job measures its cases with the serial runner's loop into
shards/shard-<i>.csv (rounds over its own cases), and a case whose jobs all died gets the
descriptive columns of its row. harness.cluster.shards describes the files.
"""

from __future__ import annotations

from pathlib import Path

from harness.cluster import engine
from harness.cluster import executors as ex
from harness.cluster.shards import MATRIX
from harness.measure import estimate, layers, loop, rows, runner
from harness.measure.matrix import Case
from harness.measure.store import RunStore, environment, matmul_fp32_gflops, matmul_rates


class ShardStore(ex.StopOnSignals, RunStore):
    """A shard's results file (shards/shard-<i>.csv) that stops at the job's end signal."""


def measure_shard(folder: str, index: int, cases: list[Case], executor: str) -> dict:
    """Measure one shard's cases into shards/shard-<index>.csv; returns its counts by status.

    Runs inside the submitit job. Cases already in its own file (an earlier attempt of the
    same job, before a requeue) are not measured again, nor are those a newer job holds.
    """
    folder = Path(folder)
    store = ShardStore(folder, csv_path=MATRIX.shard_csv(folder, index),
                       rounds_path=MATRIX.shard_rounds(folder, index))
    store.stop_on_signals()
    done = store.done_ids()  # also cuts a partial last line this shard's killed attempt left
    threads = cases[0].threads if cases else 1
    fp32 = matmul_fp32_gflops(threads)
    record = ex.job_record(index, executor, MATRIX.held, cases, environment(threads),
                           busy=[runner.busy_sample(0)], matmul_fp32_gflops=fp32,
                           matmul_gflops=matmul_rates(cases, threads, {"cpu float32": fp32}))
    MATRIX.write_record(folder, index, record)

    def between_rounds(r: int) -> None:  # this shard's rounds are over its own cases
        record["busy"].append(runner.busy_sample(r))
        MATRIX.write_record(folder, index, record)

    counts = loop.measure(cases, store, done, MATRIX.shard_log(folder, index),
                            between_rounds=between_rounds,
                            skip=lambda case: MATRIX.taken_elsewhere(folder, case.case_id, index))
    ex.job_ended(record, counts)
    MATRIX.write_record(folder, index, record)
    return dict(counts)


def _costs(cases: list[Case], rate: float) -> list[tuple[Case, float]]:
    return [(c, cost) for c, _, cost in estimate.plan_cases(cases, rate)]


def _row(case: Case) -> dict:
    return rows.case_row(case, layers.build(case))


WORK = engine.Work(files=MATRIX, body=measure_shard, costs=_costs, together=Case.series,
                   row=_row, summary=runner.summary_line, noun="case", doing="measuring")

# what the command calls: `run` the run folder once every unit has a row (else the exit
# status), `merge_before_serial` before a serial session of a run that had shards
run, merge_before_serial = WORK.run, WORK.merge_before_serial
