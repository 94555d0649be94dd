"""Content-routed sparse attention (variants/routed/): moba, quest, topk.

Each is checked against a dense float64 masked softmax whose mask is built here, from the
selection rule as the papers state it (block means, page min/max, the top scores), not
from the variant's own `select`: forward and gradients, causal and not, at odd lengths
whose last block is partial. Where the budget covers every key each is exact attention.
"""

import math

import pytest
import torch

import variants
from variants import exact_reference, naive_attention
from variants.routed import routed_rows

LENGTHS = (63, 100, 257)  # 257 = 16 blocks of 16 and a last block of one key


def qkv(N, B=1, H=2, D=8, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g).to(dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def _blocks(N, b):
    return [(s, min(N, s + b)) for s in range(0, N, b)]


def moba_gate(q, k, b):
    """q . mean of each block's actual keys, (B, H, N, nb)."""
    means = torch.stack([k[:, :, s:e].mean(dim=2) for s, e in _blocks(k.shape[2], b)], 2)
    return q @ means.transpose(-1, -2)


def quest_gate(q, k, b):
    """sum_d max(q_d min_d, q_d max_d) over each page's actual keys, (B, H, N, np)."""
    out = []
    for s, e in _blocks(k.shape[2], b):
        lo = k[:, :, s:e].amin(dim=2)[:, :, None]  # (B, H, 1, D)
        hi = k[:, :, s:e].amax(dim=2)[:, :, None]
        out.append(torch.maximum(q * lo, q * hi).sum(-1))
    return torch.stack(out, -1)


def block_rule_mask(gate, N, b, top_k, causal):
    """(B, H, N, N) bool: keys of each query's top_k blocks by gate; causal: its own block
    and the best top_k - 1 of the blocks before it, then j <= i."""
    B, H, _, nb = gate.shape
    mask = torch.zeros(B, H, N, N, dtype=torch.bool)
    for i in range(N):
        own = i // b
        g = gate[:, :, i]  # (B, H, nb)
        if causal:
            cand = list(range(own))
            chosen = [[[own] + [cand[j] for j in g[x, y, :own].argsort(descending=True)
                                [:top_k - 1].tolist()] if own else [own]
                       for y in range(H)] for x in range(B)]
        else:
            chosen = g.argsort(dim=-1, descending=True)[..., :top_k].tolist()
        for x in range(B):
            for y in range(H):
                for j in chosen[x][y]:
                    mask[x, y, i, j * b:(j + 1) * b] = True
    if causal:
        mask &= torch.ones(N, N, dtype=torch.bool).tril()
    return mask


def topk_rule_mask(q, k, top_k, causal):
    N = q.shape[2]
    s = q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    order = s.argsort(dim=-1, descending=True)[..., :top_k]
    mask = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order, True)
    return mask & s.isfinite()


def rule_mask(name, params, q, k, causal):
    with torch.no_grad():
        N = q.shape[2]
        if name == "topk":
            return topk_rule_mask(q, k, params["top_k"], causal)
        b = params.get("block_size", params.get("page_size"))
        gate = (moba_gate if name == "moba" else quest_gate)(q, k, b)
        return block_rule_mask(gate, N, b, params["top_k"], causal)


def masked_softmax(q, k, v, mask):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


SETTINGS = [("moba", {"block_size": 16, "top_k": 3}), ("moba", {"block_size": 7, "top_k": 5}),
            ("quest", {"page_size": 16, "top_k": 3}), ("quest", {"page_size": 5, "top_k": 8}),
            ("topk", {"top_k": 24})]


