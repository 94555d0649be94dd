"""Byte-level text corpora for the `lm` task, and their deterministic document-level splits.

A corpus is a tuple of documents (name, UTF-8 bytes), named by a string:

    python-docs        the standard library's docstrings (module, class and function ones,
                       read with `ast`; one document per module) and `pydoc_data.topics`
                       (one document per help topic)
    python-source      the standard library's own `.py` files, tests excluded, one a document
    path:FILE_OR_DIR   a file is one document; a folder, each file under it (sorted; hidden
                       ones such as .git/ left out); a `.jsonl` file, one document per
                       line: the string in its "text" field
    hf:NAME[:CONFIG]   a Hugging Face dataset's "train" split through `datasets` (an optional
                       extra), one document per row: its "text" field

Text is what decodes as UTF-8 and holds no NUL byte; other files and rows are left out, and
identical documents are kept once. Each document goes to `test`, `validation` or `train` by
the sha256 of its bytes (a number in [0, 1) below `test_frac`, below `test_frac +
valid_frac`, or above): the same corpus gives the same splits on every machine and run,
identical texts never straddle two splits, and adding a document moves no other. A split is
its documents in name order, each followed by the end-of-document byte EOD (0, never in
text). Read once per process (the standard library: about 3 s, most of it `ast.parse`).
"""

from __future__ import annotations

import ast
import gc
import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path

from harness.errors import UsageError

SPLITS = ("train", "validation", "test")
VALID_FRAC = 0.05  # the default shares of documents (by hash) in validation and test
TEST_FRAC = 0.05
EOD = 0  # the byte after each document in a split's bytes
TEXT_FIELD = "text"  # the field of a .jsonl line or a dataset row that holds its document
# Folders of the standard library that are not its own library code: tests, third-party
# packages, caches. Files named test_*.py are left out wherever they sit.
_NOT_STDLIB = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

_DOCS: dict[str, tuple[tuple[str, bytes], ...]] = {}
_SPLITS: dict[tuple, dict[str, bytes]] = {}


def clear_cache() -> None:
    """Forget what was read: the next call reads the corpora again (tests edit files)."""
    _DOCS.clear()
    _SPLITS.clear()


def documents(corpus: str) -> tuple[tuple[str, bytes], ...]:
    """The corpus's documents, (name, bytes) in name order, duplicates dropped; cached."""
    if corpus not in _DOCS:
        if corpus == "python-docs":
            docs = _python_docs()
        elif corpus == "python-source":
            docs = _stdlib_files()
        elif corpus.startswith("path:"):
            docs = _path_docs(corpus)
        elif corpus.startswith("hf:"):
            docs = _hf_docs(corpus)
        else:
            raise UsageError(f"unknown corpus {corpus!r}; corpora: python-docs, python-source, "
                             "path:FILE_OR_FOLDER, hf:NAME[:CONFIG]")
        seen, kept = set(), []
        for name, text in sorted(d for d in docs if _is_text(d[1])):
            if text not in seen:
                seen.add(text)
                kept.append((name, text))
        if not kept:
            raise UsageError(f"corpus {corpus!r} holds no text (no non-empty UTF-8 document "
                             "without NUL bytes)")
        _DOCS[corpus] = tuple(kept)
    return _DOCS[corpus]


