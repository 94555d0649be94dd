"""Corpora and their document splits, against recomputations written from the documented
rule (sha256 of a document's bytes, its first 8 bytes as a share of 2^64).

Planted bugs these catch: Python's salted hash(), or a name's hash, in place of the
documented one (the recomputed sha256 and membership); a document in two splits, or one
lost (disjoint, and their union the corpus); binary or NUL files, duplicates kept (the
folder); a .jsonl line read whole instead of its "text" field (the jsonl); a test file
of the standard library kept (python-source); a docstring missed or invented (against
ast.walk); a check that compares nothing, or only the train split (an edited test-split
file must fail it); an error that is not one line (every UsageError here).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.train import corpus, text_windows
from harness.train.corpus import EOD, SPLITS


@pytest.fixture(autouse=True)
def _fresh():
    text_windows.clear_cache()
    yield
    text_windows.clear_cache()


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def _rule_split(text: bytes, valid=corpus.VALID_FRAC, test=corpus.TEST_FRAC) -> str:
    u = int(hashlib.sha256(text).hexdigest()[:16], 16) / 2 ** 64
    return "test" if u < test else "validation" if u < test + valid else "train"


def _folder(tmp_path, n=200):
    for i in range(n):  # sizes and contents vary; names sort differently than numbers
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}: " + "lorem ipsum " * (i % 7))
    return tmp_path


def _docs_of(data: bytes) -> list[bytes]:
    assert data.endswith(bytes([EOD]))
    return data[:-1].split(bytes([EOD]))


def test_a_folder_is_one_document_per_text_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("beta")
    (tmp_path / "sub" / "a.md").write_text("alpha")
    (tmp_path / "copy.txt").write_text("beta")  # a duplicate: kept once
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)))  # not UTF-8
    (tmp_path / "nul.txt").write_bytes(b"text\0more")  # holds NUL
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]")  # hidden: not the user's text
    assert corpus.documents(f"path:{tmp_path}") == (("b.txt", b"beta"), ("sub/a.md", b"alpha"))
    assert corpus.documents(f"path:{tmp_path / 'b.txt'}") == (("b.txt", b"beta"),)


def test_a_jsonl_file_is_one_document_per_line_its_text_field(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"row {i}", "id": i}) for i in range(3)) + "\n\n")
    docs = corpus.documents(f"path:{f}")
    assert [t for _, t in docs] == [b"row 0", b"row 1", b"row 2"]
    f.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    corpus.clear_cache()
    with pytest.raises(UsageError) as e:
        corpus.documents(f"path:{f}")
    assert f"{f}:2" in _one_line(e) and "'text'" in _one_line(e)


def test_a_path_that_is_missing_or_holds_no_text_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError) as e:
        corpus.documents(f"path:{tmp_path / 'nowhere'}")
    assert "does not exist" in _one_line(e)
    (tmp_path / "x.bin").write_bytes(b"\xff\xfe\0")
    with pytest.raises(UsageError) as e:
        corpus.documents(f"path:{tmp_path}")
    assert "holds no text" in _one_line(e)
    with pytest.raises(UsageError) as e:
        corpus.documents("wikipedia")
    assert "unknown corpus" in _one_line(e)
    assert "does not exist" in text_windows.lm_problems(64, 256, f"path:{tmp_path / 'no'}")[0]


def test_hf_without_datasets_or_unreachable_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(UsageError) as e:
        corpus.documents("hf:wikitext:wikitext-2-raw-v1")
    assert "datasets" in _one_line(e) and "hf:wikitext" in _one_line(e)
    assert "needs the optional package `datasets`" in text_windows.lm_problems(
        64, 256, "hf:wikitext")[0]

    def unreachable(name, config, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\n"
                              "more lines")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(UsageError) as e:
        corpus.documents("hf:wikitext:wikitext-2-raw-v1")
    assert "ConnectionError" in _one_line(e) and "Couldn't reach 'wikitext'" in _one_line(e)


class _Rows:
    """What datasets.load_dataset returns, as far as the corpus reads it."""
    def __init__(self, columns: dict):
        self.columns = columns
        self.column_names = list(columns)

    def __getitem__(self, column: str) -> list:
        return self.columns[column]


def test_hf_rows_are_documents_their_text_column(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return _Rows({"text": ["first row", "", "second row", None], "id": [1, 2, 3, 4]})
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    docs = corpus.documents("hf:wikitext:wikitext-2-raw-v1")
    assert [t for _, t in docs] == [b"first row", b"second row"]
    assert calls == [("wikitext", "wikitext-2-raw-v1", "train")]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        load_dataset=lambda name, config, split: _Rows({"content": ["x"]})))
    with pytest.raises(UsageError) as e:
        corpus.documents("hf:other")
    assert "no 'text' column (columns: content)" in _one_line(e)


def test_splits_are_disjoint_cover_the_corpus_and_follow_the_sha256_rule(tmp_path):
    name = f"path:{_folder(tmp_path)}"
    docs = corpus.documents(name)
    parts = corpus.splits(name)
    got = {s: _docs_of(parts[s]) for s in SPLITS}
    want = {s: [t for _, t in docs if _rule_split(t) == s] for s in SPLITS}
    assert got == want  # membership and order (name order) as the rule says
    assert all(got[s] for s in SPLITS)
    seen = [t for s in SPLITS for t in got[s]]
    assert len(seen) == len(set(seen)) == len(docs)  # disjoint, none lost


def test_each_splits_sha256_equals_a_recomputation_and_a_new_process_agrees(tmp_path):
    name = f"path:{_folder(tmp_path)}"
    meta = corpus.describe(name)
    docs = corpus.documents(name)
    for s in SPLITS:
        data = b"".join(t + bytes([EOD]) for _, t in docs if _rule_split(t) == s)
        assert meta["splits"][s]["sha256"] == hashlib.sha256(data).hexdigest()
        assert meta["splits"][s]["bytes"] == len(data)
    json.dumps(meta)  # what train_meta.json takes
    other = subprocess.run(  # another process, another PYTHONHASHSEED: the same splits
        [sys.executable, "-c", "import json, sys; from harness.train import corpus; "
         "print(json.dumps(corpus.describe(sys.argv[1])))", name],
        env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, text=True,
        check=True, cwd=Path(__file__).resolve().parent.parent)
    assert json.loads(other.stdout) == meta


def test_python_source_is_the_stdlib_without_its_tests():
    docs = dict(corpus.documents("python-source"))
    assert "json/decoder.py" in docs and "collections/__init__.py" in docs
    parts = [n.split("/") for n in docs]
    assert not [p for p in parts if {"test", "tests", "idle_test"} & set(p[:-1])
                or p[-1].startswith("test_")]
    meta = corpus.describe("python-source")
    assert all(meta["splits"][s]["documents"] > 10 for s in SPLITS)


def _stdlib_source(module: str) -> bytes:
    return (Path(sysconfig.get_paths()["stdlib"]) / module).read_bytes()


@pytest.mark.parametrize("module", ["json/decoder.py", "collections/__init__.py",
                                    "asyncio/tasks.py", "os.py"])
def test_docstrings_are_those_ast_walk_finds(module):
    source = _stdlib_source(module)
    tree = ast.parse(source)
    want = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(
        n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    got = corpus._docstrings(tree)
    assert sorted(got) == sorted(d for d in want if d) and len(got) > 5


def test_a_recorded_split_that_differs_is_a_usage_error(tmp_path):
    name = f"path:{_folder(tmp_path)}"
    recorded = json.loads(json.dumps(corpus.describe(name)))
    corpus.check_recorded(recorded)  # the same files: nothing to say
    tampered = json.loads(json.dumps(recorded))
    tampered["splits"]["validation"]["sha256"] = "0" * 64  # same size, other bytes
    with pytest.raises(UsageError, match="the validation split differs"):
        corpus.check_recorded(tampered)
    test_doc = next(t for _, t in corpus.documents(name) if _rule_split(t) == "test")
    victim = next(p for p in tmp_path.iterdir() if p.read_bytes() == test_doc)
    victim.unlink()  # only the test split changes (an edit would move the document by hash)
    corpus.clear_cache()
    with pytest.raises(UsageError) as e:
        corpus.check_recorded(recorded)
    msg = _one_line(e)
    assert "the test split differs" in msg and name in msg and "its files changed" in msg
    recorded["python"] = "3.0.1"
    with pytest.raises(UsageError, match="recorded under Python 3.0.1, this is 3"):
        corpus.check_recorded(recorded)


def test_python_docs_are_each_modules_docstrings_and_the_help_topics(monkeypatch):
    from pydoc_data import topics

    files = [("json/decoder.py", _stdlib_source("json/decoder.py")),
             ("bad.py", b'def f(:\n    """not Python"""\n'), ("nodoc.py", b"x = 1\n")]
    monkeypatch.setattr(corpus, "_stdlib_files", lambda: files)
    docs = dict(corpus.documents("python-docs"))
    want = "\n\n".join(corpus._docstrings(ast.parse(files[0][1]))).encode()
    texts = {v.encode() for v in topics.topics.values()} | {want}  # "if" and "else": one text
    assert sorted(docs.values()) == sorted(texts)
    assert docs["docstrings:json/decoder.py"] == want
    assert docs["topics:assert"] == topics.topics["assert"].encode()


def test_too_few_documents_for_three_splits_is_a_usage_error(tmp_path):
    (tmp_path / "only.txt").write_text("one document")
    with pytest.raises(UsageError) as e:
        corpus.splits(f"path:{tmp_path}")
    assert "empty" in _one_line(e)
