"""The Sparse Frontier (issue 53, item 4): each selector's selected keys, the mass of exact
attention on them, the budgets a matrix sets, the worker's columns and the report's
section, at tiny shapes.

References are independent of the code under test: the selected keys against the support
of each variant's own float64 `weights` (softmax under its selection's mask, a separate
path), the mass against a dense float64 softmax summed over that support, the budget
against a brute-force search over every value.

Planted bugs these catch (each tried): the mass summed over the unselected keys; the mass
renormalised over the selected keys (always 1); a selection read without the causal mask
(keys after the query); the grouped key head mapped h % Hk instead of h // (Hq / Hk); a
budget bisection off by one (top_k one too large); budgets outside (0, 1] accepted; the
oracle named a winner; a slower-but-better selector counted as beating moba at equal time.
"""

from __future__ import annotations

import json

import pytest
import torch

import report_synth
import variants
from harness.errors import UsageError
from harness.measure import accuracy
from harness.measure import matrix as mx
from harness.report import sparse_frontier as SF
from harness.report import build
from harness.report import run as report_run

SELECTORS = [("moba", {"block_size": 8, "top_k": 3}), ("quest", {"page_size": 8, "top_k": 2}),
             ("topk", {"top_k": 10}), ("dsa", {"top_k": 12}),
             ("block_sparse", {"block_size": 8, "window_blocks": 1, "global_blocks": 1,
                               "random_blocks": 1})]


def _qk(B=1, H=2, N=48, D=8, Hk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g) * 1.5
    k = torch.randn(B, Hk or H, N, D, generator=g) * 1.5
    return q, k


def _support(module, q, k, causal):
    """Keys with weight in the variant's own float64 map (its selection's mask, softmaxed)."""
    w = module.weights(q.double(), k.double(), causal)
    return w > 0


@pytest.mark.parametrize("name,params", SELECTORS)
@pytest.mark.parametrize("causal", [True, False])
def test_selected_keys_and_mass_match_the_variants_own_weights(name, params, causal):
    module = variants.build(name, **params)
    if not causal and module.contract.causal == "causal_only":
        pytest.skip("causal only")
    q, k = _qk()
    N = q.shape[-2]
    sel = module.selection(q, k, causal)
    rows = torch.arange(N)
    got = module.selected_keys(sel, rows, N, causal).expand(1, 2, N, N)
    support = _support(module, q, k, causal)
    assert torch.equal(got, support)
    # mass: a dense float64 softmax summed over the support, all rows and a sample
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(s, -1) * support).sum(-1)  # (B, H, N)
    assert accuracy.mass_captured(module, sel, q, k, causal) == pytest.approx(
        float(ref.mean()), abs=1e-12)
    sample = accuracy.sample_rows(N, 20, seed=3)
    assert accuracy.mass_captured(module, sel, q, k, causal, max_rows=20, seed=3) == \
        pytest.approx(float(ref[:, :, sample].mean()), abs=1e-12)
    assert 0.0 < float(ref.mean()) < 1.0  # a budget that selects: mass strictly inside


def test_grouped_keys_read_their_own_kv_head():
    module = variants.build("moba", block_size=8, top_k=2)
    q, k = _qk(H=4, Hk=2, seed=1)
    N = q.shape[-2]
    sel = module.selection(q, k, True)
    kr = k.repeat_interleave(2, dim=1)  # the same call on the heads repeated
    assert accuracy.mass_captured(module, sel, q, k, True) == pytest.approx(
        accuracy.mass_captured(module, module.selection(q, kr, True), q, kr, True), abs=1e-12)
    assert torch.equal(module.selected_keys(sel, torch.arange(N), N, True),
                       _support(module, q, kr, True))


def test_the_oracle_holds_the_most_mass_at_its_budget():
    q, k = _qk(seed=2)
    topk = variants.build("topk", top_k=10)
    dsa = variants.build("dsa", top_k=10)
    m_top = accuracy.mass_captured(topk, topk.selection(q, k, True), q, k, True)
    m_dsa = accuracy.mass_captured(dsa, dsa.selection(q, k, True), q, k, True)
    assert m_top >= m_dsa  # per head top-k of the exact scores: the most any k keys hold


def test_a_dense_variant_selects_nothing():
    q, k = _qk()
    assert variants.build("sdpa").selection(q, k, True) is None


