"""The report's "Environment" section: meta.json (versions, devices, rates, where a sharded
run's cases ran, the matrix as run); in a folder without results.csv, model_meta.json's and
train_meta.json's instead."""

from __future__ import annotations

import json

import pandas as pd

from harness.report import model as report_model
from harness.report import provenance
from harness.report import trained as report_trained
from harness.report.run import Run

TITLE = "Environment"


def blocks(run: Run) -> list[tuple]:
    if run.results is None:
        return ((report_model.environment_blocks(run.dir) if run.has_model else [])
                + (report_trained.environment_blocks(run.dir)
                   if run.train is not None or run.text is not None else []))
    meta = run.meta
    env = {k: v for k, v in meta.items() if k not in ("matrix", "shards")}
    out: list[tuple] = [("h", 2, TITLE)]
    # a sharded run (meta.json's shard records): where its cases ran, and warnings about it
    out += [("p", note) for note in provenance.environment_notes(meta, set(run.rows["device"]))]
    if meta.get("shards"):
        out.append(("table", pd.DataFrame(provenance.shard_rows(meta["shards"]))))
    return out + [
        ("table", pd.DataFrame({"key": list(env), "value": [
            json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in env.values()]})),
        ("p", "The matrix as run:"), ("code", json.dumps(meta.get("matrix"), indent=1))]
