"""The variant contract (issue 51): one declared record per variant, checked against the
class at registration and read by everything else; queries, keys and values with heads
and widths of their own, against independent references (torch SDPA on explicitly
repeated heads, a per-head loop); the kit catches a native grouping that is not.
"""

import ast
import re
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import variants
from harness.check import groupings, kit
from variants import Contract, ContractError, Grouping, Variant, register
from variants.core import registry
from variants.core.contract import Shape

ROOT = Path(__file__).resolve().parent.parent


# -- the declared record ----------------------------------------------------------------

def test_every_variant_declares_a_frozen_contract_and_spec_reads_it():
    for name in variants.names():
        cls = registry._cls(name)
        s = variants.spec(name)
        assert isinstance(cls.contract, Contract) and s.contract is cls.contract
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls.contract.exactness = "exact"
        assert s.exact == (s.contract.exactness == "exact")
        assert s.pattern_exact == (s.contract.exactness == "pattern")
        assert s.err_ref == (s.contract.own_reference if s.contract.exactness == "own"
                             else "softmax")
        assert s.err_ref in ("softmax", "recurrence", "own_softmax")
        # every own form but mla's latent softmax is a recurrence's
        assert (s.err_ref == "own_softmax") == (name == "mla"), name
    assert not hasattr(Variant, "exact") and not hasattr(Variant, "inputs")


def test_the_natively_grouped_variants_declare_it():
    for name in ("standard", "sdpa", "sliding_window", "block_sparse", "moba", "quest"):
        assert variants.spec(name).grouping == Grouping("kv", "native",
                                                         value_dim=name != "sdpa")
    for name in ("gated_deltanet", "kda", "mamba2"):
        assert variants.spec(name).grouping.heads == "value"
    assert not [n for n in variants.names() if variants.spec(n).grouping.how == "refuse"
                and n in ("standard", "sdpa", "sliding_window", "block_sparse", "moba", "quest")]


def _fresh(body: dict, name: str, base=Variant):
    ns = {"name": name, "family": "test", "__doc__": "A test.", **body}
    return type(name.strip("_").title(), (base,), ns)


@pytest.mark.parametrize("body,words", [
    ({"contract": Contract(exactness="pattern")}, "no key_mask"),
    ({"contract": Contract(decoding=True)}, "no decode_prefill"),
    ({"contract": Contract(decoding=True, extend=True),
      "decode_prefill": lambda self, k, v, m: None,
      "decode_step": lambda self, s, q, k, v: None}, "no decode_extend"),
    ({"contract": Contract(exactness="own")}, "no float64 reference"),
    ({"contract": Contract(weights=True)}, "no attention_weights"),
    ({"exact": True}, "sets 'exact'"),
    ({"per_head_schedule": True}, "sets 'per_head_schedule'"),
    ({"contract": "exact"}, "must be a Contract"),
])
def test_a_declaration_the_class_cannot_honour_is_refused_with_one_line(body, words):
    cls = _fresh(body, "_refused")
    with pytest.raises(ContractError) as e:
        register(cls)
    assert words in str(e.value) and "\n" not in str(e.value) and "_refused" in str(e.value)
    assert "_refused" not in variants.names(private=True)


def test_a_helper_named_key_mask_claims_nothing():
    """Capabilities are declared, never inferred from a method's name."""
    cls = _fresh({"key_mask": lambda self, n: None, "attend": lambda self, q, k, v, c: v},
                 "_helper_mask")
    try:
        register(cls)
        assert not variants.spec("_helper_mask").pattern_exact
        assert variants.build("_helper_mask").decode_reasons()  # no decoding declared
    finally:
        registry._REGISTRY.pop("_helper_mask", None)
        registry._ORIGIN.pop("_helper_mask", None)


@pytest.mark.parametrize("kwargs,words", [
    ({"causal": "causal_only"}, "refused_why"),
    ({"exactness": "roughly"}, "exactness must be one of"),
    ({"grouping": Grouping("kv", "native"), "extend": True}, "extend = True needs decoding"),
])
def test_a_malformed_contract_is_refused(kwargs, words):
    with pytest.raises(ContractError, match=words):
        Contract(**kwargs)
    with pytest.raises(ContractError, match="grouping.why"):
        Grouping("kv", "refuse")


# -- the AST scan -----------------------------------------------------------------------

# Attributes a variant offers (its interface and its contract's fields): a literal-name
# getattr/hasattr of one of these in harness/ reads a variant by name, not by its record.
VARIANT_ATTRS = ({a for a in dir(Variant) if not a.startswith("__")}
                 | {f.name for f in dataclasses.fields(Contract)} | set(registry.LEGACY_FLAGS))
NON_VARIANT = {"name", "to", "forward", "params", "training", "eval", "train", "cuda",
               "cpu", "type", "float", "double", "half", "apply", "state_dict"}


