"""The memory probe under the worker's malloc settings, and the memory guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from harness.measure.matrix import Case
from harness.measure.memory import MALLOC_ENV, MemoryGuard

REPO = Path(__file__).resolve().parent.parent

_PROBE = r"""
import json, torch
from harness.measure.memory import peak_cpu_mib
def temporaries():  # ten sequential 20 MiB temporaries, each freed before the next
    for _ in range(10):
        t = torch.ones(5 * 2**20)  # 20 MiB of float32, written
        del t
def pieces():  # 100 MiB held live in 0.5 MiB pieces
    return [torch.ones(2**17) for _ in range(200)]
print(json.dumps([peak_cpu_mib(temporaries), peak_cpu_mib(pieces)]))
"""


def test_probe_reads_temporaries_and_small_pieces():
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=True)
    temps, pieces = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(temps - 20) < 4, temps
    assert abs(pieces - 100) < 5, pieces


def _case(N, variant="sdpa"):
    return Case(variant, "{}", "cpu", "float32", 1, 4, 64, N, False, "forward", "gaussian", 0,
                0.1, 3, 10.0, 1, 256, 0)


def test_guard_extrapolates_measured_peaks():
    g = MemoryGuard()
    assert g.predict_mib(_case(1024))[0] is None  # nothing measured: no prediction
    g.record(_case(1024).series(), 1024, 10.0)
    pred, how = g.predict_mib(_case(4096))
    assert pred == 160.0 and "N^2.00" in how  # one point: quadratic, pessimistic
    g.record(_case(2048).series(), 2048, 20.0)
    pred, how = g.predict_mib(_case(8192))
    assert abs(pred - 80.0) < 1e-6 and "N^1.00" in how  # two points: fitted exponent
    g.record(_case(2048).series(), 4096, 1e12)  # an absurd measured peak
    assert "memory guard" in g.refuse_reason(_case(8192))


def test_guard_uses_a_declared_prediction():
    class Declares:
        def memory_bytes(self, B, H, N, D, dtype, backward):
            assert dtype is torch.float32
            return 2**60
    assert "declared by the variant" in MemoryGuard().refuse_reason(_case(64), Declares())
