"""The command line: argument parsing and the subcommands of attnbench (run_bench.py).

    run.py     `run` (a matrix, serial or sharded; --dry-run) and `list`
    model.py   `model` (drift of a pretrained model under each variant)
    train.py   `train` (a small model trained per variant on a recall task; --dry-run)
    report.py  `report` and `compare`
    maps.py    `maps` (the attention-map grid of one head)
    check.py   `check` (the conformance kit, harness.check, on a module's variants)
    settings.py 'name(param=value)' variant settings, as --variants writes them
    modules.py `--variant-module` and a TOML's `modules`: variants of one's own, everywhere

May import every other subpackage (it decides, for instance, to write the report after a
sharded run finished); imported only by run_bench.py (the `attnbench` console script).
"""