def scan(path: Path, text: str | None = None) -> list[str]:
    """What a module does that the contract rules out: comparing a class's method with
    Variant's or Decoder's (anywhere outside variants/core), and in harness/ a
    literal-name getattr/hasattr of a variant attribute or a read of a class-level flag
    (`type(m).X`, `m.__class__.X`, `Variant.X`)."""
    tree = ast.parse(text if text is not None else path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot, ast.Eq,
                                                                ast.NotEq)) for o in node.ops):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name) and \
                        side.value.id in ("Variant", "Decoder"):
                    found.append(f"{path}:{node.lineno} compares with {side.value.id}.{side.attr}")
        if "harness" not in path.parts:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and \
                node.args[1].value in VARIANT_ATTRS - NON_VARIANT:
            found.append(f"{path}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
        if isinstance(node, ast.Attribute) and node.attr in registry.LEGACY_FLAGS + ("contract",):
            v = node.value
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "type") \
                    or (isinstance(v, ast.Attribute) and v.attr == "__class__") \
                    or (isinstance(v, ast.Name) and v.id in ("Variant", "Decoder", "cls")):
                found.append(f"{path}:{node.lineno} reads the class-level {node.attr}")
    return found


def modules_scanned() -> list[Path]:
    out = sorted((ROOT / "harness").rglob("*.py")) + sorted((ROOT / "variants").rglob("*.py"))
    return [p for p in out if not p.is_relative_to(ROOT / "variants" / "core")]


