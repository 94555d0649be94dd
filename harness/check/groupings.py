"""The kit's `groupings` property: a variant at the head and width groupings its contract
declares (`variants.core.contract.Grouping`), against float64 references.

Softmax variants (grouped keys) run at kv_heads = H, H/2 and 1; recurrences (grouped
values) at value_heads = H and 2H; where the grouping declares `value_dim`, also at
Dv != Dk. At each:

  * the output has the output's heads and width, and equals the reference: float64 exact
    attention on grouped keys (variants.exact_reference, which repeats the shared heads
    itself) for an exact or pattern-exact variant; its own float64 `reference` on the
    heads repeated for a recurrence; and for every variant, its own output on the heads
    repeated (query head h reads key-value head h // (Hq / Hk); value head j reads
    query-key head j // (Hv / Hk)), which pins the grouping's meaning for an
    approximate variant too (a grouping whose group shares a selection,
    `group_selects`, with a group's query heads drawn equal);
  * a variant that declares `native` makes no tensor of one shared head per output head
    from the shared heads alone (a repeat, an expand and a copy, a gather): watched op by
    op (`Repeats`, a TorchDispatchMode), against the same call with as many query heads
    as shared ones, so that a kernel's own copies of the shared heads (a band's padded
    spans) are not taken for a repeat: a repeat grows with the query heads, they do not;
  * its decoding form (where declared) gives the causal forward's rows, and keeps the
    state `state_size_at` predicts (1..1.25x): a `native` decoder that repeats its cache
    keeps g times the prediction.

A grouping that refuses must be refused by forward with its declared reason.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import variants
from harness.check.kit import N_GENERIC, Failed, NotApplicable, Refused, expect, rel_err
from variants import Shape

H, N, D = 4, 40, 8
B = 2
TOL64 = 1e-9  # float64 against float64: rounding only


# Ops that make a tensor from another's dtype, device or shape, never from its numbers:
# no copy of it (a kernel's output buffer, new_zeros on q's dtype).
FACTORIES = {"new_zeros", "new_empty", "new_empty_strided", "new_ones", "new_full",
             "zeros_like", "empty_like", "ones_like", "full_like"}


class Repeats(TorchDispatchMode):
    """Watches a call for a repeat of the shared heads: an op whose inputs derive from the
    shared tensors alone (k and v for grouped keys; q and k for grouped values, views and
    elementwise results of them included) and that makes a new tensor of at least
    `threshold` elements. `found` lists each such op and its size, `largest` the largest
    size. The scores (q k^T) derive from both sides and are not counted. Not counted
    either: a factory (`FACTORIES`: it reads no numbers), and an op with a floating-point
    input of its own, derived from neither side, at least as large as its output: a
    shared head's numbers combined with as many numbers made inside the call (a decay per
    value head built from a fixed schedule, retention's γ_j, applied to the query-key
    head's q k^T), not copied (a copy's other inputs are indices or smaller than it)."""

    def __init__(self, shared, others, threshold: int = 0):
        super().__init__()
        self.shared = {t.untyped_storage().data_ptr() for t in shared}
        self.others = {t.untyped_storage().data_ptr() for t in others}
        self.threshold = threshold
        self.found: list[tuple[str, int]] = []
        self.largest = 0
        # Provenance is by storage address: every tensor the call makes is held until the
        # watch ends, so that no later tensor reuses a freed one's address and inherits
        # its side (a stale address read a tensor of q's as the shared heads' alone).
        self._held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in FACTORIES:
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        ins = {t.untyped_storage().data_ptr() for t in tensors}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._held.extend(outs)
        # the numbers its floating-point inputs of neither side hold (their storage: an
        # expanded view of a few numbers is still a few)
        own = max((t.untyped_storage().nbytes() // t.element_size() for t in tensors
                   if t.is_floating_point()
                   and t.untyped_storage().data_ptr() not in self.shared | self.others),
                  default=0)
        if ins & self.shared and not ins & self.others and own >= max(
                (t.numel() for t in outs), default=1):
            pass  # per output head numbers of their own: neither a copy nor shared
        elif ins & self.shared and not ins & self.others:
            for t in outs:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in ins and t.numel() >= self.threshold:
                    self.found.append((f"{func} made {tuple(t.shape)}", t.numel()))
                    self.largest = max(self.largest, t.numel())
                self.shared.add(ptr)
        elif ins & self.others:
            self.others.update(t.untyped_storage().data_ptr() for t in outs)
        return out


def base_shape(m) -> tuple[int, int, int, int]:
    """(B, H, N, D) of the kit's grouped cases: small, at a length the variant's default
    setting takes (N_GENERIC where its budget exceeds N); a compiled variant in the
    shape the exactness cases compiled its kernels for (B = H = 3, N = 200, D = 16)."""
    if m.contract.compiled:
        return 3, 3, 200, 16
    for n in (N, N_GENERIC):
        if not m.unsupported_reasons(device="cpu", dtype=torch.float32,
                                     causal=m.contract.causal_only, seq_len=n, head_dim=D):
            return B, H, n, D
    return B, H, N, D


def shapes_for(grouping, base=(B, H, N, D)) -> list[Shape]:
    """The groupings the kit runs a variant at: kv_heads = H, H/2 (where H is even), 1;
    value_heads = H, 2H; Dv = D + 4 where declared."""
    b, h, n, d = base
    if grouping.heads == "kv":
        out = [Shape(b, h, n, d, kv_heads=x) for x in dict.fromkeys((h, h // 2, 1))
               if x and h % x == 0]
        if grouping.value_dim:
            out.append(Shape(b, h, n, d, kv_heads=max(1, h // 2), value_dim=d + 4))
    else:
        out = [Shape(b, h, n, d, value_heads=x) for x in (h, 2 * h)]
        if grouping.value_dim:
            out.append(Shape(b, h, n, d, value_heads=2 * h, value_dim=d + 4))
    return out


def _label(s: Shape) -> str:
    heads = f"value_heads {s.Hv}" if s.value_heads is not None else f"kv_heads {s.Hk}"
    return heads + (f", Dv {s.Dv}" if s.Dv != s.D else "")


def _draw(m, s: Shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
               for shape in s.shapes())
    ins = m.draw_inputs(s.B, s.out_heads, s.N, s.D, seed=seed, dtype=dtype)
    return q, k, v, ins


def _dtype(m, causal, s: Shape) -> torch.dtype:
    ok64 = not m.unsupported_reasons(device="cpu", dtype=torch.float64, causal=causal,
                                     seq_len=s.N, head_dim=s.D)
    return torch.float64 if ok64 else torch.float32


def _causal_modes(m) -> list[bool]:
    c = m.contract
    return [cz for cz in (False, True) if not (cz and not c.supports_causal)
            and not (not cz and c.causal_only)]


def groupings(name: str) -> str:
    """At each grouping the contract declares: the output against float64 references and
    against its own call on repeated heads; a native grouping allocates no repeat; the
    decoding form's rows and state (see the module's docstring)."""
    m = variants.build(name)
    c = m.contract
    g = c.grouping
    base = base_shape(m)
    reasons = m.unsupported_reasons(device="cpu", dtype=torch.float32, causal=c.causal_only,
                                    seq_len=base[2], head_dim=base[3])
    if reasons:
        raise Refused(reasons)
    if g.how == "refuse":
        s = shapes_for(g, base)[-1]
        q, k, v, ins = _draw(m, s, torch.float32)
        try:
            m(q, k, v, causal=c.causal_only, **ins)
        except ValueError as e:
            expect(g.why in str(e), f"refused {_label(s)} with {e}, not its declared reason")
            raise NotApplicable(f"refuses grouped heads: {g.why}") from None
        raise Failed(f"declares it refuses grouped heads ({g.why}) but ran {_label(s)}")
    out = []
    cases = shapes_for(g, base)
    most = cases[-1] if g.value_dim is False else cases[-2]  # kv_heads 1, value_heads 2H
    for s in cases:
        errs = []
        # Every causal mode and the decoding form at the most grouped case (and at every
        # grouped case of a native grouping); one mode elsewhere (the kit's time is short).
        full = s == most or (g.how == "native" and s.grouped)
        for causal in _causal_modes(m)[:None if full else 1]:
            errs.append(_forward(m, s, causal))
        if g.how == "native" and s.grouped:
            errs.append(_no_repeat(m, s, _causal_modes(m)[0]))
        if c.decoding and c.supports_causal and full:
            errs.append(_decode(m, s))
        out.append(f"{_label(s)}: {max(e for e in errs if e is not None):.0e}"
                   if any(e is not None for e in errs) else _label(s))
    return f"{g.heads} {g.how}; " + "; ".join(out)


def _forward(m, s: Shape, causal: bool) -> float:
    dtype = _dtype(m, causal, s)
    q, k, v, ins = _draw(m, s, dtype, seed=s.Hk + 7 * s.Hv + s.Dv)
    if m.contract.grouping.group_selects and s.Hk != s.H:
        # One selection a group (NSA's): the call on the heads repeated makes each head
        # its own group, so the two agree where a group's query heads are equal.
        r = s.H // s.Hk
        q = q[:, ::r].repeat_interleave(r, dim=1)
    with torch.no_grad():
        o = m(q, k, v, causal=causal, **ins)
        want = (s.B, s.out_heads, s.N, s.Dv)
        expect(tuple(o.shape) == want and o.dtype == dtype,
               f"{_label(s)} causal={causal}: output {tuple(o.shape)} {o.dtype}, want {want}")
        qe, ke, ve = variants.expand_heads(q, k, v)
        plain = m(qe, ke, ve, causal=causal, **ins)
        tol = TOL64 if dtype == torch.float64 else 1e-5
        err = rel_err(o, plain)
        if dtype != torch.float64:  # rounding: twice the plain path's against float64
            ref64 = variants.exact_reference(q, k, v, causal, key_mask=m.key_mask(s.N))
            tol = max(tol, 2 * rel_err(variants.naive_attention(
                qe, ke, ve, causal, key_mask=m.key_mask(s.N)), ref64) + 1e-6)
        expect(err <= tol, f"{_label(s)} causal={causal}: differs from its own call on "
                           f"the heads repeated by {err:.2e} (> {tol:g}): a head reads the "
                           "wrong shared head")
        ref = None
        if m.contract.err_ref != "softmax":
            ref = m.reference(qe.double(), ke.double(), ve.double(), True,
                              **{n: t.double() for n, t in ins.items()})
        elif m.contract.exact or m.contract.pattern_exact or m.exact_at(s.N, causal):
            ref = variants.exact_reference(q, k, v, causal, key_mask=m.key_mask(s.N))
        if ref is not None:
            e = rel_err(o, ref)
            expect(e <= tol, f"{_label(s)} causal={causal}: error {e:.2e} against its float64 "
                             f"reference (> {tol:g})")
            err = max(err, e)
    return err


def _watch(m, s: Shape, causal: bool, threshold: int = 0) -> Repeats:
    """`Repeats` over one call at s (after a first call: caches, masks, features)."""
    q, k, v, ins = _draw(m, s, torch.float64)
    m(q, k, v, causal=causal, **ins)
    # The declared inputs (gates, sinks) belong to the output heads: an op that combines
    # the shared heads with them (k scaled by a value head's beta) is not a repeat.
    shared, others = ((k, v), (q,)) if m.contract.grouping.heads == "kv" else ((q, k), (v,))
    watch = Repeats(shared, others + tuple(ins.values()), threshold)
    with watch, torch.no_grad():
        m(q, k, v, causal=causal, **ins)
    return watch


def _no_repeat(m, s: Shape, causal: bool) -> None:
    """A native grouping makes no tensor of one shared head per output head: none of at
    least B x out heads x N x width elements from the shared heads alone that is over 1.5x
    the largest such tensor of the same call with one query head per shared head (a
    repeat grows with the query heads: at least 2x here; a kernel's own copies of the
    shared heads do not)."""
    twin = Shape(s.B, s.Hk if m.contract.grouping.heads == "kv" else s.H, s.N, s.D,
                 value_dim=s.value_dim)
    alone = _watch(m, twin, causal).largest
    watch = _watch(m, s, causal, s.B * s.out_heads * s.N * min(s.D, s.Dv))
    over = [what for what, n in watch.found if n > 1.5 * alone]
    expect(not over, f"{_label(s)}: declares native grouping but "
                     f"{over[0] if over else ''} from the shared heads alone ({len(over)} "
                     f"such op(s); at most {alone:,} elements with one query head per "
                     "shared head): it repeats them")


def _decode(m, s: Shape) -> float:
    """Prefill 30 tokens, step 10: the causal forward's rows, and the predicted state."""
    dtype = _dtype(m, True, s)
    q, k, v, ins = _draw(m, s, dtype, seed=3)
    P = s.N * 3 // 4
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
        state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=s.N, q_heads=s.H,
                          **{n: t[:, :, :P] for n, t in ins.items()})
        rows = []
        for t in range(P, s.N):
            r, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                              **{n: x[:, :, t:t + 1] for n, x in ins.items()})
            rows.append(r)
    tol = TOL64 if dtype == torch.float64 else 1e-5
    err = rel_err(torch.cat(rows, dim=2), o[:, :, P:])
    expect(err <= tol, f"{_label(s)}: decoding differs from the causal forward's rows by "
                       f"{err:.2e} (> {tol:g})")
    want = m.state_size_at(s.N, s)
    if want is not None:
        held = m.state_nbytes(state) / torch.finfo(dtype).bits * 8 / s.B
        expect(want <= held <= 1.25 * want,
               f"{_label(s)}: the decoding state holds {held:,.0f} numbers per batch element, "
               f"state_size_at predicts {want:,} (1..1.25x): "
               + ("it repeats the shared heads" if held > want else "it undercounts"))
    return err
