"""The report: reads run folders (results.csv, model.csv, train.csv, meta.json) and writes
report.md, report.html and plots/; compares two runs. It never measures.

    folder.py          loading a run folder, labels, the case key
    analysis.py        Pareto fronts, crossovers, log-log slopes, change classes
    tables.py          the report's tables (answers, ratios, slopes, GFLOP/s, ...)
    captured.py        the view of captured (real-model) inputs
    implementations.py library kernels beside ours
    model.py           the "Model drift" section (model.csv)
    trained.py         the "Quality when trained" section and its Answers line (train.csv)
    frontier.py        trained quality against state: the frontier, the MAD-style mean
    cells.py           a trained configuration over its seeds: median, range, marks
    provenance.py      where a sharded run's cases ran (meta.json's shard records)
    rounds.py          cases whose timing rounds disagree, other work seen on the cores
    plots.py           the PNG plots
    maps.py            the attention-map grid (maps.npz), the report's first section
    build.py           the report itself (`write_report`) and its sections
    compare.py         two runs side by side (`compare_runs`)

Imports only harness.files (names and columns): whatever it needs of a run is in the files
it reads. Imported by harness.cli.
"""