@pytest.mark.parametrize("name,params", SELECTORS)
def test_the_budget_is_the_closest_value(name, params):
    module = variants.build(name, **params)
    N, causal = 64, True
    field = module.budget_param
    lo = 0 if field == "random_blocks" else 1
    hi = N // 8 + 2 if field == "random_blocks" else N  # more random blocks than blocks: all

    def kpq(x):
        return variants.build(name, **{**params, field: x}).keys_per_query(N, causal)
    for keys in (5.0, 13.0, 30.0):
        got = module.budget_params(keys, N, causal)[field]
        best = min(abs(kpq(x) - keys) for x in range(lo, hi + 1))
        assert abs(kpq(got) - keys) == pytest.approx(best)
    assert variants.build("sdpa").budget_params(8, N, causal) is None


def _matrix(**over):
    raw = {"variants": ["sdpa", "moba", "topk"], "seq_lens": [256], "causal": [True],
           "params": {"moba": [{"block_size": 16}]}, "budgets": [0.05, 0.25],
           "selection": True, **over}
    return mx.expand(mx.normalise(raw))


def test_budgets_set_each_selector_and_leave_sdpa_alone():
    cases = _matrix()
    got = sorted((c.variant, json.loads(c.params).get("top_k")) for c in cases)

    def closest(name, keys, **p):  # brute force over every top_k
        return min(range(1, 257), key=lambda x: abs(variants.build(
            name, **p, top_k=x).keys_per_query(256, True) - keys))
    want = [("moba", closest("moba", b * 256, block_size=16)) for b in (0.05, 0.25)] + \
        [("sdpa", None)] + [("topk", closest("topk", b * 256)) for b in (0.05, 0.25)]
    assert got == sorted(want) and len(set(got)) == 5
    assert all(c.selection for c in cases)
    # a matrix without them reads as before (old folders resume)
    plain = mx.normalise({"variants": ["sdpa"]})
    assert "budgets" not in plain["groups"][0] and "selection" not in plain["groups"][0]


@pytest.mark.parametrize("over,msg", [({"budgets": [0.0]}, "fractions in (0, 1]"),
                                      ({"budgets": [1.5]}, "fractions in (0, 1]"),
                                      ({"budgets": ["x"]}, "fractions in (0, 1]"),
                                      ({"selection": 1}, "must be true or false")])
def test_bad_frontier_settings_are_one_line(over, msg):
    with pytest.raises(UsageError, match=msg.replace("(", r"\(").replace("]", r"\]")) as e:
        _matrix(**over)
    assert "\n" not in str(e.value)


def test_the_worker_records_mass_and_selection_time():
    from harness.measure.worker import run_case

    [case] = [c for c in _matrix(budgets=[0.25]) if c.variant == "moba"]
    case = mx.Case(**{**case.to_json(), "seq_len": 64, "heads": 2, "head_dim": 8,
                      "min_run_time_s": 0.001, "min_repeats": 1, "threads": 1})
    got = run_case(case, "time")
    assert got["status"] == "ok" and 0 < got["mass"] <= 1 and got["select_ms"] > 0
    module = variants.build("moba", **json.loads(case.params))
    assert (got["select_flops"], got["select_bytes"]) == module.selection_cost(
        case.batch, 2, 2, 64, 8, case.causal, 4)
    plain = run_case(mx.Case(**{**case.to_json(), "selection": False}), "time")
    assert "mass" not in plain and "select_ms" not in plain and "select_flops" not in plain


def _row(variant, budget, mass, cos, ms, sel_ms, n=4096, inp="retrieval", **params):
    r = report_synth.row("sdpa", n, causal=True, time_ms=ms, input=inp, family="routed",
                         params=json.dumps(params, sort_keys=True), keys_per_query=budget * n,
                         mass=mass, row_cos=cos, select_ms=sel_ms, err_ref="softmax",
                         exact=False)
    return {**r, "variant": variant}


def _frontier_rows(quest_ms=4.0):
    return [report_synth.row("sdpa", 4096, causal=True, time_ms=10.0, input="retrieval",
                             row_cos=1.0, err_ref="softmax", exact=True),
            _row("moba", 0.05, 0.6, 0.7, 3.0, 0.5, block_size=64, top_k=3),
            _row("moba", 0.25, 0.9, 0.95, 5.0, 0.6, block_size=64, top_k=16),
            _row("quest", 0.05, 0.65, 0.8, quest_ms, 0.9, page_size=64, top_k=3),
            _row("quest", 0.25, 0.85, 0.9, 6.0, 1.0, page_size=64, top_k=16),
            _row("topk", 0.05, 0.99, 0.999, 30.0, 20.0, top_k=205),
            _row("topk", 0.25, 1.0, 1.0, 40.0, 25.0, top_k=1024)]


