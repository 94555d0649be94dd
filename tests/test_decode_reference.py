"""A recurrence's decode rows are checked against an independent float64 reference: its
causal forward in float64 over the same context and tokens (`Variant.reference_from`,
carried from chunk to chunk), never its decoding form run again in float64.

Planted and seen failing (then reverted): the decode pass's recurrence reference as the
variant's own prefill and steps in float64 (the code before: every planted row read
~2e-7); `reference_from` continuing from zeros instead of the state it is given; the
context's chunks not fed to the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import variants
from harness.measure.worker import EXTRA_ENV

REPO = Path(__file__).resolve().parent.parent

# gated_deltanet with its step written out by hand, one part of it wrong by choice; its
# forward (and so the reference) is gated_deltanet's own.
PLANTED = '''
import dataclasses

from variants import param, register
from variants.recurrent.recurrent import GatedDeltaNet


@dataclasses.dataclass(frozen=True)
class PlantedParams:
    chunk: int = param(64, min=1)
    wrong: str = param("none", choices=("none", "decay", "erase", "write", "read"))


@register
class PlantedStep(GatedDeltaNet):
    name = "_planted_step"
    Params = PlantedParams

    def decode_step(self, state, q, k, v, **inputs):
        wrong, dtype, S = self.params.wrong, q.dtype, state.S
        q, k, v, g, beta = (t.to(S.dtype) for t in self._terms(q, k, v, inputs))
        a = g[:, :, 0].exp()  # (B, H)
        S.mul_((a * a if wrong == "decay" else a)[..., None, None])
        kt, vt, b = k[:, :, 0], v[:, :, 0], beta[:, :, 0, None]  # (B, H, D), (B, H, 1)
        before = (q[:, :, 0, None, :] @ S) * q.shape[-1] ** -0.5  # (B, H, 1, Dv)
        erase = 0 if wrong == "erase" else (kt[..., None, :] @ S).squeeze(-2)
        write = (vt - erase) * (1 if wrong == "write" else b)
        S.add_(kt[..., :, None] * write[..., None, :])
        o = before if wrong == "read" else (q[:, :, 0, None, :] @ S) * q.shape[-1] ** -0.5
        return o.to(dtype), state
'''

TOML = """
variants = ["gated_deltanet", "_planted_step"]
params = {_planted_step = [{wrong = "none"}, {wrong = "decay"}, {wrong = "erase"},
                           {wrong = "write"}, {wrong = "read"}]}
seq_lens = [9000]
heads = 2
head_dim = 16
passes = ["decode"]
causal = [true]
decode_tokens = 4
min_run_time_s = 0.01
min_repeats = 2
"""


@pytest.mark.slow  # six decode cases in worker processes
def test_a_wrong_step_registered_from_outside_shows_in_its_decode_row(tmp_path):
    """Across a chunk boundary (9000 > 8192 tokens of context): the unchanged recurrence,
    and the hand-written step without a bug, below 1e-4; each planted bug above 1e-2."""
    (tmp_path / "planted_step.py").write_text(PLANTED)
    (tmp_path / "m.toml").write_text(TOML)
    env = {**os.environ, EXTRA_ENV: str(tmp_path / "planted_step.py"),
           "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "run_bench.py", "run", "--config",
                        str(tmp_path / "m.toml"), "--results-dir", str(tmp_path), "--run-id",
                        "d", "--no-report"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.read_csv(tmp_path / "d" / "results.csv")
    assert set(df["status"]) == {"ok"}, df[["variant", "params", "reason"]]
    assert set(df["err_ref"]) == {"recurrence"}
    err = {(v if v == "gated_deltanet" else json.loads(p)["wrong"]): e
           for v, p, e in zip(df["variant"], df["params"], df["rel_err"])}
    assert err["gated_deltanet"] < 1e-4 and err["none"] < 1e-4, err
    for wrong in ("decay", "erase", "write", "read"):
        assert err[wrong] > 1e-2, (wrong, err)


@pytest.mark.parametrize("name", ["retention", "gla", "mamba2", "deltanet", "gated_deltanet",
                                  "kda"])
def test_reference_from_in_pieces_is_the_sequential_recurrence(name):
    """reference_from over a sequence cut in three pieces, each from the state the last
    returned, equals reference.py's float64 sequential recurrence over the whole."""
    m = variants.build(name)
    B, H, N, D = 1, 2, 150, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    ins = m.draw_inputs(B, H, N, D, seed=1)
    want = m.reference(q, k, v, causal=True, **ins)
    outs, state = [], None
    for a, b in ((0, 70), (70, 71), (71, N)):
        o, state = m.reference_from(state, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                    **{n: t[:, :, a:b] for n, t in ins.items()})
        assert o.dtype == torch.float64
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), want, rtol=1e-10, atol=1e-12)


def test_a_recurrence_without_a_reference_from_a_state_says_it_cannot_decode():
    from variants.recurrent.recurrent import Mamba2

    class NoReference(Mamba2):
        name = "_no_reference"
        reference_from = variants.Variant.reference_from

    with pytest.raises(variants.ContractError, match="reference_from") as e:
        variants.register(NoReference)
    assert "\n" not in str(e.value) and "_no_reference" not in variants.names(private=True)
    assert variants.build("mamba2").decode_reasons() == []
