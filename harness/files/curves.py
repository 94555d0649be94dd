"""train_curves.jsonl: every trained row's runs as they went, one JSON line per row
({"config_id", "variant", "seed", "runs": [{"lr", "status", "steps_run", "stopped",
"history", "held_out_loss"}, ...]}); a shard's file sits beside its train file
(shards/train-<i>_curves.jsonl). Written by the training sweep, read by the report and by
the estimate's calibration (harness.train.stops)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES_SUFFIX = "_curves.jsonl"  # train.csv -> train_curves.jsonl
TRAIN_CURVES = "train" + CURVES_SUFFIX


def curves_path(csv_path: Path) -> Path:
    """The curves file beside a train file."""
    return Path(csv_path).with_name(Path(csv_path).stem + CURVES_SUFFIX)


def read_curves(path: Path) -> dict[str, dict]:
    """config_id -> its line (the last of a config_id trained again); {} without the file.
    A partial last line (a run killed while writing) is left out."""
    out: dict[str, dict] = {}
    path = Path(path)
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[got["config_id"]] = got
    return out