def test_the_section_names_winners_and_whether_one_beats_moba(tmp_path, monkeypatch):
    meta = {**report_synth.META, "matrix": {"groups": [{"budgets": [0.05, 0.25]}]}}
    sec = _section(report_synth.write_run(tmp_path / "f", _frontier_rows(), meta))
    assert "| topk (oracle)" in sec and "(plots/sparse_frontier.png)" in sec
    # the oracle is best everywhere but never the answer
    assert "at 0.05 N quest (row_cos 0.8000" in sec and "at 0.25 N moba (row_cos 0.9500" in sec
    assert "beats moba at equal time: quest at 0.05 N (4 ms, row_cos 0.8000) against moba " \
           "at 0.25 N (5 ms, 0.9500)" not in sec  # 0.8 < 0.95: not better than that moba
    assert "quest at 0.05 N (4 ms, row_cos 0.8000) against moba at 0.05 N" not in sec  # slower
    assert "no selector beats moba at equal time" in sec
    assert (tmp_path / "f" / "plots" / "sparse_frontier.png").stat().st_size > 10_000
    # quest as fast as moba's small budget and more accurate: it beats moba there (the
    # figure drawn once is enough)
    monkeypatch.setattr(SF, "_plot", lambda tables, path: path)
    sec = _section(report_synth.write_run(tmp_path / "g", _frontier_rows(quest_ms=3.0), meta))
    assert "beats moba at equal time: quest at 0.05 N (3 ms, row_cos 0.8000) against moba " \
           "at 0.05 N (3 ms, 0.7000)" in sec


def test_leads_inside_the_tie_margin_name_a_tie_and_beat_nothing():
    """local inputs give every selector row_cos 1.0000: the answer is a tie, not whichever
    is first by the sixth digit, and a lead that small does not beat moba. Planted: the
    margin dropped (idxmax alone; a strict > against moba) fails both checks."""
    import pandas as pd

    def row(sel, b, cos, ms):
        return {"selector": sel, "budget": b, "row_cos": cos, "mass": 1.0, "time_ms": ms,
                "ceiling": False}
    t = pd.DataFrame([row("dsa", 0.05, 1.0, 500.0), row("moba", 0.05, 0.99999, 27.0),
                      row("quest", 0.05, 0.9996, 30.0), row("block_sparse", 0.05, 0.95, 8.0),
                      row("block_sparse", 0.25, 1.0, 35.0), row("moba", 0.1, 0.99998, 40.0),
                      row("dsa", 0.25, 0.99, 900.0), row("moba", 0.25, 0.95, 80.0)])
    w = SF.winners(t).set_index("budget")["best row_cos"]
    assert w[0.05] == "tie: dsa, moba, quest"
    assert w[0.25] == "block_sparse"  # a lead of 0.01 over dsa is a win
    beats = [(r["selector"], r["budget"], m["budget"]) for r, m in SF.beats_baseline(t)]
    # block_sparse at 0.25 N is as fast as moba at 0.1 N but only 2e-5 better: no beat;
    # against moba at 0.25 N (80 ms, 0.95) its 1.0 is a beat, as is quest's 0.9996
    assert sorted(beats) == [("block_sparse", 0.25, 0.25), ("quest", 0.05, 0.25)]


def _section(folder) -> str:
    """The section's Markdown (the section alone: the whole report takes seconds)."""
    blocks = SF.blocks(report_run.read(folder))
    assert blocks[0] == ("h", 2, SF.TITLE)
    return build.to_markdown(blocks, folder)


def test_a_run_without_selection_has_no_section(tmp_path):
    folder = report_synth.write_run(tmp_path / "f", report_synth.synthetic_rows([256]))
    assert SF.blocks(report_run.read(folder)) == []
    # and the report's order holds the section (behind its guard for benchmark rows)
    inner = [c.cell_contents for f in build.ORDER for c in (f.__closure__ or ())]
    assert SF.blocks in inner


# -- nsa on the frontier, and the selection's FLOPs and bytes ------------------------------
NSA = {"block": 8, "stride": 4, "select_block": 8, "top_n": 2, "window": 5}


