"""The `run` and `list` commands of attnbench (run_bench.py).

`run` checks the whole matrix before anything is measured (every problem reported on one
line, exit 2, nothing written), then runs it into <results-dir>/<run-id>/ and, once every
case has its row (serial or sharded), writes the run's report there (`--no-report`: not); the
same run id again resumes that run (see harness.measure.store for the rule). `--dry-run`
prints the plan (and where each variant from outside the package comes from). `list`
shows every variant with its origin: its family folder, a module, an entry point.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch

import variants
from harness.models import capture
from harness.measure import estimate
from harness.measure import layers, stack
from harness.measure import maps
from harness.cli import modules
from harness.cli.settings import split_setting, split_variants
from harness.cluster import executors
from harness.cluster import sharded
from harness.cluster import shards
from harness.measure import matrix as mx
from harness.measure import runner
from harness.measure.memory import MemoryGuard, decode_bytes
from harness.errors import UsageError
from harness.measure.store import RunStore, matmul_fp32_gflops
from harness.measure.inputs import DISTRIBUTIONS
from harness.measure.worker import import_extra
from tabulate import tabulate

# The narrowing flags: flag dest -> (matrix key, element type).
_OVERRIDES = {"variants": ("variants", str), "seq_lens": ("seq_lens", int),
              "device": ("devices", str), "dtype": ("dtypes", str), "pass_": ("passes", str),
              "inputs": ("inputs", str), "causal": ("causal", "bool"), "batch": ("batch", int),
              "heads": ("heads", int), "head_dim": ("head_dim", int),
              "kv_heads": ("kv_heads", int), "value_heads": ("value_heads", int),
              "value_dim": ("value_dim", int)}
_SCALARS = {"timeout": ("timeout_s", float), "min_run_time": ("min_run_time_s", float),
            "min_repeats": ("min_repeats", int), "threads": ("threads", int),
            "mem_limit_mib": ("mem_limit_mib", int), "err_rows": ("err_rows", int),
            "rounds": ("rounds", int), "decode_tokens": ("decode_tokens", int)}


def bench_presets() -> list[str]:
    """The presets `run` takes: the benchmark matrices of harness/presets (not the training
    ones, which `train` takes)."""
    return sorted(p.stem for p in mx.PRESET_DIR.glob("*.toml")
                  if not mx.is_training(mx.read_toml(str(p))))


def check_preset(source: str) -> None:
    """UsageError naming the presets `run` takes when `source` is neither one nor a file."""
    path = Path(source)
    if not path.suffix and not path.exists() and not (mx.PRESET_DIR / f"{source}.toml").exists():
        raise UsageError(f"unknown preset {source!r}; presets: {', '.join(bench_presets())}, "
                         "or a .toml file")


def add_run_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help=f"{', '.join(bench_presets())} (default: quick), or a path to a "
                          ".toml matrix")
    src.add_argument("--config", default=None, help="a .toml matrix file of your own")
    p.add_argument("--results-dir", default="results", type=Path,
                   help="where the run's folder goes (default: results)")
    p.add_argument("--run-id", default=None,
                   help="folder name under --results-dir (default: a UTC timestamp); "
                        "an existing run of the same matrix is resumed")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (cases, declared skips, rough time) and run nothing")
    p.add_argument("--no-report", dest="no_report", action="store_true",
                   help="leave out the report (report.md, report.html, plots/) the run "
                        "otherwise writes when every case has its row")
    narrow = p.add_argument_group("narrowing (each replaces the matrix's key, named in "
                                  "brackets, in every group)")
    narrow.add_argument("--variants", metavar="NAMES",
                        help="[variants] comma-separated variants to keep, each a name or "
                             "name(param=value, ...), e.g. 'sdpa,sliding_window(window=64)' "
                             "(a setting replaces the matrix's settings of that variant)")
    narrow.add_argument("--seq-lens", dest="seq_lens", metavar="N,...",
                        help="[seq_lens] sequence lengths, e.g. 512,1024")
    narrow.add_argument("--device", metavar="DEVICES", help="[devices] cpu and/or cuda")
    narrow.add_argument("--dtype", metavar="DTYPES",
                        help=f"[dtypes] {', '.join(mx.DTYPES)} (comma-separated)")
    narrow.add_argument("--pass", dest="pass_", metavar="PASSES",
                        help="[passes] forward, forward_backward and/or decode (time per "
                             "generated token; needs --causal true)")
    narrow.add_argument("--inputs", metavar="INPUTS",
                        help=f"[inputs] {', '.join(DISTRIBUTIONS + tuple(capture.BUILTIN))} "
                             "(or a [captures.NAME] of the matrix)")
    narrow.add_argument("--causal", metavar="BOOLS",
                        help="[causal] true, false or true,false")
    narrow.add_argument("--batch", metavar="B,...", help="[batch] batch sizes")
    narrow.add_argument("--heads", metavar="H,...", help="[heads] head counts")
    narrow.add_argument("--head-dim", dest="head_dim", metavar="D,...",
                        help="[head_dim] head dimensions")
    narrow.add_argument("--kv-heads", dest="kv_heads", metavar="HK,...",
                        help="[kv_heads] key-value heads of softmax variants, dividing "
                             "--heads (e.g. 8,1)")
    narrow.add_argument("--value-heads", dest="value_heads", metavar="HV,...",
                        help="[value_heads] value heads of recurrences, a multiple of "
                             "--heads (e.g. 8,16)")
    narrow.add_argument("--value-dim", dest="value_dim", metavar="DV,...",
                        help="[value_dim] values' width, for variants that declare it")
    sett = p.add_argument_group("run settings (each replaces the matrix's key, named in "
                                "brackets)")
    sett.add_argument("--timeout", metavar="S",
                      help="[timeout_s] seconds per case before the worker is killed")
    sett.add_argument("--min-run-time", dest="min_run_time", metavar="S",
                      help="[min_run_time_s] timing budget per case, seconds")
    sett.add_argument("--min-repeats", dest="min_repeats", metavar="R",
                      help="[min_repeats] at least this many timings")
    sett.add_argument("--decode-tokens", dest="decode_tokens", metavar="T",
                      help="[decode_tokens] decode cases: tokens generated after each context "
                           "(default 16)")
    sett.add_argument("--threads", metavar="T",
                      help="[threads] torch threads in the worker (0: all cores)")
    sett.add_argument("--mem-limit-mib", dest="mem_limit_mib", metavar="MIB",
                      help="[mem_limit_mib] worker address-space cap above its baseline "
                           "(0: MemAvailable*0.9)")
    sett.add_argument("--err-rows", dest="err_rows", metavar="ROWS",
                      help="[err_rows] query rows sampled for the error")
    sett.add_argument("--rounds", metavar="R",
                      help="[rounds] time each case in R rounds spread over the run "
                           "(round 1 of every case, then round 2, ...): time_ms_spread shows "
                           "drift between them")
    executors.add_args(p)


def _parse(text: str, typ, flag: str):
    try:
        if typ == "bool":
            return {"true": True, "false": False}[text.strip().lower()]
        return typ(text.strip())
    except (KeyError, ValueError):
        name = "true/false" if typ == "bool" else typ.__name__
        raise UsageError(f"--{flag.replace('_', '-')}: expected {name}, got {text!r}") from None


def overrides_from(args) -> dict:
    out = {}
    for dest, (key, typ) in _OVERRIDES.items():
        text = getattr(args, dest, None)
        if text is not None and dest == "variants":  # a name, or name(param=value, ...)
            out[key] = [(lambda n, p: n if p is None else (n, p))(*split_setting(t))
                        for t in split_variants(text)]
        elif text is not None:
            out[key] = [_parse(t, typ, dest.rstrip("_")) for t in text.split(",") if t.strip()]
    for dest, (key, typ) in _SCALARS.items():
        text = getattr(args, dest, None)
        if text is not None:
            out[key] = _parse(text, typ, dest)
    return out


def _run_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")


def run_matrix(source: str, overrides: dict, results_dir: Path, run_id: str | None,
               settings: executors.Settings | None = None, argv: list[str] | None = None):
    """Check, then run a matrix; returns the run folder when every case has a row, else the
    exit status (a sharded run submitted with --no-wait or left unfinished).

    UsageError before any writing."""
    settings = settings or executors.Settings()
    matrix, cases = mx.load(source, overrides)
    if not cases:
        raise UsageError("the matrix has no cases")
    local = settings.kind != "slurm"  # Slurm jobs run on the cluster's nodes, not here
    if local and any(c.device == "cuda" for c in cases) and not torch.cuda.is_available():
        raise UsageError("the matrix asks for device cuda but CUDA is not available here "
                         "(--device cpu, or --dry-run to see the plan)")
    check_settings(cases)
    run_id = run_id or _run_id()
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise UsageError(f"--run-id must be a plain folder name, got {run_id!r}")
    executors.check_available(settings)
    store = RunStore(Path(results_dir) / run_id)
    resume = store.check(matrix)
    if resume:
        modules.warn_changed(store.read_meta())
    capture.prepare(cases)  # captured inputs: once, cached, before anything is measured
    if settings.kind != "serial":
        out = sharded.run(matrix, cases, store, resume, settings, _rerun(argv, run_id))
    else:
        if resume:
            sharded.merge_before_serial(store, cases)
        counts = runner.run(matrix, cases, store, resume=resume)
        print(runner.summary_line(len(cases), counts, len(cases) - sum(counts.values()),
                                  store.folder))
        out = store.folder
    if not isinstance(out, int):  # every case has its row: the attention maps of the run
        maps.write(out, cases)
    return out


def check_settings(cases) -> None:
    """UsageError naming every setting that cannot be on its device at all (a variant's
    `setting_errors`: a cache dtype the device or torch lacks), judged on the devices
    here (a CUDA case only where CUDA is), before anything is written or measured."""
    errors, seen = [], set()
    for c in cases:
        key = (c.variant, c.params, c.device)
        if key in seen or (c.device == "cuda" and not torch.cuda.is_available()):
            continue
        seen.add(key)
        errors += [f"{c.variant}: {e}" for e in layers.build(c).setting_errors(c.device)]
    if errors:
        raise UsageError("; ".join(dict.fromkeys(errors)))


def _rerun(argv: list[str] | None, run_id: str) -> str:
    """The command that waits for this run's jobs, merges and reports: the same command
    without --no-wait, with the run id."""
    argv = [a for a in (argv or []) if a != "--no-wait"]
    if not any(a == "--run-id" or a.startswith("--run-id=") for a in argv):
        argv += ["--run-id", run_id]
    head = (["attnbench"] if os.path.basename(sys.argv[0] or "") == "attnbench"
            else [sys.executable.rsplit("/", 1)[-1], "run_bench.py"])
    return shlex.join([*head, *argv])


def run_command(args) -> int:
    import_extra()  # variant modules (harness.cli.modules has loaded them), entry points
    source = args.config or args.preset or "quick"
    check_preset(source)
    settings = executors.settings_from(args, mx.read_toml(source).get("executor"))
    if args.dry_run:
        return plan(source, overrides_from(args), settings.shards)
    out = run_matrix(source, overrides_from(args), args.results_dir, args.run_id, settings,
                     getattr(args, "argv", None))
    if isinstance(out, int):
        return out
    if args.no_report:
        return 0
    from harness.cli.report import report_dir  # every case has its row, whatever the executor

    return report_dir(out)


def run_default() -> Path:
    """The default job of `attnbench`: the quick preset on CPU into results/."""
    return run_matrix("quick", {"devices": ["cpu"]}, Path("results"), None)


def plan(source: str, overrides: dict, n_shards: int = 1) -> int:
    """Print the cases, their declared skips and a rough time estimate (harness.measure.estimate);
    with n_shards > 1, also each shard's share."""
    _, cases = mx.load(source, overrides)
    check_settings(cases)
    rate = matmul_fp32_gflops(cases[0].threads if cases else 1) * 1e9
    skipped, reasons, total_s = 0, Counter(), 0.0
    planned = estimate.plan_cases(cases, rate)
    guard, guarded = MemoryGuard(), []  # decode states too large for this machine's memory
    for case, why, cost in planned:
        if why:
            skipped += 1
            reasons[f"{case.variant}: {'; '.join(why)}"] += 1
            continue
        if case.decode and case.device == "cpu" and guard.refuse_reason(case, layers.build(case)):
            guarded.append(case)
            continue
        total_s += cost
    where = [f"fp32 matmul {rate / 1e9:.0f} GFLOP/s measured here"] * any(
        c.device == "cpu" for c in cases)
    if any(c.device == "cuda" for c in cases):
        fast, cached = estimate.COMPILE_ASSUMED_S
        where.append(f"CUDA cases at an assumed {estimate.GPU_ASSUMED_GFLOPS / 1e3:.0f} TFLOP/s "
                     f"GPU{'' if torch.cuda.is_available() else ' (no CUDA here)'}, a compile "
                     f"{fast:.0f} s + {cached:.0f} s cached in the second worker")
    print(f"{len(cases)} cases; {skipped} skipped as declared unsupported; "
          f"{len(cases) - skipped} to run, compute-bound estimate {total_s / 60:.1f} min "
          f"({'; '.join(where)})")
    mixers = dict.fromkeys(n for c in cases for n in stack.mixers(c.variant))  # a pattern's too
    outside = {n: variants.origin(n) for n in mixers
               if not variants.origin(n).startswith("variants/")}
    for name, origin in outside.items():
        print(f"  {name}: from {origin}")
    for reason, n in reasons.most_common():
        print(f"  skip x{n}: {reason}")
    if guarded:
        print(f"  memory guard: {len(guarded)} decode case(s) whose state exceeds its share of "
              f"this machine's free memory, recorded as skipped when run here (not in the "
              f"estimate): {', '.join(c.label() for c in guarded)}")
    decoding = [(c, decode_bytes(c, layers.build(c)))
                for c, why, _ in planned if c.decode and not why]
    sized = [(c, b) for c, b in decoding if b is not None]
    if sized:
        c, b = max(sized, key=lambda cb: cb[1])
        print(f"  decode: {len(decoding)} cases, the largest state {b / 2**20:,.0f} MiB "
              f"({c.label()}); the memory guard skips a case whose state exceeds its share "
              f"of free memory")
    if n_shards > 1:
        cost = {c.case_id: t for c, _, t in planned}
        for i, part in enumerate(shards.split([(c, t) for c, _, t in planned], n_shards)):
            print(f"  shard {i}: {len(part)} cases, estimate "
                  f"{sum(cost[c.case_id] for c in part) / 60:.1f} min")
    return 0


