"""Grouped value heads in the gated linear recurrences (variants/recurrent/), run natively:
q, k (B, H, N, Dk), v and the gates per value head (B, r H, N, ...), value head h r + j
reading query-key head h (issue 51; fla's num_v_heads). Held against a float64 sequential
recurrence run per value head on its own (written here, one head at a time, with
retention's gamma_j computed here), against the same variant on q and k repeated (the
ungrouped twin), in the chunked form (chunk 4: several chunks), the one-chunk form and
the streamed blocks, forward and gradients; decoding against the forward's rows; the
decode state per value head and no more; the kit's watch for a repeat."""

import math

import pytest
import torch

import variants
from harness.check import groupings, kit
from variants.core import registry
from variants.recurrent import GatedDeltaNet, recurrence

NAMES = ["retention", "gla", "mamba2", "deltanet", "gated_deltanet", "kda"]
B, H, N, D = 2, 2, 23, 8


def _draw(m, r, Dv=D, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, r * H, n, Dv, generator=g, dtype=torch.float64)
    return q, k, v, m.draw_inputs(B, r * H, n, D, seed=seed + 1, dtype=torch.float64)


def per_value_head(name, q, k, v, ins):
    """Each value head j alone: its query-key head j // r, its own gates, the sequential
    recurrence (variants.recurrent.recurrence) on one head; retention's decay
    gamma_j = 1 - 2^(-5-j) of value head j."""
    r = v.shape[1] // q.shape[1]
    delta = name in ("deltanet", "gated_deltanet", "kda")
    out = []
    for j in range(v.shape[1]):
        qj, kj = q[:, j // r:j // r + 1], k[:, j // r:j // r + 1]
        if delta:
            qj, kj = (torch.nn.functional.normalize(t, dim=-1) for t in (qj, kj))
        g = ins.get("g")
        g = None if g is None else g[:, j:j + 1]
        if name == "retention":
            g = torch.full(qj.shape[:3], math.log(1 - 2.0 ** (-5 - j)), dtype=q.dtype)
        beta = ins.get("beta")
        out.append(recurrence(qj, kj, v[:, j:j + 1], g, None if beta is None
                              else beta[:, j:j + 1]))
    return torch.cat(out, dim=1)


def _grads(fn, q, k, v, ins, w):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *ins.values())]
    o = fn(*leaves[:3], **dict(zip(ins, leaves[3:])))
    (o * w).sum().backward()
    return [o.detach()] + [t.grad for t in leaves]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("r,chunk,Dv", [(1, 4, D), (2, 4, D), (2, 64, D), (3, 4, 5)])
@pytest.mark.parametrize("name", NAMES)
def test_grouped_values_match_each_value_heads_own_recurrence(name, r, chunk, Dv):
    """value_heads = H and 2H (3H and Dv != Dk too), chunk 4 (six chunks) and 64 (the
    one-chunk form): output and every gradient (q, k summed over their value heads, each
    value head's v, g and beta) within 1e-10 of the per-value-head float64 recurrence;
    the output within 1e-12 of the variant's own call on q and k repeated."""
    m = variants.build(name, chunk=chunk)
    q, k, v, ins = _draw(m, r, Dv)
    w = torch.randn(B, r * H, N, Dv, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    got = _grads(lambda *a, **i: m(*a, causal=True, **i), q, k, v, ins, w)
    ref = _grads(lambda *a, **i: per_value_head(name, *a, i), q, k, v, ins, w)
    for label, a, b in zip(["o", "dq", "dk", "dv", *ins], got, ref):
        assert _rel(a, b) <= 1e-10, (label, _rel(a, b))
    with torch.no_grad():
        twin = m(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, causal=True, **ins)
    assert _rel(got[0], twin) <= 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_the_streamed_blocks_carry_the_packed_state(name, monkeypatch):
    """Blocks of a few chunks (chunked.stream), the packed (Dk, r Dv) state carried from
    block to block, at value_heads 2H, without autograd (the preallocated output)."""
    from variants.recurrent import chunked
    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 1)  # one chunk a block
    m = variants.build(name, chunk=4)
    q, k, v, ins = _draw(m, 2)
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
    assert _rel(o, per_value_head(name, q, k, v, ins)) <= 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_decoding_grouped_values_gives_the_forwards_rows(name):
    """Prefill 13 tokens at value_heads 2H (the block and token-by-token prefills), step the
    other 10: each row equals the causal forward's (float64, 1e-10); the state is the
    query-key heads' packed (B, H, Dk, r Dv), as state_size_at says."""
    m = variants.build(name, chunk=4)
    q, k, v, ins = _draw(m, 2)
    P = 13
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
        state = m.prefill(k[:, :, :P], v[:, :, :P], max_len=N,
                          **{n: t[:, :, :P] for n, t in ins.items()})
        rows = []
        for t in range(P, N):
            row, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                **{n: x[:, :, t:t + 1] for n, x in ins.items()})
            rows.append(row)
    assert _rel(torch.cat(rows, dim=2), o[:, :, P:]) <= 1e-10
    assert tuple(state.S.shape) == (B, H, D, 2 * D)
    shape = variants.Shape(B, H, N, D, value_heads=2 * H)
    assert state.S.numel() == B * m.state_size_at(N, shape)


