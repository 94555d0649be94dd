"""mla (variants/latent): the absorbed form equals the naive one, both equal an independent
float64 reference (per-head keys and values built from the latent here, dense softmax with
an explicit causal mask), forward, backward and decoded; the absorbed decoder keeps
kv_lora_rank + qk_rope_head_dim numbers a token at any head count and never decompresses
its cache; its decode traffic and FLOPs; a width that does not match the projections is
bad input (exit 2, one line).

Planted bugs (test_planted_bugs_fail): the rotary part dropped from the absorbed scores;
FlashAttention's 1/sqrt(R + dr) for the model's 1/sqrt(dn + dr); W_UV applied to every
cached latent before the weighted sum (equal in exact arithmetic: caught by the tensor a
step makes); the naive decoder's rotary key left out of its cache."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import variants
from harness.errors import UsageError
from harness.measure import decode, layers, matrix, rows, timing
from tests.dispatch_probe import LargestOutput
from variants.latent import kernels as K

REPO = Path(__file__).resolve().parents[1]
W = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
V3 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
WIDE = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=20)  # dv > dn + dr


def _mla(form="absorbed", **widths):
    return variants.build("mla", form=form, **(widths or W))


def _draw(B, H, N, p, dtype=torch.float64, seed=0):
    """q = q_pe, k = k_pe, v = the latent, and the inputs: unit-scale projections
    (N(0, 1/R): decompressed keys and values of unit variance) so that attention is not
    flat."""
    g = torch.Generator().manual_seed(seed)
    R, dr, dn, dv = (p[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                    "v_head_dim"))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, H, N, dr), r(B, 1, N, dr), r(B, 1, N, R)
    ins = {"q_nope": r(B, H, N, dn), "w_uk": r(H, dn, R) / math.sqrt(R),
           "w_uv": r(H, dv, R) / math.sqrt(R)}
    cast = lambda t: t.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), {n: cast(t) for n, t in ins.items()}


def independent(q, k, v, causal, q_nope, w_uk, w_uv, scale=None):
    """float64, from the definition: head h's key [c W_UK_h^T | k_pe], value c W_UV_h^T,
    query [q_nope_h | q_pe_h]; the dense scores, -inf above the diagonal when causal."""
    q, k, v, q_nope, w_uk, w_uv = (t.double() for t in (q, k, v, q_nope, w_uk, w_uv))
    B, H, N, dr = q.shape
    keys = torch.cat([torch.einsum("bnr,hdr->bhnd", v[:, 0], w_uk),
                      k.expand(B, H, N, dr)], dim=-1)
    values = torch.einsum("bnr,hdr->bhnd", v[:, 0], w_uv)
    queries = torch.cat([q_nope, q], dim=-1)
    scale = scale or 1 / math.sqrt(queries.shape[-1])
    s = queries @ keys.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ values


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _forms_agree(widths=W, dtype=torch.float64, N=37, H=3):
    """Absorbed = naive = independent, causal and not; the largest of the errors."""
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    q, k, v, ins = _draw(2, H, N, widths, dtype)
    worst = 0.0
    for causal in (False, True):
        a = _mla("absorbed", **widths)(q, k, v, causal=causal, **ins)
        n = _mla("naive", **widths)(q, k, v, causal=causal, **ins)
        ref = independent(q, k, v, causal, **ins)
        assert a.shape == (2, H, N, widths["v_head_dim"]) and a.dtype == dtype
        errs = (_rel(a, n), _rel(a, ref), _rel(n, ref))
        assert max(errs) <= tol, (causal, errs)
        worst = max(worst, *errs)
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("widths", [W, WIDE], ids=["dv<dn+dr", "dv>dn+dr"])
def test_absorbed_equals_naive_and_the_independent_reference(widths, dtype):
    _forms_agree(widths, dtype)


def test_the_variants_own_reference_and_scale():
    """`reference` (the harness's err_ref) is the independent form; a given `scale` is used."""
    q, k, v, ins = _draw(1, 2, 20, W)
    m = _mla()
    assert abs(m.softmax_scale - 1 / math.sqrt(20)) < 1e-15
    assert _rel(m.reference(q, k, v, True, **ins), independent(q, k, v, True, **ins)) < 1e-13
    m2 = variants.build("mla", scale=0.3, **W)
    ref = independent(q, k, v, True, **ins, scale=0.3)
    assert _rel(m2(q, k, v, causal=True, **ins), ref) < 1e-12
    assert _rel(m2.reference(q, k, v, True, **ins), ref) < 1e-13
    # DeepSeek-V3's default is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(192)
    assert variants.build("mla").softmax_scale == 1 / math.sqrt(192)


def test_gradients_match_float64_autograd_of_the_reference():
    """Both forms' backward (q, k, v and the three inputs) equals autograd through the
    independent dense form, in float64."""
    q, k, v, ins = _draw(1, 2, 19, W)
    leaves = [q, k, v, *ins.values()]
    g = torch.randn(1, 2, 19, W["v_head_dim"], generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    want = torch.autograd.grad((independent(*[t.requires_grad_() for t in leaves[:3]], True,
                                            **dict(zip(ins, [t.requires_grad_() for t in
                                                             leaves[3:]]))) * g).sum(), leaves)
    for form in ("absorbed", "naive"):
        o = _mla(form)(q, k, v, causal=True, **ins)
        got = torch.autograd.grad((o * g).sum(), leaves)
        for name, a, b in zip(("q", "k", "v", *ins), got, want):
            assert _rel(a, b) < 1e-12, (form, name)


def _decode(m, q, k, v, ins, P):
    """Prefill P tokens (in two pieces by extend), step the rest: outputs and state."""
    N = q.shape[2]
    per = {"q_nope": True, "w_uk": False, "w_uv": False}
    at = lambda a, b: {n: (t[:, :, a:b] if per[n] else t) for n, t in ins.items()}  # noqa: E731
    h = P // 2
    state = m.prefill(k[:, :, :h], v[:, :, :h], max_len=N, q_heads=q.shape[1], **at(0, h))
    state = m.extend(state, k[:, :, h:P], v[:, :, h:P], **at(h, P))
    out = []
    for t in range(P, N):
        o, state = m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                          **at(t, t + 1))
        out.append(o)
    return torch.cat(out, dim=2), state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoding_equals_the_causal_forward_and_the_reference(dtype):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    q, k, v, ins = _draw(2, 3, 24, W, dtype, seed=1)
    ref = independent(q, k, v, True, **ins)
    for P in (0, 1, 13):
        a, _ = _decode(_mla("absorbed"), q, k, v, ins, P)
        n, _ = _decode(_mla("naive"), q, k, v, ins, P)
        assert a.dtype == dtype and a.shape == (2, 3, 24 - P, W["v_head_dim"])
        assert max(_rel(a, n), _rel(a, ref[:, :, P:]), _rel(n, ref[:, :, P:])) <= tol, P


def test_reference_from_carries_the_context():
    """reference_from over two pieces equals the independent form's rows."""
    q, k, v, ins = _draw(1, 2, 25, W, seed=2)
    m = _mla()
    per = lambda a, b: {**ins, "q_nope": ins["q_nope"][:, :, a:b]}  # noqa: E731
    _, state = m.reference_from(None, q[:, :, :11], k[:, :, :11], v[:, :, :11], **per(0, 11))
    o, _ = m.reference_from(state, q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], **per(11, 25))
    assert _rel(o, independent(q, k, v, True, **ins)[:, :, 11:]) < 1e-13


