"""Each training preset's estimate and ceiling on two workers at its committed reference
run's step times and stops, as tests/test_train_protocol.py plans it (the figures
docs/training.md quotes). A matrix of your own as MATRIX.toml:FOLDER, priced at FOLDER's
reference run.

    python tools/plan_train_presets.py                       # the five protocol presets
    python tools/plan_train_presets.py old.toml:results/train-cpu
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.train import estimate, runner, stops  # noqa: E402
from harness.train import matrix as tm  # noqa: E402

WORKERS = 2


def main(presets: list[str]) -> None:
    for arg in presets:
        name, _, folder = arg.partition(":")
        _, configs = tm.load(name)
        step = estimate.reference_steps(folder or f"results/{name}")
        est = estimate.plan_seconds(configs, step, runner.skip_reasons, stops.share)
        most = estimate.plan_seconds(configs, step, runner.skip_reasons)
        print(f"{name}: estimate {estimate.wall_seconds(est, WORKERS) / 60:.1f} min, ceiling "
              f"{estimate.wall_seconds(most, WORKERS) / 60:.1f} min on {WORKERS} workers")


if __name__ == "__main__":
    main(sys.argv[1:] or ["train-cpu", "mad-cpu", "hybrid-cpu", "state-cpu", "lm-cpu"])
