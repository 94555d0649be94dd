"""The float64 reference against independent computations."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.measure.memory import MALLOC_ENV
from variants import dense_mask, exact_reference, naive_attention


def _qkv(N, B=2, H=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, B, H, N, D, generator=g, dtype=torch.float64).unbind(0)


def _textbook(q, k, v, mask):
    """softmax(q k^T / sqrt(D)) v in float64 written out with exp and sums, one row at a time."""
    N, D = q.shape[-2:]
    out = torch.zeros_like(q)
    for i in range(N):
        s = (q[..., i, :, None] * k.transpose(-1, -2)).sum(-2) / math.sqrt(D)  # (B, H, N)
        w = torch.where(mask[i], torch.exp(s - s.max(-1, keepdim=True).values), 0.0)
        out[..., i, :] = (w[..., None] * v).sum(-2) / w.sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 37, 130])
def test_reference_equals_the_textbook_formula(N, causal):
    q, k, v = _qkv(N)
    ref = exact_reference(q, k, v, causal, chunk=16)  # several chunks, a ragged last one
    torch.testing.assert_close(ref, _textbook(q, k, v, dense_mask(N, causal)),
                               rtol=1e-12, atol=1e-12)


def test_reference_with_a_pattern_equals_sdpa_with_the_explicit_mask():
    q, k, v = _qkv(100)
    band = lambda i, j: (i[:, None] - j[None, :]).abs() <= 5  # noqa: E731
    ref = exact_reference(q, k, v, True, key_mask=band, chunk=7)
    mask = dense_mask(100, True, band)
    torch.testing.assert_close(ref, F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(naive_attention(q, k, v, True, key_mask=band), ref,
                               rtol=1e-10, atol=1e-10)


def test_sampled_rows_equal_the_same_rows_of_the_full_reference():
    q, k, v = _qkv(200)
    rows = torch.tensor([0, 3, 199, 57])
    torch.testing.assert_close(exact_reference(q, k, v, True, rows=rows),
                               exact_reference(q, k, v, True)[:, :, rows])


def test_a_row_without_allowed_keys_is_zero_not_nan():
    q, k, v = _qkv(10)
    none_for_row_0 = lambda i, j: (i[:, None] > 0) & (j[None, :] >= 0)  # noqa: E731
    ref = exact_reference(q, k, v, key_mask=none_for_row_0)
    assert torch.isfinite(ref).all() and (ref[:, :, 0] == 0).all()


def test_low_precision_inputs_are_upcast_not_rounded():
    q, k, v = _qkv(50)
    ref16 = exact_reference(q.bfloat16(), k.bfloat16(), v.bfloat16())
    ref64 = exact_reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double())
    assert ref16.dtype == torch.float64
    torch.testing.assert_close(ref16, ref64, rtol=0, atol=0)


_PROBE = """
import torch
from harness.measure.memory import peak_cpu_mib
from variants import exact_reference
torch.manual_seed(0)
q, k, v = torch.randn(3, 1, 8, 32768, 64).unbind(0)
rows = torch.arange(0, 32768, 128)  # 256 rows: the same chunking as all rows, 1/128 the time
print(peak_cpu_mib(lambda: exact_reference(q, k, v, causal=True, rows=rows)))
"""


def test_reference_at_32k_tokens_stays_far_below_the_n_by_n_footprint():
    """N = 32768, H = 8: the N x N float64 scores would be 64 GiB; chunks keep it < 1 GiB."""
    env = {**os.environ, **MALLOC_ENV}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    peak_mib = float(out.stdout.split()[-1])
    # measured 395 MiB: float64 copies of k and v (256 MiB) and one chunk of scores.
    assert 0 < peak_mib < 512, peak_mib