@pytest.mark.parametrize("H", [2, 16])
def test_the_absorbed_cache_is_576_numbers_a_token_at_any_head_count(H):
    """DeepSeek-V3's widths: R + dr = 576 numbers a token for every head; the naive
    decoder's H (dn + dr + dv) = 320 H."""
    B, N = 1, 6
    m = variants.build("mla")
    q, k, v, ins = _draw(B, H, N, V3, torch.float32)
    state = m.prefill(k, v, max_len=N, q_heads=H, **ins)
    assert m.state_nbytes(state) == B * N * 576 * 4
    s = variants.Shape(B, H, N, 64, kv_heads=1, value_dim=512)
    assert m.state_size_at(N, s) == 576 * N == m.state_size(N, 64)
    naive = variants.build("mla", form="naive")
    state = naive.prefill(k, v, max_len=N, q_heads=H, **ins)
    assert naive.state_nbytes(state) == B * N * H * (128 + 64 + 128) * 4
    assert naive.state_size_at(N, s) == H * N * 320


def test_decode_traffic_and_flops():
    """What a step reads (the latent cache and both up-projections) and computes: at
    DeepSeek-V3's 128 heads and a long context, 2 H (2 R + dr) FLOPs per cached number,
    about 121 a byte in float32 (the issue's figure)."""
    m = variants.build("mla")
    s = variants.Shape(1, 128, 65536, 64, kv_heads=1, value_dim=512)
    N = 65536
    assert m.decode_read_size_at(N, s) == N * 576 + 128 * 512 * 256
    assert m.decode_flops_at(N, s) == 2 * 128 * (512 * 256 + N * (2 * 512 + 64))
    per_number = 2 * 128 * (2 * 512 + 64) / 576
    assert 480 < per_number < 490  # FLOPs per cached number: ~121 per byte in float32
    naive = variants.build("mla", form="naive")
    assert naive.decode_read_size_at(N, s) == 128 * N * 320 + 128 * 512 * 256