def test_nsa_selects_its_chosen_blocks_and_window_up_to_the_query():
    """Against the float64 reference's own branch masks (a separate selection, made from
    the float64 compressed probabilities by a loop): chosen-block tokens up to the query,
    or the window's. Planted: the window one token wider; blocks after the query kept."""
    from variants.learned_sparse import reference

    module = variants.build("nsa", **NSA)
    q, k = _qk(B=2, H=4, Hk=2, N=40, D=8, seed=4)
    N = q.shape[-2]
    sel = module.selection(q, k, True)
    got = module.selected_keys(sel, torch.arange(N), N, True)  # (B, Hk, N, N)
    blocks, win = reference._branch_masks(q, k, *(NSA[x] for x in (
        "block", "stride", "select_block", "top_n", "window")))
    want = (blocks | win)[:, ::2]  # a group's query heads share its selection
    assert torch.equal(got, want)
    assert not want.all(dim=-1).all()  # some key is left out: the test can fail
    # the mass of a sample of rows sums exact attention over exactly those keys
    kr = k.repeat_interleave(2, dim=1)
    s = (q.double() @ kr.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(s, -1) * want.repeat_interleave(2, dim=1)).sum(-1)
    assert accuracy.mass_captured(module, sel, q, k, True) == pytest.approx(
        float(ref.mean()), abs=1e-12)


def test_nsa_budget_sets_top_n():
    module = variants.build("nsa", **NSA)
    got = module.budget_params(20.0, 64, True)["top_n"]
    kpq = [variants.build("nsa", **{**NSA, "top_n": t}).keys_per_query(64, True)
           for t in range(1, 9)]
    assert abs(kpq[got - 1] - 20.0) == pytest.approx(min(abs(x - 20.0) for x in kpq))


@pytest.mark.parametrize("name,params", [*SELECTORS[:4], ("nsa", NSA),
                                         ("dsa", {"top_k": 12, "indexer": "lightning"})])
@pytest.mark.parametrize("causal", [True, False])
def test_selection_flops_are_the_matmuls_the_selection_runs(name, params, causal):
    """select_flops x B x N against torch's own count of the matmuls `selection` runs
    (torch.utils.flop_counter: mm and bmm, 2 a multiply-add; the top-k, masks and sums
    are not matmuls). Planted: a causal chunk counted against all N keys; Quest's bound
    counted as one product."""
    from torch.utils.flop_counter import FlopCounterMode

    module = variants.build(name, **params)
    if not causal and module.contract.causal == "causal_only":
        pytest.skip("causal only")
    B, H, N, D = 2, 4, 48, 8
    g = module.contract.grouping  # grouped keys where it takes them natively
    Hk = 2 if g.heads == "kv" and g.how == "native" else H
    q, k = _qk(B=B, H=H, Hk=Hk, N=N, D=D, seed=5)
    inputs = module.draw_inputs(B, H, N, D, seed=0) if module.contract.inputs else {}
    with FlopCounterMode(display=False) as fc:
        module.selection(q, k, causal, **inputs)
    flops, nbytes = module.selection_cost(B, H, Hk, N, D, causal, 4)
    assert flops * B * N == pytest.approx(fc.get_total_flops(), rel=1e-9)
    assert nbytes > 0


def test_selection_bytes_count_what_each_selector_reads():
    N, D = 64, 8
    moba = variants.build("moba", block_size=8, top_k=2).selection_cost(1, 4, 4, N, D)
    quest = variants.build("quest", page_size=8, top_k=2).selection_cost(1, 4, 4, N, D)
    assert quest[1] == 2 * moba[1] == 2 * 8 * 4 * D * 4  # min and max against a mean
    topk = variants.build("topk", top_k=8)
    assert topk.selection_cost(1, 4, 2, N, D)[1] * 2 == topk.selection_cost(1, 4, 4, N, D)[1]
    light = variants.build("dsa", top_k=8, indexer="lightning")
    # one indexer key a token, shared by every head: the heads do not change the bytes
    assert light.selection_cost(1, 4, 4, N, D)[1] == light.selection_cost(1, 8, 8, N, D)[1]
    assert variants.build("block_sparse", block_size=8).selection_cost(1, 4, 4, N, D) is None
    assert variants.build("sdpa").selection_cost(1, 4, 4, N, D) is None