def _is_text(data: bytes) -> bool:
    if not data or b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stdlib_files() -> list[tuple[str, bytes]]:
    """(path relative to the standard library, bytes) of its .py files, tests excluded."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_STDLIB)
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("test_"):
                path = os.path.join(folder, f)
                out.append((Path(os.path.relpath(path, root)).as_posix(),
                            Path(path).read_bytes()))
    return out


# The nodes whose bodies may hold a def or a class (simple statements never do); try/except*
# is Python 3.11's.
_COMPOUND = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.If, ast.For, ast.AsyncFor,
             ast.While, ast.Try, ast.With, ast.AsyncWith, ast.Match, ast.excepthandler,
             ast.match_case) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _docstrings(tree: ast.AST) -> list[str]:
    """The module's, its classes' and its functions' docstrings, in source order. Walks
    statement bodies only (defs nest in if/try/with blocks, never in expressions)."""
    out = []
    if isinstance(tree, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(tree)
        if doc:
            out.append(doc)
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for stmt in getattr(tree, field, ()):
            if isinstance(stmt, _COMPOUND):
                out.extend(_docstrings(stmt))
    return out


def _python_docs() -> list[tuple[str, bytes]]:
    from pydoc_data import topics

    out = [(f"topics:{k}", v.encode()) for k, v in topics.topics.items()]
    gc.disable()  # ast.parse makes millions of objects and no cycles: collection tripled its time
    try:
        for name, source in _stdlib_files():
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a file of another Python's grammar (none in 3.11's own)
                continue
            doc = "\n\n".join(_docstrings(tree))
            if doc:
                out.append((f"docstrings:{name}", doc.encode()))
    finally:
        gc.enable()
    return out


def _path_docs(corpus: str) -> list[tuple[str, bytes]]:
    root = Path(corpus[len("path:"):]).expanduser()
    if not root.exists():
        raise UsageError(f"corpus {corpus!r}: {str(root)!r} does not exist")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts))  # .git, ...
    out = []
    for f in files:
        name = f.name if f == root else f.relative_to(root).as_posix()
        if f.suffix != ".jsonl":
            out.append((name, f.read_bytes()))
            continue
        for i, line in enumerate(f.read_bytes().splitlines(), 1):
            if line.strip():
                out.append((f"{name}:{i:09d}", _jsonl_text(line, f"{f}:{i}")))
    return out


def _jsonl_text(line: bytes, where: str) -> bytes:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UsageError(f"corpus file {where}: not a JSON line ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get(TEXT_FIELD), str):
        raise UsageError(f"corpus file {where}: a .jsonl line must be an object with a string "
                         f"{TEXT_FIELD!r} field")
    return row[TEXT_FIELD].encode()


def _hf_docs(corpus: str) -> list[tuple[str, bytes]]:
    name, _, config = corpus[len("hf:"):].partition(":")
    try:
        import datasets
    except ImportError:
        raise UsageError(f"corpus {corpus!r} needs the optional package `datasets` "
                         "(pip install datasets)") from None
    try:
        rows = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # the hub unreachable, no such dataset, ...: the user's to fix
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"corpus {corpus!r}: `datasets` could not load it "
                         f"({type(e).__name__}: {first})") from None
    if TEXT_FIELD not in rows.column_names:
        raise UsageError(f"corpus {corpus!r}: its rows have no {TEXT_FIELD!r} column "
                         f"(columns: {', '.join(rows.column_names)})")
    return [(f"{i:09d}", t.encode()) for i, t in enumerate(rows[TEXT_FIELD])
            if isinstance(t, str)]


# -- splits ----------------------------------------------------------------------------------
def share(text: bytes) -> float:
    """The document's number in [0, 1): its sha256's first 8 bytes (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") / 2.0 ** 64


def split_of(text: bytes, valid_frac: float = VALID_FRAC, test_frac: float = TEST_FRAC) -> str:
    u = share(text)
    return "test" if u < test_frac else "validation" if u < test_frac + valid_frac else "train"


def splits(corpus: str, valid_frac: float = VALID_FRAC,
           test_frac: float = TEST_FRAC) -> dict[str, bytes]:
    """{split: its bytes}: the split's documents in name order, each followed by EOD; cached.
    UsageError when a split gets no document (too few documents for the fractions)."""
    key = (corpus, valid_frac, test_frac)
    if key not in _SPLITS:
        if not (0 < valid_frac and 0 < test_frac and valid_frac + test_frac < 1):
            raise UsageError(f"corpus {corpus!r}: valid_frac and test_frac must be > 0 with a "
                             f"sum below 1, got {valid_frac}, {test_frac}")
        parts: dict[str, list[bytes]] = {s: [] for s in SPLITS}
        docs = documents(corpus)
        for _, text in docs:
            parts[split_of(text, valid_frac, test_frac)] += [text, bytes([EOD])]
        empty = [s for s in SPLITS if not parts[s]]
        if empty:
            raise UsageError(f"corpus {corpus!r}: its {len(docs)} documents leave the "
                             f"{' and '.join(empty)} split empty (documents go to splits by "
                             "hash: give more, smaller documents, e.g. a .jsonl)")
        _SPLITS[key] = {s: b"".join(parts[s]) for s in SPLITS}
    return _SPLITS[key]


def describe(corpus: str, valid_frac: float = VALID_FRAC, test_frac: float = TEST_FRAC) -> dict:
    """What train_meta.json records: the corpus, the fractions, the Python that read it (its
    standard library is python-docs' and python-source's text), and per split its documents,
    bytes and sha256 (of the split's bytes as the model reads them)."""
    parts = splits(corpus, valid_frac, test_frac)
    return {"corpus": corpus, "valid_frac": valid_frac, "test_frac": test_frac,
            "python": platform.python_version(),
            "splits": {s: {"documents": parts[s].count(bytes([EOD])), "bytes": len(parts[s]),
                           "sha256": hashlib.sha256(parts[s]).hexdigest()} for s in SPLITS}}


def check_recorded(recorded: dict) -> None:
    """UsageError (one line) when a recorded `describe` differs from this machine's
    recomputation: resuming on other data (another Python's standard library, an edited
    folder) would mix two corpora in one run."""
    now = describe(recorded["corpus"], recorded["valid_frac"], recorded["test_frac"])
    for s in SPLITS:
        was, new = recorded["splits"][s], now["splits"][s]
        if (was["sha256"], was["bytes"]) != (new["sha256"], new["bytes"]):
            why = (f"recorded under Python {recorded['python']}, this is {now['python']}"
                   if recorded["python"] != now["python"] else "its files changed")
            raise UsageError(
                f"corpus {recorded['corpus']!r}: the {s} split differs from the one this run "
                f"recorded ({new['bytes']:,} bytes, sha256 {new['sha256'][:12]} here; "
                f"{was['bytes']:,} bytes, {was['sha256'][:12]} recorded; {why}): resume where "
                "it was made or start a new run")
