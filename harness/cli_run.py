"""The `run` and `list` commands of run_bench.py.

`run` checks the whole matrix before anything is measured (every problem reported on one
line, exit 2, nothing written), then runs it into <results-dir>/<run-id>/; the same run id
again resumes that run (see harness.store for the rule). `--dry-run` prints the plan.
"""

from __future__ import annotations

import argparse
import datetime
from collections import Counter
from pathlib import Path

import torch
from tabulate import tabulate

import variants
from harness import matrix as mx
from harness import runner
from harness.errors import UsageError
from harness.store import RunStore, matmul_fp32_gflops
from harness.worker import import_extra

# The narrowing flags: flag dest -> (matrix key, element type).
_OVERRIDES = {"variants": ("variants", str), "seq_lens": ("seq_lens", int),
              "device": ("devices", str), "dtype": ("dtypes", str), "pass_": ("passes", str),
              "inputs": ("inputs", str), "causal": ("causal", "bool"), "batch": ("batch", int),
              "heads": ("heads", int), "head_dim": ("head_dim", int)}
_SCALARS = {"timeout": ("timeout_s", float), "min_run_time": ("min_run_time_s", float),
            "min_repeats": ("min_repeats", int), "threads": ("threads", int),
            "mem_limit_mib": ("mem_limit_mib", int), "err_rows": ("err_rows", int)}


def add_run_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="quick (default), cpu, gpu, or a path to a .toml matrix")
    src.add_argument("--config", default=None, help="a .toml matrix file of your own")
    p.add_argument("--results-dir", default="results", type=Path)
    p.add_argument("--run-id", default=None,
                   help="folder name under --results-dir (default: a UTC timestamp); "
                        "an existing run of the same matrix is resumed")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (cases, declared skips, rough time) and run nothing")
    narrow = p.add_argument_group("narrowing (each replaces the matrix's key in every group)")
    narrow.add_argument("--variants", help="comma-separated variant names to keep")
    narrow.add_argument("--seq-lens", dest="seq_lens", help="e.g. 512,1024")
    narrow.add_argument("--device", help="cpu or cuda (comma-separated)")
    narrow.add_argument("--dtype", help="float32,bfloat16,...")
    narrow.add_argument("--pass", dest="pass_", help="forward and/or forward_backward")
    narrow.add_argument("--inputs", help="gaussian,sharp,local")
    narrow.add_argument("--causal", help="true, false or true,false")
    narrow.add_argument("--batch")
    narrow.add_argument("--heads")
    narrow.add_argument("--head-dim", dest="head_dim")
    sett = p.add_argument_group("run settings")
    sett.add_argument("--timeout", help="seconds per case before the worker is killed")
    sett.add_argument("--min-run-time", dest="min_run_time", help="timing budget per case, s")
    sett.add_argument("--min-repeats", dest="min_repeats", help="at least this many timings")
    sett.add_argument("--threads", help="torch threads in the worker (0: all cores)")
    sett.add_argument("--mem-limit-mib", dest="mem_limit_mib",
                      help="worker address-space cap above its baseline (0: MemAvailable*0.9)")
    sett.add_argument("--err-rows", dest="err_rows", help="query rows sampled for the error")


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
        if text is not None:
            out[key] = [_parse(t, typ, dest.rstrip("_")) for t in text.split(",") if t.strip()]
    for dest, (key, typ) in _SCALARS.items():
        text = getattr(args, dest, None)
        if text is not None:
            out[key] = _parse(text, typ, dest)
    return out


def _run_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")


def run_matrix(source: str, overrides: dict, results_dir: Path, run_id: str | None) -> Path:
    """Check, then run a matrix; returns the run folder. UsageError before any writing."""
    matrix, cases = mx.load(source, overrides)
    if not cases:
        raise UsageError("the matrix has no cases")
    if any(c.device == "cuda" for c in cases) and not torch.cuda.is_available():
        raise UsageError("the matrix asks for device cuda but CUDA is not available here "
                         "(--device cpu, or --dry-run to see the plan)")
    run_id = run_id or _run_id()
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise UsageError(f"--run-id must be a plain folder name, got {run_id!r}")
    store = RunStore(Path(results_dir) / run_id)
    resume = store.check(matrix)
    counts = runner.run(matrix, cases, store, resume=resume)
    summary = ", ".join(f"{s} {counts[s]}" for s in runner.STATUSES)
    earlier = len(cases) - sum(counts.values())
    print(f"{len(cases)} cases: {summary}"
          f"{f' ({earlier} done earlier)' if earlier else ''} -> {store.folder}")
    return store.folder


def run_command(args) -> int:
    import_extra()  # variants registered outside the package (ATTNBENCH_EXTRA_MODULES)
    source = args.config or args.preset or "quick"
    if args.dry_run:
        return plan(source, overrides_from(args))
    run_matrix(source, overrides_from(args), args.results_dir, args.run_id)
    return 0


