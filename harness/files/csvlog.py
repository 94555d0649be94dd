"""Append-only CSV logs and atomic JSON files: how every run-folder file is written.

A row is appended and fsynced as soon as its case finishes, so a killed run keeps what it
measured; a JSON file is replaced in one rename, so a reader never sees half of it.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
from pathlib import Path


def now() -> str:
    """The current UTC time, ISO 8601 to the second (meta.json's timestamps)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (a temp file, then rename): a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class CsvLog:
    """A CSV file of fixed columns, appended and fsynced row by row (results.csv, model.csv).

    A writer killed mid-row leaves a partial last line: it is not a finished row, so
    `rows` ignores it and `open` cuts it off before appending.
    """

    def __init__(self, path: Path, columns: list[str], later: tuple[str, ...] = ()):
        self.path, self.columns = Path(path), columns
        # Columns added at the end since earlier versions: a file written before them
        # (its header the columns without that tail) is still this log, appended to in
        # its own columns (`takes`).
        self.later = tuple(later)

    def takes(self, header: list[str]) -> bool:
        """Whether a file of this header is this log: these columns, or these without a
        tail of `later` columns (a folder written before they were added)."""
        n = len(header)
        return header == self.columns or (header == self.columns[:n]
                                          and set(self.columns[n:]) <= set(self.later))

    def _data(self, cut: bool) -> bytes:
        data = self.path.read_bytes() if self.path.exists() else b""
        end = data.rfind(b"\n") + 1
        if end < len(data):
            if cut:
                with self.path.open("r+b") as f:
                    f.truncate(end)
            data = data[:end]
        return data

    def header(self) -> list[str] | None:
        return next(csv.reader(io.StringIO(self._data(cut=False).decode())), None)

    def rows(self, cut: bool = False) -> list[dict]:
        """The finished rows; cut=True also removes a partial last line from the file."""
        return list(csv.DictReader(io.StringIO(self._data(cut).decode())))

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self._data(cut=True)
        header = None if fresh else self.header()
        if header is not None and header != self.columns and self.takes(header):
            self.columns = header  # a folder from before the later columns: its own
        self._f = self.path.open("a", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=self.columns, extrasaction="raise")
        if fresh:
            self._w.writeheader()
            self._sync()

    def append(self, row: dict) -> None:
        self._w.writerow({c: _cell(row.get(c)) for c in self.columns})
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
