"""Median and IQR wall time of one call, by torch.utils.benchmark.Timer.

Timer.blocked_autorange (PyTorch docs, "torch.utils.benchmark") calibrates a block size,
then times blocks until `min_run_time` has passed; each block gives one per-call time.
A slow call may give fewer blocks than `min_repeats`; then single calls are timed (same
clock) until there are enough, so the IQR means something; a call known to be slow skips
autorange. CUDA work is timed per call with CUDA events after a synchronisation
(`time_cuda_events`; docs/measurement.md, "Time"). Inputs and modules are built
by the caller, outside the timed region; a call that needs work between calls (a decoder
rewound to its context) passes it as `setup`, run untimed before each call. The callables
timed (`forward_fn`, `forward_backward_fn`) check the call once when they are made and
then hold the method alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
from torch.utils import benchmark


# Per-call event timings of a microsecond kernel stop here even short of min_run_time.
_MAX_EVENT_REPEATS = 10_000


@dataclasses.dataclass(frozen=True)
class Timing:
    time_ms: float  # median per-call time
    time_ms_iqr: float  # interquartile range of the per-call times
    repeats: int  # number of timed measurements (blocks) the median is over
    samples_ms: tuple[float, ...] = ()  # the per-call times themselves (rounds pool them)


def time_call(fn: Callable[[], object], *, min_run_time: float = 0.2, min_repeats: int = 5,
              warmup: int = 1, call_s: float | None = None,
              device: torch.device | str | None = None,
              setup: Callable[[], object] | None = None) -> Timing:
    """Time fn() after `warmup` untimed calls.

    call_s: a rough duration of one call seen before (untimed). When min_repeats such calls
    already fill min_run_time, the calls are timed one by one, which spares
    blocked_autorange's calibration calls on slow cases.
    device: where fn's work runs; on CUDA each call is timed with CUDA events
    (`time_cuda_events`), on the GPU's own clock.
    setup: run before every call (the first warm-up call too), outside the timed region
    (a decoder's state rewound to its context); the calls are then timed one by one.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if device is not None and torch.device(device).type == "cuda":
        return time_cuda_events(fn, torch.device(device), min_run_time=min_run_time,
                                min_repeats=min_repeats, setup=setup)
    if setup is not None:
        return summarise(_one_by_one(fn, setup, min_run_time, min_repeats))
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn},
                            num_threads=torch.get_num_threads())
    if call_s is not None and call_s * min_repeats >= min_run_time:
        times = []
    else:
        times = list(timer.blocked_autorange(min_run_time=min_run_time).times)
    while len(times) < min_repeats:
        times.append(_time_once(fn))
    return summarise(times)


def _one_by_one(fn, setup, min_run_time: float, min_repeats: int) -> list[float]:
    """Calls timed one at a time, each after an untimed setup(), until min_repeats are
    timed and their sum reaches min_run_time (at most _MAX_EVENT_REPEATS past that)."""
    times: list[float] = []
    total = 0.0
    while len(times) < min_repeats or (total < min_run_time
                                       and len(times) < _MAX_EVENT_REPEATS):
        setup()
        times.append(_time_once(fn))
        total += times[-1]
    return times


def _time_once(fn: Callable[[], object]) -> float:
    """One call's seconds on Timer's clock (perf_counter), CUDA synchronised both sides.

    Timer.timeit(1) would first make two untimed warm-up calls, tripling a slow case.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_cuda_events(fn: Callable[[], object], device: torch.device, *,
                     min_run_time: float = 0.2, min_repeats: int = 5,
                     setup: Callable[[], object] | None = None) -> Timing:
    """Per-call times of fn() on `device` from CUDA events, after a synchronisation.

    The device is synchronised first (no earlier work in the measurement); each call is
    bracketed by two events recorded on the current stream and read after the end event
    has completed (Event.elapsed_time, ms on the GPU's clock: launch overhead that the
    GPU does not see is excluded, queued work is not). Calls repeat until min_repeats
    are timed and their sum reaches min_run_time. setup() runs before each start event,
    so its queued work ends before the event is reached.
    """
    torch.cuda.synchronize(device)
    times, total = [], 0.0
    with torch.cuda.device(device):
        while len(times) < min_repeats or (total < min_run_time
                                           and len(times) < _MAX_EVENT_REPEATS):
            if setup is not None:
                setup()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            total += times[-1]
    return summarise(times)


def summarise(times_s: list[float]) -> Timing:
    ms = sorted(t * 1e3 for t in times_s)
    if len(ms) >= 2:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = ms[0]
    return Timing(statistics.median(ms), q3 - q1, len(ms), tuple(ms))


def forward_fn(module, q, k, v, causal: bool, **inputs) -> Callable[[], torch.Tensor]:
    """The forward pass, without autograd bookkeeping (`inputs`: those beyond q, k, v).

    The call is checked here, once (`Variant.check_call`); the callable runs the method
    alone (`Variant.unchecked`), so a timed region holds the call and nothing else."""
    module.check_call(q, k, v, causal, **inputs)

    def fn():
        with torch.no_grad():
            return module.unchecked(q, k, v, causal, **inputs)
    return fn


def forward_backward_fn(module, q, k, v, causal: bool, **inputs) -> Callable[[], torch.Tensor]:
    """Forward, then backward of o.sum() into q, k, v (which require grad) and the inputs
    beyond them that require grad; checked once here, as `forward_fn`.

    Gradients are dropped at the start of each call so they are not accumulated and the
    previous call's gradient buffers are freed before this one allocates its own.
    """
    module.check_call(q, k, v, causal, backward=True, **inputs)
    leaves = (q, k, v, *inputs.values())

    def fn():
        for t in leaves:
            t.grad = None
        o = module.unchecked(q, k, v, causal, **inputs)
        o.sum().backward()
        return o.detach()
    return fn
