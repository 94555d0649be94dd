"""Scale-out: a matrix's cases split into shards and run as submitit jobs (local
processes or Slurm), their rows merged into results.csv exactly as a serial run writes it.

    executors.py  the executor settings, submitting jobs, asking which are alive, a job's body
    shards.py     the split of cases into shards, shard files, merging, provenance records
    sharded.py    the sharded run: submit, wait, merge, resume
    trained.py    the sharded training sweep (`train --executor ...`): its shard files, merge

May import harness.measure (a job runs the same runner), harness.train (a training job runs
the same sweep), harness.models and harness.files; imported by harness.cli. It never writes the report: the command does that after a run.
"""