def run_default() -> Path:
    """The default job of `python run_bench.py`: the quick preset on CPU into results/."""
    return run_matrix("quick", {"devices": ["cpu"]}, Path("results"), None)


# The dry run's assumptions for CUDA cases (no GPU is measured before a run): a dense
# matmul rate of a modern data-centre GPU (H100/H200 class: TF32/bf16 tensor cores well
# above this; variants run below it), and the seconds the first worker spends compiling
# a library kernel the first time it meets a (variant, dtype, pass); the second worker
# finds inductor's on-disk cache and pays the smaller figure. Unmeasured on a GPU here.
GPU_ASSUMED_GFLOPS = 100_000
COMPILE_ASSUMED_S = (20.0, 5.0)


def plan(source: str, overrides: dict) -> int:
    """Print the cases, their declared skips and a rough time estimate; run nothing.

    Estimate per case (compute-bound, so a lower bound for variants far below their FLOP
    rate): 0.5 s of overhead, the float64 reference at a quarter of the matmul rate, and
    the workers' calls (memory: a warm-up and the probe; time: the error pass, a warm-up,
    then max(min_repeats, min_run_time / t + 1) timed) of t = flops / (0.25 * rate),
    capped at the case's timeout. The rate is the fp32 matmul rate measured here for CPU
    cases and GPU_ASSUMED_GFLOPS for CUDA cases (estimated even where CUDA is absent:
    the plan of a GPU run made on a laptop). Variants that compile add COMPILE_ASSUMED_S
    (both workers) for each new (variant, device, dtype, pass). The memory guard's
    extrapolated refusals need measured peaks, so they are not known here.
    """
    _, cases = mx.load(source, overrides)
    rates = {"cpu": matmul_fp32_gflops(cases[0].threads if cases else 1) * 1e9,
             "cuda": GPU_ASSUMED_GFLOPS * 1e9}
    skipped, reasons, total_s, compiled = 0, Counter(), 0.0, set()
    for case in cases:
        module = variants.build(case.variant, **case.param_dict)
        why = [r for r in runner.skip_reasons(case, module) if r != runner.NO_CUDA]
        if why:
            skipped += 1
            reasons[f"{case.variant}: {'; '.join(why)}"] += 1
            continue
        rate = rates[case.device]
        flops = runner.case_row(case, module)["flops"]
        t = flops / (0.25 * rate)
        rows = min(case.seq_len, case.err_rows)
        ref = 4 * case.batch * case.heads * rows * case.seq_len * case.head_dim / (0.25 * rate)
        calls = 4 + max(case.min_repeats, case.min_run_time_s / max(t, 1e-9) + 1)
        est = 0.5 + ref + t * calls
        kernel = (case.variant, case.device, case.dtype, case.pass_)
        if module.compiles and kernel not in compiled:
            compiled.add(kernel)
            est += sum(COMPILE_ASSUMED_S)
        total_s += min(est, case.timeout_s)
    where = [f"fp32 matmul {rates['cpu'] / 1e9:.0f} GFLOP/s measured here"] * any(
        c.device == "cpu" for c in cases)
    if any(c.device == "cuda" for c in cases):
        where.append(f"CUDA cases at an assumed {GPU_ASSUMED_GFLOPS / 1e3:.0f} TFLOP/s GPU"
                     f"{'' if torch.cuda.is_available() else ' (no CUDA here)'}, "
                     f"a compile {COMPILE_ASSUMED_S[0]:.0f} s + {COMPILE_ASSUMED_S[1]:.0f} s "
                     "cached in the second worker")
    print(f"{len(cases)} cases; {skipped} skipped as declared unsupported; "
          f"{len(cases) - skipped} to run, compute-bound estimate {total_s / 60:.1f} min "
          f"({'; '.join(where)})")
    for reason, n in reasons.most_common():
        print(f"  skip x{n}: {reason}")
    return 0


def add_list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true", help="include names starting with '_'")


def list_command(args) -> int:
    rows = []
    for name in variants.names(private=args.all):
        s = variants.spec(name)
        params = ", ".join(f"{p.name}={p.default!r}" + _constraint(p) for p in s.params) or "-"
        exact = "exact" if s.exact else ("pattern" if s.pattern_exact else "approx")
        rows.append([name, s.family, exact, "yes" if s.supports_causal else "no",
                     "yes" if s.supports_backward else "no", params, s.paper])
    print(tabulate(rows, headers=["variant", "family", "exact", "causal", "backward",
                                  "parameters (defaults)", "paper"]))
    return 0


def _constraint(p) -> str:
    if p.choices is not None:
        return " {" + "|".join(map(str, p.choices)) + "}"
    if p.min is not None or p.max is not None:
        lo = "" if p.min is None else f"{p.min:g}"
        hi = "" if p.max is None else f"{p.max:g}"
        return f" [{lo}..{hi}]"
    return ""
