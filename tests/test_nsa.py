"""NSA (variants/learned_sparse/nsa.py, blocks.py): Native Sparse Attention's compressed,
selected and window branches mixed by the gates gate_cmp, gate_slc, gate_win.

Checked against the float64 plain form (`nsa_reference`: mean-pooled blocks by a loop,
dense masks, the selection by a stable sort over an explicit overlap matrix) and, where a
single branch covers every key, against exact attention; forward and the gradients of q,
k, v and the gates; the decoder against the causal forward's rows, and what a step
gathers against `decode_read_size_at`. Each planted bug (a selection that reads the
future, the bottom-n blocks, ties to the earlier block, a compressed block seen before it
ends) makes `check` fail.
"""

import pytest
import torch

import run_bench
from dispatch_probe import LargestOutput

import variants
from variants.learned_sparse import gathered, nsa_reference
from variants.learned_sparse import blocks as bk
from variants.learned_sparse import indexer as ix

# l = 8, d = 4, l' = 16: compressed blocks straddle selection blocks (Eq. 9's sum).
SMALL = {"block": 8, "stride": 4, "select_block": 16, "top_n": 4, "window": 6}


def case(N, B=2, H=4, Hk=2, D=8, Dv=12, seed=0, grad=False, gates=None, ties=None, m=None):
    """q, k, v (grouped keys, values of their own width) and the gates, drawn as the
    benchmark draws them or fixed to `gates`; ties: keys repeating with that period, so
    that every complete compressed block has the same key and block importances tie,
    and q, k small integers at D = 4 (scale 1/2), so that every score is exact: the tie
    does not hang on how a matmul rounds each column."""
    D = 4 if ties else D
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, N, Dv, generator=g, dtype=torch.float64)
    if ties:
        q, k = q.round(), k[:, :, torch.arange(N) % ties].round().contiguous()
    ins = (m or variants.build("nsa")).draw_inputs(B, H, N, D, seed=seed, dtype=torch.float64)
    if gates is not None:
        ins = {n: torch.full((B, H, N), float(x), dtype=torch.float64)
               for n, x in zip(ins, gates)}
    for t in (q, k, v, *ins.values()):
        t.requires_grad_(grad)
    return q, k, v, ins


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def check(m, q, k, v, ins, tol=1e-10):
    """m's forward and its gradients (q, k, v, gates) against autograd through
    `nsa_reference`."""
    w = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    o = m(q, k, v, causal=True, **ins)
    ref = nsa_reference(q, k, v, **ins, **vars(m.params))
    assert rel(o, ref) <= tol, f"forward: {rel(o, ref):.2e}"
    xs = [x for x in (q, k, v, *ins.values()) if x.requires_grad]
    got = torch.autograd.grad((o * w).sum(), xs)
    want = torch.autograd.grad((ref * w).sum(), xs)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) <= tol, f"gradient {i}: {rel(a, b):.2e}"


@pytest.fixture
def cut(request, monkeypatch):
    """The chunks as a call at this size makes them, or a few query rows a chunk."""
    if request.param == "cut":
        monkeypatch.setattr(bk, "_CHUNK_BYTES", 2**14)
        monkeypatch.setattr(gathered, "_STEP_BYTES", 2**18)


