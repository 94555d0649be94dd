"""The `train` command of attnbench: trained recall quality per variant.

Checks the whole training matrix before anything is trained or written (every problem on
one line, exit 2), then trains it into <results-dir>/<run-id>/train.csv, serially here or
sharded over submitit jobs (--executor local|slurm --shards N), and writes the folder's
report. The same run id again resumes the sweep. `--dry-run` prints the plan.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from harness.measure import layers
from harness.cli import modules
from harness.cli.run import _parse, _rerun, _run_id
from harness.cluster import executors
from harness.errors import UsageError
from harness.measure.matrix import read_toml
from harness.measure.rows import NO_CUDA
from harness.measure.store import matmul_fp32_gflops
from harness.measure.worker import import_extra
from harness.train import estimate, lm, stops
from harness.train import matrix as tm
from harness.train import runner
from harness.train.store import TrainStore

DEFAULT_PRESET = "train-quick"


def add_train_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="train-quick (default: about 5 minutes on 2 cores), train-cpu (the "
                          "recall frontier on two MQAR settings, two seeds, raced rates; "
                          "planned within 90 minutes), mad-cpu (MQAR and MAD's tasks), "
                          "train-gpu (Zoology's Figure 2 grid), hybrid-cpu (layer patterns: "
                          "linear mixers with full attention at 4:0, 3:1, 1:1), hybrid-gpu, lm-cpu and "
                          "lm-gpu (bits per byte on real text), state-cpu (parity)")
    src.add_argument("--config", default=None, help="a training matrix .toml of your own")
    p.add_argument("--results-dir", default="results", type=Path,
                   help="where the sweep's folder goes (default: results)")
    p.add_argument("--run-id", default=None,
                   help="folder name under --results-dir (default: a UTC timestamp); a sweep "
                        "of the same matrix there is resumed; the folder may hold a `run`")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (configurations, declared skips, a time estimate from "
                        "step costs probed here) and train nothing")
    p.add_argument("--extend-to", default=None, metavar="STEPS",
                   help="continue the not_learned and partial rows of the folder --run-id "
                        "to a cap of STEPS, each from its winning run's checkpoint from "
                        "before its decay (rows updated in place, the old ones appended to "
                        "train_history.csv); the folder's own matrix, serially")
    p.add_argument("--variants", help="comma-separated variant names to keep")
    p.add_argument("--task", help="comma-separated task names to keep (harness.train.tasks: "
                                  "mqar, selective_copying, noisy_recall, fuzzy_recall, ...)")
    p.add_argument("--threads", help="torch threads in the worker (0: all cores)")
    p.add_argument("--workers", help="configurations trained at once, each in its own worker "
                                     "process (default: the matrix's `workers`, else 1)")
    executors.add_args(p)


def overrides_from(args) -> dict:
    out = {}
    if args.variants is not None:
        out["variants"] = [t.strip() for t in args.variants.split(",") if t.strip()]
    if getattr(args, "task", None) is not None:
        out["task"] = [t.strip() for t in args.task.split(",") if t.strip()]
    if args.threads is not None:
        out["threads"] = _parse(args.threads, int, "threads")
    return out


def estimate_seconds(configs: list[tm.TrainConfig], log_path: Path | None = None,
                     workers: int = 1) -> tuple[list[tuple], list[tuple]]:
    """The estimate and the plan's ceiling, each [(config, predicted seconds, declared
    skips)], at step costs probed here now, in training workers (`workers` at once; their
    log at log_path, else a temporary file); a probe that failed falls back to the FLOP
    model at the matmul rate measured here. The estimate trains the share of the planned
    steps that the committed reference runs trained (harness.train.stops), the ceiling
    every planned step."""
    import tempfile

    trainable = []
    for c in configs:
        module = layers.build(c)
        if not [r for r in runner.skip_reasons(c, module) if r != NO_CUDA]:
            trainable.append(c)
    with tempfile.TemporaryDirectory() as tmp:
        probed = estimate.probe_all(trainable, log_path or Path(tmp) / "probe.log", workers)
    rate = []

    def step(c, module):
        got = probed.get(estimate.probe_key(c))
        if got is not None:
            return got
        if not rate:
            rate.append(matmul_fp32_gflops(c.threads) * 1e9)
        return estimate.flop_step_seconds(c, module, rate[0])

    return (estimate.plan_seconds(configs, step, runner.skip_reasons, stops.share),
            estimate.plan_seconds(configs, step, runner.skip_reasons))


def plan(configs: list[tm.TrainConfig], n_shards: int = 1, workers: int = 1) -> int:
    """Print the configurations, their declared skips and the time estimate."""
    reasons, costs = Counter(), []
    expected, ceiling = estimate_seconds(configs, workers=workers)
    for c, t, why in expected:
        if why:
            reasons[f"{c.variant}: {'; '.join(why)}"] += 1
        costs.append((c, t))
    skipped = sum(reasons.values())
    total = sum(t for _, t in costs)
    most = sum(t for _, t, _ in ceiling)
    cells = len({c.cell_id for c in configs})
    over = f" ({cells} cells over their seeds)" if cells < len(configs) else ""

    def on(seconds: float, plan: list) -> str:
        # the wall time as the sweep deals cells to workers (a long last cell leaves the
        # others idle), not the work divided by the workers
        wall = estimate.wall_seconds(plan, workers)
        return f"{seconds / 60:.1f} min of work" + \
            (f" (about {wall / 60:.1f} min on {workers} workers)" if workers > 1 else "")

    print(f"{len(configs)} configurations{over}; {skipped} skipped as "
          f"declared unsupported; {len(configs) - skipped} to train; estimate {on(total, expected)}, "
          f"at step costs probed here ({estimate.PROBE_STEPS} steps per model) and the "
          f"share of the planned steps the reference runs trained "
          f"(harness/train/stops.json); at most {on(most, ceiling)} if no run stops early and "
          f"the race cuts nothing (every rate, and one beyond the grid's edge, to max_steps)"
          f"{'; CUDA at an assumed rate' if any(c.device == 'cuda' for c in configs) else ''}")
    for reason, n in reasons.most_common():
        print(f"  skip x{n}: {reason}")
    if n_shards > 1:
        from harness.cluster import shards

        cost = {c.config_id: t for c, t in costs}
        for i, part in enumerate(shards.split(costs, n_shards, unit=lambda c: c.cell_id)):
            print(f"  shard {i}: {len(part)} configurations, estimate "
                  f"{sum(cost[c.config_id] for c in part) / 60:.1f} min")
    return 0


def workers_from(args, source: str) -> int:
    if getattr(args, "workers", None) is not None:
        n = _parse(args.workers, int, "workers")
        if n < 1:
            raise UsageError(f"--workers must be a positive integer, got {args.workers!r}")
        return n
    return tm.sweep_workers(source)


def run_train(source: str, overrides: dict, results_dir: Path, run_id: str | None,
              settings: executors.Settings | None = None, argv: list[str] | None = None,
              workers: int = 1):
    """Check, then train a matrix; returns the run folder when every configuration has a
    row, else the exit status (a sharded sweep submitted with --no-wait or unfinished)."""
    settings = settings or executors.Settings()
    matrix, configs = tm.load(source, overrides)
    if not configs:
        raise UsageError("the training matrix has no configuration")
    if settings.kind != "slurm" and any(c.device == "cuda" for c in configs) \
            and not torch.cuda.is_available():
        raise UsageError("the matrix asks for device cuda but CUDA is not available here "
                         "(--dry-run to see the plan)")
    run_id = run_id or _run_id()
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise UsageError(f"--run-id must be a plain folder name, got {run_id!r}")
    executors.check_available(settings)
    store = TrainStore(Path(results_dir) / run_id)
    resume = store.check(matrix)
    if resume:
        modules.warn_changed(store.read_meta())  # variant modules edited since it started
        # an lm corpus whose splits differ from the recorded ones: exit 2, nothing trained
        lm.check_resume(store.read_meta().get("corpora"))
    if settings.kind != "serial":
        from harness.cluster import trained

        return trained.run(matrix, configs, store, resume, settings, _rerun(argv, run_id))
    if resume:
        from harness.cluster import trained

        trained.merge_before_serial(store, configs)
    earlier = len(store.done_ids()) if resume else 0
    todo = [c for c in configs if c.config_id not in store.done_ids()] if resume else configs
    store.folder.mkdir(parents=True, exist_ok=True)
    expected, ceiling = estimate_seconds(todo, store.folder / "train_worker.log", workers)
    counts = runner.run(matrix, configs, store, resume=resume, workers=workers,
                        estimate_s=estimate.wall_seconds(expected, workers),
                        ceiling_s=estimate.wall_seconds(ceiling, workers))
    print(runner.summary_line(len(configs), counts, earlier, store.folder))
    return store.folder


def extend_command(args) -> int:
    """`train --extend-to STEPS --run-id ID`: the folder's rows trained on, then its
    report."""
    from harness.train import extend

    steps = _parse(args.extend_to, int, "extend-to")
    if args.config or args.preset or args.variants or getattr(args, "task", None):
        raise UsageError("--extend-to continues the folder's own matrix: give --run-id "
                         "(and --results-dir), not --preset, --config, --variants or --task")
    if not args.run_id:
        raise UsageError("--extend-to needs --run-id: the folder whose rows to continue")
    if executors.settings_from(args, None).kind != "serial":
        raise UsageError("--extend-to runs serially here: drop --executor")
    folder = Path(args.results_dir) / args.run_id
    counts = extend.extend(folder, steps)
    print(f"extended {sum(counts.values())} row(s) to {steps} steps"
          + "".join(f", {o}: {n}" for o, n in counts.items()) + f" -> {folder}")
    from harness.cli.report import report_dir

    return report_dir(folder) if counts else 0


def train_command(args) -> int:
    import_extra()  # variants registered outside the package (ATTNBENCH_EXTRA_MODULES)
    if getattr(args, "extend_to", None) is not None:
        return extend_command(args)
    source = args.config or args.preset or DEFAULT_PRESET
    settings = executors.settings_from(args, read_toml(source).get("executor"))
    if settings.kind != "serial" and getattr(args, "workers", None) is not None:
        raise UsageError("--workers is for a sweep on this machine; with --executor, "
                         "--shards says how many configurations train at once")
    workers = workers_from(args, source) if settings.kind == "serial" else 1
    if args.dry_run:
        _, configs = tm.load(source, overrides_from(args))
        if not configs:
            raise UsageError("the training matrix has no configuration")
        return plan(configs, settings.shards, workers)
    out = run_train(source, overrides_from(args), args.results_dir, args.run_id, settings,
                    getattr(args, "argv", None), workers)
    if isinstance(out, int):
        return out
    from harness.cli.report import report_dir

    return report_dir(out)