def test_nothing_outside_core_infers_a_capability_or_reads_a_flag():
    scanned = modules_scanned()
    assert len(scanned) > 100 and not any(p.is_relative_to(ROOT / "variants" / "core")
                                          for p in scanned)
    found = [f for p in scanned for f in scan(p.relative_to(ROOT))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("planted", [
    'def f(variant):\n    return getattr(variant, "per_head_schedule", False)\n',
    'def f(m):\n    return hasattr(m, "decode_prefill")\n',
    'def f(m):\n    return type(m).decode_prefill is Decoder.decode_prefill\n',
    'def f(m):\n    return type(m).exact\n',
    'def f(cls):\n    return cls.key_mask is not Variant.key_mask\n',
])
def test_the_scan_fails_a_planted_read(planted):
    path = ROOT / "harness" / "check" / "properties.py"
    text = path.read_text() + "\n\n" + planted
    assert scan(path.relative_to(ROOT), text), planted
    assert not scan(path.relative_to(ROOT))


# -- heads and widths, against independent references ---------------------------------

def _qkv(Hq, Hk, Hv, N=24, D=8, Dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, Hq, N, D, generator=g, dtype=dtype),
            torch.randn(2, Hk, N, D, generator=g, dtype=dtype),
            torch.randn(2, Hv, N, Dv or D, generator=g, dtype=dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hk,Dv", [(4, None), (2, None), (1, None), (2, 12), (1, 5)])
def test_the_reference_and_the_native_variants_match_sdpa_on_repeated_heads(Hk, Dv, causal):
    q, k, v = _qkv(4, Hk, Hk, Dv=Dv)
    N = q.shape[-2]
    mask = torch.ones(N, N, dtype=torch.bool).tril() if causal else None
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // Hk, 1),
                                          v.repeat_interleave(4 // Hk, 1), attn_mask=mask)
    torch.testing.assert_close(variants.exact_reference(q, k, v, causal), want)
    for name in ("standard", "sdpa"):
        if Dv and not variants.spec(name).grouping.value_dim:
            with pytest.raises(ValueError, match="value_dim"):
                variants.build(name)(q, k, v, causal=causal)
            continue
        torch.testing.assert_close(variants.build(name)(q, k, v, causal=causal), want)


def test_grouped_values_read_query_key_head_j_over_the_group():
    """Hq = Hk = 2, Hv = 4: value head j reads q, k head j // 2 (a per-head loop)."""
    q, k, v = _qkv(2, 2, 4)
    m = variants.build("gated_deltanet")
    ins = m.draw_inputs(2, 4, 24, 8, dtype=torch.float64)
    o = m(q, k, v, causal=True, **ins)
    assert o.shape == (2, 4, 24, 8)
    for j in range(4):
        one = m(q[:, j // 2:j // 2 + 1], k[:, j // 2:j // 2 + 1], v[:, j:j + 1], causal=True,
                **{n: t[:, j:j + 1] for n, t in ins.items()})
        torch.testing.assert_close(o[:, j:j + 1], one)
    ref = m.reference(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v, True, **ins)
    torch.testing.assert_close(o, ref)


@pytest.mark.parametrize("shape,words", [
    ((4, 3, 3), "Hk = Hv dividing Hq"),
    ((4, 2, 1), "Hk = Hv dividing Hq"),
    ((4, 2, 2, 12), "value_dim"),
])
def test_a_shape_the_grouping_does_not_take_is_refused(shape, words):
    q, k, v = _qkv(*shape[:3], Dv=shape[3] if len(shape) > 3 else None)
    with pytest.raises(ValueError, match=words):
        variants.build("sdpa")(q, k, v)


def test_the_exact_decoder_keeps_one_cache_per_kv_head():
    """Decoding at kv_heads 1 of 4: the rows of the causal forward, from a cache of one
    head (a quarter of kv_heads 4's bytes)."""
    m = variants.build("sdpa")
    nbytes = {}
    for Hk in (4, 1):
        q, k, v = _qkv(4, Hk, Hk, N=20, dtype=torch.float32)
        o = m(q, k, v, causal=True)
        state = m.prefill(k[:, :, :12], v[:, :, :12], max_len=20, q_heads=4)
        rows = [m.step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])[0]
                for t in range(12, 20)]
        torch.testing.assert_close(torch.cat(rows, 2), o[:, :, 12:])
        nbytes[Hk] = m.state_nbytes(state)
        assert m.state_size_at(20, Shape(2, 4, 20, 8, kv_heads=Hk)) * 2 * 4 == nbytes[Hk]
    assert nbytes[1] * 4 == nbytes[4]


# -- the kit catches a native grouping that is not -------------------------------------

class _TiledKeys(Variant):
    """Declares native grouped keys; query head h reads key head h % Hk (a tile, not the
    grouping's h // (Hq / Hk))."""
    name, family, paper = "_tiled_keys", "test", "https://arxiv.org/abs/1706.03762"
    contract = Contract(exactness="exact", grouping=Grouping("kv", "native"))

    def attend(self, q, k, v, causal):
        g = q.shape[1] // k.shape[1]
        return variants.naive_attention(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), causal)

    def flops(self, B, H, N, D, causal=False):
        return 4 * B * H * N * N * D


class _RepeatedCache(type(variants.build("sdpa"))):
    """sdpa's forward, and a decoder that repeats the keys and values into a cache of one
    head per query head (the kit's H = 4) while declaring native grouping."""
    name = "_repeated_cache"

    def decode_prefill(self, k, v, max_len):
        g = 4 // k.shape[1]
        return super().decode_prefill(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                      max_len)

    def decode_step(self, state, q, k, v):
        g = q.shape[1] // k.shape[1]
        return super().decode_step(state, q, k.repeat_interleave(g, 1),
                                   v.repeat_interleave(g, 1))


class _RepeatedKeys(Variant):
    """Right answers, but the keys and values repeated to one head per query head while
    declaring native grouping: the repeat watch's planted bug."""
    name, family, paper = "_repeated_keys", "test", "https://arxiv.org/abs/1706.03762"
    contract = Contract(exactness="exact", grouping=Grouping("kv", "native"))

    def attend(self, q, k, v, causal):
        g = q.shape[1] // k.shape[1]
        return variants.naive_attention(q, k.repeat_interleave(g, 1),
                                        v.repeat_interleave(g, 1), causal)

    def flops(self, B, H, N, D, causal=False):
        return 4 * B * H * N * N * D


@pytest.mark.parametrize("cls,words", [(_TiledKeys, "differs from its own call"),
                                       (_RepeatedCache, "it repeats the shared heads"),
                                       (_RepeatedKeys, "it repeats them")])
def test_the_kit_fails_a_planted_grouping_bug(cls, words):
    register(cls)
    try:
        r = kit.run_property(groupings.groupings, cls.name)
    finally:
        registry._REGISTRY.pop(cls.name, None)
        registry._ORIGIN.pop(cls.name, None)
    assert r.status == "fail" and words in r.detail, r.line()


def test_the_floor_passes_the_kit_and_a_zero_output_is_no_nan():
    """`none` (the trained floor, left out of "all") outputs zeros: its grouping check
    compares zero with zero (0, not 0 / 0 = nan, which no tolerance passes), and as a
    floor it needs no paper. Planted: rel_err dividing by a zero norm fails here; a wrong
    answer against a zero reference still measures as its absolute size."""
    from harness.check import properties
    for fn in (properties.spec, groupings.groupings):
        r = kit.run_property(fn, "none")
        assert r.status == "pass", r.line()
    z = torch.zeros(2, 3)
    assert kit.rel_err(z, z) == 0.0 and kit.rel_err(z + 0.5, z) == pytest.approx(1.5 ** 0.5)


def test_a_band_wider_than_the_sequence_is_native_not_a_repeat():
    """sliding_window's default window (256) at the kit's N = 40: its padded spans are
    larger than one key head per query head, yet grow with the key-value heads only."""
    r = kit.run_property(groupings.groupings, "sliding_window")
    assert r.status == "pass" and "kv native" in r.detail and "kv_heads 1" in r.detail, \
        r.line()


def test_a_freed_shared_address_does_not_make_a_later_tensor_the_shared_heads():
    """The repeat watch tracks sides by storage address: a shared-head intermediate that is
    freed must not pass its side to a tensor of neither side made at its address (here
    `new_zeros`, which the allocator places there). Planted: not holding the call's
    tensors flags `z + 1` as made from the shared heads alone (the nsa flake of a61c559's
    CI)."""
    k = torch.randn(256, 16, dtype=torch.float64)
    q = torch.randn(256, 16, dtype=torch.float64)
    watch = groupings.Repeats((k,), (q,), threshold=0)
    with watch:
        t = k * 2
        del t
        z = k.new_zeros(256, 16)
        z + 1
    assert [what for what, _ in watch.found] == ["aten.mul.Tensor made (256, 16)"]


# -- a variant of one's own, from docs/variants.md alone --------------------------------

def docs_example() -> str:
    """The complete example of docs/variants.md's "Adding a variant" (it declares grouped
    keys, natively), as a file of one's own: importing from `variants`, as the page says."""
    import re
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "variants.md").read_text(), re.S)
    text = next(b for b in blocks if "@register" in b)
    assert "from ..core import" in text and 'Grouping("kv", "native"' in text
    return text.replace("from ..core import", "from variants import")


