"""harness.models.source: the shipped model, its config, text windows and the usage errors."""

import pytest
import torch

from harness.models import source as hf
from harness.errors import UsageError


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_tokenizer(str(hf.minilm_path()))


def test_minilm_info_from_its_config():
    info = hf.model_info(str(hf.resolve_model("minilm")))
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (6, 12, 12, 32)
    assert info.max_positions == 512 and not info.causal and info.name == "minilm"


def test_windows_are_seeded_exact_length_and_wrapped_in_special_tokens(tokenizer):
    text = hf.default_text()
    a = hf.token_windows(tokenizer, text, 128, 3, seed=0)
    assert a.shape == (3, 128) and a.dtype == torch.int64
    assert torch.equal(a, hf.token_windows(tokenizer, text, 128, 3, seed=0))
    assert not torch.equal(a, hf.token_windows(tokenizer, text, 128, 3, seed=1))
    assert (a[:, 0] == tokenizer.cls_token_id).all() and (a[:, -1] == tokenizer.sep_token_id).all()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    for row in a:  # each window's body is a contiguous run of the text's own tokens
        body = row[1:-1]
        starts = (ids[:len(ids) - len(body) + 1] == body[0]).nonzero().flatten()
        assert any(torch.equal(ids[s:s + len(body)], body) for s in starts.tolist())


def test_text_too_short_names_the_counts(tokenizer):
    with pytest.raises(hf.TextTooShort, match=r"has \d+ tokens, fewer than the 510"):
        hf.token_windows(tokenizer, "a few words only", 512, 1, seed=0)


def test_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        hf.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="no config.json"):
        hf.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot load its config"):
        hf.model_info(str(hf.resolve_model(str(tmp_path))))
    with pytest.raises(UsageError, match="does not exist"):
        hf.load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UsageError, match="is empty"):
        hf.load_text(tmp_path / "empty.txt")
