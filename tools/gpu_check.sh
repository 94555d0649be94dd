#!/usr/bin/env bash
# The GPU check: on a CUDA machine with torch installed, run the CUDA-marked tests
# (`python -m pytest -m cuda`: every variant's own code on the device against the float64
# reference, the CUDA memory guard, timing, memory, allocator release, matmul rates, a
# CUDA run end to end) and then the gpu-smoke preset, and print a compact summary.
#
#   bash tools/gpu_check.sh               # results under $OUT (or ./gpu-check) when done
#
# Packages the GPU machine lacks travel as wheels in .whl/ (pure Python or ABI-independent,
# installed offline with --no-deps): submitit (the cluster code imports it lazily),
# xformers (the xformers variants; 0.0.35 needs torch >= 2.10) and fla-core (the `*_fla`
# variants: flash-linear-attention's Triton kernels, pure Python; triton comes with CUDA
# torch). Fetched where pip works (.whl/ is git-ignored, so it travels only when carried):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl submitit==1.5.4 xformers==0.0.35 fla-core==0.6.0
# Time: GPU_CHECK_BUDGET_S (default 540) in all; the tests get at most GPU_CHECK_TESTS_S
# (default 240), the preset what is left. A preset cut short keeps every finished row and
# the summary says how many of its cases ran.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET=${GPU_CHECK_BUDGET_S:-540}
TESTS_S=${GPU_CHECK_TESTS_S:-240}
OUTDIR=${OUT:-$PWD/gpu-check}
mkdir -p "$OUTDIR"
START=$(date +%s)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site .whl/*.whl || { echo "gpu_check: wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

$PY - <<'PYEOF' || { echo "gpu_check: no CUDA device visible to torch"; exit 1; }
import importlib.util, torch
assert torch.cuda.is_available()
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"xformers {'present' if importlib.util.find_spec('xformers') else 'absent'}, "
      f"fla {'present' if importlib.util.find_spec('fla') else 'absent'}, "
      f"triton {'present' if importlib.util.find_spec('triton') else 'absent'}")
PYEOF

echo "== pytest -m cuda (at most ${TESTS_S} s)"
timeout "$TESTS_S" $PY -m pytest -m cuda -q -rs -p no:cacheprovider \
    --junitxml="$OUTDIR/cuda-tests.xml" tests >"$OUTDIR/cuda-tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUTDIR/cuda-tests.log" | cut -c1-220 | head -40
tail -1 "$OUTDIR/cuda-tests.log"
[ "$TESTS_RC" -eq 124 ] && echo "gpu_check: the CUDA tests ran past ${TESTS_S} s and were stopped"

LEFT=$((BUDGET - ($(date +%s) - START)))
echo "== run --preset gpu-smoke (at most ${LEFT} s)"
timeout "$LEFT" $PY run_bench.py run --preset gpu-smoke --results-dir "$OUTDIR" \
    --run-id gpu-smoke >"$OUTDIR/gpu-smoke.log" 2>&1
RUN_RC=$?
[ "$RUN_RC" -eq 124 ] && echo "gpu_check: gpu-smoke ran past ${LEFT} s and was stopped"
tail -2 "$OUTDIR/gpu-smoke.log" | tr '\r' '\n' | tail -1

$PY - "$OUTDIR/gpu-smoke" <<'PYEOF'
import collections, csv, json, sys
from pathlib import Path
folder = Path(sys.argv[1])
if not (folder / "results.csv").exists():
    print("gpu_check: gpu-smoke wrote no rows"); sys.exit(0)
rows = list(csv.DictReader((folder / "results.csv").open()))
meta = json.loads((folder / "meta.json").read_text())
print(f"gpu-smoke: {len(rows)} of {meta.get('cases')} cases have rows;",
      dict(collections.Counter(r["status"] for r in rows)))
print("matmul GFLOP/s:", {k: round(v) for k, v in (meta.get("matmul_gflops") or {}).items()})
def short(r):
    return (f"{r['variant']} N={r['seq_len']} {r['dtype']} {r['pass']}"
            f"{' causal' if r['causal'] == 'True' else ''}")
for r in rows:  # every case that did not run, unless it is a declared skip
    if r["status"] not in ("ok", "skipped") or (r["status"] == "skipped"
                                                and "memory guard" in r["reason"]):
        print(f"  {r['status']:9} {short(r)}: {r['reason'][:160]}")
skips = collections.Counter(f"{r['variant']}: {r['reason'][:100]}" for r in rows
                            if r["status"] == "skipped" and "memory guard" not in r["reason"])
for why, n in skips.most_common():
    print(f"  skipped x{n} {why}")
flex = [r for r in rows if r["status"] == "ok" and r["compile_ms"]]
for r in flex[:12]:
    print(f"  compile_ms {float(r['compile_ms']):9.1f}  time_ms {float(r['time_ms']):9.3f}  {short(r)}")
PYEOF
echo "gpu_check: tests exit $TESTS_RC, gpu-smoke exit $RUN_RC; files in $OUTDIR"
[ "$TESTS_RC" -eq 0 ] && [ "$RUN_RC" -eq 0 ]
