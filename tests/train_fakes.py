"""A throwaway variant for the training tests: it ends its process (a crash the worker
cannot report). Loaded by path, with tests/harness_fakes.py, through
ATTNBENCH_EXTRA_MODULES in the test process and the training workers."""

from __future__ import annotations

import os

from variants import Variant, register


@register
class Exits(Variant):
    """Ends the whole process with status 7 on its first call."""
    name = "_test_train_exits"
    family = "test"

    def flops(self, B, H, N, D, causal=False):
        return 0

    def attend(self, q, k, v, causal):
        os._exit(7)
