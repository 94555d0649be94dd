"""`run` ends with the run's report, whatever the executor (`--no-report`: not), and the
HTML report's tables fit the page's width instead of running off its right edge."""

import csv
import re

import pandas as pd
import pytest

import run_bench
from harness.report.build import to_html, write_report
from report_synth import synthetic_rows, write_run

# The quick preset cut to two cases that take a second each (no captured inputs).
TINY = ["run", "--preset", "quick", "--variants", "sdpa,linear", "--seq-lens", "128",
        "--pass", "forward", "--causal", "false", "--inputs", "gaussian", "--min-run-time", "0.01",
        "--min-repeats", "3"]
REPORT = ("report.md", "report.html")


def _run(tmp_path, run_id, *extra) -> int:
    return run_bench.main([*TINY, "--results-dir", str(tmp_path), "--run-id", run_id, *extra])


def _plots(folder) -> list[str]:
    return sorted(p.name for p in (folder / "plots").glob("*.png")) \
        if (folder / "plots").is_dir() else []


@pytest.mark.slow  # two real cases, each in a worker process, then the report
def test_serial_run_writes_its_report(tmp_path, capsys):
    assert _run(tmp_path, "serial") == 0
    folder = tmp_path / "serial"
    assert "report: " in capsys.readouterr().out
    for name in REPORT:
        assert (folder / name).is_file(), name
    assert "time_vs_length.png" in _plots(folder)
    md = (folder / "report.md").read_text()
    assert "\n## Answers\n" in md and "| sdpa " in md and "| linear " in md


@pytest.mark.slow
def test_no_report_skips_it_and_the_resumed_run_writes_it(tmp_path, capsys):
    folder = tmp_path / "r"
    assert _run(tmp_path, "r", "--no-report") == 0
    assert "report: " not in capsys.readouterr().out
    assert (folder / "results.csv").is_file()
    assert not any((folder / name).exists() for name in REPORT) and not _plots(folder)

    # As if the run had been killed before its last case: that case's row is missing.
    lines = (folder / "results.csv").read_text().splitlines(keepends=True)
    assert len(lines) == 3  # the header and two cases
    (folder / "results.csv").write_text("".join(lines[:2]))
    assert _run(tmp_path, "r") == 0
    out = capsys.readouterr().out
    assert "(1 done earlier)" in out and "report: " in out
    with (folder / "results.csv").open() as f:
        assert sorted(r["variant"] for r in csv.DictReader(f)) == ["linear", "sdpa"]
    for name in REPORT:
        assert (folder / name).is_file(), name
    assert "time_vs_length.png" in _plots(folder)


def _css_rules(page: str) -> dict[str, str]:
    """Selector -> its declarations, one entry per selector of a rule's list."""
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    rules = {}
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", style):
        for sel in selectors.split(","):
            rules[sel.strip()] = rules.get(sel.strip(), "") + ";" + body
    return rules


def test_html_tables_wrap_to_the_page_width(tmp_path):
    folder = write_run(tmp_path / "syn", synthetic_rows((1024, 4096)))
    write_report(folder)
    page = (folder / "report.html").read_text()
    rules = _css_rules(page)
    assert "max-width:100%" in rules["table"]  # a wide table is laid out within the page
    assert "overflow-wrap:anywhere" in rules["td"]  # ... and its long cells wrap to let it
    # No rule that every cell matches keeps cells on one line (a tag selector, alone or
    # with a pseudo-class such as :first-child); only one-word cells (class "word") are.
    for sel, body in rules.items():
        if re.fullmatch(r"(table|thead|tbody|tr|td|th)(:[\w-]+(\([^)]*\))?)*", sel):
            assert "nowrap" not in body, (sel, body)
    assert "nowrap" in rules["td.word"]

    # Every table of the page is one these rules apply to: no inline style overrides them.
    tables = re.findall(r"<table[^>]*>", page)
    assert tables and all("style" not in t for t in tables)
    assert not re.search(r"<t[dh][^>]*style=", page)
    answers = page[page.index("<h2>Answers</h2>"):]
    answers = answers[:answers.index("</table>")]
    cells = re.findall(r"<(td|th)( class=\"word\")?>([^<]*)</\1>", answers)
    assert cells
    for _, word, text in cells:  # one short word on one line; anything longer may wrap
        assert bool(word) == (" " not in text and len(text) <= 16), (word, text)
    assert any(" " in text and len(text) > 20 for _, _, text in cells)  # a long cell to wrap


def test_only_short_words_are_kept_whole():
    """A number stays on one line; a long label without spaces may still break, or it
    would widen its column past the page as the old nowrap did."""
    df = pd.DataFrame({"variant": ["block_sparse(block_size=128,num_random_blocks=3)"],
                       "rel_err": ["2.61e-07"], "answer": ["no faster approximate path"]})
    page = to_html([("table", df)], "t")
    assert '<td class="word">2.61e-07</td>' in page
    assert "<td>block_sparse(block_size=128,num_random_blocks=3)</td>" in page
    assert "<td>no faster approximate path</td>" in page
