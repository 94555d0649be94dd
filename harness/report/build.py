"""The report of a run folder: report.md, a self-contained report.html and plots/*.png.

Reads the run folder only (run.read: results.csv, meta.json, train.csv, model.csv;
docs/results.md). Each section is a module whose entry gives its blocks for the run;
this module holds their order and the two writers: the document is built once as a list
of blocks, then rendered to Markdown (DataFrame.to_markdown) and to HTML
(DataFrame.to_html, plots inlined as base64 PNG).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pandas as pd

from harness.report import (answers, budget, by_length, complexity, crossover, environment,
                            gflops, layers, pareto, scaling, settings, summary, unmeasured)
from harness.report import generation, hybrid, sparse_frontier, text_state
from harness.report import maps as report_maps
from harness.report import model as report_model
from harness.report import run as report_run
from harness.report import trained as report_trained
from harness.report.implementations import implementations_blocks
from harness.report.rounds import TITLE as ROUNDS, rounds_blocks
from harness.report.run import Run

# The sections a benchmark run's report always has (level-2 titles).
SECTIONS = ("Attention maps", answers.TITLE, ROUNDS, layers.TITLE, complexity.TITLE,
            crossover.TITLE, "Implementations", by_length.TITLE, scaling.TITLE, pareto.TITLE,
            gflops.TITLE, unmeasured.TITLE, settings.TITLE, environment.TITLE)


def _bench(entry):
    """A section of the forward and forward+backward rows: none in a run without them."""
    def blocks(run: Run) -> list[tuple]:
        return entry(run) if not run.df.empty else []
    return blocks


def _trained(run: Run) -> list[tuple]:
    return ([] if run.train is None
            else report_trained.section_blocks(run.train, run.timed, run.dir))


# The report's sections in order; each gives [] where the folder holds nothing for it.
ORDER = (
    summary.blocks,
    _bench(lambda run: report_maps.maps_blocks(run.dir)),
    answers.blocks,
    _trained,
    lambda run: text_state.text_blocks(run.text, run.train, run.dir),
    lambda run: text_state.state_blocks(run.train, run.dir),
    hybrid.blocks,
    lambda run: report_model.drift_blocks(run.dir),
    _bench(lambda run: rounds_blocks(run.df, run.meta)),
    _bench(layers.blocks),
    _bench(complexity.blocks),
    _bench(crossover.blocks),
    lambda run: generation.generation_blocks(run.dec, run.meta, run.dir),
    _bench(lambda run: implementations_blocks(run.df)),
    _bench(by_length.blocks),
    _bench(scaling.blocks),
    _bench(budget.blocks),
    _bench(sparse_frontier.blocks),
    _bench(pareto.blocks),
    _bench(gflops.blocks),
    unmeasured.blocks,
    settings.blocks,
    environment.blocks,
)


def build_blocks(run: Run) -> list[tuple]:
    """The report as blocks: ("h", level, text), ("p", text), ("table", df), ("img", path, alt),
    ("code", text). Writes the plots into run.dir/plots as it goes."""
    return [b for section in ORDER for b in section(run)]


def to_markdown(blocks: list[tuple], run_dir: Path) -> str:
    out = []
    for b in blocks:
        if b[0] == "h":
            out.append(f"{'#' * b[1]} {b[2]}")
        elif b[0] == "p":
            out.append(b[1])
        elif b[0] == "table" and not b[1].empty:
            out.append(b[1].fillna("–").to_markdown(index=False, disable_numparse=True))
        elif b[0] == "img":
            out.append(f"![{b[2]}]({b[1].relative_to(run_dir).as_posix()})")
        elif b[0] == "code":
            out.append(f"```json\n{b[1]}\n```")
    return "\n\n".join(out) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;
  max-width:1400px;margin:2em auto;padding:0 1.5em;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}
h2{font-size:1.3em;margin-top:2em;padding-bottom:.2em;border-bottom:2px solid #d0d7de}
h3{font-size:1.05em;margin-top:1.4em;color:#333}h4{font-size:.95em;margin:1em 0 .3em;color:#555}
p{max-width:110ch}
table{max-width:100%;border-collapse:collapse;font-size:13px;margin:.6em 0 1.2em;
  font-variant-numeric:tabular-nums;box-shadow:0 1px 2px rgba(0,0,0,.06)}
th{background:#f1f3f5;font-weight:600;text-align:right;position:sticky;top:0}
td,th{border:1px solid #d8dee4;padding:4px 9px;text-align:right;overflow-wrap:break-word}
td{overflow-wrap:anywhere}td.word,th.word{white-space:nowrap}
td:first-child,th:first-child{text-align:left}
tbody tr:nth-child(even){background:#fafbfc}tbody tr:hover{background:#eef6ff}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
pre{background:#f6f8fa;padding:1em;overflow:auto;font-size:12px}
summary{cursor:pointer;color:#0969da}
""".replace("\n", "")


# A cell of one short word (a number, a variant, a pass): kept on one line, so that a
# narrow column never splits 2.61e-07 at its hyphen. Longer cells wrap (at spaces, and
# anywhere in the body if they must), so a wide table fits the page's width
# (max-width:100%) instead of running off its right edge.
_WORD = re.compile(r"<(td|th)>([^<\s]{1,16})</\1>")


def _table_html(df: pd.DataFrame) -> str:
    text = df.fillna("–").to_html(index=False, border=0, escape=True)
    return _WORD.sub(r'<\1 class="word">\2</\1>', text)


def to_html(blocks: list[tuple], title: str) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{_CSS}</style></head><body>"]
    for b in blocks:
        if b[0] == "h":
            out.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            out.append(f"<p>{html.escape(b[1])}</p>")
        elif b[0] == "table" and not b[1].empty:
            out.append(_table_html(b[1]))
        elif b[0] == "img":
            data = base64.b64encode(b[1].read_bytes()).decode("ascii")
            out.append(f"<img alt='{html.escape(b[2])}' src='data:image/png;base64,{data}'>")
        elif b[0] == "code":
            out.append(f"<details><summary>matrix</summary><pre>{html.escape(b[1])}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(run_dir) -> Path:
    """Write report.md, report.html and plots/ into a run folder; returns report.md's path.

    The folder may hold a benchmark run (results.csv), model drift (model.csv) and a
    training sweep (train.csv), in any combination with at least one of them."""
    run = report_run.read(run_dir)
    blocks = build_blocks(run)
    md = run.dir / "report.md"
    md.write_text(to_markdown(blocks, run.dir))
    (run.dir / "report.html").write_text(to_html(blocks, f"attnbench report: {run.name}"))
    return md
