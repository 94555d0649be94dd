"""The hybrid presets train what docs/training.md says: hybrid-cpu, each linear mixer at
4:0, 3:1 and 1:1 with full attention, pure sdpa and a Samba-like stack, on train-cpu's two
MQAR settings under its protocol, planned within 90 minutes on two workers; hybrid-gpu the
ratios that ship up to 7:1 on a CUDA device.

Planted bugs: a ratio or a mixer left out, a setting dropped, one seed, a pattern whose
stack is not four layers, a plan that outgrows 90 minutes at the reference run's steps.
"""

from __future__ import annotations

import csv
import json

from harness.measure import stack
from harness.train import estimate, runner
from harness.train import matrix as tm

MIXERS = ("gated_deltanet", "mamba2", "gla", "linear")


def _compositions(configs):
    """(N, pairs) -> {(mixer, attention layers)} of the configurations."""
    out: dict = {}
    for c in configs:
        key = (c.seq_len, c.task_param_dict["num_kv_pairs"])
        attention, mixer = stack.composition(c.variant, c.layers)
        out.setdefault(key, set()).add((mixer, attention))
    return out


def test_hybrid_cpu_trains_each_mixer_at_each_ratio_on_both_settings():
    _, configs = tm.load("hybrid-cpu")
    want = {(m, a) for m in MIXERS for a in (0, 1, 2)} | {("", 4), ("mamba2", 0)}
    want.add(("mamba2+sliding_window", 0))
    got = _compositions(configs)
    assert set(got) == {(64, 8), (128, 16)}
    for key, comps in got.items():
        assert comps == want, (key, comps ^ want)
    assert {c.layers for c in configs} == {4} and {c.d_model for c in configs} == {64}
    assert {len(c.seeds) for c in configs} == {2} and {len(c.lrs) for c in configs} == {4}
    _, cpu = tm.load("train-cpu")  # the protocol of the trained reference
    fields = ("batch", "max_steps", "race_steps", "settle_window", "settle_margin",
              "early_stop", "train_examples", "test_examples", "lrs")
    assert {tuple(getattr(c, f) for f in fields) for c in configs} == \
        {tuple(getattr(c, f) for f in fields) for c in cpu}
    samba = [c for c in configs if c.variant == "mamba2+sliding_window"]
    assert {(c.seq_len, json.loads(c.params)["sliding_window"]["window"]) for c in samba} \
        == {(64, 16), (128, 32)}


def _two_layer_steps() -> dict:
    """(mixer, its params, N) -> seconds of one layer's share of a step at two heads, from
    the committed train-cpu run (two layers, batch 32, one thread): its step over 2."""
    out = {}
    with open("results/train-cpu/train.csv") as f:
        for r in csv.DictReader(f):
            if r["step_ms"] and int(r["heads"]) == 2:
                key = (r["variant"], json.dumps(json.loads(r["params"]), sort_keys=True),
                       int(r["seq_len"]))
                out.setdefault(key, []).append(float(r["step_ms"]) / 1e3 / 2)
    return {k: sorted(v)[len(v) // 2] for k, v in out.items()}


def test_hybrid_cpu_plans_within_90_minutes_on_two_workers():
    """A stack's step is its layers' shares of the single mixers' two-layer steps."""
    _, configs = tm.load("hybrid-cpu")
    steps = _two_layer_steps()

    def step(c, module):
        params = json.loads(c.params) if stack.is_pattern(c.variant) else {c.variant: {}}
        total = 0.0
        for name in stack.layers_of(c.variant, c.layers):
            own = json.dumps(params.get(name, {}), sort_keys=True)
            match = [v for (n, p, N), v in steps.items() if n == name and N == c.seq_len
                     and (p == own or name != "sliding_window")]
            assert match, (name, own, c.seq_len)
            total += min(match)
        return total

    costs = estimate.plan_seconds(configs, step, runner.skip_reasons)
    minutes = sum(t for _, t, _ in costs) / 60 / tm.sweep_workers("hybrid-cpu")
    assert tm.sweep_workers("hybrid-cpu") == 2 and minutes <= 90, minutes


def test_hybrid_gpu_takes_the_ratios_that_ship_to_7_to_1():
    _, configs = tm.load("hybrid-gpu")
    got = _compositions(configs)
    assert set(got) == {(256, 32), (512, 64)}
    for comps in got.values():
        for m in ("gated_deltanet", "kda", "mamba2", "gla", "linear"):
            assert {a for mixer, a in comps if mixer == m} == {0, 1, 2, 4}
        assert ("", 8) in comps and ("mamba2+sliding_window", 0) in comps
    assert {c.layers for c in configs} == {8} and {c.device for c in configs} == {"cuda"}
    assert {len(c.seeds) for c in configs} == {2}
