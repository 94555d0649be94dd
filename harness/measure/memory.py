"""Peak memory of one call, the worker's address-space cap, and the runner's memory guard.

CPU: write "5" to /proc/self/clear_refs (resets VmHWM to the current RSS; Linux
Documentation/filesystems/proc.rst), read VmRSS, run the call, read VmHWM; the peak is
VmHWM - VmRSS_before. This is only right when freed memory goes back to the kernel, so the
worker runs with MALLOC_MMAP_THRESHOLD_=65536 and MALLOC_TRIM_THRESHOLD_=0 (docs/measurement.md,
"Memory"). CUDA: reset_peak_memory_stats, then max_memory_allocated
minus the memory allocated before the call. The same two readings, VmRSS and
memory_allocated, give the state a variant keeps between calls (`resident_mib`).

The guard compares a case's predicted memory with MemAvailable on CPU and with the free
memory `torch.cuda.mem_get_info` reports on CUDA.
"""

from __future__ import annotations

import math
import resource
from typing import Callable

import torch

MIB = 2**20
# The worker's environment: freed chunks are unmapped/trimmed at once, so VmHWM sees them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
# The guard leaves this share of MemAvailable unused (other processes, the reference).
GUARD_SHARE = 0.8


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def peak_cpu_mib(fn: Callable[[], object]) -> float:
    """Peak resident memory (MiB) that one call of fn adds above the resident size before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    out = fn()
    hwm = _status_kib("VmHWM")
    del out
    return (hwm - before) / 1024


def peak_cuda_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak CUDA memory (MiB) allocated by one call of fn above what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return (peak - before) / MIB


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    return peak_cuda_mib(fn, device) if device.type == "cuda" else peak_cpu_mib(fn)


def resident_mib(device: torch.device) -> float:
    """What this process holds now (MiB): VmRSS on CPU, CUDA's allocated memory on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / MIB
    return _status_kib("VmRSS") / 1024


def release(device: str) -> None:
    """Hand the CUDA caching allocator's free blocks back to the device (no-op elsewhere).

    Each worker process has its own allocator; blocks one keeps cached after its part of a
    case are not free for the other worker, nor for the next case's guard.
    """
    if device == "cuda" and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def cuda_free_bytes(device: str = "cuda") -> int:
    """Free memory on the CUDA device, as the driver reports it (cudaMemGetInfo)."""
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return free


def cap_address_space(extra_mib: int) -> int:
    """Cap this process's address space at its current size + extra_mib (0: MemAvailable*0.9).

    A runaway allocation then fails at once (torch's DefaultCPUAllocator raises "not enough
    memory", becoming an `oom` row) instead of pushing the machine into swap. Only the soft
    limit moves, so the worker can lift it again for the next case. Returns the cap in bytes.
    """
    extra = extra_mib * MIB if extra_mib else int(mem_available_bytes() * 0.9)
    cap = _status_kib("VmSize") * 1024 + extra
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def lift_address_space_cap() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def is_oom_message(text: str) -> bool:
    """Whether an error text is an out-of-memory failure (CPU allocator, CUDA, Python)."""
    t = text.lower()
    return any(s in t for s in ("out of memory", "not enough memory", "defaultcpuallocator",
                                "memoryerror", "can't allocate memory", "cannot allocate memory"))


def decode_bytes(case, module) -> int | None:
    """A decode case's bytes: the state at its final length (`state_bytes_at(N + T)`: B H
    state_size(N + T, D) elements in the case's dtype, or as the variant stores them, a
    narrower cache_dtype), the context chunk being drawn, and the new tokens; None where
    the variant does not state its state size."""
    dtype = getattr(torch, case.dtype)
    state = module.state_bytes_at(case.seq_len + case.decode_tokens, case.shape, dtype)
    if state is None:
        return None
    size = torch.finfo(dtype).bits // 8
    s = case.shape
    chunk = case.batch * min(case.seq_len, 8192) * (s.H * s.D + s.Hk * s.D + s.Hv * s.Dv)
    return case.batch * state + chunk * size


class MemoryGuard:
    """Predicts a case's peak memory before it runs and refuses one that cannot fit.

    Variant-agnostic: a variant may declare `memory_bytes(B, H, N, D, dtype, backward)`
    (a prediction or None) and that is used; otherwise the guard extrapolates from the
    peaks measured earlier in the run for the same series (the same case at shorter
    lengths; cases run in ascending seq_len) with a power law N^p fitted to the two longest
    measured lengths, p clamped to [1, 2]; from one point it assumes p = 2 (pessimistic).
    With no measurement it predicts nothing and the worker's address-space cap is the
    backstop.
    """

    def __init__(self, share: float = GUARD_SHARE):
        self.share = share
        self.points: dict[tuple, dict[int, float]] = {}

    def record(self, series: tuple, seq_len: int, peak_mib: float | None) -> None:
        if peak_mib is not None and math.isfinite(peak_mib):
            self.points.setdefault(series, {})[seq_len] = max(peak_mib, 1.0)

    def predict_mib(self, case, module=None) -> tuple[float | None, str]:
        if getattr(case, "decode", False) and module is not None:
            b = decode_bytes(case, module)
            if b is not None:
                return b / MIB, "the decoding state it keeps (state_size)"
        if module is not None:
            b = module.memory_bytes(case.batch, case.heads, case.seq_len, case.head_dim,
                     getattr(torch, case.dtype), case.backward)
            if b is not None:
                return b / MIB, "declared by the variant"
        pts = self.points.get(case.series(), {})
        shorter = sorted(n for n in pts if n < case.seq_len)
        if not shorter:
            return None, ""
        n1 = shorter[-1]
        p = 2.0
        if len(shorter) >= 2:
            n0 = shorter[-2]
            p = math.log(pts[n1] / pts[n0]) / math.log(n1 / n0)
            p = min(2.0, max(1.0, p))
        return pts[n1] * (case.seq_len / n1) ** p, f"extrapolated from N={n1} as N^{p:.2f}"

    def refuse_reason(self, case, module=None) -> str | None:
        """A skip reason when the predicted peak exceeds share * the memory available to
        the case (CPU: MemAvailable; CUDA: the device's free memory), else None."""
        if case.device not in ("cpu", "cuda"):
            return None
        pred, how = self.predict_mib(case, module)
        if pred is None:
            return None
        if case.device == "cuda":
            avail, what = cuda_free_bytes(case.device) / MIB, "free CUDA memory"
        else:
            avail, what = mem_available_bytes() / MIB, "MemAvailable"
        if pred > self.share * avail:
            return (f"memory guard: predicted peak {pred:.0f} MiB ({how}) exceeds "
                    f"{self.share:.0%} of {what} {avail:.0f} MiB")
        return None
