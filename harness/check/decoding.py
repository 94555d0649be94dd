"""The kit's properties of a variant's other forms: its attention weights (`weights(q, k)
@ v` is the output), its decoding form (prefill, then one token at a time, equal to the
causal forward's rows) and its declared state size against the state it keeps.
"""

from __future__ import annotations

import torch

import variants
from harness.check.kit import (N_GENERIC, Failed, NotApplicable, Refused, expect, extra, qkv,
                               rel_err)


def weights_case(name: str, causal: bool) -> str:
    """weights(q, k) @ v equals forward(q, k, v) (float64 where the variant takes it, else
    float32 to its rounding); a causal map puts no weight on the future; above
    WEIGHTS_MAX_N every variant refuses."""
    m = variants.build(name)
    big = m.weights_reasons(device="cpu", dtype=torch.float32, causal=causal,
                            seq_len=variants.WEIGHTS_MAX_N + 1, head_dim=16)
    expect(any(str(variants.WEIGHTS_MAX_N) in r for r in big),
           f"weights does not refuse N = {variants.WEIGHTS_MAX_N + 1}")
    wide = not m.unsupported_reasons(device="cpu", dtype=torch.float64, causal=causal,
                                     seq_len=N_GENERIC, head_dim=16)
    dtype = torch.float64 if wide else torch.float32
    q, k, v = qkv(dtype=dtype)
    reasons = m.weights_reasons(device=q.device, dtype=dtype, causal=causal,
                                seq_len=N_GENERIC, head_dim=16)
    if reasons:
        try:
            m.weights(q, k, causal)
        except ValueError as e:
            expect(reasons[0] in str(e), f"weights refused with {e}, not {reasons[0]!r}")
            raise Refused(reasons) from None
        raise Failed(f"declares {reasons[0]!r} but weights gave a map")
    ins = extra(m, q)
    with torch.no_grad():
        w = m.weights(q, k, causal, **ins)
        o = m(q, k, v, causal=causal, **ins)
    expect(w.shape == (*q.shape[:3], N_GENERIC) and w.dtype == dtype,
           f"weights {tuple(w.shape)} {w.dtype}, expected {(*q.shape[:3], N_GENERIC)} {dtype}")
    d = float((w @ v - o).abs().max())
    tol = 1e-9 if wide else 2e-5
    expect(d <= tol * (1 + float(o.abs().max())), f"weights @ v differs from forward by "
                                                  f"{d:.2e} (> {tol:g})")
    if causal:
        expect(bool((w.triu(1) == 0).all()), "causal weights on future keys")
    return f"causal={causal} {str(dtype)[6:]}: |weights @ v - forward| {d:.1e}"


def weights(name: str) -> str:
    """weights_case, non-causal and causal (each where the variant gives a map)."""
    out, skipped = [], None
    for causal in (False, True):
        try:
            out.append(weights_case(name, causal))
        except Refused as r:
            skipped = r
    if not out:
        raise skipped
    return "; ".join(out)


B, H, D, T = 2, 3, 8, 6  # decoding: T tokens stepped after each context


def _decodes(m) -> torch.dtype:
    """The dtype decoding is checked in (float64 where the variant runs it), or NotApplicable
    / Refused where it has no decoding form or cannot run one here."""
    reasons = m.decode_reasons()
    if reasons:
        raise NotApplicable(f"no decoding form: {'; '.join(reasons)}")
    for dtype in (torch.float64, torch.float32):
        why = m.unsupported_reasons(device="cpu", dtype=dtype, causal=True, seq_len=128,
                                    head_dim=D)
        if not why:
            return dtype
    raise Refused(why)


def decoding(name: str) -> str:
    """Prefill P tokens, step T more one at a time: each output equals that row of the causal
    forward over the whole sequence (float64: within 1e-10; float32: 1e-4), P = 0, 1, 7, 70."""
    m = variants.build(name)
    dtype = _decodes(m)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    worst = 0.0
    for P in (0, 1, 7, 70):
        q, k, v = qkv(B=B, H=H, N=P + T, D=D, dtype=dtype, seed=P)
        ins = m.draw_inputs(B, H, P + T, D, seed=P, dtype=dtype)
        with torch.no_grad():
            full = m(q, k, v, causal=True, **ins)[:, :, P:]
            state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=P + T,
                              **{n: x[:, :, :P] for n, x in ins.items()})
            out = []
            for t in range(P, P + T):
                o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1],
                                  v[:, :, t:t + 1], **{n: x[:, :, t:t + 1] for n, x in ins.items()})
                expect(o.shape == (B, H, 1, D) and o.dtype == dtype,
                       f"step gave {tuple(o.shape)} {o.dtype}, expected {(B, H, 1, D)} {dtype}")
                out.append(o)
        err = rel_err(torch.cat(out, dim=-2), full)
        worst = max(worst, err)
        expect(err <= tol, f"context {P}: decoded tokens differ from the causal forward by "
                           f"{err:.2e} (> {tol:g})")
    return f"contexts 0, 1, 7, 70 + {T} steps, {str(dtype)[6:]}: largest error {worst:.1e}"


def state_size(name: str) -> str:
    """The state a prefill keeps holds B H state_size(N, D) numbers, and at most a quarter
    more (bookkeeping: a shift, page bounds), at two contexts."""
    m = variants.build(name)
    dtype = _decodes(m)
    ratios = []
    for N in (16, 200):
        s = m.state_size(N, D)
        expect(isinstance(s, int) and s > 0, f"a decoder must declare state_size, got {s!r}")
        k, v = qkv(B=B, H=H, N=N, D=D, dtype=dtype)[1:]
        with torch.no_grad():
            state = m.prefill(k, v, max_len=N, **m.draw_inputs(B, H, N, D, dtype=dtype))
        held = m.state_nbytes(state)
        ratio = held / (B * H * s * dtype.itemsize)
        ratios.append(f"N={N}: {s} numbers, state_nbytes {ratio:.3f}x")
        expect(1 <= ratio <= 1.25, f"N={N}: state_nbytes {held:,} B is {ratio:.3f}x "
                                   f"B H state_size x {dtype.itemsize} B (allowed 1..1.25)")
    return "; ".join(ratios)
