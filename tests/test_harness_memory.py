"""The memory probe under the worker's malloc settings, and the memory guard."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from harness.measure.matrix import Case
from harness.measure import memory
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


def _masked_case(variant: str, N: int, backward: bool = False) -> Case:
    import variants

    params = json.dumps(dataclasses.asdict(variants.make_params(variant)), sort_keys=True)
    return Case(variant, params, "cpu", "float32", 1, 1, 64, N, False,
                "forward_backward" if backward else "forward", "gaussian", 0, 0.05, 3, 300.0,
                2, 256, 0)


def test_masked_sdpa_memory_includes_its_mask_and_matches_memory_bytes(tmp_path):
    """The memory worker at N = 8192: the N x N bool mask (64 MiB) the masked-SDPA variants
    keep is their `state_mib`, and state + one call's peak is within 20% of `memory_bytes`
    (the figure the memory guard refuses cases by)."""
    import variants
    from harness.measure.processes import Worker

    N = 8192
    worker = Worker("memory", tmp_path / "worker.log", threads=2)
    try:
        for variant in ("block_sparse_sdpa_mask", "sliding_window_sdpa_mask", "sdpa"):
            case = _masked_case(variant, N)
            got = worker.run(case, timeout_s=300)
            assert got["status"] == "ok", got
            total = got["peak_mem_mib"] + got["state_mib"]
            if variant == "sdpa":  # nothing kept between calls
                assert got["state_mib"] < 2, got
                continue
            assert abs(got["state_mib"] - N * N / 2**20) < 2, got  # the mask, 64 MiB
            predicted = variants.build(variant).memory_bytes(1, 1, N, 64, torch.float32) / 2**20
            assert abs(total - predicted) <= 0.2 * total, (variant, got, predicted)
    finally:
        worker.close()


def test_guard_on_cuda_reads_the_devices_free_memory(monkeypatch):
    """No GPU here: torch.cuda.mem_get_info is replaced by a stub (nothing else gives the
    guard a device's free memory). The same check runs for real in
    tests/test_device_paths.py where CUDA is available."""
    calls = []

    def mem_get_info(device):
        calls.append(torch.device(device))
        return 10 * 2**30, 80 * 2**30  # 10 GiB free of 80

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    import variants

    std = variants.build("standard")
    big = Case("standard", "{}", "cuda", "float32", 1, 8, 64, 32768, False, "forward",
               "gaussian", 0, 0.1, 3, 10.0, 1, 256, 0)  # scores and probabilities: 64 GiB
    reason = MemoryGuard().refuse_reason(big, std)
    assert reason and "free CUDA memory 10240 MiB" in reason and "declared" in reason, reason
    small = dataclasses.replace(big, seq_len=4096)  # 1 GiB: fits in 80% of 10 GiB
    assert MemoryGuard().refuse_reason(small, std) is None
    assert calls and all(d.type == "cuda" for d in calls)
    # no prediction (sdpa declares none, nothing measured yet): nothing to refuse by
    sdpa = dataclasses.replace(big, variant="sdpa")
    assert MemoryGuard().refuse_reason(sdpa, variants.build("sdpa")) is None


def test_release_empties_the_cuda_cache_only_for_cuda(monkeypatch):
    """torch.cuda stubbed (no GPU here): release("cuda") hands the caching allocator's free
    blocks back; on CPU it does nothing. Run for real in tests/test_device_paths.py."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    memory.release("cpu")
    assert emptied == []
    memory.release("cuda")
    assert emptied == [True]


def test_each_device_and_dtype_gets_its_own_matmul_rate(monkeypatch):
    """The runner sets a CUDA run's GFLOP/s against the matmul rate of that device in that
    dtype. torch.cuda.is_available is stubbed to True (no GPU here) and the measurement
    recorded instead of run; the real one runs in tests/test_device_paths.py."""
    from harness.measure import store

    measured = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(store, "matmul_gflops",
                        lambda device, dtype, threads, n=None, min_run_time=0.5:
                        measured.append((device, dtype))
                        or 1000.0)
    base = _case(64)
    cases = [dataclasses.replace(base, device=d, dtype=t)
             for d, t in (("cpu", "float32"), ("cuda", "bfloat16"), ("cuda", "float32"),
                          ("cuda", "bfloat16"), ("cpu", "bfloat16"))]
    rates = store.matmul_rates(cases, 2, {"cpu float32": 50.0})
    assert rates == {"cpu float32": 50.0, "cuda bfloat16": 1000.0, "cuda float32": 1000.0,
                     "cpu bfloat16": 1000.0}
    assert measured == [("cuda", "bfloat16"), ("cuda", "float32"), ("cpu", "bfloat16")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuda float32" not in store.matmul_rates(cases, 2, {"cpu float32": 50.0})


def test_cpu_matmul_rate_in_another_dtype_is_measured():
    from harness.measure import store

    rate = store.matmul_gflops("cpu", "float64", 1, n=256)
    assert 0 < rate < 1e5