@pytest.mark.parametrize("N", [1, 63, 130])
def test_one_branch_covering_every_key_is_exact_attention(N):
    """Gates (0, 1, 0) with top_n covering every block, and (0, 0, 1) with window >= N."""
    m = variants.build("nsa", **{**SMALL, "top_n": -(-N // 16)})
    q, k, v, ins = case(N, gates=(0, 1, 0))
    exact = variants.exact_reference(q, k, v, True)
    with torch.no_grad():
        assert rel(m(q, k, v, causal=True, **ins), exact) <= 1e-12
        m = variants.build("nsa", **{**SMALL, "window": N})
        q, k, v, ins = case(N, gates=(0, 0, 1))
        assert rel(m(q, k, v, causal=True, **ins), exact) <= 1e-12


@pytest.mark.parametrize("cut", ["cut"], indirect=True)
def test_the_compressed_branch_is_the_mean_pooled_blocks_it_has_seen(cut):
    """Gates (1, 0, 0): softmax over the means of the blocks ending at or before the
    query; 0 before the first block ends; forward and gradients against the reference,
    whose blocks are pooled by a loop and masked densely."""
    m = variants.build("nsa", **SMALL)
    q, k, v, ins = case(70, gates=(1, 0, 0), grad=True)
    check(m, q, k, v, ins)
    with torch.no_grad():
        o = m(q, k, v, causal=True, **ins)
    assert float(o[:, :, :7].abs().max()) == 0.0 and float(o[:, :, 7:].abs().min()) > 0
    # the query at 7 sees block 0 alone: its output is the mean of v[0:8]
    want = v[:, :, :8].mean(dim=2).repeat_interleave(2, dim=1)
    assert rel(o[:, :, 7], want) <= 1e-14


def test_a_compressed_block_seen_before_it_ends_fails(monkeypatch):
    """Planted: query t sees the compressed blocks that start at or before it (their
    later tokens are its future)."""
    m = variants.build("nsa", **SMALL)
    q, k, v, ins = case(40, gates=(1, 0, 0), grad=True)
    check(m, q, k, v, ins)

    def early(qs, kcc, t, ne, block, stride):
        sc = qs @ kcc[:, :, None, :ne].transpose(-1, -2)
        return sc.masked_fill_(torch.arange(ne) * stride > t[:, None], float("-inf"))

    monkeypatch.setattr(bk, "_scores", early)
    with pytest.raises(AssertionError, match="forward"):
        check(m, q, k, v, ins)


@pytest.mark.parametrize("N,Hk,setting,cut", [
    (100, 2, SMALL, "whole"),
    (100, 2, SMALL, "cut"),
    (130, 1, {**SMALL, "top_n": 2, "window": 20}, "whole"),
    (100, 4, {"block": 4, "stride": 4, "select_block": 4, "top_n": 5, "window": 3}, "whole"),
    (90, 2, {"block": 12, "stride": 4, "select_block": 8, "top_n": 4, "window": 9}, "cut")],
    indirect=["cut"])
def test_forward_and_gradients_match_the_float64_reference(N, Hk, setting, cut):
    m = variants.build("nsa", **setting)
    check(m, *case(N, Hk=Hk, grad=True, m=m))


def test_the_selection_is_shared_by_a_group_and_chooses_among_blocks():
    """One selection a key-value group; with fewer slots than blocks some are left out,
    the initial and local ones never."""
    m = variants.build("nsa", **{**SMALL, "top_n": 5})
    q, k, v, ins = case(130, Hk=2)
    sel = m.select(q, k)  # (B, Hk, N, 5)
    assert sel.shape == (2, 2, 130, 5)
    t = torch.arange(130)
    for j in (torch.zeros_like(t), t // 16, (t // 16 - 1).clamp(min=0)):
        assert bool((sel == j[None, None, :, None]).any(-1).all())
    assert bool((sel <= (t // 16)[None, None, :, None]).all())
    assert sel[..., 100, :].unique().numel() > 5  # groups and batches choose differently


SETTLED = {"block": 4, "stride": 4, "select_block": 4, "top_n": 4, "window": 2}
PLANT = {"block": 8, "stride": 4, "select_block": 8, "top_n": 4, "window": 6}


def test_exact_ties_go_to_the_later_block():
    """Keys of period 4 make every complete compressed block's key the same: importances
    tie exactly, and the later blocks win."""
    q, k, v, ins = case(90, grad=True, ties=4)
    m = variants.build("nsa", **SETTLED)
    check(m, q, k, v, ins)
    sel = m.select(q, k)
    assert bool((sel[:, :, 89].sort(dim=-1).values == torch.tensor([0, 20, 21, 22])).all())


def _ignores_causal(imp, t, select_block, top_n):
    """Planted: every block a candidate, the future ones among them."""
    j = torch.arange(imp.shape[-1])
    cur = (t // select_block)[:, None]
    forced = (j == 0) | (j == cur) | (j == cur - 1)
    return ix.top_later(imp.masked_fill(forced, float("inf")), top_n)


class _FutureRows(bk.BlockRows):
    """Planted: a chosen block's tokens after the query read too."""

    def __getitem__(self, index):
        b = self.blocks[:, index[1]].long()
        tok = b[..., None] * self.size + torch.arange(self.size)
        return tok.masked_fill_((b[..., None] < 0) | (tok >= self.blocks.shape[1]), -1).flatten(2)


_TOP = ix.top_later
_IMP = bk.importance


@pytest.mark.parametrize("plant", ["future", "wrong_sign", "earlier_ties"])
def test_planted_selection_bugs_fail(plant, monkeypatch):
    ties = 4 if plant == "earlier_ties" else None
    m = variants.build("nsa", **(SETTLED if ties else PLANT))
    q, k, v, ins = case(90, grad=True, ties=ties, gates=(0.2, 0.7, 0.1), m=m)
    check(m, q, k, v, ins)
    if plant == "future":
        monkeypatch.setattr(bk, "choose", _ignores_causal)
        monkeypatch.setattr(bk, "BlockRows", _FutureRows)
    elif plant == "wrong_sign":
        monkeypatch.setattr(bk, "importance", lambda *a: -_IMP(*a))
    else:
        monkeypatch.setattr(ix, "top_later", lambda s, kk: (s.shape[-1] - 1 - _TOP(
            s.flip(-1), kk)).masked_fill(_TOP(s.flip(-1), kk) < 0, -1))
    with pytest.raises(AssertionError, match="forward"):
        check(m, q, k, v, ins)


@pytest.mark.parametrize("P,ties", [(0, None), (21, None), (30, 4)])
def test_decoded_rows_equal_the_causal_forward(P, ties):
    N = 45
    setting = SETTLED if ties else SMALL
    m = variants.build("nsa", **setting)
    q, k, v, ins = case(N, ties=ties, m=m)
    with torch.no_grad():
        full = m(q, k, v, causal=True, **ins)
        state = m.prefill(k[:, :, :P // 2], v[:, :, :P // 2], max_len=N, q_heads=q.shape[1],
                          **{n: x[:, :, :P // 2] for n, x in ins.items()})
        state = m.extend(state, k[:, :, P // 2:P], v[:, :, P // 2:P],
                         **{n: x[:, :, P // 2:P] for n, x in ins.items()})
        rows = [m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                       **{n: x[:, :, t:t + 1] for n, x in ins.items()})[0] for t in range(P, N)]
    assert rel(torch.cat(rows, dim=2), full[:, :, P:]) <= 1e-12


def test_a_step_reads_what_decode_read_size_at_counts():
    """At every context 1..N: the compressed blocks a step attends, the distinct tokens of
    its chosen blocks up to it (gathered) and its window, per key-value head, times
    (D + Dv), are `decode_read_size_at`; where N is a multiple of l' past top_n l' and
    the window that is the paper's (s - l) / d + n l' + w (Sec. 5.2), plus Eq. 7's block
    i = 0."""
    setting = {"block": 8, "stride": 4, "select_block": 8, "top_n": 4, "window": 16}
    m = variants.build("nsa", **setting)
    N, Hk, D, Dv = 60, 2, 8, 12
    s = variants.Shape(2, 4, N, D, kv_heads=Hk, value_dim=Dv)
    q, k, v, ins = case(N, Hk=Hk, D=D, Dv=Dv)
    state = m.prefill(k[:, :, :0], v[:, :, :0], max_len=N, q_heads=4,
                      **{n: x[:, :, :0] for n, x in ins.items()})
    for t in range(N):
        m.decode_extend(state, k[:, :, t:t + 1], v[:, :, t:t + 1])
        nc, tok, (w0, w1), _ = m.read_plan(state, q[:, :, t:t + 1])
        for row in tok.view(-1, tok.shape[-1]):
            got = row[row >= 0]
            assert got.unique().numel() == got.numel() and int(got.max()) == t
            assert Hk * (nc + got.numel() + w1 - w0 + 1) * (D + Dv) == \
                m.decode_read_size_at(t + 1, s)
    assert m.decode_read_size_at(56, s) == Hk * ((56 - 8) // 4 + 1 + 4 * 8 + 16) * (D + Dv)
    paper = variants.build("nsa")  # l 32, d 16, l' 64, n 16, w 512
    one = variants.Shape(1, 1, 65536, 1, kv_heads=1, value_dim=1)
    assert paper.decode_read_size_at(65536, one) == 2 * ((65536 - 32) // 16 + 1 + 1024 + 512)


def test_no_tensor_grows_as_n_squared(monkeypatch):
    """Forward and backward at N = 1024 with small chunk budgets: the largest tensor is a
    chunk's, far below one N x N map."""
    monkeypatch.setattr(bk, "_CHUNK_BYTES", 2**19)
    monkeypatch.setattr(gathered, "_STEP_BYTES", 2**19)
    N = 1024
    m = variants.build("nsa", block=16, stride=8, select_block=16, top_n=4, window=32)
    q, k, v, ins = case(N, B=1, H=2, Hk=1, D=8, Dv=8)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    ins = {n: x.float() for n, x in ins.items()}
    watch = LargestOutput()
    with watch:
        m(q, k, v, causal=True, **ins).sum().backward()
    assert watch.largest <= N * N // 8, watch.largest


@pytest.mark.parametrize("setting,says", [
    ("nsa(top_n=0)", "'top_n' must be >= 1"),
    ("nsa(block=32,stride=12)", "stride 12 must divide block 32"),
    ("nsa(block=32,stride=16,select_block=40)", "stride 16 must divide select_block 40")])
def test_bad_settings_exit_2_with_one_line(setting, says, capsys):
    rc = run_bench.main(["run", "--variants", setting, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1, err


def test_gates_of_the_wrong_shape_or_range_are_one_line():
    m = variants.build("nsa", **SMALL)
    q, k, v, ins = case(20)
    bad = {**ins, "gate_slc": ins["gate_slc"][:, :2]}
    with pytest.raises(ValueError, match=r"input 'gate_slc' must be \(B, H, N\) = "
                                         r"\(2, 4, 20\)") as e:
        m(q, k, v, causal=True, **bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"input 'gate_win' must lie in \[0, 1\]") as e:
        m(q, k, v, causal=True, **{**ins, "gate_win": ins["gate_win"] + 1})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="non-causal"):
        m(q, k, v, causal=False, **ins)
