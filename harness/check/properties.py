"""The properties every variant keeps (the interface's contract), each `(name) -> detail`:
a string with the numbers when it holds; kit.Failed (what failed, the numbers) when not.

References are independent of the variant: float64 exact attention (variants.
exact_reference, with the variant's own key pattern where it claims one), finite
differences for gradients, the causal forward for the decoding form, a FLOP counter
(torch.utils.flop_counter) for `flops`. The error rule for exact variants is
flash-attention's tests': at most twice the plain implementation's in the same dtype.
"""

from __future__ import annotations

import dataclasses

import torch

import variants
from harness.check.decoding import decoding, state_size, weights
from harness.check.groupings import groupings
from harness.check.kit import (N_GENERIC, Failed, NotApplicable, Refused, expect, extra,
                               qkv, rel_err, require, run_property)


def spec(name: str) -> str:
    """The spec describes the variant; unknown and wrongly typed parameters are refused."""
    s = variants.spec(name)
    expect(s.family and s.summary, "needs a `family` and a docstring (its summary line)")
    expect(s.paper.startswith("http") or s.contract.floor,
           f"`paper` must be a link, got {s.paper!r}")  # a floor (`none`) has no paper
    m = variants.build(name, **s.defaults)
    expect(isinstance(m, torch.nn.Module), "build does not return a torch.nn.Module")
    expect(dataclasses.asdict(m.params) == s.defaults, "built params differ from the defaults")
    for params in ({"no_such_param": 1},
                   *({p.name: "x" if p.type != "str" else 3} for p in s.params)):
        try:
            variants.build(name, **params)
        except ValueError as e:
            expect(name in str(e) and next(iter(params)) in str(e),
                   f"the refusal of {params} does not name the variant and parameter: {e}")
        else:
            raise Failed(f"build accepted {params}")
    return f"family {s.family}, {len(s.params)} parameter(s), bad ones refused"


def shapes(name: str) -> str:
    """Output of q's shape, dtype and device, finite; causal and not (each where it runs)."""
    m = variants.build(name)
    q, k, v = qkv()
    ran, refused = [], None
    for causal in (False, True):
        try:
            require(m, q, causal)
        except Refused as r:
            refused = r
            continue
        with torch.no_grad():
            o = m(q, k, v, causal=causal, **extra(m, q))
        expect(o.shape == q.shape and o.dtype == q.dtype and o.device == q.device,
               f"causal={causal}: output {tuple(o.shape)} {o.dtype}, q {tuple(q.shape)} {q.dtype}")
        expect(bool(torch.isfinite(o).all()), f"causal={causal}: non-finite output")
        ran.append(f"causal={causal}")
    if not ran:
        raise refused
    return f"{tuple(q.shape)} float32, finite ({', '.join(ran)})"


def _loss(m, causal, w, q, k, v, ins):
    return (m(q, k, v, causal=causal, **ins) * w).sum()


def gradients(name: str) -> str:
    """Backward equals central finite differences of a random projection of the output,
    along a random direction of each input (float64 where the variant takes it)."""
    m = variants.build(name)
    causal = m.contract.causal_only
    wide = not m.unsupported_reasons(device="cpu", dtype=torch.float64, causal=causal,
                                     seq_len=N_GENERIC, head_dim=8, backward=True)
    dtype, eps, tol = (torch.float64, 1e-6, 1e-6) if wide else (torch.float32, 1e-2, 5e-2)
    q, k, v = qkv(B=2, H=2, N=N_GENERIC, D=8, dtype=dtype, requires_grad=True)
    require(m, q, causal, backward=True)
    ins = {n: t.requires_grad_() for n, t in extra(m, q).items()}
    g = torch.Generator().manual_seed(1)
    w = torch.randn(q.shape, generator=g, dtype=torch.float64).to(dtype)
    _loss(m, causal, w, q, k, v, ins).backward()
    named = {"q": q, "k": k, "v": v, **ins}
    worst = 0.0
    for label, t in named.items():
        expect(t.grad is not None and bool(torch.isfinite(t.grad).all())
               and float(t.grad.abs().sum()) > 0, f"no finite, non-zero gradient for {label}")
        u = torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype)
        with torch.no_grad():
            args = {n: x.detach() for n, x in named.items()}
            plus = dict(args, **{label: args[label] + eps * u})
            minus = dict(args, **{label: args[label] - eps * u})
            numeric = float(_loss(m, causal, w, plus["q"], plus["k"], plus["v"],
                                  {n: plus[n] for n in ins})
                            - _loss(m, causal, w, minus["q"], minus["k"], minus["v"],
                                    {n: minus[n] for n in ins})) / (2 * eps)
        analytic = float((t.grad.double() * u.double()).sum())
        err = abs(analytic - numeric) / max(abs(analytic), abs(numeric), 1e-12)
        worst = max(worst, err)
        expect(err <= tol, f"d/d{label}: backward {analytic:.6g}, finite differences "
                           f"{numeric:.6g} (relative difference {err:.2e} > {tol:g})")
    return (f"{', '.join(named)} against finite differences in {str(dtype)[6:]}: largest "
            f"relative difference {worst:.1e} (<= {tol:g})")


