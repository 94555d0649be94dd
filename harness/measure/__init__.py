"""Measuring a matrix: the cases, the runner and its worker processes, and how time,
peak memory and error are taken, into results.csv.

    matrix.py        a TOML matrix (preset or file) expanded into cases, checked first
    runner.py        the serial run: worker processes, time-outs, the memory guard, rows
    worker.py        one case in a process of its own (`python -m harness.measure.worker`)
    timing.py        medians and IQRs of timed calls
    memory.py        peak memory (VmHWM on CPU, the CUDA allocator's peak), the guard
    accuracy.py      error against the float64 exact reference
    inputs.py        the synthetic input distributions (`python -m harness.measure.inputs`)
    store.py         a run folder's results.csv and meta.json: append, resume, environment
    estimate.py      a case's predicted cost (the dry-run plan, the shard split)
    repeatability.py the same cases measured twice (`python -m harness.measure.repeatability`)
    maps.py          the attention maps of one head, after a run and for `maps` (maps.npz)

May import harness.models (captured inputs) and harness.files; imported by harness.cli,
harness.cluster and harness.drift.
"""
