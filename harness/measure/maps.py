"""Attention maps: the weights each variant implies on one attention head, saved for the report.

For one head of one input (layer LAYER, head HEAD of a captured model input; the
`local` synthetic input when a run has no capture), `compute` takes exact attention's
weights (softmax in float64) and each approximate variant's `Variant.weights(q, k)`, the
map with weights @ v = its output, on CPU in float32; beside each, the row cosine of the
variant's output to exact attention's on this head (accuracy.error, all rows). `save`
writes them to <folder>/maps.npz (harness.files.MAPS), with each variant's |map - exact|
taken at full resolution first: every map block-averaged to at most DRAWN x DRAWN (what a
panel of the drawing shows; 2 x 2 blocks at N = 512) and stored as float16, about 1.8 MB
for ten variants, and a JSON `meta` saying what they are. The report
(harness.report.maps) only reads that file.

`write(folder, cases)` does this after a run for the run's own variants: every distinct
(family, parameters) of the non-exact ones, first setting first (a library kernel with
our parameters draws our map again and is left out), on the first captured input of the
run at the length nearest 512, non-causal unless every case was causal. `attnbench
maps` calls `compute` for a head, length and variants of the user's choosing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import variants
from harness.files import MAPS
from harness.measure import accuracy, stack
from harness.measure.inputs import make_inputs
from harness.models import capture

# The head drawn by default: all-MiniLM-L6-v2's layer 2, head 0, on the shipped text at
# N = 512: about half its weight within 32 tokens of the query and a third beyond 128
# (parallel diagonals where the text repeats itself), so both a band and a far field matter.
LAYER, HEAD = 2, 0
SEQ_LEN = 512
SYNTHETIC = "local"  # when a run has no captured input
DRAWN = 256  # stored maps are at most this many rows and columns


def settings_of(cases) -> list[tuple[str, dict]]:
    """(variant, params) to draw for a run's cases: distinct (family, params) among the
    non-exact variants, in the order the run has them; a layer pattern's mixers with their
    parameters (a stack has no one map)."""
    seen, out = set(), []
    for case in cases:
        named = ([(n, case.param_dict[n]) for n in stack.mixers(case.variant)]
                 if stack.is_pattern(case.variant) else [(case.variant, case.param_dict)])
        for name, params in named:
            spec = variants.spec(name)
            key = (spec.family, json.dumps(params, sort_keys=True))
            if spec.exact or key in seen:
                continue
            seen.add(key)
            out.append((name, params))
    return out


def head_inputs(cases, layer: int = LAYER, head: int = HEAD, seq_len: int = SEQ_LEN):
    """(q, k, v) each (1, 1, N, D) float32, and a description dict, for the run's cases.

    The first captured input of the run at the length nearest seq_len (its first token
    window, layer `layer`, head `head`); without one, the `local` synthetic input at
    seq_len with the run's first head_dim."""
    captured = [c for c in cases if capture.is_captured(c) and not capture.skip_reasons(c)]
    causal = bool(cases) and all(c.causal for c in cases)
    if captured:
        first = captured[0].input
        same = [c for c in captured if c.input == first]
        case = min(same, key=lambda c: (abs(c.seq_len - seq_len), c.seq_len))
        q, k, v = capture.load_inputs(case, torch.float32, "cpu")  # (L * B, H, N, D)
        layers = capture.layers_of(case)
        windows = case.batch // layers
        layer = min(layer, layers - 1)
        head = min(head, q.shape[1] - 1)
        pick = slice(layer * windows, layer * windows + 1)  # layer-major: its first window
        qkv = tuple(t[pick, head:head + 1].contiguous() for t in (q, k, v))
        about = {"input": first, "layer": layer, "head": head, "seq_len": case.seq_len,
                 "causal": case.causal}
        return qkv, about
    D = cases[0].head_dim if cases else 64
    qkv = make_inputs(SYNTHETIC, 1, 1, seq_len, D, seed=cases[0].seed if cases else 0)
    return qkv, {"input": SYNTHETIC, "layer": None, "head": 0, "seq_len": seq_len,
                 "causal": causal}


def compute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            settings: list[tuple[str, dict]]) -> tuple[np.ndarray, list[dict], dict]:
    """(exact map, one record per setting, {name: array}) with the maps block-averaged to at
    most DRAWN x DRAWN: `map_<i>` the i-th drawn variant's map, `diff_<i>` its |map - exact|
    (taken before averaging).

    A record: variant, params (JSON), label, status ("ok" or "skipped"), reason, and for
    "ok": row_cos, neg_mass (share of the map's absolute mass on negative weights), map and
    diff (its array names). q, k, v: (1, 1, N, D).
    """
    from variants import softmax_weights

    exact = softmax_weights(q.double(), k.double(), causal)[0, 0]  # (N, N)
    records, arrays = [], {}
    for name, params in settings:
        m = variants.build(name, **params)
        rec = {"variant": name, "params": json.dumps(params, sort_keys=True),
               "label": _label(name, params)}
        why = m.weights_reasons(device=q.device, dtype=q.dtype, causal=causal,
                                seq_len=q.shape[-2], head_dim=q.shape[-1])
        if why:
            records.append({**rec, "status": "skipped", "reason": "; ".join(why)})
            continue
        # Inputs beyond q, k, v (a recurrence's gates): drawn as the benchmark draws them.
        inputs = m.draw_inputs(*q.shape, seed=0, dtype=q.dtype, device=q.device)
        with torch.no_grad():
            w = m.weights(q, k, causal, **inputs)[0, 0].double()  # (N, N)
            o = m(q, k, v, causal=causal, **inputs)
        err = accuracy.error(o, q, k, v, causal, max_rows=q.shape[-2])
        i = sum(r["status"] == "ok" for r in records)
        arrays[f"map_{i}"], arrays[f"diff_{i}"] = _pooled(w), _pooled((w - exact).abs())
        records.append({**rec, "status": "ok", "reason": "", "row_cos": err.row_cos,
                        "neg_mass": float(w.clamp(max=0).abs().sum() / w.abs().sum()),
                        "map": f"map_{i}", "diff": f"diff_{i}"})
    return _pooled(exact), records, arrays


def _pooled(x: torch.Tensor) -> np.ndarray:
    """(N, N) -> block means over f x f blocks, f = ceil(N / DRAWN) (the last block row and
    column average what they hold), float16."""
    f = -(-x.shape[-1] // DRAWN)
    if f > 1:
        x = torch.nn.functional.avg_pool2d(x[None, None], f, ceil_mode=True)[0, 0]
    return x.to(torch.float16).numpy()


def _label(name: str, params: dict) -> str:
    """name(parameters that differ from the variant's defaults)."""
    defaults = variants.spec(name).defaults
    inner = ", ".join(f"{k}={v}" for k, v in sorted(params.items()) if defaults.get(k) != v)
    return f"{name}({inner})" if inner else name


def save(path: Path, exact: np.ndarray, records: list[dict], arrays: dict,
         about: dict) -> Path:
    """maps.npz: `exact`, the arrays `compute` named, and `meta` (JSON: what they are)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**about, "variants": records, "stored": f"block means, at most {DRAWN} x {DRAWN}, "
            "float16; diffs taken at full resolution"}
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), exact=exact, **arrays)
    tmp.replace(path)
    return path


def write(folder: Path, cases) -> Path:
    """Compute and save the maps of a run's variants into its folder; returns the file."""
    (q, k, v), about = head_inputs(cases)
    exact, records, arrays = compute(q, k, v, about["causal"], settings_of(cases))
    return save(Path(folder) / MAPS, exact, records, arrays, about)