@pytest.fixture(params=["routed", "dense"])
def path(request, monkeypatch):
    """Both forms of moba and quest at every length: the routed kernel (the dense form's
    threshold at 0) and the dense masked form (the threshold above every length here)."""
    from variants.routed import blocks
    monkeypatch.setattr(blocks, "DENSE_MAX", 0 if request.param == "routed" else 10**6)
    return request.param


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params", SETTINGS)
def test_matches_the_dense_reference_of_its_rule(name, params, causal, path):
    """Forward and gradients against softmax under the mask the rule gives, float64."""
    m = variants.build(name, **params)
    for N in LENGTHS:
        q, k, v = qkv(N, seed=N, requires_grad=True)
        mask = rule_mask(name, params, q, k, causal)
        assert not m.exact_at(N, causal) and not bool(mask.all())
        o, ref = m(q, k, v, causal=causal), masked_softmax(q, k, v, mask)
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
        g = torch.randn_like(o)
        got = torch.autograd.grad(o, (q, k, v), g)
        want = torch.autograd.grad(ref, (q, k, v), g)
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, rtol=1e-9, atol=1e-9)


COVER = [("moba", {"block_size": 16, "top_k": 17}), ("moba", {"block_size": 300, "top_k": 1}),
         ("quest", {"page_size": 8, "top_k": 33}), ("topk", {"top_k": 257})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params", COVER)
def test_exact_where_the_budget_covers_every_key(name, params, causal, path):
    m = variants.build(name, **params)
    for N in LENGTHS:
        assert m.exact_at(N, causal)
        q, k, v = qkv(N, seed=N)
        with torch.no_grad():
            o = m(q, k, v, causal=causal)
        ref = exact_reference(q, k, v, causal)
        assert float((o - ref).norm() / ref.norm()) < 1e-10


@pytest.mark.parametrize("name,params", SETTINGS)
def test_select_names_the_chosen_blocks(name, params):
    """Non-causal: top_k distinct blocks; causal: the own block first, then earlier ones
    only, -1 where fewer exist; the rows of `weights` are nonzero exactly there."""
    N = 100
    m = variants.build(name, **params)
    q, k, v = qkv(N)
    b = params.get("block_size", params.get("page_size", 1))
    nb = math.ceil(N / b)
    kk = min(params["top_k"], nb)
    sel = m.select(q, k, False)
    assert sel.shape == (1, 2, N, kk) and bool((sel >= 0).all())
    assert bool((sel.sort(-1).values.diff(dim=-1) > 0).all())  # distinct
    sel = m.select(q, k, True)
    i = torch.arange(N)[:, None]
    if name != "topk":
        assert bool((sel[..., 0] == torch.arange(N) // b).all())  # own block first
        rest = sel[..., 1:]
        assert bool(((rest < i // b) | (rest == -1)).all())  # wholly before the query
        avail = (i // b).clamp(max=kk - 1)  # earlier blocks it can take
        assert bool(((rest >= 0).sum(-1) == avail.squeeze(1)).all())
    else:
        assert bool(((sel <= i) & (sel >= -1)).all())
        assert bool(((sel >= 0).sum(-1) == (i.squeeze(1) + 1).clamp(max=kk)).all())
    w = m.weights(q, k, True)
    assert bool((w.triu(1) == 0).all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params", [SETTINGS[0], SETTINGS[2]])
def test_tiles_and_steps_cut_anywhere(name, params, causal, monkeypatch):
    """Small chunks, tiles and steps: many tiles a slice, a step per chunk, causal tiles
    whose own blocks straddle their edges; the same output and gradients."""
    N = 257
    q, k, v = qkv(N, B=2, H=2, seed=3, requires_grad=True)
    m = variants.build(name, **params)
    o = m(q, k, v, causal=causal)
    g = torch.randn_like(o)
    want = torch.autograd.grad(o, (q, k, v), g)
    monkeypatch.setattr(routed_rows, "_CHUNK", 5)
    monkeypatch.setattr(routed_rows, "_TILE_PAIRS", 40)
    monkeypatch.setattr(routed_rows, "_STEP_BYTES", 1)
    assert routed_rows._tile_rows(N, 3, 17) < N
    o2 = m(q, k, v, causal=causal)
    torch.testing.assert_close(o2, o, rtol=1e-12, atol=1e-12)
    for a, w in zip(torch.autograd.grad(o2, (q, k, v), g), want):
        torch.testing.assert_close(a, w, rtol=1e-11, atol=1e-11)


def mask_of(sel, N, b, causal):
    """The key mask (B, H, N, N) of a selection of blocks of b keys (b = 1: keys)."""
    B, H, _, kk = sel.shape
    nb = math.ceil(N / b)
    blocks = torch.zeros(B, H, N, nb + 1, dtype=torch.bool)
    blocks.scatter_(-1, sel.masked_fill(sel < 0, nb), True)
    mask = blocks[..., :nb].repeat_interleave(b, dim=-1)[..., :N]
    return mask & torch.ones(N, N, dtype=torch.bool).tril() if causal else mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,params", [SETTINGS[0], SETTINGS[2], SETTINGS[4]])
def test_rounding_at_most_twice_the_plain_path(name, params, causal, dtype):
    """Flash-attention's rule, on the selection the variant made from these inputs."""
    N = 257
    m = variants.build(name, **params)
    q, k, v = qkv(N, B=2, H=3, D=32, dtype=dtype, seed=1)
    b = params.get("block_size", params.get("page_size", 1))
    with torch.no_grad():
        mask = mask_of(m.select(q, k, causal), N, b, causal)
        got = m(q, k, v, causal=causal)
    for x in range(2):  # the mask differs per (batch, head)
        for y in range(3):
            sl = [t[x:x + 1, y:y + 1] for t in (q, k, v)]

            def allowed(i, j, mxy=mask[x, y]):
                return mxy[i[:, None], j[None, :]]
            ref = exact_reference(*sl, False, key_mask=allowed)
            base = float((naive_attention(*sl, False, key_mask=allowed).double() - ref)
                         .norm() / ref.norm())
            err = float((got[x:x + 1, y:y + 1].double() - ref).norm() / ref.norm())
            assert err <= 2 * base + torch.finfo(dtype).eps, (name, x, y, err, base)


def test_budget_and_flops_read_the_parameters():
    m = variants.build("moba", block_size=64, top_k=4)
    assert m.keys_per_query(4096) == 256
    # causal: query i reads min(3, i // 64) earlier blocks and its own up to i
    i = torch.arange(4096)
    want = ((i // 64).clamp(max=3) * 64 + i % 64 + 1).double().mean()
    assert m.keys_per_query(4096, True) == pytest.approx(float(want))
    assert variants.build("topk", top_k=100).keys_per_query(50) == 50
    assert variants.build("quest", page_size=16, top_k=8).keys_per_query(1000) == 128
    f = m.flops(1, 1, 4096, 64)
    assert f == 4 * 4096 * 4 * 64 * 64 + 2 * 4096 * 64 * 64
    assert m.flops(1, 1, 4096, 64, True) < f


@pytest.mark.parametrize("name,params", [("sliding_window", {"window": 5}),
                                         ("block_sparse", {"block_size": 8, "random_blocks": 1}),
                                         ("sliding_window_sdpa_mask", {"window": 7}),
                                         ("block_sparse_flex", {"block_size": 4})])
def test_fixed_patterns_count_the_keys_of_their_mask(name, params):
    """keys_per_query of a fixed pattern: the mean row count of its dense mask."""
    m = variants.build(name, **params)
    for N in (37, 64, 100):
        for causal in (False, True):
            want = variants.dense_mask(N, causal, m.key_mask(N)).double().sum(1).mean()
            assert m.keys_per_query(N, causal) == pytest.approx(float(want), abs=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_routed_budgets_count_the_keys_their_weights_use(causal):
    """keys_per_query of the routed variants: the mean nonzero count of their weights' rows
    (N = 256, where the block sizes divide N)."""
    for name, params in SETTINGS[:1] + SETTINGS[2:3] + SETTINGS[4:]:
        m = variants.build(name, **params)
        q, k, _ = qkv(256)
        nz = (m.weights(q, k, causal) > 0).double().sum(-1).mean()
        assert m.keys_per_query(256, causal) == pytest.approx(float(nz), abs=1e-9)


def test_the_retrieval_input_plants_matches_a_block_mean_shows():
    """`retrieval`: each query's few planted keys lie anywhere, hold most of its weight,
    and the blocks holding them are the ones MoBA's gate and Quest's bound rank first."""
    from harness.measure.inputs import make_inputs

    N, b = 2048, 64
    q, k, v = make_inputs("retrieval", 1, 2, N, 64, seed=0)
    ref = exact_reference(q, k, v)
    for name, params in (("moba", {"block_size": b, "top_k": 4}),
                         ("quest", {"page_size": b, "top_k": 4})):
        m = variants.build(name, **params)
        with torch.no_grad():
            o = m(q, k, v)
        cos = torch.nn.functional.cosine_similarity(o.double(), ref, dim=-1).mean()
        assert cos > 0.99, (name, float(cos))  # 4 of 32 blocks: the planted ones
    window = variants.build("sliding_window", window=b * 2)  # 8 blocks' worth of keys
    with torch.no_grad():
        o = window(q, k, v)
    assert torch.nn.functional.cosine_similarity(o.double(), ref, dim=-1).mean() < 0.7


def test_the_budget_plot_draws_fixed_and_routed_rows(tmp_path):
    import pandas as pd

    from harness.report import plots

    rows = [{"variant": v, "input": inp, "seq_len": 512, "causal": c, "row_cos": cos,
             "keys_per_query": kq}
            for inp in ("minilm", "retrieval") for c in (False, True)
            for v, kq, cos in (("sliding_window", 129.0, 0.9), ("sliding_window", 257.0, 0.95),
                               ("moba", 128.0, 0.97), ("moba", 256.0, 0.99),
                               ("topk", 64.0, 0.999))]
    path = plots.budget_plot(pd.DataFrame(rows), tmp_path / "b.png")
    assert path.stat().st_size > 1000


def test_reference_ceilings_are_the_registry_s_and_never_an_answer():
    import pandas as pd

    from harness.files.columns import REFERENCE_CEILINGS
    from harness.report import tables

    assert set(REFERENCE_CEILINGS) == {n for n in variants.names()
                                       if variants.spec(n).reference_ceiling}
    base = {"setting": "s", "status": "ok", "seq_len": 512, "exact": False, "rel_err": 0.1,
            "time_ms_iqr": 0.0, "params": "{}", "causal": False, "pass": "forward",
            "err_ref": "softmax", "family": "x", "device": "cpu", "dtype": "float32",
            "batch": 1, "heads": 1, "head_dim": 64, "input": "gaussian", "max_abs_err": 0.1}
    df = pd.DataFrame([base | {"variant": "sdpa", "label": "sdpa", "exact": True,
                               "time_ms": 10.0, "row_cos": 1.0, "rel_err": 0.0},
                       base | {"variant": "moba", "label": "moba", "time_ms": 2.0,
                               "row_cos": 0.995},
                       base | {"variant": "topk", "label": "topk", "time_ms": 1.0,
                               "row_cos": 0.9999}])
    answers = tables.fastest_accurate(df, ["setting"])
    assert "topk" not in answers.to_string()
    assert (answers["most accurate approximate"] == "moba").all()


@pytest.mark.parametrize("name", ["moba", "quest"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_models_strided_q_k_v_give_the_contiguous_answer(name, causal, path):
    """Inside a model q, k, v are (B, N, H, D) transposed: strided. The default job's drift
    through MiniLM (one window: B = 1) failed on them ("view size is not compatible")."""
    m = variants.build(name)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(1, 100, 3, 16, generator=g, dtype=torch.float64).transpose(1, 2)
         .requires_grad_(True) for _ in range(3)]
    y = [t.detach().contiguous().requires_grad_(True) for t in x]
    o, r = m(*x, causal=causal), m(*y, causal=causal)
    torch.testing.assert_close(o, r, rtol=0, atol=0)
    o.square().sum().backward()
    r.square().sum().backward()
    for a, b in zip(x, y):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
