"""A training sweep over shards (`train --executor local|slurm --shards N`): what the engine
(harness.cluster.engine) needs to know of a sweep: its units are configurations, a cell's
seeds together in the split, a shard's job trains its configurations with the serial sweep's loop
into shards/train-<i>.csv, and a configuration whose jobs all died gets the descriptive
columns of its row. A cell's seeds are one shard's (the race of the first picks the rate
of the others). harness.cluster.shards describes the files (`TRAIN`).
"""

from __future__ import annotations

from pathlib import Path

from harness.measure import layers
from harness.cluster import engine
from harness.cluster import executors as ex
from harness.cluster.shards import TRAIN
from harness.measure.store import environment
from harness.train import estimate, runner
from harness.train.matrix import TrainConfig
from harness.train.store import TrainStore


class TrainShardStore(ex.StopOnSignals, TrainStore):
    """A shard's train file that takes no row once the scheduler ends the job."""


def train_shard(folder: str, index: int, configs: list[TrainConfig], executor: str) -> dict:
    """Train one shard's configurations into shards/train-<index>.csv and its curves file
    (inside the job), other work on the node sampled into the shard's record as a serial
    sweep samples it (`runner.BusyWatch`); configurations already in that file (an earlier
    attempt, before a requeue) are skipped, and so are those a newer job of the sweep holds
    when this one starts."""
    folder = Path(folder)
    store = TrainShardStore(folder, csv_path=TRAIN.shard_csv(folder, index))
    store.stop_on_signals()
    done = store.done_ids() | {c.config_id for c in configs
                               if TRAIN.taken_elsewhere(folder, c.config_id, index)}
    env = environment(configs[0].threads if configs else 1)
    record = ex.job_record(index, executor, TRAIN.held, configs, env, busy=[])
    TRAIN.write_record(folder, index, record)
    watch = runner.BusyWatch(record["busy"])
    watch.start()
    try:
        counts = runner.sweep(configs, store, done, TRAIN.shard_log(folder, index))
    finally:
        watch.stop()
    ex.job_ended(record, counts)
    TRAIN.write_record(folder, index, record)
    return dict(counts)


def _costs(configs: list[TrainConfig], rate: float) -> list[tuple[TrainConfig, float]]:
    """The split's costs: the protocol's steps at the FLOP model's step (relative costs are
    what balances shards; no probe runs on the submitting machine)."""
    return [(c, estimate.config_seconds(c, estimate.flop_step_seconds(
        c, layers.build(c), rate))) for c in configs]


def _row(config: TrainConfig) -> dict:
    return runner.config_row(config, layers.build(config))


def _cell(config: TrainConfig) -> str:
    """A cell's seeds stay in one shard: the later seeds train at the rate the first's race
    picked."""
    return config.cell_id


WORK = engine.Work(files=TRAIN, body=train_shard, costs=_costs, together=_cell, row=_row,
                   summary=runner.summary_line, noun="configuration", doing="training")

# what the command calls: `run` the run folder once every unit has a row (else the exit
# status), `merge_before_serial` before a serial session of a run that had shards
run, merge_before_serial = WORK.run, WORK.merge_before_serial