@pytest.fixture
def own_registry(monkeypatch):
    from harness.measure import maps, runner
    from harness.measure.worker import EXTRA_ENV
    from variants.core import modules
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    for name in ("matmul_fp32_gflops", "read_bandwidth_gbps"):  # seconds, not the point
        monkeypatch.setattr(runner, name, lambda threads: 1.0)
    monkeypatch.setattr(runner, "matmul_rates", lambda *a: {"cpu float32": 1.0})
    monkeypatch.setattr(maps, "write", lambda folder, cases: None)
    saved = (dict(registry._REGISTRY), dict(registry._ORIGIN), dict(modules._LOADED))
    yield
    for live, old in zip((registry._REGISTRY, registry._ORIGIN, modules._LOADED), saved):
        live.clear()
        live.update(old)


def test_a_variant_written_from_the_docs_runs_check_and_run_at_kv_heads_2(tmp_path, capsys,
                                                                          own_registry):
    import csv

    import run_bench
    path = tmp_path / "toy_attention.py"  # one file, outside the repository
    path.write_text(docs_example())
    # The properties the grouping touches (tests/test_check.py runs the whole kit on a file
    # of one's own: README's).
    assert run_bench.main(["check", str(path), "--properties",
                           "shapes,groupings"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and re.search(r"PASS\s+toy\s+groupings\s+kv native; kv_heads 4", out)
    cfg = tmp_path / "m.toml"
    cfg.write_text('variants = ["toy"]\nseq_lens = [64]\nheads = 4\nhead_dim = 16\n'
                   'kv_heads = [4, 2]\ninputs = ["gaussian"]\npasses = ["forward"]\n'
                   'causal = [true]\nmin_run_time_s = 0.01\nmin_repeats = 1\n')
    code = run_bench.main(["run", "--variant-module", str(path), "--config", str(cfg),
                           "--kv-heads", "2", "--results-dir", str(tmp_path), "--run-id", "r",
                           "--no-report"])
    assert code == 0
    rows = list(csv.DictReader((tmp_path / "r" / "results.csv").open()))
    assert [(r["variant"], r["kv_heads"], r["status"]) for r in rows] == [("toy", "2", "ok")]
    assert float(rows[0]["rel_err"]) < 1e-5


class _RefusesGroups(Variant):
    """Exact attention over equal heads only, saying why."""
    name, family, paper = "_refuses_groups", "test", "https://arxiv.org/abs/1706.03762"
    contract = Contract(exactness="exact", grouping=Grouping("kv", "refuse", why="one head only"))

    def attend(self, q, k, v, causal):
        return variants.naive_attention(q, k, v, causal)

    def flops(self, B, H, N, D, causal=False):
        return 4 * B * H * N * N * D


def test_a_refused_grouping_is_refused_with_its_reason_and_the_kit_says_n_a():
    register(_RefusesGroups)
    try:
        q, k, v = _qkv(4, 2, 2)
        with pytest.raises(ValueError, match="one head only"):
            variants.build("_refuses_groups")(q, k, v)
        r = kit.run_property(groupings.groupings, "_refuses_groups")
        assert r.status == "n/a" and "one head only" in r.detail, r.line()
        assert Shape(1, 4, 8, 8, kv_heads=2).check(_RefusesGroups.contract.grouping) == [
            "refuses grouped heads: one head only"]
    finally:
        registry._REGISTRY.pop("_refuses_groups", None)
        registry._ORIGIN.pop("_refuses_groups", None)