def batch_heads(name: str) -> str:
    """Batch entries and heads are independent: permuted heads, a sliced batch, same rows."""
    m = variants.build(name)
    q, k, v = qkv()
    causal = m.contract.causal_only
    require(m, q, causal)
    perm = torch.tensor([2, 0, 1])
    ins = extra(m, q)
    if m.contract.per_head_schedule:  # head h has its own fixed constant (RetNet's
        perm = torch.tensor([0, 1, 2])           # decays): heads are independent, not alike
    with torch.no_grad():
        o = m(q, k, v, causal=causal, **ins)
        o_perm = m(q[:, perm], k[:, perm], v[:, perm], causal=causal,
                   **{n: t[:, perm] for n, t in ins.items()})
        o_b1 = m(q[1:], k[1:], v[1:], causal=causal, **{n: t[1:] for n, t in ins.items()})
    d = max(float((o_perm - o[:, perm]).abs().max()), float((o_b1 - o[1:]).abs().max()))
    expect(d <= 1e-5, f"outputs differ by {d:.2e} (> 1e-5) when heads or batch move")
    return f"heads permuted, batch sliced: largest difference {d:.1e}"


def causal(name: str) -> str:
    """Causal outputs ignore future keys and values; a non-causal-only variant refuses
    causal=True with its reason."""
    m = variants.build(name)
    q, k, v = qkv()
    if not variants.spec(name).supports_causal:
        reasons = m.unsupported_reasons(device="cpu", dtype=q.dtype, causal=True,
                                        seq_len=N_GENERIC, head_dim=16)
        expect(bool(reasons), "supports_causal is False but no reason is declared")
        try:
            m(q, k, v, causal=True)
        except ValueError as e:
            expect("causal" in str(e), f"refused causal=True without saying so: {e}")
            return f"non-causal only, causal=True refused ({reasons[0]})"
        raise Failed("non-causal only, but forward ran causal=True")
    require(m, q, causal=True)
    i = N_GENERIC // 2
    g = torch.Generator().manual_seed(7)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, i + 1:] = torch.randn(k2[:, :, i + 1:].shape, generator=g) * 3
    v2[:, :, i + 1:] = torch.randn(v2[:, :, i + 1:].shape, generator=g) * 3
    ins = extra(m, q)
    with torch.no_grad():
        o, o2 = m(q, k, v, causal=True, **ins), m(q, k2, v2, causal=True, **ins)
    past = float((o2[:, :, :i + 1] - o[:, :, :i + 1]).abs().max())
    future = float((o2[:, :, i + 1:] - o[:, :, i + 1:]).abs().max())
    expect(past <= 1e-5, f"rows 0..{i} changed by {past:.2e} when keys and values after "
                         f"{i} changed: the output reads the future")
    expect(future > 1e-5, f"rows after {i} did not change ({future:.1e}) with their own keys")
    return f"rows 0..{i} moved {past:.1e} when later keys changed (later rows {future:.2f})"


def determinism(name: str) -> str:
    """Two modules built with the same parameters give the same output, bit for bit."""
    q, k, v = qkv()
    m = variants.build(name)
    causal = m.contract.causal_only
    require(m, q, causal)
    ins = extra(m, q)
    with torch.no_grad():
        a = variants.build(name)(q, k, v, causal=causal, **ins)
        b = variants.build(name)(q, k, v, causal=causal, **ins)
    d = float((a - b).abs().max())
    expect(d == 0, f"two builds differ by {d:.2e}")
    return "two builds, identical outputs"


