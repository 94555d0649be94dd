"""Measuring a matrix: the cases, the runner and its worker processes, and how time,
peak memory and error are taken, into results.csv.

    matrix.py        a TOML matrix (preset or file) expanded into cases, checked first
    runner.py        the serial run: meta.json (environment, rates, busy samples) around the loop
    loop.py          the measuring loop: the memory guard, a series stopped at its failure, rounds
    rows.py          a case's descriptive columns and the reasons it is skipped
    layers.py        what a case builds: the variant, or a layer pattern's Stack of layers
    stack.py         layer patterns ("gated_deltanet*3+sdpa"): parsed, repeated, their state summed
    processes.py     the worker processes seen from the runner: requests, time-outs, crashes
    worker.py        one case in a process of its own (`python -m harness.measure.worker`)
    timing.py        medians and IQRs of timed calls (the call alone: checked once, setup untimed)
    decode.py        the decode pass: each layer's context into its state, steps timed, reference
    memory.py        peak memory (VmHWM on CPU, the CUDA allocator's peak), the guard
    accuracy.py      error against the float64 exact reference
    inputs.py        the synthetic input distributions (`python -m harness.measure.inputs`)
    store.py         a run folder's results.csv, rounds.jsonl and meta.json: append, resume
    busy.py          other work on the cores now (`python -m harness.measure.busy`)
    estimate.py      a case's predicted cost (the dry-run plan, the shard split)
    repeatability.py drift between runs, with and without rounds (`python -m harness.measure.repeatability`)
    roofline.py      our variants against the machine's matmul rate (`python -m harness.measure.roofline`)
    maps.py          the attention maps of one head, after a run and for `maps` (maps.npz)

May import harness.models (captured inputs) and harness.files; imported by harness.cli,
harness.cluster and harness.drift.
"""
