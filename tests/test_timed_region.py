"""A timed region holds the call and nothing else: no check, copy, cast or slicing per
call, whether the pass is forward, forward_backward or decode.

Each test takes the callable the worker hands to `timing.time_call` (a fake in its place,
nothing is timed), runs it under a dispatch mode that records every aten op, and holds it
to the bare method: the same ops as `Variant.unchecked` (forward) or the ops of
`decode_step` alone (decode), and no call of the checks (`check_qkv`, `check_inputs`,
`check_token`, `unsupported_reasons`), which are plain Python and leave no op.

Planted and seen failing (then reverted): the timed forward calling `module(...)` again
(the checks per call: mamba2's range check is a reduction and a host read per input); a
`q.clone()` in `timing.forward_fn` and in `forward_backward_fn`; the decode loop calling
`Variant.step` (check per token); slicing the tokens inside the timed loop; the rewind
to the context inside the timed call instead of the untimed setup; a stack's timed loop
stepping its first layer only, and a torch.cat of a stack's outputs inside it.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import variants
from harness.measure import decode, layers, matrix, timing, worker
from harness.measure.inputs import make_inputs
from variants.core import decoder, interface

CHECKS = ("check_qkv", "check_inputs", "check_token")


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it; `outside` those run while no `decode_step` is."""

    def __init__(self, depth: list[int] | None = None):
        super().__init__()
        self.ops, self.outside, self.depth = Counter(), Counter(), depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        if self.depth is not None and self.depth[0] == 0:
            self.outside[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting_checks(monkeypatch):
    """Every check the interface runs, counted (they still run)."""
    calls = Counter()
    for module in (interface, decoder):
        for name in CHECKS:
            if not hasattr(module, name):
                continue
            real = getattr(module, name)

            def spy(*a, _real=real, _name=name, **kw):
                calls[_name] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(module, name, spy)
    real_reasons = interface.Variant.unsupported_reasons

    def reasons(self, **kw):
        calls["unsupported_reasons"] += 1
        return real_reasons(self, **kw)

    monkeypatch.setattr(interface.Variant, "unsupported_reasons", reasons)
    yield calls


def _case(variant, pass_, N=96, T=4):
    raw = {"variants": [variant], "seq_lens": [N], "passes": [pass_], "causal": [True],
           "heads": 2, "head_dim": 16, "min_run_time_s": 0.01, "min_repeats": 2,
           "decode_tokens": T}
    (case,) = matrix.expand(matrix.normalise(raw))
    return case


@pytest.mark.parametrize("pass_", ["forward", "forward_backward"])
@pytest.mark.parametrize("name", ["sdpa", "mamba2", "gated_deltanet"])
def test_a_forward_timed_region_is_the_bare_call(monkeypatch, name, pass_):
    case = _case(name, pass_)
    module = variants.build(name)
    q, k, v = make_inputs("gaussian", 1, 2, 96, 16, seed=0)
    inputs = module.draw_inputs(1, 2, 96, 16, seed=0)
    seen = {}

    with _counting_checks(monkeypatch) as checks:
        def fake(fn, **kw):
            fn()  # a first call's one-time work (a layout, features) is not the point
            checks.clear()
            with _Ops() as ops:
                fn()
            seen["ops"], seen["checks"] = ops.ops, Counter(checks)
            return timing.Timing(1.0, 0.0, 2, (1.0, 1.0))

        monkeypatch.setattr(timing, "time_call", fake)
        got = worker._measure_time(case, module, q, k, v, torch.device("cpu"), inputs)
    assert got["status"] == "ok", got
    assert not seen["checks"], f"checks inside the timed region: {dict(seen['checks'])}"

    def bare():  # the method and, for forward_backward, the backward of o.sum()
        if pass_ == "forward":
            with torch.no_grad():
                return module.unchecked(q, k, v, True, **inputs)
        for t in (q, k, v, *inputs.values()):
            t.grad = None
        o = module.unchecked(q, k, v, True, **inputs)
        o.sum().backward()
        return o.detach()

    bare()
    with _Ops() as ops:
        bare()
    assert seen["ops"] == ops.ops, (seen["ops"] - ops.ops, ops.ops - seen["ops"])


@pytest.mark.parametrize("name", ["sdpa", "sliding_window", "mamba2", "gated_deltanet",
                                  "linear"])
def test_a_decode_repeat_is_the_steps_alone(monkeypatch, name):
    """Every op of a timed repeat runs inside one of its T `decode_step` calls; the rewind
    is its setup, outside the timed call; no check runs in it."""
    T = 4
    case = _case(name, "decode", N=80, T=T)
    module = variants.build(name)
    depth, calls = [0], [0]
    real_step = module.decode_step

    def spy(*a, **kw):
        depth[0] += 1
        calls[0] += 1
        try:
            return real_step(*a, **kw)
        finally:
            depth[0] -= 1

    module.decode_step = spy  # the instance's: what the harness's loop looks up
    seen = {}
    with _counting_checks(monkeypatch) as checks:
        def fake(fn, setup=None, **kw):
            assert setup is not None, "no untimed rewind: a repeat would grow the context"
            setup()
            checks.clear()
            calls[0] = 0
            with _Ops(depth) as ops:
                fn()
            seen.update(outside=ops.outside, checks=Counter(checks), calls=calls[0])
            setup()
            return timing.Timing(1.0, 0.0, 2, (1.0, 1.0))

        monkeypatch.setattr(timing, "time_call", fake)
        got = decode.measure(case, module, torch.device("cpu"), "retime")
    assert got["status"] == "ok", got
    assert seen["calls"] == T
    assert not seen["checks"], f"checks inside the timed loop: {dict(seen['checks'])}"
    assert not seen["outside"], f"work outside the steps: {dict(seen['outside'])}"


@pytest.mark.parametrize("spec, per_layer", [
    ("gated_deltanet*3+sdpa", ["gated_deltanet"] * 3 + ["sdpa"]),
    ("sdpa*2", ["sdpa", "sdpa"]),
    ("sdpa*1", ["sdpa"]),
])
def test_a_stacks_decode_repeat_is_every_layers_steps_alone(monkeypatch, spec, per_layer):
    """A layer pattern: a timed repeat is T steps of every layer, each token through the
    layers in turn, and nothing else; every layer's state rewound by the untimed setup."""
    T = 3
    case = _case(spec, "decode", N=80, T=T)
    stack = layers.build(case)
    assert [m.name for m in stack.layers] == per_layer
    depth, order = [0], []
    for i, m in enumerate(stack.layers):
        real_step = m.decode_step

        def spy(*a, _real=real_step, _i=i, **kw):
            depth[0] += 1
            order.append(_i)
            try:
                return _real(*a, **kw)
            finally:
                depth[0] -= 1

        m.decode_step = spy
    seen = {}
    with _counting_checks(monkeypatch) as checks:
        def fake(fn, setup=None, **kw):
            assert setup is not None, "no untimed rewind: a repeat would grow the context"
            setup()
            checks.clear()
            order.clear()
            with _Ops(depth) as ops:
                fn()
            seen.update(outside=ops.outside, checks=Counter(checks), order=list(order))
            setup()
            return timing.Timing(1.0, 0.0, 2, (1.0, 1.0))

        monkeypatch.setattr(timing, "time_call", fake)
        got = decode.measure(case, stack, torch.device("cpu"), "retime")
    assert got["status"] == "ok", got
    assert seen["order"] == list(range(len(per_layer))) * T  # token by token, every layer
    assert not seen["checks"], f"checks inside the timed loop: {dict(seen['checks'])}"
    assert not seen["outside"], f"work outside the steps: {dict(seen['outside'])}"


def test_step_by_hand_still_checks_its_token_and_inputs():
    """`step` is safe to call directly: a misshapen gate or a token of two positions is a
    ValueError naming it, as before the harness took the unchecked path."""
    m = variants.build("mamba2")
    k = v = torch.randn(1, 2, 8, 16)
    state = m.prefill(k, v, max_len=12, **m.draw_inputs(1, 2, 8, 16))
    q1 = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="'g'"):
        m.step(state, q1, q1, q1, g=torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="'g'"):
        m.step(state, q1, q1, q1, g=torch.ones(1, 2, 1))  # a log-decay above 0
    with pytest.raises(ValueError, match="one token"):
        m.step(state, *(torch.randn(1, 2, 2, 16),) * 3, g=torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="'g'"):  # the harness's one check of T tokens
        m.check_tokens(*(torch.randn(1, 2, 3, 16),) * 3, g=torch.ones(1, 2, 3))


def test_time_calls_setup_runs_before_every_call_and_is_never_timed(monkeypatch):
    """time_call(setup=...): setup before each call, the warm-up's too; the samples are
    the calls' own durations (the 1 s of each setup in none of them)."""
    clock = {"now": 0.0, "fn": 0, "setup": 0, "order": []}
    durations = [0.5, 0.001, 0.002, 0.003, 0.004]  # the first: the warm-up

    def fn():
        clock["now"] += durations[clock["fn"]]
        clock["fn"] += 1
        clock["order"].append("fn")

    def setup():
        clock["now"] += 1.0
        clock["setup"] += 1
        clock["order"].append("setup")

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    t = timing.time_call(fn, min_run_time=0.005, min_repeats=4, warmup=1, setup=setup)
    assert clock["order"] == ["setup", "fn"] * 5
    assert t.samples_ms == pytest.approx((1.0, 2.0, 3.0, 4.0))
