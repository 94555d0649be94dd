"""Throwaway variants for the harness tests: one raises, one sleeps, one returns NaN.

Loaded by path (harness.measure.worker.import_extra / ATTNBENCH_EXTRA_MODULES) in the test process
and in the harness's worker processes; names start with "_" so "all" leaves them out.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from variants import Variant, param, register


class _Fake(Variant):
    family = "test"

    def flops(self, B, H, N, D, causal=False):
        return 0


@register
class Raises(_Fake):
    """Raises a RuntimeError on every call."""
    name = "_test_raises"

    def attend(self, q, k, v, causal):
        raise RuntimeError("deliberate failure in _test_raises")


@dataclasses.dataclass(frozen=True)
class SleepParams:
    seconds: float = param(30.0, doc="sleep per call", min=0.0)


@register
class Sleeps(_Fake):
    """Sleeps, then returns v (a stand-in for a case that runs past its time limit)."""
    name = "_test_sleeps"
    Params = SleepParams

    def attend(self, q, k, v, causal):
        time.sleep(self.params.seconds)
        return v.clone()


@register
class NaNs(_Fake):
    """Returns NaN everywhere."""
    name = "_test_nan"

    def attend(self, q, k, v, causal):
        return torch.full_like(q, float("nan"))


@register
class PreparesByCalling(_Fake):
    """Its `prepare` runs one call, as a compile does (prepare_calls = 1); each call sleeps,
    then returns v. compile_ms must not count that call."""
    name = "_test_prepares"
    Params = SleepParams
    prepare_calls = 1

    def prepare(self, q, k, v, causal, backward=False):
        self.attend(q, k, v, causal)
        return True

    def attend(self, q, k, v, causal):
        time.sleep(self.params.seconds)
        return v.clone()


@register
class Hogs(_Fake):
    """Asks for a petabyte on its device: every call runs out of memory (CPU or CUDA)."""
    name = "_test_hogs"

    def attend(self, q, k, v, causal):
        torch.empty(2**50, dtype=torch.uint8, device=q.device)
        return v.clone()