def flops(name: str) -> str:
    """`flops` is a positive int that grows with N, causal exact counts half (FlashAttention's
    convention), and it is within 2x of torch's FLOP counter where that sees the matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    m = variants.build(name)
    f = [m.flops(1, 8, n, 64, False) for n in (1024, 4096)]
    expect(all(isinstance(x, int) and x > 0 for x in f), f"flops must be positive ints: {f}")
    expect(f[1] > f[0], f"flops do not grow with N: {f}")
    s = variants.spec(name)
    if s.supports_causal:
        c = m.flops(1, 8, 4096, 64, True)
        expect(isinstance(c, int) and c > 0, f"causal flops must be a positive int: {c}")
        if s.exact:
            expect(c == f[1] // 2, f"exact causal flops {c} != half of {f[1]}")
    counted = []
    if not m.contract.compiled:
        for cz in (False, True):
            q, k, v = qkv(B=1, H=2, N=256, D=32)
            if m.unsupported_reasons(device="cpu", dtype=q.dtype, causal=cz, seq_len=256,
                                     head_dim=32):
                continue
            ins = extra(m, q)
            with torch.no_grad(), FlopCounterMode(display=False) as fc:
                m(q, k, v, causal=cz, **ins)
            n, a = fc.get_total_flops(), m.flops(1, 2, 256, 32, cz)
            if n:  # 0 where the work is in a fused kernel the counter does not see (SDPA)
                expect(0.5 <= a / n <= 2, f"causal={cz}: flops {a:,} against {n:,} counted "
                                          f"(ratio {a / n:.2f}, outside 0.5..2)")
                counted.append(f"{a / n:.2f}x the count{' causal' if cz else ''}")
    return (f"{f[0]:,} at N=1024, {f[1]:,} at N=4096"
            + (f"; {', '.join(counted)}" if counted else "; no matmul the counter sees"))


def exact_case(name: str, N: int, shape=(1, 2, 32), causal=False,
               dtype=torch.float32) -> str:
    """An exact or pattern-exact variant (or a setting whose `exact_at(N)` says so) against
    float64 exact attention on its key pattern: error at most twice the plain path's."""
    m = variants.build(name)
    s = variants.spec(name)
    if not (s.exact or s.pattern_exact or m.exact_at(N, causal)):
        raise NotApplicable(f"approximate at N={N} (exact_at False): its error is measured, "
                            "not bounded")
    B, H, D = shape
    q, k, v = qkv(B=B, H=H, N=N, D=D, dtype=dtype, seed=N)
    require(m, q, causal)
    mask = m.key_mask(N)
    with torch.no_grad():
        ref = variants.exact_reference(q, k, v, causal, key_mask=mask)
        base = rel_err(variants.naive_attention(q, k, v, causal, key_mask=mask), ref)
        err = rel_err(m(q, k, v, causal=causal), ref)
    bound = 2 * base + torch.finfo(dtype).eps
    expect(err <= bound, f"N={N} causal={causal} {str(dtype)[6:]}: error {err:.2e} against "
                         f"float64 exact attention > {bound:.2e} (twice the plain path's)")
    return f"N={N} causal={causal} {str(dtype)[6:]}: error {err:.1e} <= {bound:.1e}"


def recurrence_case(name: str, N: int = 100) -> str:
    """A variant measured against its own float64 form (`err_ref` recurrence): forward in
    float64 equals its sequential `reference` to 1e-10 (float32 where it refuses float64:
    1e-4)."""
    m = variants.build(name)
    wide = not m.unsupported_reasons(device="cpu", dtype=torch.float64, causal=True,
                                     seq_len=N, head_dim=16)
    dtype, tol = (torch.float64, 1e-10) if wide else (torch.float32, 1e-4)
    q, k, v = qkv(B=2, H=3, N=N, D=16, dtype=dtype, seed=N)
    require(m, q, causal=True)
    ins = extra(m, q)
    with torch.no_grad():
        err = rel_err(m(q, k, v, causal=True, **ins),
                      m.reference(q.double(), k.double(), v.double(), True,
                                  **{n: t.double() for n, t in ins.items()}))
    expect(err <= tol, f"N={N} {str(dtype)[6:]}: error {err:.2e} against its float64 "
                       f"sequential reference > {tol:g}")
    return f"N={N} {str(dtype)[6:]}: error {err:.1e} against its sequential float64 form"


def exactness(name: str) -> str:
    """exact_case at a ragged and a multi-block length, causal and not; a recurrence
    against its own float64 form instead."""
    if variants.spec(name).err_ref != "softmax":
        return recurrence_case(name)
    out, skipped = [], None
    for N in (63, N_GENERIC):
        for cz in (False, True):
            try:
                out.append(exact_case(name, N, causal=cz))
            except (Refused, NotApplicable) as e:
                skipped = e
    if not out:
        raise skipped
    return "; ".join(out)


ALL = (spec, shapes, gradients, batch_heads, causal, determinism, flops, exactness,
       weights, decoding, state_size, groupings)


def check(names: list[str], properties=ALL) -> list:
    """Every property of every named variant, as kit.Results."""
    return [run_property(fn, n) for n in names for fn in properties]
