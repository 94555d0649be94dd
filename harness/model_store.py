"""A run folder's model.csv (the `model` command's rows) and model_meta.json beside it.

Rows are appended and fsynced as each case finishes. Resume rule: model_meta.json holds
the settings that make the numbers comparable (model, text, windows, seed, threads aside);
running again into the same folder with the same settings skips every case whose key
(model, variant, params, device, dtype, seq_len) is already in model.csv, whatever its
status; other settings are a usage error. A folder that holds neither an attnbench run
(meta.json, written by `run`) nor model drift is not touched.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from harness.errors import UsageError

MODEL_CSV = "model.csv"
MODEL_META = "model_meta.json"
COLUMNS = ["model", "variant", "family", "params", "device", "dtype", "seq_len", "windows",
           "causal", "status", "reason", "emb_cos", "hidden_rel_err", "kl", "ppl_ratio",
           "time_ms", "time_ms_iqr", "repeats", "peak_mem_mib", "threads", "seed"]
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
        if not self.csv_path.exists():
            return set()
        data = self.csv_path.read_bytes()
        if data and not data.endswith(b"\n"):  # a partial last line: not a finished case
            data = data[:data.rfind(b"\n") + 1]
        reader = csv.DictReader(io.StringIO(data.decode()))
        if reader.fieldnames is not None and reader.fieldnames != COLUMNS:
            raise UsageError(f"{self.csv_path} has other columns than this version writes")
        return {row_key(r) for r in reader}

    def open(self, meta: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.meta_path.exists():
            tmp = self.meta_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.meta_path)
        self._cut_partial_line()
        fresh = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        self._f = self.csv_path.open("a", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=COLUMNS, extrasaction="raise")
        if fresh:
            self._w.writeheader()
            self._sync()

    def _cut_partial_line(self) -> None:
        """A run killed mid-write leaves a partial last line: drop it before appending."""
        if not self.csv_path.exists():
            return
        data = self.csv_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.csv_path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict) -> None:
        self._w.writerow({c: _cell(row.get(c)) for c in COLUMNS})
        self._sync()

    def _sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v
