"""Layer patterns (harness.measure.stack): parsing, repetition to `layers`, the summed state,
and the recall model built from one (a pattern of one mixer is the plain model)."""

import pytest
import torch

import variants
from harness.measure import layers, stack
from harness.train.model import RecallModel


def test_a_pattern_parses_to_one_mixer_a_layer():
    assert stack.parse("gated_deltanet*3+sdpa") == ("gated_deltanet",) * 3 + ("sdpa",)
    assert stack.parse("mamba2+sliding_window") == ("mamba2", "sliding_window")
    assert stack.layers_of("gla*3+sdpa", 8) == (("gla",) * 3 + ("sdpa",)) * 2
    assert stack.layers_of("sdpa", 3) == ("sdpa",) * 3
    assert stack.mixers("gla*3+sdpa+gla") == ("gla", "sdpa")
    assert stack.is_pattern("sdpa*4") and not stack.is_pattern("sdpa")
    assert stack.composition("gla*3+sdpa", 4) == (1, "gla")


@pytest.mark.parametrize("spec, layers, words", [
    ("gla*3+sdpa", 6, "does not divide layers = 6"),
    ("gla*0+sdpa", 4, "positive integer"),
    ("gla*x", 4, "positive integer"),
    ("gla*-1", 4, "positive integer"),
    ("glaa*3+sdpa", 4, "unknown variant 'glaa'"),
    ("gla++sdpa", 4, "empty term"),
])
def test_a_bad_pattern_names_its_fault(spec, layers, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("*", r"\*")):
        stack.layers_of(spec, layers)


def test_a_stack_keeps_the_sum_of_its_layers_state():
    N, D = 4096, 64
    want = 3 * variants.build("gated_deltanet").state_size(N, D) \
        + variants.build("sdpa").state_size(N, D)
    assert layers.build_mixer("gated_deltanet*3+sdpa", {}).state_size(N, D) == want
    window = {"sliding_window": {"window": 16}}
    assert layers.build_mixer("mamba2+sliding_window", window).state_size(N, D) == \
        variants.build("mamba2").state_size(N, D) \
        + variants.build("sliding_window", window=16).state_size(N, D)


def _model(spec, params):
    torch.manual_seed(0)
    return RecallModel(spec, params, vocab_size=32, d_model=32, layers=4, heads=2,
                       causal=True, mlp=False)


def test_a_pattern_of_one_mixer_is_the_plain_model():
    plain, pattern = _model("sdpa", {}), _model("sdpa*4", {})
    a, b = dict(plain.named_parameters()), dict(pattern.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    x = torch.randint(0, 32, (2, 16))
    assert torch.equal(plain(x), pattern(x))


def test_a_stack_builds_each_layer_with_its_own_mixer_and_parameters():
    model = _model("gla*3+sliding_window", {"sliding_window": {"window": 4}})
    mixers = [b.mixer for b in model.blocks]
    assert [m.name for m in mixers] == ["gla", "gla", "gla", "sliding_window"]
    assert mixers[3].params.window == 4
    assert set(model.blocks[0].inputs) == {"g"} and not model.blocks[3].inputs
    x = torch.randint(0, 32, (2, 16))
    assert model(x).shape == (2, 16, 32)


def test_a_train_matrix_takes_patterns_and_their_mixers_settings(tmp_path):
    from harness.errors import UsageError
    from harness.train import matrix
    raw = {"variants": ["gla*3+sliding_window", "sdpa"], "layers": 4,
           "params": {"sliding_window": [{"window": 4}, {"window": 8}]}}
    configs = matrix.expand(matrix.normalise(raw))
    stacks = [c for c in configs if c.variant == "gla*3+sliding_window"]
    assert sorted(c.param_dict["sliding_window"]["window"] for c in stacks) == [4, 8]
    assert all(c.param_dict["gla"] == json_defaults("gla") for c in stacks)
    with pytest.raises(UsageError, match="does not divide layers = 6"):
        matrix.expand(matrix.normalise({**raw, "layers": 6}))
    with pytest.raises(UsageError, match="unknown variant 'glaa'"):
        matrix.normalise({"variants": ["glaa*3+sdpa"], "layers": 4})


def json_defaults(name):
    import dataclasses
    return dataclasses.asdict(variants.make_params(name))


def test_variants_on_the_command_line_adds_a_stack_on_its_mixers_settings():
    from harness.train import matrix
    raw = {"variants": ["sdpa", "sliding_window"], "layers": 4,
           "params": {"sliding_window": [{"window": 4}]}}
    configs = matrix.expand(matrix.normalise(
        raw, {"variants": ["gla*3+sliding_window"]}))
    assert [c.variant for c in configs] == ["gla*3+sliding_window"]
    assert configs[0].param_dict["sliding_window"]["window"] == 4


def _config(spec, layers=4, params=None, heads=2):
    from harness.train import matrix
    raw = {"variants": [spec], "layers": layers, "heads": heads, "seq_lens": [64],
           "params": params or {}}
    (config,) = matrix.expand(matrix.normalise(raw))
    return config


def test_a_stacks_train_row_is_hybrid_with_its_layers_summed_state():
    from harness.train import rows
    config = _config("gated_deltanet*3+sdpa")
    row = rows.config_row(config, layers.build(config))
    D = config.head_dim
    want = 3 * variants.build("gated_deltanet").state_size(64, D) \
        + variants.build("sdpa").state_size(64, D)
    assert row["family"] == "hybrid"
    assert row["state_size"] == config.heads * want and row["state_bytes"] == 4 * row["state_size"]
    assert (row["attention_layers"], row["mixer"]) == (1, "gated_deltanet")
    plain = _config("gated_deltanet")
    row = rows.config_row(plain, layers.build(plain))
    assert row["family"] == "recurrent" and (row["attention_layers"], row["mixer"]) == (0, "gated_deltanet")
    assert row["state_size"] == 4 * plain.heads * variants.build("gated_deltanet").state_size(64, D)
    assert stack.composition("sdpa*4", 4) == (4, "")
    assert stack.composition("mamba2+sliding_window", 4) == (0, "mamba2+sliding_window")


def test_a_stacks_flops_and_skips_are_its_layers():
    from harness.train import estimate
    config = _config("gla*3+sdpa")
    gla, sdpa = _config("gla"), _config("sdpa")
    flops = [estimate.forward_flops(c, layers.build(c), 8)
             for c in (config, gla, sdpa)]
    assert flops[0] == pytest.approx((3 * flops[1] + flops[2]) / 4)
    module = layers.build(config)
    assert module.key_mask(64) is None
    case = dict(device="cpu", dtype=torch.float32, causal=False, seq_len=64, head_dim=32,
                backward=True)
    assert module.unsupported_reasons(**case) == variants.build("gla").unsupported_reasons(**case)
    assert module.unsupported_reasons(**case)  # gla is causal only