def test_gated_deltanet_at_16_value_heads_keeps_twice_the_state_of_8():
    """Issue 51: 8 query-key heads, value_heads 16 against 8: exactly twice the bytes of
    decode state (a (Dk, Dv) state per value head), no more (q and k are not kept)."""
    m = variants.build("gated_deltanet")
    held = {}
    for Hv in (8, 16):
        g = torch.Generator().manual_seed(0)
        k = torch.randn(1, 8, 40, 16, generator=g)
        v = torch.randn(1, Hv, 40, 16, generator=g)
        ins = m.draw_inputs(1, Hv, 40, 16, seed=0)
        with torch.no_grad():
            state = m.prefill(k, v, max_len=41, q_heads=8, **ins)
        held[Hv] = m.state_nbytes(state)
        assert held[Hv] == 4 * m.state_size_at(40, variants.Shape(1, 8, 40, 16, value_heads=Hv))
    assert held[16] == 2 * held[8] == 2 * 8 * 16 * 16 * 4


def test_the_recurrences_declare_native_value_grouping():
    for name in NAMES:
        assert variants.spec(name).grouping == variants.Grouping("value", "native",
                                                                 value_dim=True)


class _RepeatedQK(GatedDeltaNet):
    """Right answers, native declared, but q and k repeated to one per value head before
    the kernels: the watch's planted bug for a recurrence."""
    name = "_repeated_qk"

    def attend(self, q, k, v, causal, **inputs):
        r = v.shape[1] // q.shape[1]
        return super().attend(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v,
                              causal, **inputs)


def test_the_watch_catches_a_recurrence_that_repeats_q_and_k():
    variants.register(_RepeatedQK)
    try:
        r = kit.run_property(groupings.groupings, _RepeatedQK.name)
    finally:
        registry._REGISTRY.pop(_RepeatedQK.name, None)
        registry._ORIGIN.pop(_RepeatedQK.name, None)
    assert r.status == "fail" and "it repeats them" in r.detail, r.line()


@pytest.mark.parametrize("N,chunk", [(48, 64), (200, 16)])
@pytest.mark.parametrize("name", NAMES)
def test_q_k_products_are_taken_once_per_query_key_head(name, N, chunk):
    """torch's FlopCounterMode around the forward at value_heads 2H against the same call
    on q and k repeated: Q K^T (2 n C D a query-key head; and K K^T, 4 n C D, for the
    delta rule) is counted once per query-key head, not per value head, where no decay
    per value head and key channel enters it (all but gla and kda, whose scores are per
    value head); everything else is the same work. flops_at is within 0.75..1.5x of the
    counter (it does not see the triangular solve; gla's quadrant products)."""
    from torch.utils.flop_counter import FlopCounterMode
    m = variants.build(name, chunk=chunk)
    Hv, D16 = 4, 16
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, N, D16, generator=g) for _ in range(2))
    v = torch.randn(1, Hv, N, D16, generator=g)
    ins = m.draw_inputs(1, Hv, N, D16)
    counted = []
    for qq, kk in ((q, k), (q.repeat_interleave(2, 1), k.repeat_interleave(2, 1))):
        c = FlopCounterMode(display=False)
        with c, torch.no_grad():
            m(qq, kk, v, causal=True, **ins)
        counted.append(c.get_total_flops())
    C = min(chunk, N)
    n = -(-N // C) * C  # the padded length
    shared = {"retention": 2, "mamba2": 2, "deltanet": 4, "gated_deltanet": 4}.get(name, 0)
    assert counted[1] - counted[0] == H * shared * n * C * D16
    want = m.flops_at(variants.Shape(1, H, N, D16, value_heads=Hv))
    assert 0.75 <= want / counted[0] <= 1.5
