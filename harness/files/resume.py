"""The folder check every store runs before it writes: may this folder take this run?

`run`, `train` and `model` write into results/<run-id>/, and each resumes a folder only
when it holds the same run: its own metadata file records the matrix (or settings), and
its CSV has this version's columns. Anything else ends in one UsageError line before a
byte is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import UsageError
from harness.files.csvlog import CsvLog


def check_folder(folder: Path, meta_path: Path, log: CsvLog, *, runs: set[str], key: str,
                 value, other: str) -> bool:
    """True when `folder` holds a run of this `value` to resume, False when there is
    nothing of it yet (absent, empty, or another attnbench run without this one's files).

    runs: the metadata file names that make a folder an attnbench run this store may write
    beside. key: the field of meta_path that must equal value. other: how the mismatch
    error names what the folder holds ("a run of a different matrix")."""
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder")
    entries = {p.name for p in folder.iterdir()}
    if not entries:
        return False
    if not runs & entries:
        raise UsageError(f"{folder} exists and is not an attnbench run (no "
                         f"{' or '.join(sorted(runs))}); choose another --run-id or "
                         "--results-dir")
    if not meta_path.is_file():
        if log.path.exists():
            raise UsageError(f"{log.path} exists without {meta_path.name}; not resuming "
                             "(choose another --run-id)")
        return False
    try:
        old = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{meta_path} is not valid JSON ({e}); not resuming") from None
    if old.get(key) != value:
        raise UsageError(f"{folder} holds {other}; resuming needs the same preset/config and "
                         "flags (or choose another --run-id)")
    header = log.header()
    if header is not None and not log.takes(header):
        raise UsageError(f"{log.path} has other columns than this version writes")
    return True
