"""A run folder's model.csv (the `model` command's rows) and model_meta.json beside it.

Rows are appended and fsynced as each case finishes. Resume rule: model_meta.json holds
the settings that make the numbers comparable (model, text, windows, seed, threads aside);
running again into the same folder with the same settings skips every case whose key
(model, variant, params, device, dtype, seq_len) is already in model.csv, whatever its
status; other settings are a usage error. A folder that holds neither an attnbench run
(meta.json, written by `run`) nor model drift is not touched.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import UsageError
from harness.files import MODEL_CSV, MODEL_META, CsvLog, write_json
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
        if not self.folder.exists():
            return set()
        if not self.folder.is_dir():
            raise UsageError(f"{self.folder} exists and is not a folder")
        entries = {p.name for p in self.folder.iterdir()}
        if entries and not ({"meta.json", MODEL_META} & entries):
            raise UsageError(f"{self.folder} exists and is not an attnbench run (no meta.json "
                             f"or {MODEL_META}); choose another --run-id or --results-dir")
        if self.meta_path.exists():
            try:
                old = json.loads(self.meta_path.read_text())
            except json.JSONDecodeError as e:
                raise UsageError(f"{self.meta_path} is not valid JSON ({e}); "
                                 "not resuming") from None
            if old.get("settings") != settings:
                raise UsageError(f"{self.folder} holds model drift with other settings (model, "
                                 "text, windows or seed); choose another --run-id")
        log = CsvLog(self.csv_path, COLUMNS)
        header = log.header()
        if header is not None and header != COLUMNS:
            raise UsageError(f"{self.csv_path} has other columns than this version writes")
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
