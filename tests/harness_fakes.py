"""Throwaway variants for the harness tests: one raises, one sleeps, one returns NaN, one
prepares by calling, one runs out of memory, one kills the job it runs in, one fails once
a file exists.

Loaded by path (harness.measure.worker.import_extra / ATTNBENCH_EXTRA_MODULES) in the test process
and in the harness's worker processes; names start with "_" so "all" leaves them out.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import torch

from variants import Contract, Variant, param, register


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
    contract = Contract(prepare_calls=1)

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


@dataclasses.dataclass(frozen=True)
class KillParams:
    kill_at: int = param(64, doc="the sequence length at which it kills its job", min=1)


@register
class KillsJob(_Fake):
    """At N = kill_at, SIGKILLs the process that started its worker when that is a submitit
    job (SUBMITIT_EXECUTOR is set: the shard's runner), then exits: a case that takes its
    whole job down, as the node's OOM killer or a driver crash would. Outside a submitit job
    only the worker exits (an `error` row). At any other N it returns v."""
    name = "_test_kills_job"
    Params = KillParams

    def attend(self, q, k, v, causal):
        if q.shape[2] != self.params.kill_at:
            return v.clone()
        if os.environ.get("SUBMITIT_EXECUTOR"):
            os.kill(os.getppid(), signal.SIGKILL)
        os._exit(3)


@dataclasses.dataclass(frozen=True)
class FlagParams:
    flag: str = param("", doc="a path: every call raises once this file exists")


@register
class FailsOnceFlagged(_Fake):
    """Returns v until the file `flag` exists, then raises: a case that breaks in a later
    timing round (the test creates the file between rounds)."""
    name = "_test_fails_if"
    Params = FlagParams

    def attend(self, q, k, v, causal):
        if self.params.flag and os.path.exists(self.params.flag):
            raise RuntimeError(f"deliberate failure: {self.params.flag} exists")
        return v.clone()
