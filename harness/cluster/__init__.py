"""Scale-out: a matrix's cases or a sweep's configurations split into shards and run as
submitit jobs (local processes or Slurm), their rows merged into results.csv or train.csv
exactly as a serial run writes them.

    executors.py  the executor settings, submitting jobs, asking which are alive, a job's shell
    shards.py     the split into shards; each command's shard files, merging, job lists, records
    engine.py     the one sharded engine: submit, wait, resubmit, retry, give up, merge
    sharded.py    what a benchmark run gives the engine (`run --executor ...`): cases, their job
    trained.py    what a training sweep gives it (`train --executor ...`): configurations, theirs

May import harness.measure (a job runs the same runner), harness.train (a training job runs
the same sweep), harness.models and harness.files; imported by harness.cli. It never writes
the report: the command does that after a run.
"""
