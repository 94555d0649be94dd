"""A run folder's train.csv (one row per trained configuration) and train_meta.json.

A training sweep may share its folder with a benchmark run (results.csv, meta.json) or
model drift (model.csv): the report then sets accuracy against measured time. Resume rule,
as for `run`: a folder is resumed only when its train_meta.json holds the same normalised
matrix; every configuration id already in train.csv (whatever its status) is done and
skipped. Beside train.csv, train_curves.jsonl keeps every trained row's runs as they went
(one JSON line per row: its config_id, variant, seed, and each rate's held-out accuracy and
loss at every evaluation), for reading a plateau, a rise or a cut. A partial last line (a run killed while writing) is cut off before appending. A
folder that holds files but no attnbench run (meta.json, model_meta.json or
train_meta.json) is not touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.files import (META, MODEL_META, TRAIN_COLUMNS, TRAIN_CSV, TRAIN_META, CsvLog,
                           check_folder, write_json)
from harness.files.curves import curves_path, read_curves


class TrainStore:
    def __init__(self, folder: Path, csv_path: Path | None = None):
        self.folder = Path(folder)
        # a shard of a sharded sweep appends to its own file (harness.cluster.trained)
        self.csv_path = Path(csv_path) if csv_path is not None else self.folder / TRAIN_CSV
        self.meta_path = self.folder / TRAIN_META
        self.curves_path = curves_path(self.csv_path)

    def check(self, matrix: dict) -> bool:
        """UsageError unless the folder is absent, empty, another attnbench run without a
        sweep, or a sweep of this matrix; True when there is a sweep to resume."""
        return check_folder(self.folder, self.meta_path, CsvLog(self.csv_path, TRAIN_COLUMNS),
                            runs={META, MODEL_META, TRAIN_META}, key="matrix", value=matrix,
                            other="a training sweep of a different matrix")

    def done_ids(self) -> set[str]:
        """Configuration ids already in the file, after cutting off a partial last line."""
        return {r["config_id"] for r in CsvLog(self.csv_path, TRAIN_COLUMNS).rows(cut=True)}

    def rows(self) -> list[dict]:
        """The rows already in the file (strings, as read), after cutting a partial line."""
        return list(CsvLog(self.csv_path, TRAIN_COLUMNS).rows(cut=True))

    def open(self) -> None:
        self._log = CsvLog(self.csv_path, TRAIN_COLUMNS)
        self._log.open()
        self._curves = self.curves_path.open("a")

    def append(self, row: dict) -> None:
        self._log.append(row)
        if row.get("curves"):
            self._curves.write(json.dumps({"config_id": row["config_id"],
                                           "variant": row.get("variant"),
                                           "seed": row.get("seed"),
                                           "runs": row["curves"]}) + "\n")
            self._curves.flush()

    def curves(self) -> dict[str, dict]:
        """config_id -> its line of the curves file (harness.files.curves)."""
        return read_curves(self.curves_path)

    def close(self) -> None:
        self._log.close()
        self._curves.close()

    def read_meta(self) -> dict:
        return json.loads(self.meta_path.read_text()) if self.meta_path.exists() else {}

    def write_meta(self, meta: dict) -> None:
        write_json(self.meta_path, meta)
