"""The micro benchmarks prepare each variant before its timed rounds (a flex compile or a
mask never lands inside them), as the harness's worker does."""

import sys
from pathlib import Path

import torch

from variants import Variant, register

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))
import test_micro  # noqa: E402


@register
class _CountsPrepare(Variant):
    """Records its prepare calls; returns v."""
    name, family = "_micro_counts_prepare", "test"
    calls: list = []

    def prepare(self, q, k, v, causal, backward=False):
        _CountsPrepare.calls.append(("prepare", backward))
        return True

    def attend(self, q, k, v, causal):
        _CountsPrepare.calls.append(("attend", torch.is_grad_enabled()))
        return v.clone()

    def flops(self, B, H, N, D, causal=False):
        return 0


def test_case_setup_prepares_before_returning_the_timed_call():
    for backward in (False, True):
        _CountsPrepare.calls.clear()
        m, q, k, v = test_micro._case("_micro_counts_prepare", 64, backward)
        assert _CountsPrepare.calls == [("prepare", backward)]  # and no call yet
        assert q.requires_grad is backward and q.grad is None