def test_the_absorbed_step_never_decompresses_its_cache():
    """A step's largest tensor is the (B, H, n) scores or a view of the latent cache (B, n,
    R + dr), never per-head values of every cached token (B, H, n, dv): W_UV comes after
    the sum."""
    B, H, N = 1, 8, 256
    q, k, v, ins = _draw(B, H, N + 1, W, torch.float32)
    m = _mla()
    state = m.prefill(k[:, :, :N], v[:, :, :N], max_len=N + 1, q_heads=H,
                      **{**ins, "q_nope": ins["q_nope"][:, :, :N]})
    probe = LargestOutput()
    with probe, torch.no_grad():
        m.step(state, q[:, :, N:], k[:, :, N:], v[:, :, N:],
               **{**ins, "q_nope": ins["q_nope"][:, :, N:]})
    bound = B * (N + 1) * max(H, W["kv_lora_rank"] + W["qk_rope_head_dim"])
    assert probe.largest <= bound, probe.largest
    assert B * H * (N + 1) * W["v_head_dim"] > 3 * bound  # the bug's tensor: far above


@pytest.fixture
def untimed(monkeypatch):
    monkeypatch.setattr(timing, "time_call", lambda fn, setup=None, **kw: (
        setup(), fn(), timing.Timing(1.0, 0.0, 1, (1.0,)))[-1])


def _case(params, **kw):
    raw = {"variants": {"mla": [params]}, "seq_lens": [300], "passes": ["decode"],
           "causal": [True], "decode_tokens": 4, "heads": 3, "head_dim": 8, "kv_heads": [1],
           "value_dim": [16], "min_run_time_s": 0.01, "min_repeats": 1, **kw}
    (case,) = matrix.expand(matrix.normalise(raw))
    return case


@pytest.mark.parametrize("form", ["absorbed", "naive"])
def test_the_decode_pass_measures_it_against_its_reference(untimed, form):
    case = _case({**W, "form": form})
    m = layers.build(case)
    assert not rows.skip_reasons(case, m)
    r = decode.measure(case, m, torch.device("cpu"), "time")
    assert r["status"] == "ok" and r["rel_err"] < 1e-5 and r["row_cos"] > 0.99999, r
    assert m.contract.err_ref == "own_softmax"  # its rows: its own exact softmax, not a recurrence
    row = 16 + 8 if form == "absorbed" else 3 * (12 + 8 + 10)
    read = 300 * row + 3 * 16 * (12 + 10)
    write = 16 + 8 if form == "absorbed" else None
    assert r["decode_flops"] == m.decode_flops_at(300, case.shape)
    if write is not None:
        assert abs(r["decode_read_mib"] - (read + write) * 4 / 2**20) < 1e-12
    assert abs(r["decode_state_mib"] - 304 * row * 4 / 2**20) < 1e-12


def test_a_case_without_mlas_widths_is_skipped_with_the_reason():
    """An `all` matrix's multi-head case (no kv_heads, no value_dim) is a skipped row."""
    raw = {"variants": ["mla"], "seq_lens": [64], "passes": ["forward"], "causal": [True],
           "heads": 4, "head_dim": 64, "min_run_time_s": 0.01}
    (case,) = matrix.expand(matrix.normalise(raw))
    reasons = rows.skip_reasons(case, layers.build(case))
    assert any("kv_heads 4 is not 1" in r for r in reasons)
    assert any("value_dim 64 is not kv_lora_rank 512" in r for r in reasons)


SETTING = "mla(" + ",".join(f"{k}={v}" for k, v in W.items()) + ")"