def add_list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true", help="include names starting with '_'")
    p.add_argument("--spec", metavar="NAME", help="print one variant's declared contract, "
                                                  "field by field")
    p.add_argument("--wide", action="store_true",
                   help="every column: backward, heads (the groupings it runs), parameters, "
                        "extra inputs, why a device is out, paper "
                        "(the default view fits 100 columns)")


def _devices(m) -> tuple[str, str]:
    """The devices a variant runs on (cpu, cuda; judged as if a CUDA device were here when
    none is) at some dtype and causal setting, and why the others are out."""
    ok, why = [], []
    for device in ("cpu", "cuda"):
        best = None
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for causal in (False, True):
                r = m.unsupported_reasons(device=device, dtype=dtype, causal=causal,
                                          seq_len=1024, head_dim=64)
                r = [x for x in r if "no cuda device here" not in x.lower()]
                best = r if best is None or len(r) < len(best) else best
        if best:
            why.append(f"{device}: {best[0]}")
        else:
            ok.append(device)
    return ",".join(ok) or "-", "; ".join(why) or "-"


def list_command(args) -> int:
    if getattr(args, "spec", None):
        try:
            s = variants.spec(args.spec)
        except ValueError as e:  # an unknown name: one line, exit 2
            raise UsageError(str(e)) from None
        print(f"{s.name} ({s.family}, {s.origin}): {s.summary}")
        print(tabulate(list(s.contract.describe().items()), headers=["contract", "declared"]))
        return 0
    rows = []
    for name in variants.names(private=args.all):
        s = variants.spec(name)
        m = variants.build(name)
        params = ", ".join(f"{p.name}={p.default!r}" + _constraint(p) for p in s.params) or "-"
        exact = "exact" if s.exact else ("pattern" if s.pattern_exact else "approx")
        exact = exact if s.err_ref == "softmax" else "own ref"
        exact = "ceiling" if s.reference_ceiling else exact
        causal = "only" if s.causal_only else ("yes" if s.supports_causal else "no")
        inputs = "; ".join(f"{i.name} {i.shape_text} {i.range_text}" for i in s.inputs) or "-"
        devices, why = _devices(m)
        decode = "no" if m.decode_reasons() else "yes"
        rows.append([name, s.family, exact, causal, decode, devices, s.origin,
                     "yes" if s.supports_backward else "no", s.grouping.describe(), params,
                     inputs, why, s.paper])
    headers = ["variant", "family", "exact", "causal", "decode", "devices", "origin",
               "backward", "heads", "parameters (defaults)", "inputs beyond q, k, v",
               "devices out", "paper"]
    keep = len(headers) if args.wide else 7
    table = [headers[:keep], None, *(r[:keep] for r in rows)]  # None: the rule
    widths = [max(len(r[i]) for r in table if r) for i in range(keep)]
    for r in table:
        cells = ["-" * w for w in widths] if r is None else [c.ljust(w) for c, w in zip(r, widths)]
        print("  ".join(cells).rstrip())
    if not args.wide:
        print("exact: exact softmax, pattern (exact on a key pattern), approx, own ref (error "
              "against its own\nfloat64 recurrence), ceiling (an oracle bound); --wide: "
              "backward, heads, parameters, inputs, paper")
    return 0


def _constraint(p) -> str:
    if p.choices is not None:
        return " {" + "|".join(map(str, p.choices)) + "}"
    if p.min is not None or p.max is not None:
        lo = "" if p.min is None else f"{p.min:g}"
        hi = "" if p.max is None else f"{p.max:g}"
        return f" [{lo}..{hi}]"
    return ""
