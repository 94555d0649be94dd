"""The `model` command of attnbench: drift of a pretrained model under each variant.

Every argument, the model, the text and the results folder are checked before anything is
measured or written (one line on stderr, exit 2); then harness.drift.engine measures the
cases not yet in <results-dir>/<run-id>/model.csv and appends their rows.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harness.cli.settings import _split_top, split_setting
from harness.errors import UsageError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="minilm",
                   help="'minilm' (the shipped all-MiniLM-L6-v2) or a local Hugging Face "
                        "model directory (an encoder or a causal LM)")
    p.add_argument("--text", default=None,
                   help="a UTF-8 text file (default: Python's own pydoc_data.topics)")
    p.add_argument("--variants", default=None,
                   help="comma-separated settings, e.g. 'sdpa,sliding_window(window=64),"
                        "linformer(k=128)' (default: sdpa and our non-exact variants, "
                        "with their defaults)")
    p.add_argument("--seq-lens", dest="seq_lens", default="512", help="e.g. 128,512")
    p.add_argument("--windows", default="2", help="token windows per N (default 2)")
    p.add_argument("--seed", default="0", help="seed of the windows' offsets")
    p.add_argument("--threads", default="0", help="torch threads (0: all cores)")
    p.add_argument("--results-dir", default="results", type=Path,
                   help="where the run's folder goes (default: results)")
    p.add_argument("--run-id", default=None,
                   help="folder under --results-dir (default: a UTC timestamp); rows already "
                        "in its model.csv are kept and not measured again")


def parse_variants(text: str | None) -> list[tuple[str, dict]]:
    """'a,b(k=1, c=x)' -> [("a", {}), ("b", {"k": 1, "c": "x"})], each checked by the registry."""
    import variants
    from harness.drift.engine import default_variants

    if text is None:
        return [(name, {}) for name in default_variants()]
    out = []
    for item in _split_top(text):
        name, params = split_setting(item)
        params = params or {}
        try:
            variants.make_params(name.strip(), **params)
        except ValueError as e:
            raise UsageError(f"--variants: {e}") from None
        out.append((name.strip(), params))
    if not out:
        raise UsageError("--variants names no variant")
    return out


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        vals = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--{flag}: expected integers, got {text!r}") from None
    if not vals or min(vals) < low:
        raise UsageError(f"--{flag}: expected integers >= {low}, got {text!r}")
    return vals


def _int(text: str, flag: str, low: int) -> int:
    vals = _ints(text, flag, low)
    if len(vals) != 1:
        raise UsageError(f"--{flag}: expected one integer, got {text!r}")
    return vals[0]


def run_model(args) -> Path:
    """Check everything, then measure; returns the run folder. UsageError before any write."""
    from harness.cli.run import _run_id
    from harness.drift.memory import Probe

    specs = parse_variants(args.variants)
    seq_lens = sorted(set(_ints(args.seq_lens, "seq-lens", 1)))
    windows, seed = _int(args.windows, "windows", 1), _int(args.seed, "seed", 0)
    threads = _int(args.threads, "threads", 0)
    threads = threads or os.cpu_count() or 1
    run_id = args.run_id or _run_id()
    if "/" in run_id or run_id in (".", ".."):
        raise UsageError(f"--run-id must be a plain folder name, got {run_id!r}")
    probe = Probe()  # imports while this process checks the input; killed if not needed
    try:
        return _measure(args, probe, specs, seq_lens, windows, seed, threads, run_id)
    finally:
        probe.kill()


def _measure(args, probe, specs, seq_lens, windows, seed, threads, run_id) -> Path:
    import torch

    from harness.models import source as hf
    from harness.drift import engine as md
    from harness.drift.store import ModelStore, row_key
    from harness.measure.store import environment, now

    hf.quiet_transformers()
    source = md.open_source(args.model, args.text, seq_lens, windows, seed)
    store = ModelStore(Path(args.results_dir) / run_id)
    settings = md.settings_of(source, windows, seed)
    done = store.check(settings)
    cases = [c for c in md.plan(specs, seq_lens)
             if row_key(md.base_row(c, source, windows, seed)) not in done]
    if not cases:
        print(f"model {source.info.name}: all {len(done)} cases done earlier -> {store.csv_path}")
        return store.folder
    torch.set_num_threads(threads)
    model, _ = hf.load_model(source.path)  # UsageError when transformers cannot load it
    probe.send(source, windows, seed, cases)
    store.open({"settings": settings, "started": now(), **environment(threads)})
    counts = md.run(source, model, cases, store, windows, seed, threads, probe)
    summary = ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
    earlier = f" ({len(done)} done earlier)" if done else ""
    print(f"model {source.info.name}: {len(cases)} cases: {summary or 'none'}{earlier} -> "
          f"{store.csv_path}")
    return store.folder


def model_command(args) -> int:
    run_model(args)
    return 0


def default_args(results_dir: Path, run_id: str) -> argparse.Namespace:
    """The model drift of the default job: minilm, the shipped text, N = 512, one window
    (one window keeps the default job short; `model` alone compares 2)."""
    p = argparse.ArgumentParser()
    add_model_args(p)
    return p.parse_args(["--results-dir", str(results_dir), "--run-id", run_id,
                         "--windows", "1"])