def test_a_width_that_does_not_match_its_projections_exits_2(tmp_path):
    """From the command line: one line, exit 2, nothing written."""
    r = subprocess.run([sys.executable, "run_bench.py", "run", "--preset", "quick",
                        "--inputs", "gaussian", "--heads", "3", "--seq-lens", "64",
                        "--variants", SETTING, "--head-dim", "8", "--kv-heads", "1",
                        "--value-dim", "24", "--results-dir", str(tmp_path / "res"),
                        "--run-id", "x"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "mla: value_dim 24 is not kv_lora_rank 16" in r.stderr, r.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("shape, expect", [
    ({"head_dim": 12}, "mla: head_dim 12 is not qk_rope_head_dim 8"),
    ({"kv_heads": [3]}, "mla: kv_heads 3 is not 1"),
    ({"value_dim": [16], "kv_heads": [1], "head_dim": 8}, None),
])
def test_the_plan_refuses_each_width(shape, expect):
    raw = {"variants": {"mla": [W]}, "seq_lens": [64], "passes": ["forward"], "heads": 3,
           "head_dim": 8, "kv_heads": [1], "value_dim": [16], **shape}
    if expect is None:
        cases = matrix.expand(matrix.normalise(raw))
        assert cases and all(c.kv_heads == 1 and c.value_dim == 16 for c in cases)
        return
    with pytest.raises(UsageError, match=expect):
        matrix.expand(matrix.normalise(raw))


def test_a_call_with_mismatched_widths_is_refused():
    q, k, v, ins = _draw(1, 2, 5, W)
    with pytest.raises(ValueError, match="value_dim 15 is not kv_lora_rank 16"):
        _mla()(q, k, v[..., :15], causal=True, **ins)
    with pytest.raises(ValueError, match="w_uk"):
        _mla()(q, k, v, causal=True, **{**ins, "w_uk": ins["w_uk"][:, :, :15]})


# -- planted bugs --------------------------------------------------------------------
def _no_rope(q_pe, q_nope, w_uk):
    return torch.cat([K.per_head(q_nope, w_uk), torch.zeros_like(q_pe)], dim=-1)


def _values_first(kc, q_pe, q_nope, w_uk, w_uv, scale):
    """W_UV on every cached latent, then the weighted sum: the same numbers, H n dv made."""
    cd = torch.float64 if q_pe.dtype == torch.float64 else torch.float32
    R = w_uk.shape[-1]
    qa = K.absorbed_query(q_pe.to(cd), q_nope.to(cd), w_uk.to(cd))[:, :, 0]
    p = torch.softmax(torch.bmm(qa * scale, kc.to(cd).transpose(1, 2)), dim=-1)  # (B, H, n)
    vals = torch.einsum("bnr,hdr->bhnd", kc[..., :R].to(cd), w_uv.to(cd))  # (B, H, n, dv)
    return (p[:, :, None] @ vals).to(q_pe.dtype)


def _checks():
    return {
        "forms": lambda: _forms_agree(),
        "decoding": lambda: test_decoding_equals_the_causal_forward_and_the_reference(
            torch.float64),
        "no_decompression": test_the_absorbed_step_never_decompresses_its_cache,
    }


@pytest.mark.parametrize("bug, check", [
    ("rope_dropped", "forms"), ("rope_dropped", "decoding"),
    ("flash_scale", "forms"), ("values_first", "no_decompression"),
    ("naive_cache_without_rope", "decoding"),
])
def test_planted_bugs_fail(monkeypatch, bug, check):
    _checks()[check]()  # holds as written
    mla_cls = type(_mla())
    if bug == "rope_dropped":
        monkeypatch.setattr(K, "absorbed_query", _no_rope)
    elif bug == "flash_scale":  # FlashAttention's reference default, not the model's
        monkeypatch.setattr(mla_cls, "softmax_scale", property(
            lambda self: 1 / math.sqrt(self.params.kv_lora_rank + self.params.qk_rope_head_dim)))
    elif bug == "values_first":
        monkeypatch.setattr(K, "absorbed_step", _values_first)
    else:
        plain = mla_cls.decode_extend
        monkeypatch.setattr(mla_cls, "decode_extend", lambda self, state, k, v, **ins: plain(
            self, state, torch.zeros_like(k) if not hasattr(state, "kc") else k, v, **ins))
    with pytest.raises(AssertionError):
        _checks()[check]()
