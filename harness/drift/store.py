"""A run folder's model.csv (the `model` command's rows) and model_meta.json beside it.

Rows are appended and fsynced as each case finishes. Resume rule: model_meta.json holds
the settings that make the numbers comparable (model, text, windows, seed, threads aside);
running again into the same folder with the same settings skips every case whose key
(model, variant, params, device, dtype, seq_len) is already in model.csv, whatever its
status; other settings are a usage error. A folder that holds neither an attnbench run
(meta.json, written by `run`) nor model drift is not touched.
"""

from __future__ import annotations

from pathlib import Path

from harness.files import META, MODEL_CSV, MODEL_META, CsvLog, check_folder, write_json
from harness.files import MODEL_COLUMNS as COLUMNS
KEY = ("model", "variant", "params", "device", "dtype", "seq_len")


def row_key(row: dict) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in KEY)


class ModelStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.csv_path = self.folder / MODEL_CSV
        self.meta_path = self.folder / MODEL_META

    def check(self, settings: dict) -> set[tuple[str, ...]]:
        """UsageError unless the folder can take these rows; returns the keys already done."""
        log = CsvLog(self.csv_path, COLUMNS)
        check_folder(self.folder, self.meta_path, log, runs={META, MODEL_META},
                     key="settings", value=settings,
                     other="model drift with other settings (model, text, windows or seed)")
        return {row_key(r) for r in log.rows()}

    def open(self, meta: dict) -> None:
        if not self.meta_path.exists():
            write_json(self.meta_path, meta)
        self._log = CsvLog(self.csv_path, COLUMNS)
        self._log.open()

    def append(self, row: dict) -> None:
        self._log.append(row)

    def close(self) -> None:
        self._log.close()
