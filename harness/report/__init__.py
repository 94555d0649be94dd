"""The report: reads run folders (results.csv, model.csv, train.csv, meta.json) and writes
report.md, report.html and plots/; compares two runs. It never measures.

    folder.py          loading a run folder, labels, the case key
    run.py             the run folder as the sections read it, the slices they share
    analysis.py        Pareto fronts, crossovers, log-log slopes, change classes
    tables.py          the report's tables (answers, ratios, slopes, GFLOP/s, ...)
    captured.py        the view of captured (real-model) inputs
    canvas.py          what the figures share: geometry, the Agg canvas, styles, legend
    plots.py           figures of benchmark rows (scaling, Pareto, GFLOP/s, budget)
    trained_plots.py   figures of trained rows (accuracy, frontier, share of attention)
    build.py           the report itself (`write_report`): the sections' order, the writers
    compare.py         two runs side by side (`compare_runs`)

  the sections, in report order, each a module whose entry gives its blocks for a run:
    summary.py         the title and what the run holds
    maps.py            the attention-map grid (maps.npz)
    answers.py         "Answers"; its decode lines in decoders.py (the recurrences
                       beside the exact decoder in decode_recurrences.py)
    trained.py         "Quality when trained" and its Answers line (train.csv); a
                       configuration over its seeds in cells.py; its
                       frontier of accuracy against state and its tasks in frontier.py,
                       the best at equal state in equal_state.py,
                       its curves of accuracy against steps in curves.py
    hybrid.py          recall of layer-pattern stacks against their share of attention
                       layers, and its Answers line (train.csv)
    model.py           "Model drift" (model.csv)
    rounds.py          cases whose timing rounds disagree, other work seen on the cores
    layers.py          error per layer on captured inputs
    complexity.py      log-log slopes of time and memory
    crossover.py       crossover lengths against the exact paths
    generation.py      time and state per generated token (decode rows)
    implementations.py library kernels beside ours
    by_length.py       time, memory and error tables by length
    scaling.py         the scaling plots
    budget.py          error against the budget of keys
    pareto.py          the Pareto front of error against time
    gflops.py          achieved GFLOP/s
    unmeasured.py      cases not measured
    settings.py        each label's parameters in full
    environment.py     meta.json (provenance.py: where a sharded run's cases ran)

Imports only harness.files (names and columns): whatever it needs of a run is in the files
it reads. Imported by harness.cli.
"""
